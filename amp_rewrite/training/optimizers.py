"""Wrap an optimizer in its own family's loss-scale optimizer.

Float16 gradients underflow unless the loss is scaled up before differentiation and the
gradients scaled back down; a step whose gradients are not finite must be skipped and
the scale lowered. Each optimizer family already ships a well-kept implementation of
that arithmetic, so this module only picks the right one and maps the seed API's
``loss_scale`` argument onto it:

* Keras 3 → ``keras.mixed_precision.LossScaleOptimizer`` (subclassed in
  ``keras_optimizer`` only to add a fixed scale and the tf_keras-style
  ``get_scaled_loss``/``get_unscaled_gradients``);
* tf_keras (Keras 2) → ``tf_keras.mixed_precision.LossScaleOptimizer`` (a fixed scale is
  tf_keras' own ``dynamic=False``, which, as tf_keras documents, applies every step);
* ``tf.compat.v1.train.Optimizer`` → ``tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer``.
"""
from __future__ import annotations

import math
import numbers
import sys
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.python.util import deprecation

from amp_rewrite.training.keras_optimizer import DEFAULT_GROWTH_STEPS, DEFAULT_INITIAL_SCALE, LossScaleOptimizer

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
    # numbers.Real covers NumPy scalars (np.float32(128)) too; a bool is no scale.
    if isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, (bool, np.bool_)):
        if not math.isfinite(loss_scale) or loss_scale <= 0:
            raise ValueError(f"a fixed loss_scale must be a positive finite number, got {loss_scale!r}")
        return ScalePlan(dynamic=False, initial_scale=float(loss_scale))
    raise TypeError(f"cannot interpret loss_scale={loss_scale!r} ({type(loss_scale).__name__}); {LOSS_SCALE_HELP}")


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
    # TF1's optimizer takes nothing else, so TensorFlow's notice that DynamicLossScale is
    # deprecated (it points to Keras) would only confuse a v1 user: silenced.
    with deprecation.silence():
        scale = tf.compat.v1.mixed_precision.DynamicLossScale(
            initial_loss_scale=plan.initial_scale, increment_period=plan.growth_steps if plan.dynamic else NEVER,
            multiplier=2 if plan.dynamic else 1,
        )
    return _V1LossScaleOptimizer(opt, scale)
