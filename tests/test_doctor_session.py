"""The training doctor on the Session path: a TF1 graph trained with the v1 wrapper, its skipped
step's feed replayed in the rewritten mirror (``DoctorHook``, ``diagnose_session_step``).

The issue's model in TF1 ops (a MatMul+ReLU, then ``x * x * 5000`` in the name scope
``square``, in float16): the first non-finite op is ``square/mul_1``, the keep the doctor
suggests makes the skips stop, the replay leaves training as it was, and a step whose batch
comes from an iterator is refused in one line.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import tensorflow as tf
from test_doctor import data

import amp_rewrite

pytestmark = pytest.mark.usefixtures("no_live_rewrite")


def _graph(*, divisor: float = 1.0, iterator: bool = False, **options):
    """The overflow model in a new tf.Graph, its batch fed through placeholders (or read from a
    one-shot iterator); returns (graph, opt, train op, feed_dict, variables)."""
    x, y = data("overflow", 32)
    x = x / divisor
    graph = tf.Graph()
    with graph.as_default():
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf.compat.v1.train.AdamOptimizer(), target="float16",
                                                               **options)
        if iterator:
            batch = tf.compat.v1.data.make_one_shot_iterator(tf.data.Dataset.from_tensors((x, y)).repeat())
            inputs, labels, feed = *batch.get_next(), {}
        else:
            inputs = tf.compat.v1.placeholder(tf.float32, (None, 64), name="x")
            labels = tf.compat.v1.placeholder(tf.int64, (None,), name="y")
            feed = {inputs: x, labels: y.astype("int64")}
        rng = np.random.RandomState(0)
        hidden = tf.Variable(rng.normal(0, 0.1, (64, 32)).astype("float32"), name="hidden")
        logits = tf.Variable(rng.normal(0, 0.1, (32, 10)).astype("float32"), name="logits")
        with tf.name_scope("square"):
            activation = tf.nn.relu(tf.matmul(inputs, hidden))
            squared = activation * activation * 5000.0
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=labels, logits=tf.matmul(squared, logits)))
        train = opt.minimize(loss)
    return graph, opt, train, feed, [hidden, logits]


def _monitored(steps: int, hook: bool, **options):
    """``steps`` runs of a MonitoredTrainingSession (with ``DoctorHook(first_skip=True)`` if ``hook``);
    returns (weights, skipped steps, the hook, the amp_rewrite warnings)."""
    graph, opt, train, feed, variables = _graph(**options)
    with graph.as_default():
        doctor = amp_rewrite.DoctorHook(opt, first_skip=True) if hook else None
        skipped = opt.skipped_steps
        with warnings.catch_warnings(record=True) as records, tf.compat.v1.train.MonitoredTrainingSession(
                hooks=[doctor] if hook else []) as sess:
            warnings.simplefilter("always")
            for _ in range(steps):
                sess.run(train, feed)
            weights, count = sess.run([variables, skipped])
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    said = [str(r.message) for r in records if "amp_rewrite" in str(r.message)]
    return weights, int(count), doctor, said


def test_the_hook_names_the_op_in_a_monitored_session_and_its_keep_stops_the_skips():
    """Every step skipped: the first skip and the stuck warning carry the diagnosis (the Mul of
    ``square``, float16, finite in float32); rebuilt with its keep, the skips stop."""
    _, skipped, doctor, said = _monitored(20, True)
    assert skipped == 20
    first, stuck = doctor.diagnoses
    assert (first.node, first.op, first.dtype, first.cause, first.float32_finite) == (
        "square/mul_1", "Mul", "float16", "precision", True)
    assert stuck.loss_scale == 1.0 and stuck.keep == first.keep and first.keep[0] == "square/mul_1"
    assert len(said) == 2 and "training is stuck" in said[1] and "first non-finite op of the step: square/mul_1" \
        in said[1], said
    _, kept_skipped, _, _ = _monitored(20, False, keep=list(first.keep))
    _, later, _, _ = _monitored(30, False, keep=list(first.keep))
    assert kept_skipped == later < 20  # the scale settles, then every step applies


def test_the_hook_never_changes_training():
    """Skips while the scale comes down, then applied steps: the weights after 12 runs are the
    same with the hook (which replayed the first skipped step) as without it."""
    with_hook, skipped, doctor, said = _monitored(12, True, divisor=16.0)
    without, skipped_without, _, _ = _monitored(12, False, divisor=16.0)
    assert 0 < skipped == skipped_without < 12
    assert said and said[0].startswith("amp_rewrite doctor:"), said  # the first skip was replayed
    assert all(np.array_equal(a, b) for a, b in zip(with_hook, without))


def test_diagnose_session_step_in_a_plain_session_loop():
    """A plain Session loop: after a skipped run, diagnose_session_step(sess, feed_dict, optimizer=opt)."""
    graph, opt, train, feed, _ = _graph()
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train, feed)
        assert sess.run(opt.skipped_steps) == 1
        diagnosis = amp_rewrite.diagnose_session_step(sess, feed, optimizer=opt)
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    assert (diagnosis.node, diagnosis.op, diagnosis.cause) == ("square/mul_1", "Mul", "precision")
    assert diagnosis.line().startswith("amp_rewrite doctor: first non-finite op of the step: square/mul_1 (Mul,"
                                       " float16, in square)")


def test_a_step_fed_by_a_one_shot_iterator_is_refused_in_one_line():
    """An iterator gives the next batch at each run: no replay, one line naming the op; the hook
    warns it instead of a diagnosis, and training goes on."""
    graph, opt, train, feed, _ = _graph(iterator=True)
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        sess.run(train)
        with pytest.raises(amp_rewrite.AmpRewriteError, match=r"^cannot replay this step: its gradients depend on"
                                                              r" 'IteratorGetNext' \(IteratorGetNext\), .*feed_dict"):
            amp_rewrite.diagnose_session_step(sess, feed, optimizer=opt)
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    _, skipped, doctor, said = _monitored(5, True, iterator=True)
    assert skipped == 5 and not doctor.diagnoses
    assert said == ["amp_rewrite doctor: cannot replay this step: its gradients depend on 'IteratorGetNext'"
                    " (IteratorGetNext), which gives a new value at each run (an iterator, a queue, a random op);"
                    " feed the step's batch through a placeholder (feed_dict) so the doctor can run it again"], said


def test_a_session_that_does_not_run_the_rewrite_is_refused_in_one_line():
    """A Session created before enabling runs the graph as it is: nothing to diagnose, said so."""
    graph = tf.Graph()
    with graph.as_default():
        tf.constant(1.0)
        sess = tf.compat.v1.Session()
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf.compat.v1.train.AdamOptimizer(), target="float16")
    with pytest.raises(amp_rewrite.AmpRewriteError, match=r"^this Session does not run the rewrite"):
        amp_rewrite.diagnose_session_step(sess, {}, optimizer=opt)
    sess.close()


def test_a_step_built_under_a_strategy_is_refused_in_one_line():
    """A v1 step built by ``strategy.run`` in a TF1 graph: its gradients are per replica, so the
    Session doctor says in one line that it cannot diagnose it, instead of replaying one replica."""
    graph = tf.Graph()
    with graph.as_default():
        strategy = tf.distribute.OneDeviceStrategy("/cpu:0")
        with strategy.scope():
            opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf.compat.v1.train.AdamOptimizer(),
                                                                   target="float16")
            weights = tf.Variable(np.ones((4, 4), "float32"))
            x = tf.compat.v1.placeholder(tf.float32, (None, 4), name="x")
            train = strategy.run(lambda: opt.minimize(tf.reduce_sum(tf.matmul(x, weights))))
        init = tf.compat.v1.global_variables_initializer()
    feed = {x: np.ones((2, 4), "float32")}
    with graph.as_default(), tf.compat.v1.Session() as sess:
        sess.run(init)
        sess.run(train, feed)
        with pytest.raises(amp_rewrite.AmpRewriteError, match=r"^the doctor cannot diagnose a Session's step built"
                                                              r" under a tf.distribute strategy"):
            amp_rewrite.diagnose_session_step(sess, feed, optimizer=opt)
    amp_rewrite.disable_mixed_precision_graph_rewrite()


def test_a_session_that_has_not_run_the_step_is_refused_in_one_line():
    """A step added after the Session's first run, which has not run since: not in what it runs, said so."""
    graph = tf.Graph()
    with graph.as_default():
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf.compat.v1.train.AdamOptimizer(), target="float16")
    with graph.as_default(), tf.compat.v1.Session() as sess:
        weights = tf.Variable(np.ones((4, 4), "float32"))
        sess.run(weights.initializer)
        opt.minimize(tf.reduce_sum(tf.matmul(tf.ones((2, 4)), weights)))
        with pytest.raises(amp_rewrite.AmpRewriteError, match=r"^this Session has not run the training step yet"):
            amp_rewrite.diagnose_session_step(sess, {}, optimizer=opt)
    amp_rewrite.disable_mixed_precision_graph_rewrite()
