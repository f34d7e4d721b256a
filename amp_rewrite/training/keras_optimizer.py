"""The Keras 3 loss-scale optimizer that ``enable_mixed_precision_graph_rewrite`` returns.

A module of its own, importing only Keras and TensorFlow, because ``import amp_rewrite``
registers it with Keras' serialization as soon as Keras is loaded (``registration``):
``keras.models.load_model`` in a new process must find the class behind a ``.keras`` file.
"""
from __future__ import annotations

import weakref

import keras
import tensorflow as tf

DEFAULT_INITIAL_SCALE = 2.0**15
DEFAULT_GROWTH_STEPS = 2000


@keras.saving.register_keras_serializable(package="amp_rewrite")
class LossScaleOptimizer(keras.mixed_precision.LossScaleOptimizer):
    """Keras 3's loss-scale optimizer, plus a fixed scale and the seed API's methods.

    ``apply``/``apply_gradients`` keep Keras 3's contract (they take *scaled* gradients, as
    ``model.fit`` passes them), except when every gradient passed is one of the tensors
    ``get_unscaled_gradients`` returned: those are unscaled, as the tf_keras API had it.
    The decision is made from the tensors of that call alone, so unscaling gradients in
    another function or trace (a monitoring step, say) never changes how a step applies.
    """

    def __init__(self, inner_optimizer, initial_scale=DEFAULT_INITIAL_SCALE,
                 dynamic_growth_steps=DEFAULT_GROWTH_STEPS, fixed=False, name=None, **kwargs):
        super().__init__(inner_optimizer, initial_scale=initial_scale,
                         dynamic_growth_steps=dynamic_growth_steps, name=name, **kwargs)
        self.fixed = fixed
        # id → tensor, for the tensors get_unscaled_gradients returned; weak, so an entry
        # lives only as long as its tensor and an id reused later never matches.
        self._unscaled = weakref.WeakValueDictionary()

    @property
    def loss_scale(self):
        """The current scale (a scalar tensor; the initial one before the first step)."""
        if not self.built:
            return tf.constant(self.initial_scale, tf.float32)
        return tf.convert_to_tensor(self.dynamic_scale)

    def get_scaled_loss(self, loss):
        return self.scale_loss(loss)

    def get_unscaled_gradients(self, grads):
        scale = self.loss_scale
        unscaled = [None if g is None else g / tf.cast(scale, g.dtype) for g in grads]
        for g in unscaled:
            if g is not None:
                self._unscaled[id(g)] = g
        return unscaled

    def _returned_unscaled(self, grads) -> bool:
        """Whether ``grads`` are the tensors ``get_unscaled_gradients`` returned (all, or none)."""
        present = [g for g in grads if g is not None]
        unscaled = [self._unscaled.get(id(g)) is g for g in present]
        if any(unscaled) and not all(unscaled):
            raise ValueError(
                f"apply() got {sum(unscaled)} of {len(present)} gradients from get_unscaled_gradients() and the"
                " rest from elsewhere; pass either the gradients of the scaled loss, all scaled, or exactly the"
                " list get_unscaled_gradients() returned"
            )
        return bool(present) and all(unscaled)

    def apply(self, grads, trainable_variables=None):
        grads = list(grads)
        if self._returned_unscaled(grads):
            # Back to scaled, as Keras unscales itself: exact, a dynamic scale is a power of two.
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
