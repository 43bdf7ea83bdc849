"""Tests of `tf_agn.datasets`: the offline sets, their split, and the errors."""

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds

from tf_agn import datasets


@pytest.fixture(scope="module")
def mnist5k():
    return datasets.load("mnist5k")


@pytest.fixture(scope="module")
def digits():
    return datasets.load("digits", flatten=False)


def _check_arrays(split, image_shape):
    for x, y in split:
        assert x.dtype == np.float32 and x.shape[1:] == image_shape
        assert 0.0 <= x.min() and x.max() <= 1.0
        assert np.issubdtype(y.dtype, np.integer) and y.shape == (len(x),)
        assert set(np.unique(y)) == set(range(10))


def test_mnist5k_is_a_balanced_4000_1000_split(mnist5k):
    _check_arrays(mnist5k, (784,))
    (_, y_train), (_, y_test) = mnist5k
    # 500 digits per class, 20% of each held out.
    np.testing.assert_array_equal(np.bincount(y_train), [400] * 10)
    np.testing.assert_array_equal(np.bincount(y_test), [100] * 10)


def test_mnist5k_keeps_images_unflattened():
    (x_train, _), (x_test, _) = datasets.load("mnist5k", flatten=False)
    assert x_train.shape == (4000, 28, 28, 1)
    assert x_test.shape == (1000, 28, 28, 1)


def test_digits_is_a_stratified_split(digits):
    _check_arrays(digits, (8, 8, 1))
    (x_train, y_train), (x_test, y_test) = digits
    assert len(x_train) + len(x_test) == 1797
    # Each class, of 174 to 183 images, holds out 20% of its own.
    per_class = np.bincount(y_train) + np.bincount(y_test)
    test_share = np.bincount(y_test) / per_class
    np.testing.assert_allclose(test_share, 0.2, atol=0.01)


@pytest.mark.parametrize("fixture", ["mnist5k", "digits"])
def test_train_and_test_are_disjoint(fixture, request):
    # No image occurs twice in either set, so a shared image would be a leak.
    (x_train, _), (x_test, _) = request.getfixturevalue(fixture)
    assert not set(map(bytes, x_train)) & set(map(bytes, x_test))


def test_the_training_set_is_shuffled(mnist5k):
    # The file is sorted by label; a prefix for a reduced run needs all.
    (_, y_train), _ = mnist5k
    assert set(y_train[:100]) == set(range(10))


def test_split_is_fixed_by_the_seed(mnist5k):
    again = datasets.load("mnist5k")
    other = datasets.load("mnist5k", seed=1)
    for (x, y), (x_again, y_again) in zip(mnist5k, again):
        np.testing.assert_array_equal(x, x_again)
        np.testing.assert_array_equal(y, y_again)
    assert not np.array_equal(mnist5k[1][1], other[1][1])


def test_test_fraction():
    (x_train, _), (x_test, _) = datasets.load("mnist5k", test_fraction=0.5)
    assert len(x_train) == len(x_test) == 2500
    with pytest.raises(ValueError, match="test_fraction"):
        datasets.load("mnist5k", test_fraction=1.0)


def test_unknown_name_lists_the_allowed_ones():
    with pytest.raises(ValueError, match="mnist5k, digits, mnist, cifar10"):
        datasets.load("imagenet")


@pytest.mark.parametrize("name", ["mnist", "cifar10"])
def test_missing_tfds_data_says_how_to_get_it(name, tmp_path):
    # An empty data_dir and download=False (the default): tfds looks on
    # disk only, so this runs offline and fast.
    with pytest.raises(FileNotFoundError, match="Download it first") as info:
        datasets.load(name, data_dir=str(tmp_path))
    assert "mnist5k" in str(info.value)


@pytest.mark.parametrize(
    "name, image_shape", [("mnist", (28, 28, 1)), ("cifar10", (32, 32, 3))]
)
def test_tfds_arrays_are_scaled_and_flattened(name, image_shape, monkeypatch):
    # The real tfds.load needs downloaded data (and tfds' mock_data cannot
    # serve batch_size=-1), so this stands in for it.
    calls = []

    def fake_load(*args, **kwargs):
        calls.append((args, kwargs))
        rng = np.random.default_rng(0)
        return [
            (
                tf.constant(rng.integers(0, 256, (n, *image_shape), np.uint8)),
                tf.constant(rng.integers(0, 10, (n,), np.int64)),
            )
            for n in (6, 3)
        ]

    monkeypatch.setattr(tfds, "load", fake_load)
    (x_train, y_train), (x_test, y_test) = datasets.load(name)
    [(args, kwargs)] = calls
    assert args == (name,) and kwargs["split"] == ["train", "test"]
    assert kwargs["download"] is False
    assert kwargs["as_supervised"] and kwargs["batch_size"] == -1
    size = int(np.prod(image_shape))
    assert x_train.shape == (6, size) and x_test.shape == (3, size)
    assert x_train.dtype == np.float32 and x_train.max() <= 1.0
    assert y_train.dtype == np.int32 and y_test.shape == (3,)
