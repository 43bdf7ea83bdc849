"""Model-parallel training with decoupled stages: ADL, DDG and BP.

`split_model` cuts a Keras model into K stages; `DecoupledModel` trains them
on K devices, all stages at work in every tick (see `DecoupledModel`).
"""

from tf_agn.decoupled.model import DecoupledModel
from tf_agn.decoupled.split import split_model
