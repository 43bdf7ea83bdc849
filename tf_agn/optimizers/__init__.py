"""tf_agn's Keras 3 optimizers."""

from tf_agn.optimizers import loss_scaling
from tf_agn.optimizers import saving
from tf_agn.optimizers.aggregating import SGD
from tf_agn.optimizers.aggregating import Adam
from tf_agn.optimizers.aggregating import AdamW
from tf_agn.optimizers.aggregating import Aggregating
from tf_agn.optimizers.aggregating import RMSprop
from tf_agn.optimizers.aggregating import aggregating_class
from tf_agn.optimizers.agn import AGN
from tf_agn.optimizers.distributed_optimizer import DistributedOptimizer
from tf_agn.optimizers.downpour import DOWNPOUR
from tf_agn.optimizers.downpour import DynSGD
from tf_agn.optimizers.elastic import AEASGD
from tf_agn.optimizers.elastic import EAMSGD
from tf_agn.optimizers.streaming_diloco import StreamingDiLoCo
from tf_agn.optimizers.windowed import WindowedOptimizer
from tf_agn.optimizers.wrapping import WrappingOptimizer

# Keras' LossScaleOptimizer, which `compile` puts around these under mixed
# precision, then skips a step on every replica when any replica overflows.
loss_scaling.install()
# ... and saves sharded state whole.
saving.install()
