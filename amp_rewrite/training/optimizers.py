"""Wrap an optimizer in its own family's loss-scale optimizer.

Float16 gradients underflow unless the loss is scaled up before differentiation and the
gradients scaled back down; a step whose gradients are not finite must be skipped and
the scale lowered. Each optimizer family already ships a well-kept implementation of
that arithmetic, so this module only picks the right one and maps the seed API's
``loss_scale`` argument onto it:

* Keras 3 → ``keras.mixed_precision.LossScaleOptimizer`` (subclassed below only to add
  a fixed scale and the tf_keras-style ``get_scaled_loss``/``get_unscaled_gradients``);
* tf_keras (Keras 2) → ``tf_keras.mixed_precision.LossScaleOptimizer`` (a fixed scale is
  tf_keras' own ``dynamic=False``, which, as tf_keras documents, applies every step);
* ``tf.compat.v1.train.Optimizer`` → ``tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer``.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any

import keras
import tensorflow as tf

DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000
NEVER = 2**31 - 1  # growth steps of a fixed scale: Keras counts steps in an int32
LOSS_SCALE_HELP = (
    'pass loss_scale="dynamic", a positive number (a fixed scale), None (no scaling), or a '
    "tf.compat.v1.mixed_precision.DynamicLossScale / FixedLossScale"
)


@dataclass(frozen=True)
class ScalePlan:
    """What ``loss_scale`` asks for: a dynamic scale, or a fixed one (1.0 for None)."""

    dynamic: bool
    initial_scale: float
    growth_steps: int = DEFAULT_GROWTH_STEPS


def plan_loss_scale(loss_scale: Any) -> ScalePlan:
    """Interpret the seed API's ``loss_scale`` argument, or say what to pass instead."""
    v1 = tf.compat.v1.mixed_precision
    if loss_scale is None:
        return ScalePlan(dynamic=False, initial_scale=1.0)
    if isinstance(loss_scale, str):
        if loss_scale == "dynamic":
            return ScalePlan(dynamic=True, initial_scale=DEFAULT_INITIAL_SCALE)
        raise ValueError(f"loss_scale must be 'dynamic', not {loss_scale!r}; {LOSS_SCALE_HELP}")
    if isinstance(loss_scale, v1.DynamicLossScale):
        if loss_scale.multiplier != 2:
            raise ValueError(
                f"DynamicLossScale(multiplier={loss_scale.multiplier}) is not supported: the loss-scale"
                " optimizers double and halve the scale; use multiplier=2"
            )
        return ScalePlan(True, float(loss_scale.initial_loss_scale), int(loss_scale.increment_period))
    if isinstance(loss_scale, v1.FixedLossScale):
        return ScalePlan(dynamic=False, initial_scale=float(loss_scale()))
    if isinstance(loss_scale, (int, float)) and not isinstance(loss_scale, bool):
        if not math.isfinite(loss_scale) or loss_scale <= 0:
            raise ValueError(f"a fixed loss_scale must be a positive finite number, got {loss_scale!r}")
        return ScalePlan(dynamic=False, initial_scale=float(loss_scale))
    raise TypeError(f"cannot interpret loss_scale={loss_scale!r} ({type(loss_scale).__name__}); {LOSS_SCALE_HELP}")


@keras.saving.register_keras_serializable(package="amp_rewrite")
class LossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer):
    """Keras 3's loss-scale optimizer, plus a fixed scale and the seed API's methods.

    ``apply_gradients`` keeps Keras 3's contract (it takes *scaled* gradients, as
    ``model.fit`` passes them); after ``get_unscaled_gradients`` in the same step it takes
    the unscaled ones instead, as the tf_keras API did.
    """

    def __init__(self, inner_optimizer, initial_scale=DEFAULT_INITIAL_SCALE,
                 dynamic_growth_steps=DEFAULT_GROWTH_STEPS, fixed=False, name=None, **kwargs):
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps, name=name, **kwargs)
        self.fixed = fixed
        self._unscaled_by_caller = False

    @property
    def loss_scale(self):
        """The current scale (a scalar tensor; the initial one before the first step)."""
        if not self.built:
            return tf.constant(self.initial_scale, tf.float32)
        return tf.convert_to_tensor(self.dynamic_scale)

    def get_scaled_loss(self, loss):
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        self._unscaled_by_caller = True
        scale = self.loss_scale
        return [None if g is None else g / tf.cast(scale, g.dtype) for g in grads]

    def apply(self, grads, trainable_variables=None):
        if self._unscaled_by_caller:
            # Back to scaled: exact, the scale is a power of two for dynamic scaling.
            self._unscaled_by_caller = False
            scale = self.loss_scale
            grads = [None if g is None else g * tf.cast(scale, g.dtype) for g in grads]
        return super().apply(grads, trainable_variables)

    def minimize(self, loss, var_list, tape=None):
        """Scale, differentiate, apply: one training step (``loss`` may be a callable)."""
        tape = tape if tape is not None else tf.GradientTape()
        if callable(loss):
            with tape:  # trainable variables are watched automatically
                loss = loss()
        # d(scale * loss) = scale * d(loss): seed the backward pass with the scale.
        grads = tape.gradient(loss, var_list, output_gradients=tf.cast(self.loss_scale, loss.dtype))
        self.apply(grads, var_list)

    def _tf_apply(self, grads, trainable_variables=None):
        """Keras decides on replica 0's gradients alone when a merge call is needed, so a
        NaN on another replica was applied everywhere: decide on all replicas together."""
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            return super()._tf_apply(grads, trainable_variables)

        def apply_everywhere(distribution, grads, trainable_variables):
            finite_per_replica = distribution.extended.call_for_each_replica(
                lambda g: tf.cast(self.check_finite(g), tf.float32), args=(grads,))
            finite_replicas = distribution.reduce(tf.distribute.ReduceOp.SUM, finite_per_replica, axis=None)

            def apply():
                distribution.extended.call_for_each_replica(
                    self._stateful_handle_finite_grads, args=(grads, trainable_variables))

            tf.cond(finite_replicas >= distribution.num_replicas_in_sync, apply,
                    self._stateful_handle_non_finite_grads)

        tf.distribute.get_replica_context().merge_call(apply_everywhere, args=(grads, trainable_variables))

    def _stateful_handle_non_finite_grads(self):
        if self.fixed:  # a fixed scale still skips the step, but never changes
            return
        super()._stateful_handle_non_finite_grads()
        # Keras halves without a floor; a run of bad steps must not drive the scale below 1
        # (tf_keras and TF1 stop there too), or good gradients would be scaled *up*.
        self.dynamic_scale.assign(tf.maximum(self.dynamic_scale, 1.0))

    def _stateful_handle_finite_grads(self, grads, trainable_variables):
        before = tf.identity(self.dynamic_scale)
        super()._stateful_handle_finite_grads(grads, trainable_variables)
        # ... and doubles without a ceiling: keep the last finite scale.
        self.dynamic_scale.assign(tf.where(tf.math.is_finite(self.dynamic_scale), self.dynamic_scale, before))

    def get_config(self):
        return {**super().get_config(), "fixed": self.fixed}


def _family(opt: Any) -> str:
    if isinstance(opt, keras.optimizers.Optimizer):
        return "keras"
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is not None and isinstance(
        opt, (tf_keras.optimizers.Optimizer, tf_keras.optimizers.legacy.Optimizer)
    ):
        return "tf_keras"
    if isinstance(opt, tf.compat.v1.train.Optimizer):
        return "v1"
    raise TypeError(
        f'"opt" must be a Keras 3 optimizer, a tf_keras optimizer or a tf.compat.v1.train.Optimizer,'
        f" got {type(opt).__module__}.{type(opt).__name__}"
    )


def _already_wrapped(opt: Any) -> bool:
    wrappers: list[type] = [keras.mixed_precision.LossScaleOptimizer,
                            tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer]
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is not None:
        wrappers.append(tf_keras.mixed_precision.LossScaleOptimizer)
    return isinstance(opt, tuple(wrappers))


class _V1LossScaleOptimizer(tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer):
    """TF1's loss-scale optimizer with the seed API's ``get_scaled_loss`` & co."""

    @property
    def loss_scale(self):
        return self._loss_scale()

    def get_scaled_loss(self, loss):
        return self._scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        return self._unscale_grads(grads)


def wrap_optimizer(opt: Any, loss_scale: Any = "dynamic") -> Any:
    """``opt`` wrapped in its family's loss-scale optimizer, configured from ``loss_scale``."""
    if _already_wrapped(opt):
        raise ValueError(
            f'"opt" is already a loss-scale optimizer ({type(opt).__name__}); pass the optimizer it wraps'
        )
    family = _family(opt)
    plan = plan_loss_scale(loss_scale)
    if family == "keras":
        return LossScaleOptimizer(opt, initial_scale=plan.initial_scale,
                                  dynamic_growth_steps=plan.growth_steps if plan.dynamic else NEVER,
                                  fixed=not plan.dynamic)
    if family == "tf_keras":
        tf_keras = sys.modules["tf_keras"]
        return tf_keras.mixed_precision.LossScaleOptimizer(
            opt, dynamic=plan.dynamic, initial_scale=plan.initial_scale,
            **({"dynamic_growth_steps": plan.growth_steps} if plan.dynamic else {}),
        )
    # A fixed scale still skips non-finite steps: a dynamic one that never grows or shrinks.
    scale = tf.compat.v1.mixed_precision.DynamicLossScale(
        initial_loss_scale=plan.initial_scale, increment_period=plan.growth_steps if plan.dynamic else NEVER,
        multiplier=2 if plan.dynamic else 1,
    )
    return _V1LossScaleOptimizer(opt, scale)
