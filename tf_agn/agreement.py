"""Checking that every worker reduces with the same settings.

Workers that pack, scale, compress or window differently make collectives
that never meet (a hang) or meet with wrong shapes (wrong numbers).
`check_agreement` (the strategy's settings, called by
`tf_agn.strategies.multi_worker_mirrored`) and `check_optimizer_agreement`
(a tf_agn optimizer's settings and variables, called when it is built)
all-gather a few integers encoding them and raise the same error on every
worker, naming the setting and each worker's value, if they differ.
"""

import collections
import json
import zlib

import tensorflow as tf

from tf_agn import _compat
from tf_agn import transports
from tf_agn import compression
from tf_agn.aggregation import AggregationMethod
from tf_agn.replica_aggregation import tf_agn_ops

CommunicationImplementation = tf.distribute.experimental.CommunicationImplementation

Setting = collections.namedtuple("Setting", ["name", "code", "show"])
Setting.__doc__ = """One setting workers must share: its name, this worker's
value encoded as an int64, and how to show a code in an error."""

_METHODS = list(AggregationMethod)
# Built-in compressions are codes 0, 1, 2, ...; any other compressor's
# name is encoded by its CRC-32 after them.
_COMPRESSIONS = [None, *compression.BY_NAME, compression.PowerSGD.name]
_IMPLEMENTATIONS = list(CommunicationImplementation)


def _version_code(version):
    major, minor, patch = (int(part) for part in version.split(".")[:3])
    return (major * 1000 + minor) * 1000 + patch


def _version_text(code):
    return f"{code // 1_000_000}.{code // 1000 % 1000}.{code % 1000}"


def _compression_code(compressor):
    """`compressor`'s name as an int, the same in every process."""
    name = compression.name_of(compressor)
    if name in _COMPRESSIONS:
        return _COMPRESSIONS.index(name)
    return len(_COMPRESSIONS) + _crc(name)


def _compression_text(code):
    if code < len(_COMPRESSIONS):
        return repr(_COMPRESSIONS[code])
    return f"a compressor of another name (code {code})"


def _crc(value):
    """A code for any JSON-able value that is the same in every process."""
    return zlib.crc32(json.dumps(value, sort_keys=True, default=str).encode())


def _code_text(code):
    return f"code {code}"


def _method_setting(name, method):
    return Setting(name, _METHODS.index(method), lambda code: _METHODS[code].value)


def compression_settings(compressor):
    """The compressor's name, then its configuration (PowerSGD's rank, say),
    as `Setting`s."""
    return [
        Setting("compression", _compression_code(compressor), _compression_text),
        Setting("compression settings", _crc(_configuration(compressor)), _code_text),
    ]


def _configuration(compressor):
    """`compressor`'s config, or its class's path where it has none."""
    try:
        return compression.serialize(compressor)
    except TypeError:  # A user's compressor without `get_config`: its class.
        return f"{type(compressor).__module__}.{type(compressor).__qualname__}"


def strategy_settings(ops, devices):
    """What this worker's collectives depend on in its strategy.

    Args:
        ops: this worker's `AggregatingAllReduce`.
        devices: this worker's replica devices.

    Returns:
        A list of `Setting`s, in the order workers compare them.
    """
    return [
        _method_setting("aggregation", ops.aggregation),
        Setting("bytes_per_pack", ops.bytes_per_pack, str),
        *compression_settings(ops.compressor),
        Setting(
            "transport",
            transports.TRANSPORTS.index(ops.transport),
            lambda code: transports.TRANSPORTS[code],
        ),
        Setting(
            "implementation",
            _IMPLEMENTATIONS.index(ops.options.implementation),
            lambda code: _IMPLEMENTATIONS[code].name,
        ),
        Setting("local replicas", len(devices), str),
        Setting("tf_agn version", _version_code(_tf_agn_version()), _version_text),
    ]


def optimizer_settings(method, compressor, window, variables, sparse=None):
    """What an optimizer's collectives depend on.

    Args:
        method: the `AggregationMethod` in force.
        compressor: the compressor in force, or None.
        window: `(name, steps)`: how many steps make one collective
            (`gradient_accumulation_steps`, or AGN's `local_steps`).
        variables: the variables whose gradients or commits travel.
        sparse: None, or for each variable whether it is declared to have
            sparse gradients, and so no compressor state
            (`sparse_gradients`).

    Returns:
        A list of `Setting`s, in the order workers compare them.
    """
    window_name, steps = window
    shapes = [(tuple(v.shape), str(v.dtype)) for v in variables]
    declared = [i for i, is_sparse in enumerate(sparse or ()) if is_sparse]
    return [
        _method_setting("aggregation_method", method),
        *compression_settings(compressor),
        Setting(window_name, steps or 0, str),
        Setting("trainable variables", len(shapes), str),
        Setting("trainable variable shapes and dtypes", _crc(shapes), _code_text),
        Setting("variables with sparse gradients", _crc(declared), _code_text),
    ]


def _tf_agn_version():
    import tf_agn  # The package imports this module's users first.

    return tf_agn.__version__


def disagreement(settings, codes_per_worker, subject="strategy"):
    """The first setting on which workers disagree, described, or None.

    Args:
        settings: this worker's `Setting`s, for their names and how to show
            their codes.
        codes_per_worker: each worker's codes of the same settings, in
            worker order.
        subject: what every worker must build alike, for the message.

    Returns:
        None if every worker has the same codes, else a message naming the
        setting and the value of each worker that differs from worker 0's.
    """
    first = codes_per_worker[0]
    for position, setting in enumerate(settings):
        values = [codes[position] for codes in codes_per_worker]
        if any(value != first[position] for value in values):
            described = ", ".join(
                f"worker {worker} has {setting.show(value)}"
                for worker, value in enumerate(values)
            )
            return (
                f"Workers disagree on {setting.name}: {described}. Every "
                f"worker must build its {subject} with the same settings (the "
                "same program and tf_agn release on each)."
            )
    return None


def _check(settings, ops, devices, timeout_seconds, subject):
    """All-gathers every worker's codes of `settings`; raises if they differ.

    Returns only when every worker has made the call.
    """
    devices = tuple(devices)
    # One all-gather over every local replica of every worker.
    group = transports.collective_group(
        devices,
        group_size=len(devices) * ops.num_workers,
        first_replica=ops.worker_index * len(devices),
    )
    codes = [setting.code for setting in settings]
    options = tf.distribute.experimental.CommunicationOptions(
        timeout_seconds=timeout_seconds,
        implementation=transports.default_implementation(devices),
    )
    transport = transports.CollectiveTransport(group, options, jit_compile=False)

    def exchange(values):
        """Every replica's `values`, gathered in replica order."""

        @tf.function(autograph=False)
        def gather():
            return transport.all_gather([tf.constant([values], tf.int64)] * len(devices))

        return gather()[0].numpy()

    try:
        gathered = exchange(codes)
    except tf.errors.DeadlineExceededError:
        raise TimeoutError(
            f"Not every worker checked its {subject} settings within "
            f"{timeout_seconds} s: a worker failed after connecting, or runs "
            "an older tf_agn that does not check. Collectives of this process "
            "are aborted; restart every worker."
        ) from None
    per_worker = [list(gathered[r]) for r in range(0, group.size, len(devices))]
    message = disagreement(settings, per_worker, subject)
    if message:
        # A collective's receivers pull their data from the senders, so a
        # worker that raised and exited at once could take with it what a
        # slower peer had still to fetch: that peer would fail with "Socket
        # closed" instead of this message. No worker finishes one more
        # exchange before every worker has finished the first.
        try:
            exchange([0])
        except tf.errors.OpError:
            pass  # A peer left after the first exchange; this one has it too.
        raise ValueError(message)


def check_agreement(ops, devices, timeout_seconds):
    """Raises on every worker unless all build `ops` alike.

    Call it on every worker at the same point (`multi_worker_mirrored`
    does, once the strategy exists).

    Args:
        ops: this worker's `AggregatingAllReduce`.
        devices: this worker's replica devices.
        timeout_seconds: how long to wait for the other workers.

    Raises:
        ValueError: naming the first setting the workers disagree on and
            each worker's value.
        TimeoutError: if some worker does not take part within
            `timeout_seconds`.
    """
    _check(strategy_settings(ops, devices), ops, devices, timeout_seconds, "strategy")


def check_optimizer_agreement(optimizer, method, compressor, window, variables, sparse=None):
    """Raises on every worker unless all build `optimizer` alike.

    Call it in `build`, before creating any variable. Under a strategy
    without tf_agn's ops, or on one worker, it does nothing; otherwise it
    waits as long as the strategy's collectives do (`timeout_seconds` of
    its `AggregatingAllReduce`: by default, for ever).

    Args:
        optimizer: the tf_agn optimizer being built.
        method, compressor, window, variables, sparse: see
            `optimizer_settings`.

    Raises:
        ValueError: naming the first setting the workers disagree on and
            each worker's value.
        TimeoutError: if some worker does not take part within the ops'
            `timeout_seconds`.
    """
    # Before any variable: `MultiWorkerMirroredStrategy` broadcasts each new
    # variable's initial value from the chief, so workers that create
    # different variables (int8's residuals on one, PowerSGD's Q on another)
    # would fail in a broadcast ("tasks are unhealthy") or hang. The
    # timeout is the collectives', as the broadcasts after it would wait.
    strategy = _compat.creation_strategy(optimizer)
    ops = tf_agn_ops(strategy)
    if ops is None or ops.num_workers == 1:
        return
    # Eagerly, even when Keras builds the optimizer while tracing the train
    # step: instance keys are drawn when a collective runs, so the keys of
    # the check and of the step stay matched on every worker.
    with tf.init_scope():
        _check(
            optimizer_settings(method, compressor, window, variables, sparse),
            ops,
            strategy.extended.worker_devices,
            ops.options.timeout_seconds,
            "optimizer and model",
        )
