"""Wrap an optimizer in its own family's loss-scale optimizer.

Float16 gradients underflow unless the loss is scaled up before differentiation and the
gradients scaled back down; a step whose gradients are not finite must be skipped and
the scale lowered. Each optimizer family already ships a well-kept implementation of
that arithmetic, so this module only picks the right one and maps the seed API's
``loss_scale`` argument onto it:

* Keras 3 → ``keras.mixed_precision.LossScaleOptimizer`` (subclassed in
  ``keras_optimizer`` to add a fixed scale and the tf_keras-style
  ``get_scaled_loss``/``get_unscaled_gradients``, whose gradients it then applies unscaled);
* tf_keras (Keras 2) → ``tf_keras.mixed_precision.LossScaleOptimizer`` (a fixed scale is
  tf_keras' own ``dynamic=False``, which, as tf_keras documents, applies every step);
* ``tf.compat.v1.train.Optimizer`` → ``tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer``
  (a fixed scale is ``_FixedLossScale``, which skips non-finite steps as Keras 3's does).

The scale is checked where every family keeps it, in float32. Every wrapper counts its
skipped steps (``skipped_steps``) and says once when training is stuck (``skips``).
"""
from __future__ import annotations

import numbers
import sys
import warnings
import weakref
from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from amp_rewrite import _tf
from amp_rewrite.training import float8
from amp_rewrite.training.float8_state import Float8State
from amp_rewrite.training.keras_optimizer import (
    DEFAULT_GROWTH_STEPS, DEFAULT_INITIAL_SCALE, LossScaleOptimizer, MadeFor,
)
from amp_rewrite.training.skips import FIND_THE_OP, FIND_THE_OP_ELSEWHERE, SkipCounter, count_in_update, tell_doctor

NEVER = 2**31 - 1  # growth steps of a fixed scale: Keras counts steps in an int32
FLOAT32_MAX = float(np.finfo(np.float32).max)
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
        initial, period = _float32_scale(loss_scale.initial_loss_scale, "initial_loss_scale"), loss_scale.increment_period
        if 2 * initial > FLOAT32_MAX:
            raise ValueError(f"DynamicLossScale(initial_loss_scale={loss_scale.initial_loss_scale!r}) doubles past"
                             " float32's largest value at its first growth; start at 2**126 or below (2**15 is usual)")
        if not 1 <= period <= NEVER:
            raise ValueError(f"DynamicLossScale(increment_period={period}) must be between 1 and {NEVER}"
                             " (steps are counted in an int32)")
        return ScalePlan(True, initial, int(period))
    if isinstance(loss_scale, v1.FixedLossScale):
        # The number as given: calling it makes a float32 tensor, which fails for one float32 cannot hold.
        value = loss_scale.get_config()["loss_scale_value"]
        return ScalePlan(dynamic=False, initial_scale=_float32_scale(value, "FixedLossScale"))
    # numbers.Real covers NumPy scalars (np.float32(128)) too; a bool is no scale.
    if isinstance(loss_scale, numbers.Real) and not isinstance(loss_scale, (bool, np.bool_)):
        return ScalePlan(dynamic=False, initial_scale=_float32_scale(loss_scale, "a fixed loss_scale"))
    raise TypeError(f"cannot interpret loss_scale={loss_scale!r} ({type(loss_scale).__name__}); {LOSS_SCALE_HELP}")


def _float32_scale(value: Any, what: str) -> float:
    """``value`` as a float, if float32 (where every family keeps the scale) holds it as a positive
    finite number: 1e39 is inf there, 1e-46 is 0."""
    with np.errstate(over="ignore"):  # 1e39 becoming inf is what is checked
        as_float32 = np.float32(value) if np.isfinite(value) else np.float32("nan")
    if not np.isfinite(as_float32) or as_float32 <= 0:
        raise ValueError(f"{what} must be a positive finite number in float32, where the scale is kept,"
                         f" got {value!r} ({float(as_float32)!r} in float32); pass one between 2**-126 and 2**127")
    return float(value)


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


def loss_scale_classes() -> tuple[type, ...]:
    """The wrapper classes of the families whose ``fit`` takes a callback: Keras 3's (ours), and
    tf_keras' where it is loaded."""
    tf_keras = sys.modules.get("tf_keras")
    return (LossScaleOptimizer,) if tf_keras is None else (LossScaleOptimizer,
                                                           tf_keras.mixed_precision.LossScaleOptimizer)


def _already_wrapped(opt: Any) -> bool:
    wrappers: list[type] = [keras.mixed_precision.LossScaleOptimizer,
                            tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer]
    tf_keras = sys.modules.get("tf_keras")
    if tf_keras is not None:
        wrappers.append(tf_keras.mixed_precision.LossScaleOptimizer)
    return isinstance(opt, tuple(wrappers))


@dataclass(frozen=True)
class GraphStep:
    """A step the v1 wrapper built in a TF1 graph: what a Session's replay fetches."""

    graph: weakref.ref  # the tf.Graph it is in
    gradients: tuple[str, ...]  # the float tensors of the unscaled gradients it applies
    loss_scale: str  # a tensor reading the loss scale
    distributed: bool = False  # built under a tf.distribute strategy: its gradients are per replica


class _FixedLossScale(tf.compat.v1.mixed_precision.DynamicLossScale):
    """A fixed scale that skips non-finite steps, as the Keras 3 wrapper's does (TF1's own
    FixedLossScale applies them)."""

    def __init__(self, scale: float) -> None:
        super().__init__(initial_loss_scale=scale, increment_period=NEVER, multiplier=1)

    def update(self, grads):
        grads = [g for g in tf.nest.flatten(grads) if g is not None]

        def all_finite(grads):
            return tf.cast(tf.reduce_all([tf.reduce_all(tf.math.is_finite(g)) for g in grads]), tf.float32)

        if tf.distribute.has_strategy():  # in the cross-replica context of apply_gradients' merge call
            strategy = tf.distribute.get_strategy()
            finite_replicas = strategy.reduce(
                tf.distribute.ReduceOp.SUM, strategy.extended.call_for_each_replica(all_finite, args=(grads,)), axis=None)
            return tf.no_op(), tf.equal(finite_replicas, strategy.num_replicas_in_sync)
        return tf.no_op(), tf.equal(all_finite(grads), 1.0)


class _V1LossScaleOptimizer(tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer):
    """TF1's loss-scale optimizer with the seed API's ``get_scaled_loss`` & co, and FP8 training's
    state: recorded for the step being traced, or (a TF1 graph) added to the user's graph."""

    def __init__(self, opt: Any, scale: Any) -> None:
        super().__init__(opt, scale)
        self._amp_rewrite_scale = scale
        self.doctor = None  # a Session's training doctor (training.doctor_session) told when training is stuck
        self._amp_rewrite_skips = SkipCounter(fixed=isinstance(scale, _FixedLossScale),
                                              tell=tell_doctor(self, FIND_THE_OP_ELSEWHERE))
        count_in_update(scale, self._amp_rewrite_skips)
        self.graph_step: GraphStep | None = None  # the last step built in a TF1 graph (the Session doctor's replay)

    @property
    def skipped_steps(self):
        """How many steps this wrapper has skipped (non-finite gradients) in this process, an int64 tensor."""
        return tf.convert_to_tensor(self._amp_rewrite_skips.skipped)

    @property
    def loss_scale(self):
        return self._amp_rewrite_scale()

    def get_scaled_loss(self, loss):
        return _tf.V1_SCALE_LOSS.get()(self, loss)

    def get_unscaled_gradients(self, grads):
        return _tf.V1_UNSCALE_GRADS.get()(self, grads)

    def apply_gradients(self, grads_and_vars, global_step=None, name=None):
        grads_and_vars = tuple(grads_and_vars)
        graph = tf.compat.v1.get_default_graph()
        if not tf.executing_eagerly() and not hasattr(graph, "outer_graph"):  # a TF1 graph, run by a Session
            gradients = [t.name for g, _ in grads_and_vars if g is not None
                         for t in tf.nest.flatten(g, expand_composites=True) if t.dtype.is_floating]
            self.graph_step = GraphStep(weakref.ref(graph), tuple(gradients), tf.convert_to_tensor(self.loss_scale).name,
                                        tf.distribute.has_strategy())
        state = float8_state_of(self)
        if state is not None:
            _float8_apply(self, state, [v for _, v in grads_and_vars])
        return super().apply_gradients(grads_and_vars, global_step, name)


def _float8_apply(opt: Any, state: Float8State, variables: list[Any]) -> None:
    """FP8 training's part of a v1 ``apply_gradients``: in a TF1 graph, the state as variables
    of the graph (``float8.add_graph_state``), else recorded for the step being traced."""
    enablement = enablement_of(opt)
    graph = tf.compat.v1.get_default_graph()
    if tf.executing_eagerly() or hasattr(graph, "outer_graph"):
        float8.record_apply(state, variables)
    elif enablement is not None and enablement.settings.float8 is not None:
        float8.add_graph_state(graph, enablement.settings.float8, enablement.settings.target,
                               enablement.settings.lists)


# An optimizer -> the wrapper this module made of it, as long as both live.
_INNER_TO_WRAPPER: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wrap_optimizer(opt: Any, loss_scale: Any = "dynamic", float8_amax_history_length: int | None = None,
                   made_for: MadeFor | None = None) -> Any:
    """``opt`` wrapped in its family's loss-scale optimizer, configured from ``loss_scale``; with
    ``float8_amax_history_length``, tracking a new ``Float8State`` as ``float8_state`` (FP8 training).
    ``made_for``: the live rewrite's target it is made for (``resumable``)."""
    _tf.require(_tf.OPTIMIZERS)
    if _already_wrapped(opt):
        raise ValueError(
            f'"opt" is already a loss-scale optimizer ({type(opt).__name__}); pass the optimizer it wraps'
        )
    family = _family(opt)
    plan = plan_loss_scale(loss_scale)
    earlier = _INNER_TO_WRAPPER.get(opt)
    if earlier is not None and earlier() is not None:
        warnings.warn(
            f"amp_rewrite: this {type(opt).__name__} is already wrapped by a loss-scale optimizer that is still in use"
            " (an earlier enable_mixed_precision_graph_rewrite returned it); two wrappers of one optimizer keep two"
            " loss scales and both step it: use the wrapper you have, or wrap a new optimizer", stacklevel=3)
    wrapped = _wrap(opt, family, plan, float8_amax_history_length, made_for)
    _INNER_TO_WRAPPER[opt] = weakref.ref(wrapped)
    return wrapped


def float8_state_of(opt: Any) -> Float8State | None:
    """The FP8 training state a wrapper of ours tracks, or None (any other object)."""
    state = getattr(opt, "float8_state", None)
    return state if isinstance(state, Float8State) else None


MADE_FOR = "_amp_rewrite_made_for"  # on a tf_keras or v1 wrapper of ours: what it was made for
ENABLEMENT = "_amp_rewrite_enablement"  # on a wrapper of ours: the enablement it holds (live.Enablement)


def resumable(opt: Any) -> MadeFor | None:
    """What a wrapper that ``enable_mixed_precision_graph_rewrite`` made was made for (it may take
    it back); None for any other object. A wrapper saved before the target was recorded is known
    only by its float8 state."""
    made_for = opt.made_for if isinstance(opt, LossScaleOptimizer) else getattr(opt, MADE_FOR, None)
    if not isinstance(made_for, MadeFor):
        return None
    if made_for.target is None:
        return MadeFor("float8") if float8_state_of(opt) is not None else None
    return made_for


def hold(opt: Any, enablement: Any) -> None:
    """``opt`` holds ``enablement``: ``disable_mixed_precision_graph_rewrite(opt)`` stops it."""
    object.__setattr__(opt, ENABLEMENT, enablement)  # not tracked: no checkpoint dependency


def enablement_of(opt: Any) -> Any:
    """The enablement a wrapper of ours holds (``hold``), or None."""
    return getattr(opt, ENABLEMENT, None)


def _wrap(opt: Any, family: str, plan: ScalePlan, float8_amax_history_length: int | None,
          made_for: MadeFor | None) -> Any:
    made_for = made_for if made_for is not None else MadeFor()
    if family == "keras":  # it makes its float8 state itself: a .keras file rebuilds it from the config
        return LossScaleOptimizer(opt, initial_scale=plan.initial_scale,
                                  dynamic_growth_steps=plan.growth_steps if plan.dynamic else NEVER,
                                  fixed=not plan.dynamic, float8_amax_history_length=float8_amax_history_length,
                                  target=made_for.target, base_precision=made_for.base_precision)
    if family == "tf_keras":
        tf_keras = sys.modules["tf_keras"]
        wrapped = tf_keras.mixed_precision.LossScaleOptimizer(
            opt, dynamic=plan.dynamic, initial_scale=plan.initial_scale,
            **({"dynamic_growth_steps": plan.growth_steps} if plan.dynamic else {}),
        )
        _count_tf_keras_skips(wrapped, dynamic=plan.dynamic)
    else:
        wrapped = _wrap_v1(opt, plan)
    object.__setattr__(wrapped, MADE_FOR, made_for)
    if float8_amax_history_length is not None:
        wrapped.float8_state = Float8State(float8_amax_history_length)  # tf_keras' wrapper tracks it so
        if family != "tf_keras":  # TF1's optimizer does not track attributes by assignment
            _tf.TRACK_TRACKABLE.get()(wrapped, wrapped.float8_state, name="float8_state")
    return wrapped


def _count_tf_keras_skips(wrapped: Any, *, dynamic: bool) -> None:
    """tf_keras' wrapper, as ours: ``skipped_steps`` (a variable: tf_keras' wrapper is not ours to
    subclass, its class is picked by a metaclass), the summaries and the stuck warning. Its fixed
    scale applies every step (as tf_keras documents), so only a dynamic one skips."""
    object.__setattr__(wrapped, "doctor", None)  # a training doctor (training.doctor) told when training is stuck
    skips = SkipCounter(fixed=False, tell=tell_doctor(wrapped, FIND_THE_OP))
    if dynamic:
        count_in_update(getattr(wrapped, _tf.TF_KERAS_LOSS_SCALE), skips, step=lambda: wrapped.iterations)
    object.__setattr__(wrapped, "skipped_steps", skips.skipped)  # not tracked: no checkpoint dependency


def _wrap_v1(opt: Any, plan: ScalePlan) -> Any:
    # TF1's optimizer takes nothing but its deprecated loss scales, so TensorFlow's notice that
    # DynamicLossScale is deprecated (it points to Keras) would only confuse a v1 user: silenced.
    with _tf.DEPRECATION_SILENCE.get()():
        scale = (tf.compat.v1.mixed_precision.DynamicLossScale(initial_loss_scale=plan.initial_scale,
                                                              increment_period=plan.growth_steps)
                 if plan.dynamic else _FixedLossScale(plan.initial_scale))
    return _V1LossScaleOptimizer(opt, scale)
