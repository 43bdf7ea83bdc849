#!/usr/bin/env bash
# Runs tf_agn's GPU checks and prints their table: every method with and
# without fp16 compression per transport (max relative error against numpy,
# placement on each replica's GPU), ordered collectives (the whole
# CrossDeviceOps contract against ReductionToOneDevice, many packs with sparse
# values, eager and traced, steps_per_execution=3 against 1), compression
# under the stock MirroredStrategy (NCCL) against tf_agn's ops, sharded
# optimizer state against unsharded, NCCL's
# reduce-scatter (2+ GPUs), then the time of
# one all-reduce (SUM, 12.6 M floats in 48 tensors, Keras's replica-context
# path) for the stock
# MirroredStrategy default, NcclAllReduce (2+ GPUs) and our transports.
# Meant for a machine with GPUs; finishes in a few minutes.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export TF_CPP_MIN_LOG_LEVEL=2
python -c "import tensorflow as tf; print('GPUs:', tf.config.list_physical_devices('GPU'))"
timeout 480 python -m pytest -q -s -rs -m gpu tests/test_gpu.py
