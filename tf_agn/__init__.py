"""tf_agn: control how gradients from many replicas are combined."""

from tf_agn.aggregation import AggregationMethod
from tf_agn.cross_device_ops import AggregatingAllReduce
