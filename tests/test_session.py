"""The Session path: ``tf.compat.v1.Session`` graphs run our rewrite after ``enable_…(v1 optimizer)``.

Graph mode cannot be left once entered, so one fresh process (``_SCRIPT``) does it all and
reports; each test checks one part of its report:

* the MatMuls the runtime executed (RunMetadata partition graphs) for ``opt.minimize``
  (bfloat16) and ``compute_gradients`` + ``apply_gradients`` (float16), forward and backward;
* a digits MLP trains to float32's test accuracy (within 2 points) for both targets;
* a step with an Inf loss is skipped (weights unchanged) and halves the scale;
* a ``tf.compat.v1.train.Saver`` round trip into a new Session restores weights and scale;
* ops added after the first ``run`` (an accuracy op, a Saver) run rewritten in the running mirror;
* grappler's own AMP stays off in every Session; after ``disable_…`` a new Session runs
  the user's graph as it is (float32); TensorFlow's DynamicLossScale deprecation is not printed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import within_points

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import numpy as np
    import tensorflow as tf
    tf.compat.v1.disable_eager_execution()
    import amp_rewrite
    from amp_rewrite.training import session as amp_session
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split
    from tensorflow.core.framework import types_pb2
    from tensorflow.core.protobuf import rewriter_config_pb2

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split((images / 16.0).astype("float32"), labels, test_size=0.25,
                                                        random_state=0, stratify=labels)
    TRACE = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE, output_partition_graphs=True)
    EPOCHS, BATCH = 6, 64

    def executed_matmuls(sess, fetch, feed):
        meta = tf.compat.v1.RunMetadata()
        sess.run(fetch, feed, options=TRACE, run_metadata=meta)
        return sorted(types_pb2.DataType.Name(n.attr["T"].type) for g in meta.partition_graphs for n in g.node
                      if "MatMul" in n.op)

    def build(target, split):
        graph = tf.Graph()
        with graph.as_default():
            tf.compat.v1.set_random_seed(0)
            x = tf.compat.v1.placeholder(tf.float32, (None, 64), name="x")
            y = tf.compat.v1.placeholder(tf.int64, (None,), name="y")
            poison = tf.compat.v1.placeholder_with_default(1.0, (), name="poison")
            w1 = tf.compat.v1.get_variable("w1", (64, 64), initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
            w2 = tf.compat.v1.get_variable("w2", (64, 10), initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
            logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)) * poison
            opt = tf.compat.v1.train.AdamOptimizer(1e-2)
            if target:
                opt = amp_rewrite.enable_mixed_precision_graph_rewrite(opt, "dynamic", target=target)
            if split:
                train = opt.apply_gradients(opt.compute_gradients(loss))
            else:
                train = opt.minimize(loss)
            init = tf.compat.v1.global_variables_initializer()
        return graph, dict(x=x, y=y, poison=poison, w1=w1, w2=w2, logits=logits, train=train, init=init, opt=opt)

    def accuracy_op(graph, m):
        with graph.as_default():
            return tf.reduce_mean(tf.cast(tf.equal(tf.argmax(m["logits"], 1), m["y"]), tf.float32))

    def train(sess, m):
        rng = np.random.RandomState(0)
        for _ in range(EPOCHS):
            order = rng.permutation(len(x_train))
            for start in range(0, len(order), BATCH):
                batch = order[start:start + BATCH]
                sess.run(m["train"], {m["x"]: x_train[batch], m["y"]: y_train[batch]})

    report = {}
    graph, m = build(None, False)
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(m["init"])
        report["float32_executed"] = executed_matmuls(sess, m["train"], {m["x"]: x_train[:8], m["y"]: y_train[:8]})
        train(sess, m)
        report["float32_accuracy"] = float(sess.run(accuracy_op(graph, m), {m["x"]: x_test, m["y"]: y_test}))

    for target, split in (("bfloat16", False), ("float16", True)):
        result = report[target] = {}
        graph, m = build(target, split)
        sess = tf.compat.v1.Session(graph=graph)
        result["grappler_amp"] = rewriter_config_pb2.RewriterConfig.Toggle.Name(
            sess._config.graph_options.rewrite_options.auto_mixed_precision)
        sess.run(m["init"])
        feed = {m["x"]: x_train[:8], m["y"]: y_train[:8]}
        result["executed"] = executed_matmuls(sess, m["train"], feed)
        train(sess, m)
        accuracy = accuracy_op(graph, m)  # added after the first run
        result["executed_added"] = executed_matmuls(sess, accuracy, {m["x"]: x_test, m["y"]: y_test})
        result["accuracy"] = float(sess.run(accuracy, {m["x"]: x_test, m["y"]: y_test}))
        result["accuracy_dtype"] = str(sess.run(accuracy, {m["x"]: x_test, m["y"]: y_test}).dtype)
        scale = m["opt"]._loss_scale()
        before = sess.run([m["w1"], m["w2"], scale])
        sess.run(m["train"], {**feed, m["poison"]: float("inf")})
        after = sess.run([m["w1"], m["w2"], scale])
        result["inf_step"] = {"weights_unchanged": all(np.array_equal(a, b) for a, b in zip(before[:2], after[:2])),
                              "scale": [float(before[2]), float(after[2])]}
        with graph.as_default():
            saver = tf.compat.v1.train.Saver()
        path = saver.save(sess, os.path.join(sys.argv[1], target))
        saved = sess.run([m["w1"], scale])
        sess.close()
        with tf.compat.v1.Session(graph=graph) as fresh:
            saver.restore(fresh, path)
            restored = fresh.run([m["w1"], scale])
            result["saver"] = {"w1_equal": bool(np.array_equal(saved[0], restored[0])),
                               "scale": [float(saved[1]), float(restored[1])]}
        amp_rewrite.disable_mixed_precision_graph_rewrite()
        with tf.compat.v1.Session(graph=graph) as plain:
            plain.run(m["init"])
            result["after_disable"] = {"mirrored": amp_session.is_mirrored(plain),
                                       "executed": executed_matmuls(plain, m["train"], feed)}

    # Settings of a mixed_precision() block (an overlay's keep_nodes) stay with the Session
    # made inside it; an op added later that would repaint a running node is painted around it.
    overlay = os.path.join(sys.argv[1], "keep.yaml")
    with open(overlay, "w") as f:
        f.write('keep_nodes: ["kept"]\\n')
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (2, 4), name="x")
        w = tf.compat.v1.get_variable("w", (4, 3), initializer=tf.compat.v1.ones_initializer())
        feat = tf.identity(x, name="feat")
        total = tf.reduce_sum(feat)
        kept = tf.matmul(x, w, name="kept")
        triple = w.assign(w * 3.0)
        init = tf.compat.v1.global_variables_initializer()
    with amp_rewrite.mixed_precision(target="bfloat16", lists=overlay):
        sess = tf.compat.v1.Session(graph=graph)
    feed = {x: np.ones((2, 4), np.float32)}
    sess.run(init)
    sess.run(triple)
    grown = report["grown"] = {"kept": executed_matmuls(sess, kept, feed), "total": float(sess.run(total, feed))}
    mirror_graph = sess._amp_rewrite_mirror.graph
    with graph.as_default():
        low = tf.matmul(feat, w, name="low")  # painted afresh, the Identity feeding it would be bfloat16
    grown["low"] = executed_matmuls(sess, low, feed)
    grown["low_value"] = sess.run(low, feed).tolist()
    grown["low_fetched_as"] = str(sess.run(low, feed).dtype)  # bfloat16 in the mirror, float32 in the user's graph
    grown["feat"] = types_pb2.DataType.Name(sess._amp_rewrite_mirror.graph.get_operation_by_name("feat").get_attr("T")
                                            .as_datatype_enum)
    grown["same_mirror"] = sess._amp_rewrite_mirror.graph is mirror_graph
    print("RESULT " + json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path_factory.mktemp("saver"))], capture_output=True,
                          text=True, timeout=600, env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"the Session script failed:\n{done.stderr[-4000:]}"
    return {"stderr": done.stderr, **json.loads(lines[-1][len("RESULT "):])}


TARGET_TO_LOW = {"bfloat16": "DT_BFLOAT16", "float16": "DT_HALF"}
TARGETS = list(TARGET_TO_LOW)


@pytest.mark.parametrize("target", TARGETS)
def test_session_executes_forward_and_gradient_matmuls_in_target_dtype(report, target):
    """minimize (bfloat16) and compute_gradients+apply_gradients (float16): each training step
    executes 2 forward and 3 gradient MatMuls, all in the target dtype; float32 runs 5 float32 ones."""
    assert report["float32_executed"] == ["DT_FLOAT"] * 5
    assert report[target]["executed"] == [TARGET_TO_LOW[target]] * 5


@pytest.mark.parametrize("target", TARGETS)
def test_session_training_reaches_float32_accuracy(report, target):
    """A digits MLP trained 6 epochs in a rewritten Session: test accuracy within 2 points of
    float32's (≥ 90%); the accuracy comes back as float32, the user graph's dtype."""
    assert report["float32_accuracy"] >= 0.9
    assert within_points(report[target]["accuracy"], report["float32_accuracy"], 2)
    assert report[target]["accuracy_dtype"] == "float32"


@pytest.mark.parametrize("target", TARGETS)
def test_session_skips_a_non_finite_step_and_halves_the_scale(report, target):
    assert report[target]["inf_step"] == {"weights_unchanged": True, "scale": [32768.0, 16384.0]}


@pytest.mark.parametrize("target", TARGETS)
def test_session_saver_round_trip_restores_weights_and_scale(report, target):
    assert report[target]["saver"] == {"w1_equal": True, "scale": [16384.0, 16384.0]}


@pytest.mark.parametrize("target", TARGETS)
def test_ops_added_after_the_first_run_run_rewritten(report, target):
    """An accuracy op and a Saver added after training started: imported into the running
    mirror, the new MatMuls in the target dtype."""
    assert report[target]["executed_added"] == [TARGET_TO_LOW[target]] * 2


@pytest.mark.parametrize("target", TARGETS)
def test_grappler_amp_stays_off_and_disable_stops_the_rewrite(report, target):
    assert report[target]["grappler_amp"] == "OFF"
    assert report[target]["after_disable"] == {"mirrored": False, "executed": ["DT_FLOAT"] * 5}


def test_keep_nodes_hold_and_a_new_op_is_painted_around_running_nodes(report):
    """A Session made inside ``mixed_precision(lists=overlay)`` keeps the overlay's keep_nodes
    (MatMul "kept" runs float32). A MatMul added after the first runs reads an Identity that
    runs float32; painted afresh it would be converted, but a running node keeps its dtype: the
    Identity stays float32 and the new MatMul, imported into the same mirror, runs bfloat16
    and reads w's value (3 × ones, assigned in an earlier run): 4 × 3 = 12, fetched as the user's
    graph types it (float32), not as the mirror computes it (bfloat16)."""
    assert report["grown"] == {"kept": ["DT_FLOAT"], "total": 8.0, "low": ["DT_BFLOAT16"],
                               "low_value": [[12.0] * 3] * 2, "low_fetched_as": "float32", "feat": "DT_FLOAT",
                               "same_mirror": True}


def test_v1_path_prints_no_deprecation_notice(report):
    assert "DynamicLossScale.__init__" not in report["stderr"] and "is deprecated" not in report["stderr"]


def test_threads_racing_the_first_run_rewrite_the_graph_once(monkeypatch):
    """8 threads call ``Session.run`` at once on a fresh mirrored Session: the mirror is built
    once (one rewrite of the user's graph), and every thread gets the same result."""
    import threading
    import time

    import keras
    import numpy as np
    import tensorflow as tf

    import amp_rewrite
    from amp_rewrite.training import live
    from amp_rewrite.training import session as amp_session

    rewrites = []
    rewrite = amp_session.rewrite_graph_def

    def counted(*args, **kwargs):
        rewrites.append(threading.get_ident())
        time.sleep(0.2)  # the others reach the lock meanwhile
        return rewrite(*args, **kwargs)

    monkeypatch.setattr(amp_session, "rewrite_graph_def", counted)
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 4))
        product = tf.matmul(x, x)
    live.stop()
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")
    try:
        session = tf.compat.v1.Session(graph=graph)
    finally:
        live.stop()
    start, results = threading.Barrier(8), []

    def run() -> None:
        start.wait()
        results.append(session.run(product, {x: np.eye(4, dtype=np.float32)}))

    threads = [threading.Thread(target=run) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    session.close()
    assert len(rewrites) == 1 and len(results) == 8
    assert all(np.array_equal(result, np.eye(4)) for result in results)
