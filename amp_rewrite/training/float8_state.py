"""FP8 training's delayed-scaling state: per quantized operand an amax history and a scale.

A module of its own, importing only TensorFlow, because the Keras 3 loss-scale optimizer
(``keras_optimizer``, registered with Keras as soon as Keras loads) owns one.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterator

import numpy as np
import tensorflow as tf

DEFAULT_AMAX_HISTORY_LENGTH = 1024  # Keras' QuantizedFloat8DTypePolicy's
HISTORY, SCALE = "amax_history", "scale"


def check_history_length(value: object) -> int:
    """``amax_history_length`` as an int, or the one-line error saying what to pass."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"amax_history_length must be an integer >= 1 (how many steps' amax the scale looks back"
                        f" over; Keras' default is {DEFAULT_AMAX_HISTORY_LENGTH}), got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"amax_history_length must be an integer >= 1 (how many steps' amax the scale looks back"
                         f" over; Keras' default is {DEFAULT_AMAX_HISTORY_LENGTH}), got {value!r}")
    return int(value)


class Float8State(tf.Module):
    """The state of one FP8 training run, keyed by quantized operand (``<forward matmul>/input_0``,
    ``…/input_1``, ``…/output_grad``): a float32 ``amax_history`` of ``amax_history_length``
    values (the newest first, zeros before the first step) and a float32 ``scale`` (1 at first).

    A ``tf.Module``: whatever tracks it (the optimizer wrapper) carries the variables into
    ``tf.train.Checkpoint`` and SavedModels; restoring before a key's variables exist restores
    them when a trace creates them. Variables are created outside any function
    (``tf.init_scope``), the first time a training step is traced.
    """

    def __init__(self, amax_history_length: int = DEFAULT_AMAX_HISTORY_LENGTH, name: str = "float8_state") -> None:
        super().__init__(name=name)
        self.amax_history_length = check_history_length(amax_history_length)
        self.by_name: dict[str, tf.Variable] = {}  # "<key>/amax_history" or "<key>/scale" -> its variable

    def lookup(self, key: str) -> tuple[tf.Variable, tf.Variable] | None:
        """``key``'s (amax history, scale), or None if no trace has created them."""
        history, scale = self.by_name.get(f"{key}/{HISTORY}"), self.by_name.get(f"{key}/{SCALE}")
        return None if history is None or scale is None else (history, scale)

    def create(self, key: str) -> tuple[tf.Variable, tf.Variable]:
        """``key``'s variables, made now if they are not there yet."""
        with tf.init_scope():
            for kind, initial in ((HISTORY, np.zeros(self.amax_history_length, np.float32)),
                                  (SCALE, np.float32(1.0))):
                if f"{key}/{kind}" not in self.by_name:
                    self.set(f"{key}/{kind}", initial)
        return self.lookup(key)

    def set(self, name: str, value: np.ndarray) -> None:
        """Variable ``name`` (``<key>/amax_history`` or ``<key>/scale``) holds ``value``: assigned, or
        made with it (a state read back from a file before any trace made it)."""
        variable = self.by_name.get(name)
        if variable is not None:
            variable.assign(value)
            return
        with tf.init_scope():
            self.by_name[name] = tf.Variable(np.asarray(value, np.float32), trainable=False, name=name,
                                             dtype=tf.float32)

    def items(self) -> Iterator[tuple[str, tf.Variable]]:
        """(name, variable), sorted by name."""
        return iter(sorted(self.by_name.items()))
