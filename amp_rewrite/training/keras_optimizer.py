"""The Keras 3 loss-scale optimizer that ``enable_mixed_precision_graph_rewrite`` returns.

A module of its own, importing only Keras and TensorFlow, because ``import amp_rewrite``
registers it with Keras' serialization as soon as Keras is loaded (``registration``):
``keras.models.load_model`` in a new process must find the class behind a ``.keras`` file.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import keras
import tensorflow as tf

from amp_rewrite import _tf
from amp_rewrite.training.float8_state import Float8State
from amp_rewrite.training.skips import FIND_THE_OP, FLOOR_SCALE, SkipCounter

DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000
SCALED, UNSCALED = "scaled", "unscaled"  # the gradients apply() takes, by the API the code calls
FLOAT8_PREFIX = "float8:"  # the float8 state's entries in a .keras file's optimizer variables


@dataclass(frozen=True)
class MadeFor:
    """The live rewrite's target a wrapper was made for (``"float8"``: with its base precision);
    None where unknown (a file saved before it was recorded)."""

    target: str | None = None
    base_precision: str | None = None

    def enable_call(self) -> str:
        """The call that turns the rewrite on again for a wrapper ``opt`` of this kind."""
        base = f", base_precision={self.base_precision!r}" if self.base_precision else ""
        return f"amp_rewrite.enable_mixed_precision_graph_rewrite(opt, target={self.target!r}{base})"


@keras.saving.register_keras_serializable(package="amp_rewrite")
class LossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer):
    """Keras 3's loss-scale optimizer, plus a fixed scale and the seed API's methods.

    Which gradients ``apply``/``apply_gradients`` take follows the API the code calls on
    this optimizer, as each API documents it:

    * Keras 3's ``scale_loss`` (``model.fit`` calls it): the gradients of the scaled loss,
      which ``apply`` unscales, as ``keras.mixed_precision.LossScaleOptimizer`` does;
    * tf_keras' ``get_scaled_loss``/``get_unscaled_gradients``: unscaled gradients, as in
      tf_keras and TF1, so gradients clipped, accumulated or all-reduced after unscaling
      are applied as they are.

    Both on one optimizer is an error, and so is ``apply`` with neither called while the
    scale is not 1: the gradients' scale is then unknown, and a guess would be a silent factor
    of the scale. ``minimize`` scales, differentiates and applies itself, either way.
    """

    def __init__(self, inner_optimizer, initial_scale=DEFAULT_INITIAL_SCALE,
                 dynamic_growth_steps=DEFAULT_GROWTH_STEPS, *, fixed=False, float8_amax_history_length=None,
                 target=None, base_precision=None, name=None, **kwargs):
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps, name=name, **kwargs)
        self.fixed = fixed
        self._gradients: str | None = None  # SCALED or UNSCALED once the code has said which
        self.made_for = MadeFor(target, base_precision)
        self._warned_off = False
        self.doctor = None  # a training doctor (training.doctor) told when training is stuck
        # FP8 training's state (target="float8"): tracked here, so checkpoints and SavedModels carry it.
        self.float8_state = (Float8State(float8_amax_history_length) if float8_amax_history_length is not None
                             else None)
        if self.float8_state is not None:
            self.float8_state.counts_steps_with(self.iterations)

    def build(self, var_list):
        super().build(var_list)
        # Not Keras variables, so a .keras file's numbered optimizer variables stay as they were.
        object.__setattr__(self, "_skips", SkipCounter(fixed=self.fixed, tell=self._tell_stuck))
        if self.float8_state is not None:  # the variables whose matmuls record into it (training.float8)
            self.float8_state.updates(var_list)

    def _record(self, trainable_variables) -> None:
        """At each traced apply: FP8 training records which variables it updates; a wrapper whose
        rewrite is off in this process (a loaded ``.keras`` file's) says once which call turns it on."""
        from amp_rewrite.training import float8  # not at import: keras loads this module before TensorFlow is ready

        enablement = getattr(self, "_amp_rewrite_enablement", None)
        if enablement is not None and enablement.active:
            if self.float8_state is not None:
                float8.record_apply(self.float8_state, trainable_variables if trainable_variables is not None
                                    else self.float8_state.variables_updated)
        elif self.made_for.target is not None and not self._warned_off:
            self._warned_off = True
            warnings.warn(f"amp_rewrite: this {type(self).__name__} was made for the {self.made_for.target} rewrite,"
                          " which is not enabled for it in this process, so its steps train in float32; call"
                          f" {self.made_for.enable_call()} (opt: this optimizer, e.g. model.optimizer) before"
                          " training", stacklevel=4)

    @property
    def loss_scale(self):
        """The current scale (a scalar tensor; the initial one before the first step)."""
        if not self.built:
            return tf.constant(self.initial_scale, tf.float32)
        return tf.convert_to_tensor(self.dynamic_scale)

    @property
    def skipped_steps(self):
        """How many steps this wrapper has skipped (non-finite gradients) in this process, an int64 tensor."""
        return tf.convert_to_tensor(self._skips.skipped) if self.built else tf.constant(0, tf.int64)

    def _summarize(self) -> None:
        """The loss scale and skipped steps as ``tf.summary`` scalars (``skips.SkipCounter.summarize``)."""
        self._skips.summarize(self.loss_scale, self.iterations)

    def _tell_stuck(self, message: str) -> None:
        if self.doctor is not None:  # it replays the step and warns with its diagnosis
            self.doctor.stuck(message)
        else:
            warnings.warn(f"{message} {FIND_THE_OP}", stacklevel=2)

    def _use(self, gradients: str, method: str) -> None:
        if self._gradients not in (None, gradients):
            raise ValueError(
                f"{method}() called on an optimizer whose code already uses "
                + ("scale_loss(), so apply() takes the gradients of the scaled loss (Keras 3)"
                   if self._gradients == SCALED else
                   "get_scaled_loss()/get_unscaled_gradients(), so apply() takes unscaled gradients (tf_keras)")
                + "; use one of the two on one optimizer (model.fit uses scale_loss())")
        self._gradients = gradients

    def scale_loss(self, loss):
        self._use(SCALED, "scale_loss")
        return super().scale_loss(loss)

    def get_scaled_loss(self, loss):
        self._use(UNSCALED, "get_scaled_loss")
        return super().scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        self._use(UNSCALED, "get_unscaled_gradients")
        scale = self.loss_scale
        return [None if g is None else g / tf.cast(scale, g.dtype) for g in grads]

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if self._gradients is None and not (self.fixed and self.initial_scale == 1):
            raise ValueError(
                "apply() cannot tell whether these gradients are of the scaled loss: scale the loss with"
                " scale_loss() and apply its gradients (Keras 3), or use get_scaled_loss() and apply"
                " get_unscaled_gradients()' results (tf_keras); or call minimize(loss, var_list)")
        if self._gradients == UNSCALED:
            # Back to scaled, as Keras unscales itself: exact, a dynamic scale is a power of two.
            # (get_unscaled_gradients divided the gradients Keras never divides, of variables
            # with ``overwrite_with_gradient``, too; this undoes that as well.)
            scale = self.loss_scale
            grads = [None if g is None else g * tf.cast(scale, g.dtype) for g in grads]
        self._record(trainable_variables)
        applied = super().apply(grads, trainable_variables)
        self._summarize()
        return applied

    def minimize(self, loss, var_list, tape=None):
        """Scale, differentiate, apply: one training step (``loss`` may be a callable)."""
        tape = tape if tape is not None else tf.GradientTape()
        if callable(loss):
            with tape:  # trainable variables are watched automatically
                loss = loss()
        # d(scale * loss) = scale * d(loss): seed the backward pass with the scale.
        grads = tape.gradient(loss, var_list, output_gradients=tf.cast(self.loss_scale, loss.dtype))
        self._record(var_list)
        super().apply(grads, var_list)
        self._summarize()

    def _tf_apply(self, grads, trainable_variables=None):
        """Keras decides on replica 0's gradients alone when a merge call is needed, so a
        NaN on another replica was applied everywhere: decide on all replicas together."""
        if _tf.STRATEGY_SUPPORTS_NO_MERGE_CALL.get()():
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
        if self.fixed:  # a fixed scale still skips the step, but never changes: it is its floor
            self._skips.skip(tf.convert_to_tensor(self.dynamic_scale), tf.constant(True))
            return
        self._skips.skip(tf.convert_to_tensor(self.dynamic_scale), self.dynamic_scale <= FLOOR_SCALE)
        super()._stateful_handle_non_finite_grads()
        # Keras halves without a floor; a run of bad steps must not drive the scale below 1
        # (tf_keras and TF1 stop there too), or good gradients would be scaled *up*.
        self.dynamic_scale.assign(tf.maximum(self.dynamic_scale, 1.0))

    def _stateful_handle_finite_grads(self, grads, trainable_variables):
        self._skips.applied()
        before = tf.identity(self.dynamic_scale)
        super()._stateful_handle_finite_grads(grads, trainable_variables)
        # ... and doubles without a ceiling: keep the last finite scale.
        self.dynamic_scale.assign(tf.where(tf.math.is_finite(self.dynamic_scale), self.dynamic_scale, before))

    def get_config(self):
        length = self.float8_state.amax_history_length if self.float8_state is not None else None
        return {**super().get_config(), "fixed": self.fixed, "float8_amax_history_length": length,
                "target": self.made_for.target, "base_precision": self.made_for.base_precision}

    def save_own_variables(self, store):
        """Keras' numbered variables, then the float8 state by name (``float8:<key>:<kind>``, with
        ``/`` as ``:``, which no op name holds): its variables exist only once a step is traced."""
        super().save_own_variables(store)
        if self.float8_state is not None:
            for name, variable in self.float8_state.items():
                store[FLOAT8_PREFIX + name.replace("/", ":")] = variable.numpy()

    def load_own_variables(self, store):
        numbered = {key: store[key] for key in store.keys() if not key.startswith(FLOAT8_PREFIX)}
        super().load_own_variables(numbered)
        for key in store.keys():
            if key.startswith(FLOAT8_PREFIX):
                if self.float8_state is None:
                    raise ValueError(f"the file holds FP8 training state ({key!r}) for an optimizer without it;"
                                     " save and load with the same amp_rewrite optimizer")
                self.float8_state.set(key[len(FLOAT8_PREFIX):].replace(":", "/"), store[key][...])
