"""tf_agn: control how gradients from many replicas are combined.

The packages, by layer:

- `tf_agn.optimizers`: Keras optimizers that combine gradients (each with
  one step object, `tf_agn.optimizers.step`, chosen when it is built),
  windowed optimizers (AGN, DiLoCo), sharded state; `tf_agn.decoupled`:
  ADL.
- `tf_agn.collectives`: how values travel between replicas.
  `routing.py` holds what optimizers call in replica context
  (`tf_agn.aggregate`, `reduce_scatter`, `all_gather`, `all_to_all`) and
  `combine_replicas`, which routes every local replica's values to a
  transport's patterns; `aggregation_method.py` the `AggregationMethod`s
  and their replicas' weights; `cross_device_ops.py` the
  `AggregatingAllReduce` that takes TensorFlow's own callers down the same
  road.
- `tf_agn.transports`: the collective patterns on each transport;
  `tf_agn.compression`: the compressors.
- `tf_agn.resuming`: backups, and resuming on another replica count.
- `tf_agn.utils`, `tf_agn.callbacks`, `tf_agn.datasets`, `tf_agn.metrics`,
  `tf_agn.models`: helpers, callbacks and the examples' data and models.

A gradient's road: a tf_agn optimizer's step calls `tf_agn.aggregate` in
replica context, or `reduce_scatter`/`all_gather`/`all_to_all` there for
sharded state; all of them meet the local replicas in one `merge_call`,
where `routing.combine_replicas` routes the values to a transport's
collective patterns, through a compressor where one acts, each replica
weighted as its aggregation method says.

A new collective pattern is a method of each transport in
`tf_agn/transports/`, routed in `routing.combine_replicas`; a new
compressor is a subclass of `tf_agn.compression.Compressor` (`Cast` for
one that acts element by element), which callers only ask; a new
aggregation method is a member of `AggregationMethod`, with its replicas'
weights (`aggregation_method.sum_weights`), in
`tf_agn/collectives/aggregation_method.py`.
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
from tf_agn.collectives.aggregation_method import AggregationMethod
from tf_agn.collectives.communication import CommunicationCounter
from tf_agn.collectives.cross_device_ops import AggregatingAllReduce
from tf_agn.collectives.routing import aggregate
from tf_agn.utils.replicas import replica_weights

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
