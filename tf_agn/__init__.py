"""tf_agn: control how gradients from many replicas are combined.

A gradient's road: a tf_agn optimizer's step (`tf_agn.optimizers.step`,
chosen when the optimizer is built) calls `tf_agn.aggregate`
(replica_aggregation.py) in replica context, or
`reduce_scatter`/`all_gather`/`all_to_all` there for sharded state; all of
them meet the local replicas in one `merge_call`, where
`combining.combine_replicas` routes the values to a transport's collective
patterns (`tf_agn/transports/`), through a compressor where one acts
(`tf_agn/compression/`), each replica weighted as its aggregation method
says (aggregation.py). `AggregatingAllReduce` (cross_device_ops.py) takes
TensorFlow's own callers down the same road.

A new collective pattern is a method of each transport in
`tf_agn/transports/`, routed in `combining.combine_replicas`; a new
compressor is a subclass of `tf_agn.compression.Compressor` (`Cast` for
one that acts element by element), which callers only ask; a new
aggregation method is a member of `AggregationMethod`, with its replicas'
weights (`aggregation.sum_weights`), in `tf_agn/aggregation.py`.
"""

import os as _os

try:
    import tensorflow as _tensorflow  # noqa: F401
except ModuleNotFoundError as _error:
    if _error.name != "tensorflow":
        raise
    # setup.py leaves TensorFlow out, so as not to install a second one.
    raise ImportError(
        "tf_agn needs TensorFlow 2.20 or newer, which is not installed: "
        "pip install tensorflow (or tensorflow-cpu, tensorflow[and-cuda], "
        "tf-nightly), or pip install 'tf_agn[tensorflow]'."
    ) from _error

from tf_agn import _compat
from tf_agn import _source_layout
from tf_agn.aggregation import AggregationMethod
from tf_agn.communication import CommunicationCounter
from tf_agn.cross_device_ops import AggregatingAllReduce
from tf_agn.replica_aggregation import aggregate
from tf_agn.replicas import replica_weights

_compat.check_versions()
_source_layout.attach_strategies(_os.path.dirname(__file__))

from tf_agn import callbacks  # noqa: E402
from tf_agn import compression  # noqa: E402
from tf_agn import datasets  # noqa: E402
from tf_agn import decoupled  # noqa: E402
from tf_agn import metrics  # noqa: E402
from tf_agn import models  # noqa: E402
from tf_agn import optimizers  # noqa: E402
from tf_agn import strategies  # noqa: E402

__version__ = "0.1.0"
