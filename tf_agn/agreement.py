"""Checking that every worker reduces with the same settings.

Workers that build `AggregatingAllReduce` differently pack, scale or
compress differently, and their collectives then never meet (a hang) or
meet with wrong shapes (wrong numbers). `check_agreement` runs once, when
`tf_agn.strategies.multi_worker_mirrored` creates the strategy: every
worker all-gathers a few integers that encode what its collectives depend
on, and every worker raises the same error, naming the field and the
values, if they differ.
"""

import zlib

import tensorflow as tf

from tf_agn import collective
from tf_agn import compression
from tf_agn.aggregation import AggregationMethod

CommunicationImplementation = tf.distribute.experimental.CommunicationImplementation

_METHODS = list(AggregationMethod)
# Built-in compressions are codes 0, 1, 2, ...; any other compressor's
# name is encoded by its CRC-32 after them.
_COMPRESSIONS = [None, *compression.BY_NAME]
_IMPLEMENTATIONS = list(CommunicationImplementation)


def _version_code(version):
    major, minor, patch = (int(part) for part in version.split(".")[:3])
    return (major * 1000 + minor) * 1000 + patch


def _version_text(code):
    return f"{code // 1_000_000}.{code // 1000 % 1000}.{code % 1000}"


def _compression_code(compressor):
    name = compression.name_of(compressor)
    if name in _COMPRESSIONS:
        return _COMPRESSIONS.index(name)
    return len(_COMPRESSIONS) + zlib.crc32(str(name).encode())


def _compression_text(code):
    if code < len(_COMPRESSIONS):
        return repr(_COMPRESSIONS[code])
    return f"a compressor of another name (code {code})"


# name: (what to encode, as an int; how to show a code).
FIELDS = {
    "aggregation": (
        lambda ops, _: _METHODS.index(ops.aggregation),
        lambda code: _METHODS[code].value,
    ),
    "bytes_per_pack": (lambda ops, _: ops.bytes_per_pack, str),
    "compression": (lambda ops, _: _compression_code(ops.compressor), _compression_text),
    "transport": (
        lambda ops, _: collective.TRANSPORTS.index(ops.transport),
        lambda code: collective.TRANSPORTS[code],
    ),
    "implementation": (
        lambda ops, _: _IMPLEMENTATIONS.index(ops.options.implementation),
        lambda code: _IMPLEMENTATIONS[code].name,
    ),
    "local replicas": (lambda _, devices: len(devices), str),
    "tf_agn version": (lambda ops, _: _version_code(_tf_agn_version()), _version_text),
}


def _tf_agn_version():
    import tf_agn  # The package imports this module's users first.

    return tf_agn.__version__


def settings_codes(ops, devices):
    """What this worker's collectives depend on, one int per `FIELDS` entry."""
    return [encode(ops, devices) for encode, _ in FIELDS.values()]


def disagreement(codes_per_worker):
    """The first field on which workers disagree, described, or None.

    Args:
        codes_per_worker: one list of `settings_codes` per worker, in
            worker order.

    Returns:
        None if every worker has the same codes, else a message naming the
        field and the value of each worker that differs from worker 0's.
    """
    first = codes_per_worker[0]
    for position, (name, (_, show)) in enumerate(FIELDS.items()):
        values = [codes[position] for codes in codes_per_worker]
        if any(value != first[position] for value in values):
            described = ", ".join(
                f"worker {worker} has {show(value)}" for worker, value in enumerate(values)
            )
            return (
                f"Workers disagree on {name}: {described}. Every worker must "
                "build its strategy with the same settings (the same program "
                "and tf_agn release on each)."
            )
    return None


def check_agreement(ops, devices, timeout_seconds):
    """Raises on every worker unless all build `ops` alike.

    Every local replica of every worker takes part in one all-gather, so
    the call returns only when all workers have made it; call it on every
    worker at the same point (`multi_worker_mirrored` does).

    Args:
        ops: this worker's `AggregatingAllReduce`.
        devices: this worker's replica devices.
        timeout_seconds: how long to wait for the other workers.

    Raises:
        ValueError: naming the first field the workers disagree on and each
            worker's value.
        TimeoutError: if some worker does not take part within
            `timeout_seconds`.
    """
    devices = tuple(devices)
    group = collective.collective_group(
        devices,
        group_size=len(devices) * ops.num_workers,
        first_replica=ops.worker_index * len(devices),
    )
    codes = settings_codes(ops, devices)
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=timeout_seconds,
        implementation=collective.default_implementation(devices),
    )

    @tf.function(autograph=False)
    def exchange():
        return [
            group.all_gather(replica, tf.constant([codes], tf.int64), options)
            for replica in range(len(devices))
        ]

    try:
        gathered = exchange()[0].numpy()
    except tf.errors.DeadlineExceededError:
        raise TimeoutError(
            f"Not every worker checked its settings within {timeout_seconds} s: "
            "a worker failed after connecting, or runs an older tf_agn that "
            "does not check. Collectives of this process are aborted; restart "
            "every worker."
        ) from None
    per_worker = [list(gathered[r]) for r in range(0, group.size, len(devices))]
    message = disagreement(per_worker)
    if message:
        raise ValueError(message)
