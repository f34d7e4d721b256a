"""The training doctor's counting on the other wrappers: tf_keras and TF1's v1 optimizer (in a
tf.function and in a Session).

The issue's model (Dense+ReLU, then ``x * x * 5000``, in float16) skips every step: each
wrapper counts them in ``skipped_steps``, says once that training is stuck (not once per
step), and trains exactly as the family's own loss-scale optimizer does without the counting.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import tensorflow as tf
from test_doctor import data, stuck_warnings, summary_scalars

import amp_rewrite
from amp_rewrite.training import live, session

pytestmark = pytest.mark.usefixtures("no_live_rewrite")

tf_keras = pytest.importorskip("tf_keras")


class SquareV2(tf_keras.layers.Layer):
    """The issue's layer for tf_keras: ``factor`` 5000 overflows float16 at every step, 300 only
    at the loss scale's first levels (the scale comes down, then steps apply)."""

    def __init__(self, factor: float = 5000.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.factor = factor

    def call(self, x):
        return x * x * self.factor


def _tf_keras_fit(opt, factor: float, epochs: int = 3):
    """The overflow model in tf_keras, trained by ``fit`` (8 batches an epoch) with ``opt``."""
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.layers.Dense(32, activation="relu", name="hidden", input_shape=(64,)),
                                 SquareV2(factor, name="square"), tf_keras.layers.Dense(10, name="logits")])
    model.compile(optimizer=opt, loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data("overflow")
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, shuffle=False)
    return model, history, stuck_warnings(records)


def test_tf_keras_fit_counts_every_skipped_step_and_says_once_it_is_stuck():
    """tf_keras' fit of the issue's model: 24 steps, all skipped, the scale down to 1 — one
    warning (not one per step), pointing to diagnose_step, and skipped_steps 24."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf_keras.optimizers.Adam(), target="float16")
    _, history, said = _tf_keras_fit(opt, 5000.0)
    assert np.isnan(history.history["loss"]).all()
    assert int(opt.skipped_steps) == 24 and float(opt.loss_scale) == 1.0
    assert len(said) == 1, said
    assert "the last 3 steps were all skipped" in said[0] and "amp_rewrite.diagnose_step(" in said[0]


def test_tf_keras_counting_leaves_training_as_tf_keras_own_wrapper_trains():
    """The milder layer (``* 300``): some steps skipped while the scale comes down, then applied.
    Our wrapper and tf_keras' own LossScaleOptimizer under the same rewrite end with the same
    weights and scale; ours counted the skips, and said nothing (never stuck: the scale was above 1)."""
    ours = amp_rewrite.enable_mixed_precision_graph_rewrite(tf_keras.optimizers.Adam(), target="float16")
    model, _, said = _tf_keras_fit(ours, 300.0)
    weights = [v.numpy() for v in model.weights]
    live.stop()
    theirs = tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.Adam())
    with amp_rewrite.mixed_precision(target="float16"):
        reference, _, _ = _tf_keras_fit(theirs, 300.0)
    assert 0 < int(ours.skipped_steps) < 24 and not said, int(ours.skipped_steps)
    assert float(ours.loss_scale) == float(theirs.loss_scale) < 2.0**15
    assert all(np.array_equal(a, b.numpy()) for a, b in zip(weights, reference.weights))


def _tf_keras_doctor_fit(**options):
    """The issue's model (named ``overflow``) in tf_keras' fit with ``amp_rewrite.Doctor``; returns
    (doctor, history, warnings)."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf_keras.optimizers.Adam(), target="float16", **options)
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.layers.Dense(32, activation="relu", name="hidden", input_shape=(64,)),
                                 SquareV2(5000.0, name="square"), tf_keras.layers.Dense(10, name="logits")],
                                name="overflow")
    model.compile(optimizer=opt, loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data("overflow")
    doctor = amp_rewrite.Doctor()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        history = model.fit(x, y, batch_size=32, epochs=3, verbose=0, shuffle=False, callbacks=[doctor])
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    return doctor, history, stuck_warnings(records)


def test_the_doctor_in_tf_keras_fit_names_the_op_and_its_keep_stops_the_skips():
    """The same ``Doctor`` class in tf_keras' fit: one stuck warning carrying the diagnosis (the
    Mul of ``square``, in float16), the scalars in fit's logs; with its keep, the skips stop."""
    doctor, history, said = _tf_keras_doctor_fit()
    assert history.history["skipped_steps"] == [8, 16, 24]
    assert len(said) == 1 and "first non-finite op of the step: overflow/square/mul_1 (Mul, float16" in said[0], said
    (diagnosis,) = doctor.diagnoses
    assert (diagnosis.node, diagnosis.op, diagnosis.cause, diagnosis.float32_finite) == (
        "overflow/square/mul_1", "Mul", "precision", True)
    assert diagnosis.keep[0] == "overflow/square/mul_1"
    _, kept, said = _tf_keras_doctor_fit(keep=list(diagnosis.keep))
    skipped = kept.history["skipped_steps"]
    assert not said and skipped[-1] == skipped[-2] < 24, skipped  # the scale settles, then every step applies


def test_the_doctor_outside_fit_says_in_one_line_what_to_call_instead():
    """``Doctor`` is a callback of Keras 3's and tf_keras' fit; handed another model it names diagnose_step."""
    with pytest.raises(amp_rewrite.AmpRewriteError, match=r"^amp_rewrite.Doctor is a callback for model.fit of a"
                                                          r" Keras 3 or tf_keras model, not of a Module: .*diagnose_step"):
        amp_rewrite.Doctor().set_model(tf.Module())


def _v1_overflow_step(opt, x: np.ndarray, y: np.ndarray):
    """The issue's model written with TF1 ops (its weights, and the train op ``opt.minimize`` makes)."""
    rng = np.random.RandomState(0)
    hidden = tf.Variable(rng.normal(0, 0.1, (64, 32)).astype("float32"), name="hidden")
    logits = tf.Variable(rng.normal(0, 0.1, (32, 10)).astype("float32"), name="logits")

    def loss():
        activation = tf.nn.relu(tf.matmul(tf.constant(x), hidden))
        squared = activation * activation * 5000.0
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=tf.constant(y.astype("int64")), logits=tf.matmul(squared, logits)))

    return loss, [hidden, logits]


def test_the_v1_wrapper_counts_and_says_once_in_a_tf_function():
    """TF1's optimizer in a TF2 tf.function: 12 skipped steps counted, one stuck warning (it
    replaces the old stderr line at the 10th skip of a fixed scale), the weights untouched."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf.compat.v1.train.AdamOptimizer(), target="float16")
    x, y = data("overflow", 32)
    loss, variables = _v1_overflow_step(opt, x, y)

    @tf.function
    def step() -> None:
        opt.minimize(loss, var_list=variables)

    before = [v.numpy() for v in variables]
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        for _ in range(20):
            step()
    said = stuck_warnings(records)
    assert int(opt.skipped_steps) == 20 and float(opt.loss_scale) == 1.0
    assert len(said) == 1 and "with the loss scale at 1" in said[0], said
    assert all(np.array_equal(a, v.numpy()) for a, v in zip(before, variables))


def test_diagnose_step_names_the_op_for_the_v1_wrapper_in_a_tf_function():
    """TF1's optimizer in a TF2 tf.function: the loss function replayed, as for Keras, names the
    Mul of ``square`` (``variables=``: a v1 optimizer does not list them)."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf.compat.v1.train.AdamOptimizer(), target="float16")
    x, y = data("overflow", 32)
    rng = np.random.RandomState(0)
    variables = [tf.Variable(rng.normal(0, 0.1, shape).astype("float32")) for shape in ((64, 32), (32, 10))]

    def loss_fn(x, y):
        with tf.name_scope("square"):
            activation = tf.nn.relu(tf.matmul(x, variables[0]))
            squared = activation * activation * 5000.0
        return tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=y, logits=tf.matmul(squared, variables[1])))

    @tf.function
    def step(x, y):
        opt.minimize(lambda: loss_fn(x, y), var_list=variables)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step(x, y.astype("int64"))
    assert int(opt.skipped_steps) == 1
    diagnosis = amp_rewrite.diagnose_step(loss_fn, x, y.astype("int64"), optimizer=opt, variables=variables)
    assert (diagnosis.node, diagnosis.op, diagnosis.dtype, diagnosis.cause) == ("square/mul_1", "Mul", "float16",
                                                                                "precision")


def _session_run(wrap, steps: int, divisor: float = 16.0):
    """The issue's model in a TF1 graph run by a Session (the mirrored Session while the rewrite
    is on), ``steps`` training steps; returns (weights, skipped_steps or None, loss scale, warnings)."""
    x, y = data("overflow", 32)
    graph = tf.Graph()
    with graph.as_default():
        opt, scale = wrap(tf.compat.v1.train.AdamOptimizer())
        loss, variables = _v1_overflow_step(opt, x / divisor, y)  # 16: skips only while the scale comes down
        train = opt.minimize(loss())
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as sess, warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        sess.run(init)
        for _ in range(steps):
            sess.run(train)
        skipped = int(sess.run(opt.skipped_steps)) if hasattr(opt, "skipped_steps") else None
        assert session.is_mirrored(sess), "the rewrite's Session path runs the graph"
        return sess.run(variables), skipped, float(sess.run(scale())), stuck_warnings(records)


def _ours(inner):
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(inner, target="float16")
    return opt, lambda: opt.loss_scale


def _tf1_own(inner):
    scale = tf.compat.v1.mixed_precision.DynamicLossScale()
    return tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer(inner, scale), scale


def test_the_session_path_counts_every_skipped_step_and_says_once_it_is_stuck():
    """The issue's model in a Session: 20 steps, all skipped, counted; one stuck warning."""
    weights, skipped, scale, said = _session_run(_ours, 20, divisor=1.0)
    assert skipped == 20 and scale == 1.0
    assert len(said) == 1 and "with the loss scale at 1" in said[0], said


def test_the_session_path_counts_skips_and_trains_as_tf1_own_wrapper():
    """A Session of a graph built with the v1 wrapper: the skips while the scale comes down are
    counted, unsaid (never stuck), and the weights and scale after 12 steps are those of TF1's
    own MixedPrecisionLossScaleOptimizer in a Session under the same rewrite."""
    weights, skipped, scale, said = _session_run(_ours, 12)
    live.stop()
    with amp_rewrite.mixed_precision(target="float16"):
        reference, _, reference_scale, _ = _session_run(_tf1_own, 12)
    assert 0 < skipped < 12 and not said and scale == reference_scale < 2.0**15
    assert all(np.array_equal(a, b) for a, b in zip(weights, reference))


def test_tf_keras_loss_scale_and_skipped_steps_reach_tf_summary(tmp_path):
    """A tf_keras custom loop under ``writer.as_default()``: its wrapper writes both scalars at each
    step, as the Keras 3 wrapper does (the scale after the step's halving)."""
    tf_keras.utils.set_random_seed(0)
    model = tf_keras.Sequential([tf_keras.layers.Dense(32, activation="relu", input_shape=(64,)), SquareV2(),
                                 tf_keras.layers.Dense(10)])
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf_keras.optimizers.Adam(), target="float16")
    loss_object = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            scaled = opt.get_scaled_loss(loss_object(y, model(x, training=True)))
        gradients = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        opt.apply_gradients(zip(gradients, model.trainable_variables))

    x, y = data("overflow", 32)
    with tf.summary.create_file_writer(str(tmp_path)).as_default():
        for _ in range(3):
            step(x, y)
    assert summary_scalars(tmp_path) == {"amp_rewrite/loss_scale": [2.0**14, 2.0**13, 2.0**12],
                             "amp_rewrite/skipped_steps": [1.0, 2.0, 3.0]}
