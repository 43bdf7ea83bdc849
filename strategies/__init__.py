"""The distribution side of tf_agn: strategy builders, their flags and local
clusters."""

from tf_agn.strategies.cluster import LocalCluster
from tf_agn.strategies.flags import define_flags
from tf_agn.strategies.flags import strategy_from_flags
from tf_agn.strategies.mirrored import even_batch_size
from tf_agn.strategies.mirrored import mirrored
from tf_agn.strategies.mirrored import split_cpu
from tf_agn.strategies.parameter_server import parameter_server
