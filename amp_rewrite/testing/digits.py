"""Small Keras models trained on scikit-learn's digits: FP8 training's tests and tools.

``train(name, variant)`` trains model ``name`` (``"mlp"``, ``"cnn"``, ``"transformer"``) on
the 8x8 digits with one seed and one data order whatever the variant — ``"float32"``, our
``"bfloat16"`` and ``"float8"`` rewrites, or ``"keras-float8"``, Keras' own FP8 training
(``model.quantize("float8")`` on a ``mixed_bfloat16`` model: its Dense and EinsumDense
layers take ``QuantizedFloat8DTypePolicy``) — and returns the loss per epoch and the
held-out accuracy. ``training_step_hlo`` gives the HLO XLA gets for one training step of a
model, whose dots and convolutions ``count_float8_matmuls`` counts.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import amp_rewrite
from amp_rewrite.testing.float8 import hlo_instructions, scaled_float8_type

MODELS = ("mlp", "cnn", "transformer")
LOOP_MODELS = ("lstm", "gru")  # their matmuls in a while loop's body (FP8 training's loop tests)
VARIANTS = ("float32", "bfloat16", "float8", "keras-float8")
BATCH, LEARNING_RATE = 32, 1e-3


@dataclass(frozen=True)
class Digits:
    x_train: np.ndarray  # (n, 64) float32 in [0, 1]
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def digits() -> Digits:
    """scikit-learn's digits, 75/25 stratified split of seed 0 (as the Session tests split them)."""
    # scikit-learn is a test extra, not a dependency: imported when the data is asked for.
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    split = train_test_split((images / 16.0).astype("float32"), labels.astype("int32"), test_size=0.25,
                             random_state=0, stratify=labels)
    return Digits(*split[0::2], *split[1::2])


def build(name: str) -> keras.Model:
    """Model ``name`` on a flat 64-pixel input, with logits out: an MLP; a CNN (two Conv2D
    and a Dense); a Transformer block over the image's 8 rows (MultiHeadAttention, a GELU
    feed-forward, LayerNormalization, a Dense head); an LSTM or a GRU over the 8 rows (its
    matmuls in a while loop's body, and its gradient's)."""
    layers = keras.layers
    pixels = keras.Input((64,))
    if name == "mlp":
        hidden = layers.Dense(64, activation="relu")(layers.Dense(128, activation="relu")(pixels))
    elif name == "cnn":
        image = layers.Reshape((8, 8, 1))(pixels)
        hidden = layers.Conv2D(16, 3, padding="same", activation="relu")(image)
        hidden = layers.Conv2D(32, 3, strides=2, padding="same", activation="relu")(hidden)
        hidden = layers.Flatten()(hidden)
    elif name == "lstm":
        hidden = layers.LSTM(32)(layers.Reshape((8, 8))(pixels))
    elif name == "gru":
        hidden = layers.GRU(32)(layers.Reshape((8, 8))(pixels))
    elif name == "transformer":
        rows = layers.Dense(32)(layers.Reshape((8, 8))(pixels))
        attention = layers.MultiHeadAttention(4, key_dim=8)(rows, rows)
        hidden = layers.LayerNormalization()(rows + attention)
        feed_forward = layers.Dense(32)(layers.Dense(64, activation="gelu")(hidden))
        hidden = layers.GlobalAveragePooling1D()(layers.LayerNormalization()(hidden + feed_forward))
    else:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS + LOOP_MODELS)}")
    return keras.Model(pixels, layers.Dense(10)(hidden), name=name)


@dataclass(frozen=True)
class Trained:
    model: keras.Model
    optimizer: Any
    losses: tuple[float, ...]  # training loss per epoch
    accuracy: float            # on the held-out quarter


@contextlib.contextmanager
def variant_settings(variant: str, amax_history_length: int = 1024, optimizer: Any = None) -> Iterator[Any]:
    """``optimizer`` (default: Adam) as ``variant`` trains with, inside the variant's settings:
    build the model and trace its steps inside; the policy and rewrite are back to float32
    afterwards (traces keep their rewrite)."""
    optimizer = optimizer if optimizer is not None else keras.optimizers.Adam(LEARNING_RATE)
    try:
        if variant == "keras-float8":
            keras.config.set_dtype_policy("mixed_bfloat16")
        elif variant in ("bfloat16", "float8"):
            extra = {"amax_history_length": amax_history_length} if variant == "float8" else {"loss_scale": None}
            optimizer = amp_rewrite.enable_mixed_precision_graph_rewrite(optimizer, target=variant, **extra)
        elif variant != "float32":
            raise ValueError(f"unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
        yield optimizer
    finally:
        keras.config.set_dtype_policy("float32")
        if variant in ("bfloat16", "float8"):
            amp_rewrite.disable_mixed_precision_graph_rewrite(optimizer)


def train(name: str, variant: str, *, epochs: int, seed: int = 0, jit_compile: bool = True,
          amax_history_length: int = 1024, data: Digits | None = None,
          learning_rate: float = LEARNING_RATE) -> Trained:
    """Train ``name`` as ``variant`` (module doc); same weights, batches and order for every variant."""
    data = data if data is not None else digits()
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    with variant_settings(variant, amax_history_length, keras.optimizers.Adam(learning_rate)) as optimizer:
        model = build(name)
        if variant == "keras-float8":
            model.quantize("float8")
        model.compile(optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"], jit_compile=jit_compile)
        history = model.fit(data.x_train, data.y_train, batch_size=BATCH, epochs=epochs, verbose=0, shuffle=True)
        _, accuracy = model.evaluate(data.x_test, data.y_test, batch_size=256, verbose=0)
    return Trained(model, optimizer, tuple(history.history["loss"]), float(accuracy))


def training_step_hlo(name: str, variant: str, amax_history_length: int = 16) -> str:
    """The HLO XLA gets (``stage="hlo"``) for one jit-compiled training step of ``name`` as
    ``variant`` (a custom loop: tape, gradients, the optimizer's ``apply``)."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    x, y = np.zeros((BATCH, 64), np.float32), np.zeros(BATCH, np.int32)
    with variant_settings(variant, amax_history_length) as optimizer:
        model = build(name)
        if variant == "keras-float8":
            model.quantize("float8")
        return training_step(model, optimizer).experimental_get_compiler_ir(x, y)(stage="hlo")


def training_step(model: keras.Model, optimizer: Any) -> Any:
    """A ``tf.function(jit_compile=True)`` training step of ``model`` (logits, integer labels) as a
    custom loop writes it: tape, gradients, ``optimizer.apply``; it returns the loss. Call or
    trace it where the optimizer's variant is on (``variant_settings``)."""
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    optimizer.build(model.trainable_variables)

    @tf.function(jit_compile=True)
    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
        return loss

    return step



def strategy_run_accuracy(strategy: tf.distribute.Strategy, variant: str, *, epochs: int = 3,
                          amax_history_length: int = 4, data: Digits | None = None) -> float:
    """Held-out accuracy of the MLP trained ``epochs`` on digits as ``variant`` by a Keras 3
    ``strategy.run`` loop (tape, ``tape.gradient(loss)``, ``opt.apply``; the loss averaged over
    the global batch of ``BATCH``), on whatever replicas ``strategy`` has: what a replica run is
    compared with on one device."""
    data = data if data is not None else digits()
    per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    keras.utils.set_random_seed(0)
    with strategy.scope(), variant_settings(variant, amax_history_length) as optimizer:
        model = build("mlp")
        optimizer.build(model.trainable_variables)

        @tf.function
        def step(x: Any, y: Any) -> None:
            def replica(x: Any, y: Any) -> None:
                with tf.GradientTape() as tape:
                    loss = tf.reduce_sum(per_example(y, model(x, training=True))) / BATCH
                optimizer.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            strategy.run(replica, args=(x, y))

        batches = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train)).batch(BATCH, drop_remainder=True)
        for _ in range(epochs):
            for x, y in strategy.experimental_distribute_dataset(batches):
                step(x, y)
        predicted = np.argmax(keras.ops.convert_to_numpy(model(data.x_test)), axis=1)  # eager: no predict loop
    return float(np.mean(predicted == data.y_test))


def tf_keras_fit_accuracy(strategy: tf.distribute.Strategy, variant: str, *, epochs: int = 3,
                          amax_history_length: int = 4, data: Digits | None = None) -> tuple[Any, float]:
    """The wrapper and held-out accuracy of a tf_keras MLP (128-64-10) trained ``epochs`` on
    digits by ``model.fit`` as ``variant`` (``"bfloat16"`` or ``"float8"``) under ``strategy``:
    the Keras 2 path, whose ``fit`` also runs under MultiWorkerMirroredStrategy."""
    import tf_keras  # a test extra, not a dependency: imported for the Keras 2 path only

    data = data if data is not None else digits()
    extra = {"amax_history_length": amax_history_length} if variant == "float8" else {}
    tf_keras.utils.set_random_seed(0)
    with strategy.scope():
        optimizer = amp_rewrite.enable_mixed_precision_graph_rewrite(tf_keras.optimizers.Adam(LEARNING_RATE),
                                                                     target=variant, **extra)
        layers = tf_keras.layers
        model = tf_keras.Sequential([layers.Dense(128, activation="relu", input_shape=(64,)),
                                     layers.Dense(64, activation="relu"), layers.Dense(10)])
        model.compile(optimizer=optimizer, loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    try:
        batches = tf.data.Dataset.from_tensor_slices((data.x_train, data.y_train)).batch(BATCH, drop_remainder=True)
        model.fit(batches, epochs=epochs, verbose=0)
        predicted = np.argmax(model(data.x_test).numpy(), axis=1)
    finally:
        amp_rewrite.disable_mixed_precision_graph_rewrite(optimizer)
    return optimizer, float(np.mean(predicted == data.y_test))

@dataclass(frozen=True)
class MatmulCount:
    forward: int          # dots and convolutions outside the gradient
    backward: int         # those of the gradient (their TensorFlow op is under gradient_tape/)
    forward_float8: int   # ... whose two operands are both dequantized from float8_e4m3fn
    backward_float8: int  # ... one operand from float8_e5m2 (the gradient), the other from float8_e4m3fn

    @property
    def total(self) -> int:
        return self.forward + self.backward

    @property
    def float8(self) -> int:
        return self.forward_float8 + self.backward_float8


_FLOAT8_OPERANDS = {"forward": ["f8e4m3fn", "f8e4m3fn"], "backward": ["f8e4m3fn", "f8e5m2"]}


def count_float8_matmuls(hlo: str) -> MatmulCount:
    """How many of ``hlo``'s dots and convolutions read their operands dequantized from float8
    (``scaled_float8_type``) as the hybrid recipe has them, forward and backward."""
    instructions = hlo_instructions(hlo)
    counts = {"forward": [0, 0], "backward": [0, 0]}
    for instruction in instructions.values():
        if instruction.opcode in ("dot", "convolution"):
            side = "backward" if "gradient_tape/" in instruction.op_name else "forward"
            types = sorted(str(scaled_float8_type(instructions, operand)) for operand in instruction.operands)
            counts[side][0] += 1
            counts[side][1] += types == _FLOAT8_OPERANDS[side]
    return MatmulCount(counts["forward"][0], counts["backward"][0], counts["forward"][1], counts["backward"][1])
