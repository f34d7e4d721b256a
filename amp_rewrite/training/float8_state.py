"""FP8 training's delayed-scaling state: per quantized operand an amax history and a scale.

A module of its own, importing only TensorFlow, because the Keras 3 loss-scale optimizer
(``keras_optimizer``, registered with Keras as soon as Keras loads) owns one.
"""
from __future__ import annotations

import numbers
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

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


class _Untracked:
    """Holds a value out of sight of ``tf.Module``'s tracking and its ``variables`` walk."""

    def __init__(self) -> None:
        self.value: tuple[Any, ...] = ()


def workers(strategy: tf.distribute.Strategy) -> int:
    """How many workers (processes) run ``strategy``'s steps: MultiWorkerMirroredStrategy's, or 1."""
    if not isinstance(strategy, tf.distribute.MultiWorkerMirroredStrategy):
        return 1
    return max(strategy.num_replicas_in_sync // max(len(strategy.extended.worker_devices), 1), 1)


class Float8State(tf.Module):
    """The state of one optimizer wrapper's FP8 training, keyed by quantized operand: a float32
    ``amax_history`` of ``amax_history_length`` values (the newest first, zeros before the first
    step) and a float32 ``scale`` (1 at first).

    Keys survive a rebuild of the model in a busy process: ``v<i>_<name>/weight`` (``…/input``,
    ``…/output_grad``) for the matmul of the wrapper's ``i``-th variable, ``m<k>/input_0`` (…)
    for the ``k``-th of its step's matmuls that read no variable of it (``training.float8``);
    in a TF1 graph the variable's name.

    A ``tf.Module``: whatever tracks it (the optimizer wrapper) carries the variables into
    ``tf.train.Checkpoint`` and SavedModels; restoring before a key's variables exist restores
    them when a trace creates them. Variables are created outside any function
    (``tf.init_scope``), the first time a training step is traced, under the distribution
    strategy the state was made in (mirrored like the weights). ``keys`` records which keys
    it holds, so that a restore that matches only part of them can say so (``restore_report``).
    """

    def __init__(self, amax_history_length: int = DEFAULT_AMAX_HISTORY_LENGTH, name: str = "float8_state") -> None:
        super().__init__(name=name)
        self.amax_history_length = check_history_length(amax_history_length)
        self.by_name: dict[str, tf.Variable] = {}  # "<key>/amax_history" or "<key>/scale" -> its variable
        self._strategy = tf.distribute.get_strategy()
        # The keys in use, comma-separated. Not under several workers, which cannot broadcast a
        # string variable's initial value: there only a .keras file's keys are checked.
        self.keys = None
        if workers(self._strategy) == 1:
            with tf.init_scope():
                self.keys = tf.Variable("", trainable=False, name=f"{name}_keys")
        self._keys_written = ""
        self._loaded: set[str] = set()  # keys set from a file, not yet checked against a trace
        self._updated = _Untracked()
        self._step = _Untracked()  # the wrapper's step counter, the amax summaries' step (``summary_step``)
        self._matmuls = _Untracked()  # key -> the matmul it was last traced for (``matmul_of``)
        self._matmuls.value = {}

    @property
    def variables_updated(self) -> tuple[Any, ...]:
        """The variables its wrapper updates, in its order (``training.float8`` keys matmuls by them);
        not tracked (no attribute of the module is assigned): they are the model's."""
        return self._updated.value

    def updates(self, variables: Iterable[Any]) -> None:
        """Its wrapper updates ``variables`` (``variables_updated``)."""
        self._updated.value = tuple(variables)

    @property
    def summary_step(self) -> Any:
        """The step the amax summaries are written at where ``tf.summary`` has none set: the wrapper's
        step counter (``counts_steps_with``), or None."""
        return self._step.value[0] if self._step.value else None

    def counts_steps_with(self, variable: Any) -> None:
        """Its wrapper counts steps in ``variable`` (not tracked: it is the wrapper's)."""
        self._step.value = (variable,)

    def traced(self, key: str, matmul: str) -> None:
        """A trace quantizes operand ``key`` for the forward matmul node ``matmul`` (``matmul_of``)."""
        self._matmuls.value[key] = matmul

    def matmul_of(self, key: str) -> str | None:
        """The forward matmul node ``key`` was last traced for (a name of that trace's graph), or None."""
        return self._matmuls.value.get(key)

    @property
    def strategy(self) -> tf.distribute.Strategy:
        """The distribution strategy the state was made under (its variables' and its steps')."""
        return self._strategy

    def lookup(self, key: str) -> tuple[tf.Variable, tf.Variable] | None:
        """``key``'s (amax history, scale), or None if no trace has created them."""
        history, scale = self.by_name.get(f"{key}/{HISTORY}"), self.by_name.get(f"{key}/{SCALE}")
        return None if history is None or scale is None else (history, scale)

    def create(self, key: str) -> tuple[tf.Variable, tf.Variable]:
        """``key``'s variables, made now if they are not there yet."""
        with tf.init_scope(), self._strategy.scope():
            for kind, initial in ((HISTORY, np.zeros(self.amax_history_length, np.float32)),
                                  (SCALE, np.float32(1.0))):
                if f"{key}/{kind}" not in self.by_name:
                    self._make(f"{key}/{kind}", initial)
        return self.lookup(key)

    def set(self, name: str, value: np.ndarray) -> None:
        """Variable ``name`` (``<key>/amax_history`` or ``<key>/scale``) holds ``value``: assigned, or
        made with it (a state read back from a file before any trace made it)."""
        self._loaded.add(name.rpartition("/")[0])
        variable = self.by_name.get(name)
        if variable is not None:
            variable.assign(value)
            return
        with tf.init_scope(), self._strategy.scope():
            self._make(name, value)

    def _make(self, name: str, value: Any) -> None:
        # use_resource: a resource variable in a TF1 graph too (disable_v2_behavior), which FP8 training's reads
        # and updates take (core.float8.training).
        self.by_name[name] = tf.compat.v1.Variable(np.asarray(value, np.float32), trainable=False, name=name,
                                                   dtype=tf.float32, use_resource=True,
                                                   aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def items(self) -> Iterator[tuple[str, tf.Variable]]:
        """(name, variable), sorted by name."""
        return iter(sorted(self.by_name.items()))

    def restore_report(self, used: Iterable[str]) -> str | None:
        """After a trace that uses keys ``used``: where state read back since the last trace (a
        ``tf.train.Checkpoint`` restore, a ``.keras`` file) matches none or only part of them,
        the one line that says so; None where it all matched or nothing was read back."""
        used = set(used)
        with tf.init_scope():
            eager = tf.executing_eagerly() and self.keys is not None
            written = self.keys.numpy().decode() if eager else self._keys_written
        restored = set(filter(None, written.split(","))) if written != self._keys_written else set()
        restored |= self._loaded
        self._loaded = set()
        self._write_keys(sorted(used | set(filter(None, self._keys_written.split(",")))))
        matched = restored & used
        if not restored or matched == restored == used:
            return None
        example = sorted(restored - used or used - restored)[0]
        return (f"amp_rewrite: the FP8 state read back holds {len(restored)} operand(s) and this training step"
                f" quantizes {len(used)}; {len(matched)} match (e.g. {example!r} is in only one of them): the others"
                " start with a fresh amax history. Was it saved from another model, or from a different step?")

    def _write_keys(self, keys: Sequence[str]) -> None:
        self._keys_written = ",".join(keys)
        with tf.init_scope():
            if tf.executing_eagerly() and self.keys is not None:
                self.keys.assign(self._keys_written)
