"""benchmarks/stdlib_text.py: the file lists, the windows, the unigram
baseline and the model, checked against numpy on the raw bytes."""

import collections
import math
import os
import sys

import keras
import numpy as np
import pytest

sys.path.insert(
    0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")
)
import stdlib_text  # noqa: E402


@pytest.fixture(scope="module")
def heldout():
    return stdlib_text.load_split("heldout")


def test_lists_name_existing_disjoint_files_with_a_few_percent_held_out():
    train, heldout = (stdlib_text.read_list(split) for split in ("train", "heldout"))
    train_paths = {path for path, _, _ in train}
    heldout_paths = {path for path, _, _ in heldout}
    assert len(train_paths) == len(train) > 500 and len(heldout_paths) == len(heldout) > 10
    assert not train_paths & heldout_paths
    for path in train_paths | heldout_paths:
        assert os.path.isfile(os.path.join(stdlib_text.STDLIB, path)), path
        assert path.endswith(".py") and not {"test", "tests", "site-packages"} & set(
            path.split("/")
        ), path
        assert stdlib_text.is_heldout(path) == (path in heldout_paths), path
    heldout_bytes = sum(size for _, size, _ in heldout)
    share = heldout_bytes / (heldout_bytes + sum(size for _, size, _ in train))
    assert 0.01 < share < 0.08, share


def test_split_is_the_listed_files_bytes_in_order(heldout):
    expected = b"".join(
        open(os.path.join(stdlib_text.STDLIB, path), "rb").read()
        for path, _, _ in stdlib_text.read_list("heldout")
    )
    assert heldout.dtype == np.uint8 and heldout.tobytes() == expected


def test_bad_input_is_named(tmp_path, heldout):
    with pytest.raises(FileNotFoundError, match="argparse.py"):
        stdlib_text.load_split("heldout", stdlib=str(tmp_path))
    with pytest.raises(ValueError, match="'validation'"):
        stdlib_text.read_list("validation")
    with pytest.raises(ValueError, match="got 2"):
        stdlib_text.train_dataset(heldout, num_workers=2, worker_index=2)
    with pytest.raises(ValueError, match="num_heads=3, got 32"):
        stdlib_text.byte_transformer(d_model=32, num_heads=3)


def test_training_windows_are_the_bytes_and_their_next_bytes(heldout):
    text = heldout.tobytes()
    batches = [
        list(stdlib_text.train_dataset(heldout, context=16, batch_size=4, seed=3,
                                       num_workers=2, worker_index=w).take(3).as_numpy_iterator())
        for w in range(2)
    ]
    single = list(stdlib_text.train_dataset(heldout, context=16, batch_size=8, seed=3)
                  .take(3).as_numpy_iterator())
    for worker_batches in batches:
        for inputs, targets in worker_batches:
            assert inputs.shape == targets.shape == (4, 16)
            for row, next_row in zip(inputs, targets):
                # The window's bytes must occur in the text, and the targets
                # be its bytes from the second on.
                start = text.find(bytes(row.astype(np.uint8).tolist()) + bytes([next_row[-1]]))
                assert start >= 0
                window = np.frombuffer(text[start:start + 17], np.uint8)
                np.testing.assert_array_equal(row, window[:-1])
                np.testing.assert_array_equal(next_row, window[1:])
    # Two workers' k-th batches together are a single process's k-th batch
    # of twice the size: worker w has the windows w, w + 2, ...
    for k, (inputs, _) in enumerate(single):
        np.testing.assert_array_equal(inputs[0::2], batches[0][k][0])
        np.testing.assert_array_equal(inputs[1::2], batches[1][k][0])
    assert len({row.tobytes() for inputs, _ in single for row in inputs}) == 24


def test_heldout_windows_are_evenly_spaced_slices(heldout):
    inputs, targets = stdlib_text.heldout_windows(heldout, context=8, num_windows=5)
    starts = [i * (heldout.size - 9) // 4 for i in range(5)]
    assert starts[-1] + 9 == heldout.size
    for row, next_row, start in zip(inputs, targets, starts):
        np.testing.assert_array_equal(row, heldout[start:start + 8])
        np.testing.assert_array_equal(next_row, heldout[start + 1:start + 9])


def test_unigram_cross_entropy_is_the_smoothed_frequencies_log_loss(heldout):
    train = stdlib_text.load_split("train")[:200_000]
    counts = collections.Counter(train.tobytes())
    total = train.size + 256
    expected = -sum(
        math.log((counts[byte] + 1) / total) for byte in heldout.tobytes()
    ) / heldout.size
    assert stdlib_text.unigram_cross_entropy(train, heldout) == pytest.approx(expected, rel=1e-9)


def test_model_gives_next_byte_logits_and_starts_near_uniform(heldout):
    keras.utils.set_random_seed(0)
    model = stdlib_text.byte_transformer(context=32, d_model=32, num_layers=1, num_heads=2)
    stdlib_text.compile_for_bytes(model, "adam")
    inputs, targets = stdlib_text.heldout_windows(heldout, context=32, num_windows=16)
    logits = model.predict(inputs, verbose=0)
    assert logits.shape == (16, 32, 256)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(log_probs, targets[..., None], -1).mean()
    loss = model.evaluate(inputs, targets, verbose=0)
    assert loss == pytest.approx(expected, rel=1e-5)
    assert abs(loss - math.log(256)) < 0.5, loss
    # Causal: a byte's logits do not depend on the bytes after it.
    changed = inputs.copy()
    changed[:, 20:] = (changed[:, 20:] + 1) % 256
    np.testing.assert_allclose(model.predict(changed, verbose=0)[:, :20], logits[:, :20],
                               rtol=1e-5, atol=1e-5)
