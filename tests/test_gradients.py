"""Gradients through converted SavedModels: ``tf.GradientTape`` through the loaded result
equals the source's gradient within the target's tolerance, for the models people
fine-tune or explain (saliency, adversarial inputs): a ``tf.custom_gradient``, a while
loop, a Keras LSTM, and a Keras model with a custom layer whose gradient is its own.

A SavedModel stores each custom gradient as a function traced for its forward op's dtypes,
re-registered by the loader under the op's ``_gradient_op_type`` and reading forward
tensors by name; those ops and tensors keep the source's dtypes (``custom_gradient_nodes``).
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path
from typing import Callable

import keras
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.protobuf import saved_model_pb2

from amp_rewrite import cli
from amp_rewrite.calibration.savedmodel import custom_gradient_nodes

from conftest import TARGET_TO_TOLERANCE, TARGETS

BATCH, FEATURES, STEPS = 4, 8, 5


class _CustomGradient(tf.Module):
    """``matmul`` whose gradient is clipped to [-1, 1] (a common custom gradient), between two MatMuls."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.w = tf.Variable(rng.uniform(-0.5, 0.5, (FEATURES, FEATURES)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, FEATURES], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        @tf.custom_gradient
        def clipped(h: tf.Tensor) -> tuple[tf.Tensor, Callable]:
            def grad(dy: tf.Tensor, variables: list[tf.Variable] | None = None) -> tuple[tf.Tensor, list[tf.Tensor]]:
                return (tf.clip_by_value(tf.matmul(dy, self.w, transpose_b=True), -1.0, 1.0),
                        [tf.matmul(h, dy, transpose_a=True)])
            return tf.matmul(h, self.w), grad

        return {"y": tf.matmul(tf.tanh(clipped(tf.matmul(x, self.w))), self.w)}


class _WhileLoop(tf.Module):
    """``STEPS`` rounds of ``h = tanh(h @ w + x)`` in a tf.while_loop."""

    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(np.random.default_rng(1).uniform(-0.4, 0.4, (FEATURES, FEATURES)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, FEATURES], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        _, h = tf.while_loop(lambda i, h: i < STEPS, lambda i, h: (i + 1, tf.tanh(tf.matmul(h, self.w) + x)),
                             (tf.constant(0), x))
        return {"y": h}


def _save_module(module: tf.Module, path: Path) -> None:
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


@keras.saving.register_keras_serializable(package="amp_rewrite_tests")
class StraightThroughRound(keras.layers.Layer):
    """Rounds in the forward pass; its gradient passes through unchanged (a straight-through
    estimator, as quantization-aware models use): a custom layer with its own gradient."""

    def call(self, inputs: tf.Tensor) -> tf.Tensor:
        @tf.custom_gradient
        def round_through(x: tf.Tensor) -> tuple[tf.Tensor, Callable]:
            return tf.round(x * 4.0) / 4.0, lambda dy: dy
        return round_through(inputs)


def _export_keras(layers: list[keras.layers.Layer], shape: tuple[int, ...], path: Path) -> None:
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input(shape), *layers])
    model.export(str(path), verbose=False)


MODELS: dict[str, Callable[[Path], None]] = {
    "custom-gradient": lambda path: _save_module(_CustomGradient(), path),
    "while-loop": lambda path: _save_module(_WhileLoop(), path),
    "lstm": lambda path: _export_keras([keras.layers.LSTM(16), keras.layers.Dense(4)], (STEPS, FEATURES), path),
    "keras-custom-layer": lambda path: _export_keras(
        [keras.layers.Dense(16), StraightThroughRound(), keras.layers.Dense(4)], (FEATURES,), path),
}
SHAPES = {"lstm": (BATCH, STEPS, FEATURES)}
# Every model to float16; those with custom gradients to every target, and across function boundaries.
CASES = [(model, "float16", ()) for model in MODELS] + [
    (model, target, ()) for model in ("custom-gradient", "keras-custom-layer") for target in TARGETS
    if target != "float16"] + [("custom-gradient", "float16", ("--cross-function",))]


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("gradients")
    for name, save in MODELS.items():
        save(folder / name)
    return {name: folder / name for name in MODELS}


def convert(source: Path, destination: Path, *args: str) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["convert", str(source), str(destination), *args])
    assert code == 0, err.getvalue()


def input_gradient(path: Path, x: np.ndarray) -> tf.Tensor:
    """d(sum(output * w))/dx through the loaded SavedModel's serving signature, with fixed
    weights w of every sign (a plain sum would hide errors that cancel)."""
    loaded = tf.saved_model.load(str(path))  # held while its function runs: it owns the variables
    function = loaded.signatures["serving_default"]
    (name,) = function.structured_input_signature[1]
    x = tf.constant(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        (output,) = function(**{name: x}).values()
        weights = tf.reshape(tf.sin(tf.range(tf.size(output), dtype=tf.float32)), tf.shape(output))
        loss = tf.reduce_sum(output * weights)
    return tape.gradient(loss, x)


@pytest.mark.parametrize("model, target, flags", CASES, ids=[f"{m}-{t}{''.join(f)}" for m, t, f in CASES])
def test_gradient_through_the_converted_model_matches_the_source(
    sources: dict[str, Path], tmp_path: Path, model: str, target: str, flags: tuple[str, ...]
) -> None:
    converted = tmp_path / "converted"
    convert(sources[model], converted, "--target", target, *flags)
    x = np.random.default_rng(3).standard_normal(SHAPES.get(model, (BATCH, FEATURES))).astype(np.float32)
    expected, got = input_gradient(sources[model], x), input_gradient(converted, x)
    assert got.dtype == expected.dtype == tf.float32
    error = float(tf.reduce_max(tf.abs(got - expected)) / tf.reduce_max(tf.abs(expected)))
    assert error <= TARGET_TO_TOLERANCE[target], f"gradient error {error:.3g} of its scale"


def test_custom_gradient_ops_and_what_their_gradients_read_keep_their_dtypes(sources: dict[str, Path],
                                                                            tmp_path: Path) -> None:
    """The custom gradient's forward op (IdentityN with ``_gradient_op_type``) and the tensor
    its saved gradient function reads (``captured_tensor``) are found, and keep float32 while
    the MatMuls around them convert."""
    saved_model = saved_model_pb2.SavedModel.FromString((sources["custom-gradient"] / "saved_model.pb").read_bytes())
    found = custom_gradient_nodes(saved_model.meta_graphs[0])
    ops = {node: why for (_, node), why in found.items()}
    assert any(node.startswith("IdentityN") and "custom gradient" in why for node, why in ops.items()), found
    assert any("read by a custom gradient function" in why for why in ops.values()), found
    converted = tmp_path / "converted"
    convert(sources["custom-gradient"], converted)
    rewritten = saved_model_pb2.SavedModel.FromString((converted / "saved_model.pb").read_bytes()).meta_graphs[0]
    functions = {f.signature.name: f for f in rewritten.graph_def.library.function}
    dtypes = {(name, node.name): list(node.attr["T"].list.type) or [node.attr["T"].type]
              for name, function in functions.items() for node in function.node_def if "T" in node.attr}
    for key in found:
        assert all(t != tf.float16.as_datatype_enum for t in dtypes[key]), (key, dtypes[key])
    assert any(t == tf.float16.as_datatype_enum for key, types in dtypes.items() for t in types
               if functions[key[0]].node_def and key not in found), "nothing else converted"
