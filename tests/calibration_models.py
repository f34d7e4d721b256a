"""SavedModels that the plain float16 rewrite breaks, one per numerical mechanism.

Calibration (issue 18) must repair these; the plain rewrite (op lists only) gives
non-finite outputs or errors over the float16 tolerance on them, while float32 is
well-behaved. Their compute lives inside ``tf.function`` bodies, as in a real export:
three are Keras 3 models written with ``model.export``, one a ``tf.Module`` saved with
``tf.saved_model.save``.

* ``overflow_mlp``: activation overflow in a MatMul (the issue's Keras MLP).
* ``overflow_cnn``: activation overflow in a Conv2D.
* ``residual_sum``: every MatMul's output is in float16's range, their running sum
  (an AddV2 chain, infer ops) is not.
* ``small_magnitude``: values mostly below float16's smallest normal number (6.1e-5)
  lose their precision; nothing overflows.

Every model ends in a normalization, so its float32 outputs are O(1) (below 10).
``inputs(name, count, seed)`` draws a batch from the model's input distribution: seed 0
is the calibration set, seed 1 held-out data. Weights come from fixed seeds and layers
have explicit names, so a model's nodes are named the same in every build.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import tensorflow as tf

MODEL_NAMES: tuple[str, ...] = ("overflow_mlp", "overflow_cnn", "residual_sum", "small_magnitude")

CALIBRATION_SEED = 0
HELD_OUT_SEED = 1

_MLP_FEATURES = 64
_MLP_INPUT_SCALE = 20.0        # the "inputs ×20"
_MLP_KERNEL_STDDEV = 4.0       # both hidden Dense layers: pre-norm activations reach ~2e5
_IMAGE_SIZE = 16
_CNN_INPUT_SCALE = 30.0
_CNN_KERNEL_STDDEV = 4.0       # both convolutions: the second one's outputs reach ~1.2e5
_RESIDUAL_FEATURES = 64
_RESIDUAL_BRANCHES = 32
_RESIDUAL_BRANCH_SCALE = 1000.0  # each branch's MatMul output stays below ~3.5e3; the sum reaches ~1e5
_RESIDUAL_NOISE = 0.1            # branch weights differ from a shared direction by this much
_RESIDUAL_RESCALE = 1e-3         # brings the sum back to ~100 before the head MatMul
_SMALL_FEATURES = 64
_SMALL_INPUT_SCALE = 1e-6      # float16's subnormals are 6e-8 apart: 1e-6 keeps about 4 bits
_SMALL_RESCALE = 1e4           # back to ~1e-2, in float16's normal range; 1e6 in one step would overflow


def save_overflow_mlp(path: Path) -> None:
    """x ×20 → Dense 64→512 (kernel stddev 4) → ReLU → Dense 512→512 (kernel stddev 4)
    → LayerNormalization → Dense 10. The second Dense's MatMul outputs reach ~2e5.

    The issue's "weights of stddev 4" must mean both hidden layers: with stddev 4 on the
    first only (Glorot on the second) the plain float16 rewrite stays within 7e-4."""
    import keras

    layers, initializers = keras.layers, keras.initializers
    _reset_keras()
    x = keras.Input((_MLP_FEATURES,), name="x")
    h = layers.Dense(512, activation="relu", name="wide",
                     kernel_initializer=initializers.RandomNormal(stddev=_MLP_KERNEL_STDDEV, seed=1))(x)
    h = layers.Dense(512, name="overflow",
                     kernel_initializer=initializers.RandomNormal(stddev=_MLP_KERNEL_STDDEV, seed=2))(h)
    h = layers.LayerNormalization(name="norm")(h)
    logits = layers.Dense(10, name="logits")(h)
    keras.Model(x, logits, name="overflow_mlp").export(str(path), verbose=False)


def save_overflow_cnn(path: Path) -> None:
    """image ×30 (16×16×3) → Conv2D 3×3 32 (kernel stddev 4) → ReLU → Conv2D 3×3 16
    (kernel stddev 4) → ReLU → global average pool → LayerNormalization → Dense 10. The
    second convolution's outputs reach ~1.2e5."""
    import keras

    layers, initializers = keras.layers, keras.initializers
    _reset_keras()
    image = keras.Input((_IMAGE_SIZE, _IMAGE_SIZE, 3), name="image")
    h = layers.Conv2D(32, 3, padding="same", activation="relu", name="conv1",
                      kernel_initializer=initializers.RandomNormal(stddev=_CNN_KERNEL_STDDEV, seed=1))(image)
    h = layers.Conv2D(16, 3, padding="same", activation="relu", name="overflow",
                      kernel_initializer=initializers.RandomNormal(stddev=_CNN_KERNEL_STDDEV, seed=2))(h)
    h = layers.GlobalAveragePooling2D(name="pool")(h)
    h = layers.LayerNormalization(name="norm")(h)
    logits = layers.Dense(10, name="logits")(h)
    keras.Model(image, logits, name="overflow_cnn").export(str(path), verbose=False)


class _ResidualSum(tf.Module):
    """h = x + relu(x @ w_1) + ... + relu(x @ w_32); y = norm((h × 1e-3) @ head) @ out.

    The branches' weights share one direction (w_k = base + 0.1 noise), so their outputs
    add up instead of cancelling: each MatMul's output stays below ~3.5e3, the running
    sum (``sum1`` … ``sum32``, AddV2) reaches ~1e5. The sums lie between MatMuls (the
    branches before, ``head`` after, through the ``rescale`` Mul), so the float16 rewrite
    converts them; ``head``'s own inputs, after ``rescale``, are ~100.
    """

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        n = _RESIDUAL_FEATURES
        base = rng.standard_normal((n, n))
        self.branches = [
            tf.Variable((_RESIDUAL_BRANCH_SCALE * (base + _RESIDUAL_NOISE * rng.standard_normal((n, n))) / np.sqrt(n))
                        .astype(np.float32), name=f"w{k}")
            for k in range(1, _RESIDUAL_BRANCHES + 1)]
        self.head = tf.Variable((rng.standard_normal((n, n)) / np.sqrt(n)).astype(np.float32), name="head")
        self.out = tf.Variable((rng.standard_normal((n, 10)) / np.sqrt(n)).astype(np.float32), name="out")

    @tf.function(input_signature=[tf.TensorSpec([None, _RESIDUAL_FEATURES], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        h = x
        for k, w in enumerate(self.branches, start=1):
            h = tf.add(h, tf.nn.relu(tf.matmul(x, w, name=f"branch{k}")), name=f"sum{k}")
        z = tf.matmul(tf.multiply(h, _RESIDUAL_RESCALE, name="rescale"), self.head, name="head")
        mean, variance = tf.nn.moments(z, axes=[-1], keepdims=True)
        normalized = (z - mean) * tf.math.rsqrt(variance + 1e-6)
        return {"y": tf.matmul(normalized, self.out, name="out")}


def save_residual_sum(path: Path) -> None:
    """A ``tf.Module`` (see ``_ResidualSum``) saved with one signature, ``serving_default``."""
    module = _ResidualSum()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


def save_small_magnitude(path: Path) -> None:
    """x (values ~1e-6) → Dense 64→64 → ReLU → Dense 64→64 → Rescaling ×1e4 →
    LayerNormalization (epsilon 1e-6) → Dense 10. Both Dense layers' outputs are below
    6.1e-5: in float16 they are subnormal and keep a few bits; the rescaling and the
    normalization bring those errors back to O(1) without overflowing float16.

    (A LayerNormalization straight after the Dense layers would scale by ~1e6 and
    overflow float16 in its ``mul``: an overflow, not the precision loss this model is for.)"""
    import keras

    layers = keras.layers
    _reset_keras()
    x = keras.Input((_SMALL_FEATURES,), name="x")
    h = layers.Dense(64, activation="relu", name="small1")(x)
    h = layers.Dense(64, name="small2")(h)
    h = layers.Rescaling(_SMALL_RESCALE, name="rescale")(h)
    h = layers.LayerNormalization(epsilon=1e-6, name="norm")(h)
    logits = layers.Dense(10, name="logits")(h)
    keras.Model(x, logits, name="small_magnitude").export(str(path), verbose=False)


_SAVERS: dict[str, Callable[[Path], None]] = {
    "overflow_mlp": save_overflow_mlp,
    "overflow_cnn": save_overflow_cnn,
    "residual_sum": save_residual_sum,
    "small_magnitude": save_small_magnitude,
}


def save_model(name: str, path: Path) -> Path:
    """Write model ``name`` (one of ``MODEL_NAMES``) as a SavedModel at ``path``."""
    if name not in _SAVERS:
        raise ValueError(f"unknown calibration model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    _SAVERS[name](path)
    return path


def inputs(name: str, count: int, seed: int) -> dict[str, np.ndarray]:
    """A batch of ``count`` inputs for model ``name``, by signature input name, drawn
    from the model's input distribution with ``seed`` (0: calibration, 1: held out)."""
    rng = np.random.default_rng(seed)
    if name == "overflow_mlp":
        return {"x": (_MLP_INPUT_SCALE * rng.standard_normal((count, _MLP_FEATURES))).astype(np.float32)}
    if name == "overflow_cnn":
        shape = (count, _IMAGE_SIZE, _IMAGE_SIZE, 3)
        return {"image": (_CNN_INPUT_SCALE * rng.standard_normal(shape)).astype(np.float32)}
    if name == "residual_sum":
        return {"x": rng.standard_normal((count, _RESIDUAL_FEATURES)).astype(np.float32)}
    if name == "small_magnitude":
        return {"x": (_SMALL_INPUT_SCALE * rng.standard_normal((count, _SMALL_FEATURES))).astype(np.float32)}
    raise ValueError(f"unknown calibration model {name!r}; choose one of {', '.join(MODEL_NAMES)}")


def save_inputs(name: str, count: int, seed: int, path: Path) -> Path:
    """``inputs(name, count, seed)`` as an ``.npz`` file, the form ``--inputs`` takes."""
    np.savez(path, **inputs(name, count, seed))
    return path


def _reset_keras() -> None:
    import keras

    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
