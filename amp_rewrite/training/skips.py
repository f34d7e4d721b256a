"""Skipped steps, counted and said once, for every family's loss-scale wrapper.

A skipped step is thrown away. Every wrapper ``enable_mixed_precision_graph_rewrite``
returns (Keras 3, tf_keras, TF1's v1 optimizer, in a tf.function or a Session) keeps one
``SkipCounter``: how many steps it skipped, and how many in a row with the scale at its
floor. ``STUCK_STEPS`` in a row there say once that training is stuck. The counting is
graph-side, so it works in tf.functions and Sessions alike; the one warning reaches Python
through ``tf.py_function``, which XLA cannot call: under XLA the counts are kept, unsaid.
"""
from __future__ import annotations

import warnings
from typing import Callable

import tensorflow as tf

from amp_rewrite import _tf

# Skips in a row with the scale at its floor (1, or a fixed scale) that make training "stuck": below
# the floor halving cannot help, so each such skip is an update thrown away for a reason scaling
# does not fix; one could be a bad batch, three in a row are not chance (docs/guides/training.md).
STUCK_STEPS = 3
FLOOR_SCALE = 1.0
SUMMARY_LOSS_SCALE, SUMMARY_SKIPPED = "amp_rewrite/loss_scale", "amp_rewrite/skipped_steps"

FIND_THE_OP = ("If the same model trains in float32, an op overflows or underflows in low precision: add"
               " amp_rewrite.Doctor() to fit's callbacks, or call amp_rewrite.diagnose_step(...) in a custom loop,"
               " to name it and the keep= that fixes it.")
# TF1's optimizer: in a tf.function a loss function is replayed; a Session replays the step's feed.
FIND_THE_OP_ELSEWHERE = ("If the same model trains in float32, an op overflows or underflows in low precision:"
                         " call amp_rewrite.diagnose_step(loss_fn, *batch, optimizer=opt) on a skipped step's batch"
                         " in a tf.function, or add amp_rewrite.DoctorHook(opt) to a MonitoredTrainingSession's hooks"
                         " (or call amp_rewrite.diagnose_session_step(sess, feed_dict, optimizer=opt)) in a Session, to"
                         " name it and the keep= that fixes it.")


def stuck_message(skipped: int, scale: float, *, fixed: bool) -> str:
    """The one line saying training is stuck: ``STUCK_STEPS`` skips in a row at the scale's floor."""
    if fixed and scale > FLOOR_SCALE:
        why = (f"at the fixed loss scale {scale:g} (pass a smaller loss_scale, or loss_scale=\"dynamic\", if the"
               " scale is what overflows)")
    else:
        why = f"with the loss scale at {scale:g}, where scaling can no longer help"
    return (f"amp_rewrite: training is stuck: the last {STUCK_STEPS} steps were all skipped, their gradients not"
            f" finite {why}; {skipped} step(s) skipped so far (opt.skipped_steps).")


def in_xla() -> bool:
    """Whether the graph being built is compiled by XLA, which neither calls Python nor writes summaries."""
    return bool(_tf.OPTIMIZERS_XLA_CONTEXT.get()(tf.compat.v1.get_default_graph()))


class SkipCounter:
    """One wrapper's skipped steps and its run of skips at the floor, as two int64 variables.

    Made outside any trace (``tf.init_scope``: eagerly, or in a TF1 user's graph, whose
    initializer then covers them) and not tracked, so checkpoints stay as they were: the counts
    are this process's. ``tell`` receives the stuck line once (default: a warning with ``hint``)."""

    def __init__(self, *, fixed: bool, tell: Callable[[str], None] | None = None,
                 hint: str = FIND_THE_OP) -> None:
        self.fixed = fixed
        self.hint = hint
        self.tell = tell if tell is not None else self._warn
        self.warned = False
        with tf.init_scope():
            self.skipped, self.run = (
                tf.Variable(0, dtype=tf.int64, trainable=False, name=name,
                            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
                for name in ("amp_rewrite_skipped_steps", "amp_rewrite_stuck_run"))

    def skip(self, scale: tf.Tensor, at_floor: tf.Tensor) -> tf.Tensor:
        """One more skipped step at ``scale``; the ``STUCK_STEPS``-th in a row ``at_floor`` says so, once."""
        skipped = self.skipped.assign_add(1)
        run = self.run.assign(tf.where(at_floor, self.run + 1, tf.constant(0, tf.int64)))
        if in_xla():  # XLA cannot call back into Python: the counts are there to read
            return tf.identity(run)

        def say() -> tf.Tensor:
            with tf.control_dependencies([tf.py_function(self._say, [skipped, scale], [])]):
                return tf.identity(run)

        return tf.cond(tf.equal(run, STUCK_STEPS), say, lambda: tf.identity(run))

    def applied(self) -> tf.Tensor:
        """A step applied: the run of skips is broken."""
        return tf.identity(self.run.assign(0))

    def count(self, finite: tf.Tensor, scale: tf.Tensor, at_floor: tf.Tensor) -> tf.Tensor:
        """``skip`` or ``applied``, as ``finite`` says."""
        return tf.cond(finite, self.applied, lambda: self.skip(scale, at_floor))

    def summarize(self, scale: tf.Tensor, step: tf.Tensor | None) -> None:
        """The loss scale and skipped steps as ``tf.summary`` scalars: recorded where a default writer
        is set (``writer.as_default()``, Keras' ``TensorBoard(update_freq=...)``), nothing otherwise.
        ``step``: used where no summary step is set; None: then nothing is written."""
        step = tf.summary.experimental.get_step() if tf.summary.experimental.get_step() is not None else step
        if step is None or in_xla():
            return
        tf.summary.scalar(SUMMARY_LOSS_SCALE, scale, step=step)
        tf.summary.scalar(SUMMARY_SKIPPED, tf.convert_to_tensor(self.skipped), step=step)

    def _say(self, skipped: tf.Tensor, scale: tf.Tensor) -> None:
        if self.warned:
            return
        self.warned = True
        self.tell(stuck_message(int(skipped), float(scale), fixed=self.fixed))

    def _warn(self, message: str) -> None:
        warnings.warn(f"{message} {self.hint}", stacklevel=2)


def tell_doctor(owner: object, hint: str) -> Callable[[str], None]:
    """A ``SkipCounter``'s ``tell`` for ``owner`` (a wrapper): the stuck line goes to the doctor
    attached as ``owner.doctor`` (it warns once, with its diagnosis), else it is warned with ``hint``."""
    def tell(message: str) -> None:
        doctor = getattr(owner, "doctor", None)
        if doctor is not None:
            doctor.stuck(message)
        else:
            warnings.warn(f"{message} {hint}", stacklevel=2)

    return tell


def count_in_update(loss_scale: object, skips: SkipCounter, *, step: Callable[[], tf.Tensor | None] = lambda: None
                    ) -> None:
    """Make ``loss_scale``'s ``update(grads) -> (update_op, should_apply)`` (tf_keras' dynamic
    scale state, TF1's loss scales: what their wrappers call once per step) count in ``skips``
    too, and write the summaries (at ``step()``). ``loss_scale()`` is its current scale."""
    update = loss_scale.update  # type: ignore[attr-defined]

    def update_and_count(grads):
        before = tf.convert_to_tensor(loss_scale())  # type: ignore[operator]
        at_floor = tf.constant(True) if skips.fixed else before <= FLOOR_SCALE
        update_op, finite = update(grads)
        with tf.control_dependencies([] if update_op is None else [update_op]):
            counted = skips.count(tf.convert_to_tensor(finite), before, at_floor)
        with tf.control_dependencies([counted]):
            skips.summarize(tf.convert_to_tensor(loss_scale()), step())  # type: ignore[operator]
            return tf.group(counted), finite

    object.__setattr__(loss_scale, "update", update_and_count)
