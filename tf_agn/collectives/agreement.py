"""Checking that every worker reduces with the same settings.

Workers that pack, compress or window differently hang or compute wrong
numbers; these checks all-gather a few integers encoding the settings and
raise the same error on every worker where they differ.
"""

import collections
import json
import zlib

import tensorflow as tf

from tf_agn import _compat
from tf_agn import compression
from tf_agn import transports
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.collectives.cross_device_ops import tf_agn_ops

CommunicationImplementation = tf.distribute.experimental.CommunicationImplementation

Setting = collections.namedtuple("Setting", ["name", "code", "show"])
Setting.__doc__ = """One setting workers must share: its name, this worker's
value encoded as an int64, and how to show a code in an error."""

_METHODS = list(AggregationMethod)
# Any other compressor's name is its CRC-32 after these.
_COMPRESSIONS = [None, *compression.BY_NAME, compression.PowerSGD.name]
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
    return len(_COMPRESSIONS) + _crc(name)


def _compression_text(code):
    if code < len(_COMPRESSIONS):
        return repr(_COMPRESSIONS[code])
    return f"a compressor of another name (code {code})"


def _crc(value):
    """A code for a JSON-able value, the same in every process."""
    return zlib.crc32(json.dumps(value, sort_keys=True, default=str).encode())


def _code_text(code):
    return f"code {code}"


def _method_setting(name, method):
    return Setting(name, _METHODS.index(method), lambda code: _METHODS[code].value)


def compression_settings(compressor):
    """The compressor's name and configuration as `Setting`s."""
    return [
        Setting("compression", _compression_code(compressor), _compression_text),
        Setting("compression settings", _crc(_configuration(compressor)), _code_text),
    ]


def _configuration(compressor):
    try:
        return compression.serialize(compressor)
    except TypeError:  # A user's compressor without `get_config`.
        return f"{type(compressor).__module__}.{type(compressor).__qualname__}"


def strategy_settings(ops, devices):
    """The `Setting`s of this worker's `ops` and replica `devices`."""
    return [
        _method_setting("aggregation", ops.default_aggregation),
        Setting("bytes_per_pack", ops.bytes_per_pack, str),
        *compression_settings(ops.default_compressor),
        Setting(
            "transport",
            transports.TRANSPORTS.index(ops.transport_name),
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


def optimizer_settings(method, compressor, window, variables, sparse=None, schedule=()):
    """The `Setting`s an optimizer's collectives depend on.

    `window` is `(name, steps)` (`gradient_accumulation_steps` or
    `local_steps`); `sparse` says, per variable, whether it is declared to
    have sparse gradients; `schedule` holds more `(name, int)` settings of
    when collectives run.
    """
    window_name, steps = window
    shapes = [(tuple(v.shape), str(v.dtype)) for v in variables]
    declared = [i for i, is_sparse in enumerate(sparse or ()) if is_sparse]
    return [
        _method_setting("aggregation_method", method),
        *compression_settings(compressor),
        Setting(window_name, steps or 0, str),
        *[Setting(name, value, str) for name, value in schedule],
        Setting("trainable variables", len(shapes), str),
        Setting("trainable variable shapes and dtypes", _crc(shapes), _code_text),
        Setting("variables with sparse gradients", _crc(declared), _code_text),
    ]


def _tf_agn_version():
    import tf_agn  # The package imports this module's users first.

    return tf_agn.__version__


def disagreement(settings, codes_per_worker, subject="strategy"):
    """A message on the first of `settings` whose `codes_per_worker`
    differ, or None."""
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
    """All-gathers every worker's codes of `settings`; raises if they differ."""
    devices = tuple(devices)
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
        # Receivers pull from senders: one more exchange keeps a worker that
        # raises from exiting before a slower peer has fetched ("Socket closed").
        try:
            exchange([0])
        except tf.errors.OpError:
            pass  # A peer left after the first exchange; this one has it too.
        raise ValueError(message)


def check_agreement(ops, devices, timeout_seconds):
    """Raises ValueError on every worker unless all build `ops` alike, or
    TimeoutError if one does not take part within `timeout_seconds`."""
    _check(strategy_settings(ops, devices), ops, devices, timeout_seconds, "strategy")


def check_optimizer_agreement(
    optimizer, method, compressor, window, variables, sparse=None, schedule=()
):
    """`check_agreement` for `optimizer_settings`; does nothing without
    tf_agn's ops or on one worker. Call it in `build` before any variable."""
    # Each new variable is broadcast from the chief: differing variables
    # would hang or fail ("tasks are unhealthy").
    strategy = _compat.creation_strategy(optimizer)
    ops = tf_agn_ops(strategy)
    if ops is None or ops.num_workers == 1:
        return
    # Eagerly, even while Keras traces the step: collective instance keys
    # are drawn when a collective runs, so they stay matched across workers.
    with tf.init_scope():
        _check(
            optimizer_settings(method, compressor, window, variables, sparse, schedule),
            ops,
            strategy.extended.worker_devices,
            ops.options.timeout_seconds,
            "optimizer and model",
        )
