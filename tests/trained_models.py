"""Models trained on data that ships with scikit-learn, for calibration and float8 tests.

Their weights are committed (``tests/data/trained/*.npz``, written by
``tools/train_models.py``), so no test trains. Each model is a Keras 3 model built here
and filled with those weights; ``export`` writes it with ``model.export`` as a user would.
The data splits are fixed: digits (1,797 images) is shuffled with seed 0 into 1,200
training, 64 calibration and 533 held-out images; diabetes (442 patients) into 300, 64
and 78. Calibration never sees the held-out split.

Base models (trained):

* ``digits_mlp``: 64 pixels / 16 → Dense 64 → Dense 64 → Dense 10 softmax.
* ``digits_cnn``: 8×8 image → Conv 3×3 16 → BatchNorm → ReLU → Conv 3×3 32 → BatchNorm →
  ReLU → global average → Dense 10 softmax.
* ``digits_mobilenet``: ``keras.applications.MobileNetV2(alpha=0.35)`` without its top, on
  the image upscaled to 32×32×3 (nearest), then Dense 10 softmax.
* ``digits_transformer``: the 8 image rows as 8 tokens → Dense 32 + position embedding →
  one encoder block (2-head attention, LayerNorm, feed-forward 64, LayerNorm) → mean over
  tokens → Dense 10 softmax.
* ``diabetes_mlp``: 10 standardized features → Dense 32 → Dense 32 → Dense 1 (disease
  progression, 25-346).

Variants with the same function, rescaled so their values really leave float16's range
(for ReLU layers, ``relu(a·z)·W/a == relu(z)·W`` for ``a > 0``: the same outputs in float32;
the factor is taken back in two steps of its square root, through the second hidden layer):

* ``digits_mlp_raw``: takes raw pixels ×1e4 (up to 1.6e5, over float16's 65504), the first
  kernel divided to match.
* ``digits_mlp_2e4``: the first hidden layer ×``_PEAK_2E4_SCALE``: its activations peak at
  about 2.1e4, between the safe magnitude (16384) and float16's limit.
* ``diabetes_overflow``: the first hidden layer ×2e4: its activations reach ~1.1e5.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

WEIGHTS = Path(__file__).resolve().parent / "data" / "trained"
BASE_MODELS = ("digits_mlp", "digits_cnn", "digits_mobilenet", "digits_transformer", "diabetes_mlp")
VARIANTS = {"digits_mlp_raw": "digits_mlp", "digits_mlp_2e4": "digits_mlp", "diabetes_overflow": "diabetes_mlp"}
MODEL_NAMES = (*BASE_MODELS, *VARIANTS)
SPLITS = ("train", "calibration", "held_out")
_DIGITS_SPLIT = (1200, 64)   # train, calibration; the rest (533) is held out
_DIABETES_SPLIT = (300, 64)  # the rest (78) is held out
_RAW_SCALE = 1e4
_PEAK_2E4_SCALE = 6500.0     # digits_mlp's first hidden layer peaks at 3.2 on the calibration split
_DIABETES_OVERFLOW_SCALE = 2e4  # diabetes_mlp's first hidden layer peaks at 5.5 on the calibration split
_IMAGE_SIZE = 32             # digits_mobilenet's input side


def base_of(name: str) -> str:
    if name not in MODEL_NAMES:
        raise ValueError(f"unknown trained model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    return VARIANTS.get(name, name)


def is_classifier(name: str) -> bool:
    return base_of(name).startswith("digits_")


def _split(count: int, sizes: tuple[int, int], split: str) -> np.ndarray:
    order = np.random.default_rng(0).permutation(count)
    train, calibration = sizes
    return {"train": order[:train], "calibration": order[train:train + calibration],
            "held_out": order[train + calibration:]}[split]


def data(name: str, split: str) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """(inputs by signature input name, labels) of ``split`` in the form model ``name`` takes."""
    from sklearn.datasets import load_diabetes, load_digits

    base = base_of(name)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
    if base == "diabetes_mlp":
        found = load_diabetes()
        index = _split(len(found.target), _DIABETES_SPLIT, split)
        x = found.data / found.data.std(axis=0)
        return {"x": x[index].astype(np.float32)}, found.target[index].astype(np.float32)
    found = load_digits()
    index = _split(len(found.target), _DIGITS_SPLIT, split)
    pixels, labels = found.data[index].astype(np.float32), found.target[index].astype(np.int64)
    if name == "digits_mlp_raw":
        return {"x": pixels * _RAW_SCALE}, labels
    if base == "digits_mlp":
        return {"x": pixels / 16.0}, labels
    if base == "digits_cnn":
        return {"image": pixels.reshape(-1, 8, 8, 1) / 16.0}, labels
    if base == "digits_transformer":
        return {"rows": pixels.reshape(-1, 8, 8) / 16.0}, labels
    upscaled = np.kron(pixels.reshape(-1, 8, 8), np.ones((_IMAGE_SIZE // 8, _IMAGE_SIZE // 8), np.float32))
    return {"image": np.repeat(upscaled[..., None], 3, axis=-1) / 8.0 - 1.0}, labels


def build(name: str, *, trained: bool = True):
    """Model ``name`` as a ``keras.Model``, with its committed weights (``trained=False``:
    freshly initialized, for ``tools/train_models.py``)."""
    import keras

    base = base_of(name)
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    model = _BUILDERS[base](keras)
    if not trained:
        return model
    with np.load(WEIGHTS / f"{base}.npz") as saved:
        weights = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    model.set_weights(weights)
    if name in ("digits_mlp_raw", "digits_mlp_2e4", "diabetes_overflow"):
        _rescale(model, name)
    return model


def _rescale(model, name: str) -> None:
    """The variant's weights: the same function in float32, other magnitudes inside."""
    first, second = model.get_layer("dense1"), model.get_layer("dense2")
    kernel, bias = first.get_weights()
    if name == "digits_mlp_raw":  # inputs raw pixels ×1e4 instead of pixels / 16
        first.set_weights([kernel / (16.0 * _RAW_SCALE), bias])
        return
    # ×scale in the first layer, back by its square root in each of the next two, so no
    # weight gets small enough to be subnormal in float16 (which a range rule would see)
    scale = _PEAK_2E4_SCALE if name == "digits_mlp_2e4" else _DIABETES_OVERFLOW_SCALE
    root = float(np.sqrt(scale))
    first.set_weights([kernel * scale, bias * scale])
    kernel2, bias2 = second.get_weights()
    second.set_weights([kernel2 / root, bias2 * root])
    last = model.layers[-1]
    kernel3, bias3 = last.get_weights()
    last.set_weights([kernel3 / root, bias3])


def export(name: str, path: Path) -> Path:
    """Model ``name`` written with ``model.export`` (a SavedModel, signatures ``serve`` and
    ``serving_default``)."""
    build(name).export(str(path), verbose=False)
    return path


def save_inputs(name: str, split: str, path: Path, count: int | None = None) -> Path:
    """``data(name, split)``'s inputs (the first ``count``) as an ``.npz``, as ``--inputs`` takes."""
    inputs, _ = data(name, split)
    np.savez(path, **{key: value[:count] for key, value in inputs.items()})
    return path


def top1(probabilities: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.argmax(probabilities, axis=-1) == labels))


def r2(predictions: np.ndarray, targets: np.ndarray) -> float:
    predictions = predictions.reshape(-1).astype(np.float64)
    return float(1.0 - np.sum((targets - predictions) ** 2) / np.sum((targets - targets.mean()) ** 2))


def _mlp(keras):
    layers = keras.layers
    x = keras.Input((64,), name="x")
    h = layers.Dense(64, activation="relu", name="dense1")(x)
    h = layers.Dense(64, activation="relu", name="dense2")(h)
    return keras.Model(x, layers.Dense(10, activation="softmax", name="probs")(h), name="digits_mlp")


def _cnn(keras):
    layers = keras.layers
    image = keras.Input((8, 8, 1), name="image")
    h = image
    for index, filters in enumerate((16, 32), start=1):
        h = layers.Conv2D(filters, 3, padding="same", use_bias=False, name=f"conv{index}")(h)
        h = layers.BatchNormalization(momentum=0.9, name=f"bn{index}")(h)
        h = layers.ReLU(name=f"relu{index}")(h)
    h = layers.GlobalAveragePooling2D(name="pool")(h)
    return keras.Model(image, layers.Dense(10, activation="softmax", name="probs")(h), name="digits_cnn")


def _mobilenet(keras):
    image = keras.Input((_IMAGE_SIZE, _IMAGE_SIZE, 3), name="image")
    backbone = keras.applications.MobileNetV2(input_shape=(_IMAGE_SIZE, _IMAGE_SIZE, 3), alpha=0.35,
                                              include_top=False, weights=None, pooling="avg")
    for layer in backbone.layers:  # 0.999 needs far more steps than 1,200 images give
        if isinstance(layer, keras.layers.BatchNormalization):
            layer.momentum = 0.9
    probs = keras.layers.Dense(10, activation="softmax", name="probs")(backbone(image))
    return keras.Model(image, probs, name="digits_mobilenet")


def _transformer(keras):
    layers = keras.layers
    rows = keras.Input((8, 8), name="rows")
    h = layers.Dense(32, name="embed")(rows)
    h = h + layers.Embedding(8, 32, name="position")(keras.ops.arange(8))
    attended = layers.MultiHeadAttention(2, 16, name="attention")(h, h)
    h = layers.LayerNormalization(name="norm1")(h + attended)
    ffn = layers.Dense(32, name="ffn2")(layers.Dense(64, activation="relu", name="ffn1")(h))
    h = layers.LayerNormalization(name="norm2")(h + ffn)
    h = layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(rows, layers.Dense(10, activation="softmax", name="probs")(h), name="digits_transformer")


def _diabetes(keras):
    layers = keras.layers
    x = keras.Input((10,), name="x")
    h = layers.Dense(32, activation="relu", name="dense1")(x)
    h = layers.Dense(32, activation="relu", name="dense2")(h)
    return keras.Model(x, layers.Dense(1, name="progression", bias_initializer=keras.initializers.Constant(150.0))(h),
                       name="diabetes_mlp")


_BUILDERS = {"digits_mlp": _mlp, "digits_cnn": _cnn, "digits_mobilenet": _mobilenet,
             "digits_transformer": _transformer, "diabetes_mlp": _diabetes}
