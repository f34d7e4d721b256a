"""A SavedModel trained under Keras' ``mixed_float16`` can be retargeted and then fine-tuned
(issue 49's live and training paths): its float32 masters stay float32 and trainable with
``--float32-weights`` (or ``--target float32``), and gradient steps through its signature
function on its own variables lower the loss on the data it was trained on (scikit-learn's
digits). Without ``--float32-weights`` the bfloat16 weights are saved non-trainable."""
from __future__ import annotations

from pathlib import Path

import keras
import pytest
import tensorflow as tf

from amp_rewrite.testing.digits import digits
from test_cli import assert_ok, run_cli
from test_outputs_float32 import _tf1_saved_model

STEPS, LEARNING_RATE = 10, 0.1


@pytest.fixture(scope="module")
def mixed16(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An MLP trained two epochs on the digits under ``mixed_float16`` (logits float32), exported."""
    data = digits()
    keras.utils.set_random_seed(0)
    keras.config.set_dtype_policy("mixed_float16")
    try:
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu"),
                                  keras.layers.Dense(10, dtype="float32")])
        model.compile(optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        model.fit(data.x_train, data.y_train, batch_size=64, epochs=2, verbose=0)
        path = tmp_path_factory.mktemp("mixed16") / "model"
        model.export(str(path), verbose=False)
    finally:
        keras.config.set_dtype_policy("float32")
    return path


def _losses(path: Path) -> tuple[list[tf.DType], list[float]]:
    """The dtypes of the loaded model's trainable variables, and the loss before each of STEPS
    gradient-descent steps on them through its ``serve`` signature (then once more)."""
    data = digits()
    model = tf.saved_model.load(str(path))
    variables = list(model.trainable_variables)
    losses = []
    for _ in range(STEPS + 1):
        with tf.GradientTape() as tape:
            logits = tf.cast(model.serve(data.x_train), tf.float32)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(data.y_train, logits))
        losses.append(float(loss))
        gradients = tape.gradient(loss, variables)
        assert variables and all(gradient is not None for gradient in gradients), "no gradient reaches a variable"
        for variable, gradient in zip(variables, gradients):
            variable.assign_sub(LEARNING_RATE * tf.cast(gradient, variable.dtype))
    return [variable.dtype for variable in variables], losses


@pytest.mark.parametrize("target, extra", [("bfloat16", ("--float32-weights",)), ("float32", ())])
def test_retargeted_export_fine_tunes_on_its_float32_weights(mixed16: Path, tmp_path: Path, target: str,
                                                             extra: tuple[str, ...]) -> None:
    destination = tmp_path / target
    assert_ok(run_cli("convert", mixed16, destination, "--target", target, *extra))
    dtypes, losses = _losses(destination)
    assert set(dtypes) == {tf.float32} and len(dtypes) == 4, dtypes  # two kernels, two biases
    assert losses[-1] < losses[0] * 0.95, losses


def test_weights_stored_bfloat16_are_not_trainable(mixed16: Path, tmp_path: Path) -> None:
    """The default stores bfloat16 weights, saved non-trainable: an update smaller than their precision rounds away."""
    assert_ok(run_cli("convert", mixed16, tmp_path / "bf16", "--target", "bfloat16"))
    model = tf.saved_model.load(str(tmp_path / "bf16"))
    assert all(variable.dtype != tf.bfloat16 for variable in model.trainable_variables)
    assert any(variable.dtype == tf.bfloat16 for variable in model.variables)


@pytest.mark.parametrize("target, extra", [("float32", ()), ("float16", ("--float32-weights",))])
def test_weights_saved_non_trainable_are_trainable_again_once_widened(mixed16: Path, tmp_path: Path, target: str,
                                                                     extra: tuple[str, ...]) -> None:
    """Stored bfloat16 (non-trainable), then widened back to float32 by --target float32 or by
    retargeting with --float32-weights: trainable again, in their places, and a gradient step
    through the signature changes them."""
    assert_ok(run_cli("convert", mixed16, tmp_path / "bf16", "--target", "bfloat16"))
    before = [variable.name for variable in tf.saved_model.load(str(mixed16)).trainable_variables]
    assert_ok(run_cli("convert", tmp_path / "bf16", tmp_path / target, "--target", target, *extra))
    model = tf.saved_model.load(str(tmp_path / target))
    assert [variable.name for variable in model.trainable_variables] == before
    assert all(variable.trainable and variable.dtype == tf.float32 for variable in model.variables)
    dtypes, losses = _losses(tmp_path / target)
    assert set(dtypes) == {tf.float32} and len(dtypes) == 4, dtypes
    assert losses[-1] < losses[0] * 0.95, losses


def test_stored_low_again_they_are_non_trainable_again(mixed16: Path, tmp_path: Path) -> None:
    """bfloat16 -> float16, weights stored low: widened on the way, marked non-trainable again."""
    assert_ok(run_cli("convert", mixed16, tmp_path / "bf16", "--target", "bfloat16"))
    assert_ok(run_cli("convert", tmp_path / "bf16", tmp_path / "fp16", "--target", "float16"))
    model = tf.saved_model.load(str(tmp_path / "fp16"))
    assert not model.trainable_variables and any(variable.dtype == tf.float16 for variable in model.variables)
    assert_ok(run_cli("convert", tmp_path / "fp16", tmp_path / "f32", "--target", "float32"))
    assert len(tf.saved_model.load(str(tmp_path / "f32")).trainable_variables) == 4


def _tf1_trainable(path: Path) -> list[str]:
    """A TF1 SavedModel's trainable_variables collection, as a TF1 loader restores it."""
    with tf.compat.v1.Session(graph=tf.Graph()) as session:
        tf.compat.v1.saved_model.loader.load(session, ["serve"], str(path))
        return [variable.name for variable in tf.compat.v1.trainable_variables()]


def test_a_tf1_variable_stored_low_rejoins_trainable_variables_once_widened(tmp_path: Path) -> None:
    source, _ = _tf1_saved_model(tmp_path / "tf1")
    assert_ok(run_cli("convert", source, tmp_path / "bf16", "--target", "bfloat16"))
    assert _tf1_trainable(source) == ["w:0"] and _tf1_trainable(tmp_path / "bf16") == []
    assert_ok(run_cli("convert", tmp_path / "bf16", tmp_path / "f32", "--target", "float32"))
    assert _tf1_trainable(tmp_path / "f32") == ["w:0"]
