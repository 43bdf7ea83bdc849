"""The distribution side of tf_agn: strategy builders, local clusters,
parameter-server training and the asynchronous simulator."""

from tf_agn.strategies.cluster import LocalCluster
from tf_agn.strategies.commit_server import APPLIED
from tf_agn.strategies.commit_server import DUPLICATE
from tf_agn.strategies.commit_server import REJECTED_NON_FINITE
from tf_agn.strategies.evaluation import evaluate
from tf_agn.strategies.flags import define_flags
from tf_agn.strategies.flags import strategy_from_flags
from tf_agn.strategies.mirrored import even_batch_size
from tf_agn.strategies.mirrored import mirrored
from tf_agn.strategies.mirrored import split_cpu
from tf_agn.strategies.multi_worker import KerasMultiWorkerMirroredStrategy
from tf_agn.strategies.multi_worker import multi_worker_mirrored
from tf_agn.strategies.parameter_server import parameter_server
from tf_agn.strategies.simulate import simulate
from tf_agn.strategies.staleness import Staleness
from tf_agn.strategies.training import fit
