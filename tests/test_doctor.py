"""The training doctor: what a user whose float16 steps are all skipped is told, and what fixes it.

* ``enable_mixed_precision_graph_rewrite(..., lists=, keep=)``: the keep regex the doctor
  suggests, pasted into the call the user has, keeps that node float32 in the live rewrite;
* the Keras 3 wrapper counts skipped steps and says once when training is stuck;
* the doctor replays a skipped step's batch once and names the first op whose output is not
  finite, for models built to fail (float16 overflow, a LayerNorm variance that underflows,
  a softmax fed large logits); pasting its keep makes the skips stop; it never changes training.
"""
from __future__ import annotations

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_live import registered_compute, new_functions, function_names

import amp_rewrite
from amp_rewrite.training import live


@pytest.fixture(autouse=True)
def _no_live_rewrite() -> None:
    live.stop()
    keras.config.set_dtype_policy("float32")
    yield
    live.stop()


def _two_matmuls(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    with tf.name_scope("head"):
        kept = tf.matmul(a, b, name="kept")
    return tf.matmul(kept, tf.transpose(b), name="converted")


@pytest.mark.parametrize("how", ["keep", "lists"])
def test_a_keep_regex_on_the_entry_point_keeps_that_node_float32(how, tmp_path):
    """``keep=`` (as ``--keep``) and ``lists=`` (an overlay file's keep_nodes) on
    ``enable_mixed_precision_graph_rewrite``: the named MatMul stays float32, the other is float16."""
    if how == "keep":
        options = {"keep": [r"head/kep?t"]}
    else:
        (tmp_path / "keep.yaml").write_text('keep_nodes: ["head/kept"]\n')
        options = {"lists": tmp_path / "keep.yaml"}
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="float16", **options)
    before = function_names()
    a, b = tf.random.normal((4, 8)), tf.random.normal((8, 8))
    step = tf.function(_two_matmuls)  # held: its registered functions go with it
    step(a, b)
    nodes = {node.name: node.dtype for node in registered_compute(new_functions(before))}
    assert nodes == {"head/kept": "DT_FLOAT", "converted": "DT_HALF"}


def test_keep_on_the_entry_point_says_what_it_takes():
    with pytest.raises(ValueError, match=r"keep= takes node-name regexes \(strings\), got 3"):
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="float16", keep=[3])
