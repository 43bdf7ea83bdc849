"""Model-parallel training with decoupled stages: ADL, DDG and BP."""

from tf_agn.decoupled.model import DecoupledModel
from tf_agn.decoupled.split import split_model
