"""TF1 training loops as their users write them, run in one fresh process with
``tf.compat.v1.disable_v2_behavior()`` (graph mode, reference variables); prints one
``RESULT {json}`` line that ``test_tf1_training.py`` checks part by part.

``python tests/tf1_training.py WORKDIR`` — WORKDIR receives checkpoints and event files.
Every Session below is created while the rewrite is on (bfloat16) unless it says otherwise,
so each runs the rewritten mirror of its graph.
"""
from __future__ import annotations

import collections
import json
import os
import re
import sys
import warnings
from pathlib import Path

import numpy as np
import tensorflow as tf

tf.compat.v1.disable_v2_behavior()

import amp_rewrite  # noqa: E402
from amp_rewrite.training import session as amp_session  # noqa: E402
from tensorflow.core.framework import types_pb2  # noqa: E402
from tensorflow.core.protobuf import config_pb2  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TARGET = "bfloat16"
TRACE = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE, output_partition_graphs=True)
Point = collections.namedtuple("Point", ["loss", "weights"])


def executed_matmuls(run_metadata: tf.compat.v1.RunMetadata) -> list[str]:
    """The dtypes of the MatMuls the runtime ran, from the partition graphs."""
    return sorted(types_pb2.DataType.Name(node.attr["T"].type) for graph in run_metadata.partition_graphs
                  for node in graph.node if "MatMul" in node.op)


def diabetes() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_diabetes

    x, y = load_diabetes(return_X_y=True)
    return x.astype("float32"), ((y - y.mean()) / y.std()).astype("float32")[:, None]


def regression_graph(wrap: bool, poison: bool = False) -> tuple[tf.Graph, dict]:
    """A one-hidden-layer regression on diabetes, trained by Adam through ``opt.minimize``."""
    x_data, y_data = diabetes()
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.constant(x_data[:128], name="x")
        y = tf.constant(y_data[:128], name="y")
        scale = tf.compat.v1.placeholder_with_default(1.0, (), name="poison")
        w1 = tf.compat.v1.get_variable("w1", (10, 32), initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
        w2 = tf.compat.v1.get_variable("w2", (32, 1), initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
        loss = tf.reduce_mean(tf.square(tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2) - y)) * scale
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = tf.compat.v1.train.AdamOptimizer(0.01)
        if wrap:
            opt = amp_rewrite.enable_mixed_precision_graph_rewrite(opt, target=TARGET)
        train = opt.minimize(loss, global_step=step)
        tf.compat.v1.summary.scalar("loss", loss)
        summaries = tf.compat.v1.summary.merge_all()
    return graph, dict(loss=loss, step=step, train=train, w1=w1, w2=w2, summaries=summaries, poison=scale)


class Recorder(tf.compat.v1.train.SessionRunHook):
    """A custom hook: fetches a dict keyed by strings in ``before_run``, asks for a trace, and
    reads the step and weights where training ends."""

    def __init__(self, m: dict) -> None:
        self.m, self.steps, self.executed, self.end_state = m, [], [], None

    def after_create_session(self, session, coord):
        self.start_state = [int(session.run(self.m["step"])), session.run(self.m["w2"]).ravel().tolist()]

    def end(self, session):
        self.end_state = [int(session.run(self.m["step"])), session.run(self.m["w2"]).ravel().tolist()]

    def before_run(self, run_context):
        return tf.compat.v1.train.SessionRunArgs({"step": self.m["step"], "w2": self.m["w2"]}, options=TRACE)

    def after_run(self, run_context, run_values):
        self.steps.append(int(run_values.results["step"]))
        self.executed.append(executed_matmuls(run_values.run_metadata))


def monitored_training(workdir: Path, wrap: bool) -> dict:
    """MonitoredTrainingSession with StopAtStepHook, CheckpointSaverHook (through
    save_checkpoint_steps), LoggingTensorHook, SummarySaverHook, NanTensorHook and a custom
    hook, for 6 steps; with the rewrite (``wrap``) a new session then restores the last
    checkpoint and trains on to step 9. Without it, the same run is float32's reference."""
    out: dict = {}
    name = "bfloat16" if wrap else "float32"
    checkpoints, events = str(workdir / f"mts_{name}"), str(workdir / f"events_{name}")
    graph, m = regression_graph(wrap)
    with graph.as_default():
        recorder, logged = Recorder(m), []
        hooks = [tf.compat.v1.train.StopAtStepHook(last_step=6), recorder,
                 tf.compat.v1.train.LoggingTensorHook({"loss": m["loss"], "step": m["step"]}, every_n_iter=1,
                                                      formatter=lambda values: logged.append(float(values["loss"])) or ""),
                 tf.compat.v1.train.SummarySaverHook(save_steps=2, output_dir=events, summary_op=m["summaries"]),
                 tf.compat.v1.train.NanTensorHook(m["loss"])]
        with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoints, hooks=hooks,
                                                         save_checkpoint_steps=3, save_summaries_steps=None) as sess:
            out["mirrored"] = amp_session.is_mirrored(sess._tf_sess())  # pylint: disable=protected-access
            while not sess.should_stop():
                sess.run(m["train"])
    out["end"], out["hook_steps"], out["hook_executed"], out["logged"] = (
        recorder.end_state, recorder.steps, recorder.executed, logged)
    last = tf.train.latest_checkpoint(checkpoints)
    out["checkpoint"] = os.path.basename(last)
    out["checkpoint_w2"] = tf.train.load_variable(last, "w2").ravel().tolist()
    out["summary_steps"] = sorted(
        event.step for path in sorted(Path(events).glob("events.*"))
        for event in tf.compat.v1.train.summary_iterator(str(path))
        if any(value.tag == "loss" for value in event.summary.value))
    if not wrap:
        return out
    graph, m = regression_graph(wrap)
    with graph.as_default():
        resumed = Recorder(m)
        with tf.compat.v1.train.MonitoredTrainingSession(
                checkpoint_dir=checkpoints, save_checkpoint_steps=None, save_summaries_steps=None,
                hooks=[resumed, tf.compat.v1.train.StopAtStepHook(last_step=9)]) as sess:
            while not sess.should_stop():
                sess.run(m["train"])
    out["resumed"] = {"start": resumed.start_state, "end": resumed.end_state}
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    return out


def singular_and_nan() -> dict:
    """SingularMonitoredSession with StopAtStepHook(num_steps=3) and a custom hook; then a NaN
    loss: NanTensorHook raises as without the rewrite, and the step was skipped (w2 unchanged)."""
    graph, m = regression_graph(wrap=True)
    out: dict = {}
    with graph.as_default():
        recorder = Recorder(m)
        with tf.compat.v1.train.SingularMonitoredSession(
                hooks=[tf.compat.v1.train.StopAtStepHook(num_steps=3), recorder]) as sess:
            while not sess.should_stop():
                sess.run(m["train"])
            out["singular_steps"] = recorder.steps
        with tf.compat.v1.train.SingularMonitoredSession(hooks=[tf.compat.v1.train.NanTensorHook(m["loss"])]) as sess:
            sess.run(m["train"])
            before = sess.run(m["w2"])
            try:
                sess.run(m["train"], {m["poison"]: float("nan")})
                out["nan"] = "no error"
            except tf.compat.v1.train.NanLossDuringTrainingError as error:
                out["nan"] = type(error).__name__
            out["nan_step_skipped"] = bool(np.array_equal(before, sess.raw_session().run(m["w2"])))
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    return out


def state_across_a_new_op() -> dict:
    """Iterators, a reference variable, a lookup table and a queue, used for three runs; then an
    op is added that reads a running float32 node through a new MatMul (a repainting op), and
    two more runs follow. Nothing starts afresh."""
    graph = tf.Graph()
    with graph.as_default():
        data = tf.data.Dataset.range(20).map(lambda i: tf.fill([2, 4], tf.cast(i, tf.float32)))
        one_shot = tf.compat.v1.data.make_one_shot_iterator(data)
        initializable = tf.compat.v1.data.make_initializable_iterator(data)
        feats = {name: tf.identity(it.get_next(), name=f"{name}_feat")
                 for name, it in (("one_shot", one_shot), ("initializable", initializable))}
        batch_index = {name: tf.reduce_max(feat) for name, feat in feats.items()}
        w = tf.compat.v1.get_variable("w", (4, 3), initializer=tf.compat.v1.ones_initializer())  # a ref variable
        x = tf.compat.v1.placeholder(tf.float32, (2, 4), name="x")
        loss = tf.reduce_sum(tf.matmul(x, w))
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf.compat.v1.train.GradientDescentOptimizer(0.01),
                                                               target=TARGET)
        train = opt.minimize(loss)
        table = tf.lookup.experimental.MutableHashTable(tf.string, tf.float32, default_value=-1.0)
        insert = table.insert(tf.constant(["a", "b"]), tf.constant([1.5, 2.5]))
        queue = tf.queue.FIFOQueue(10, tf.float32)
        enqueue = queue.enqueue_many([tf.constant([7.0, 8.0, 9.0])])
        init = [tf.compat.v1.global_variables_initializer(), initializable.initializer]
    sess = tf.compat.v1.Session(graph=graph)
    feed = {x: np.ones((2, 4), np.float32)}
    sess.run(init)
    sess.run([insert, enqueue])
    seen = {name: [] for name in feats}
    for _ in range(3):
        indices, _ = sess.run([batch_index, train], feed)
        for name, index in indices.items():
            seen[name].append(int(index))
    trained = sess.run(w)
    with graph.as_default():
        evaluations = {name: tf.matmul(feat, tf.ones((4, 3))) for name, feat in feats.items()}  # feat: float32
        lookup = table.lookup(tf.constant(["a", "b"]))
        dequeue = queue.dequeue()
    out: dict = {"is_ref_variable": w.dtype._is_ref_dtype}  # pylint: disable=protected-access
    try:
        meta = tf.compat.v1.RunMetadata()
        values = sess.run({"w": w, "lookup": lookup, "dequeue": dequeue, "eval": evaluations}, feed, TRACE, meta)
        out["w_kept"] = bool(np.array_equal(values["w"], trained))
        out["lookup"], out["dequeue"] = values["lookup"].tolist(), float(values["dequeue"])
        out["eval_executed"] = executed_matmuls(meta)
        for name, value in values["eval"].items():
            seen[name].append(int(value[0, 0] / 4))  # a batch of index i times ones: 4 * i
        indices = sess.run(batch_index)
        for name, index in indices.items():
            seen[name].append(int(index))
    except tf.errors.OpError as error:
        out["error"] = f"{type(error).__name__}: {error.message.splitlines()[0]}"
    out["batches"] = seen
    sess.close()
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    return out


def callables_and_partial_runs() -> dict:
    """make_callable's every path (one op, one tensor, a structure, options, a feed list),
    _make_callable_from_options (what tf_keras' graph-mode K.function runs) and partial runs:
    each runs the mirror (bfloat16 MatMuls), and its updates are what ``run`` sees."""
    out: dict = {}
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 8), name="x")
        w = tf.compat.v1.get_variable("w", (8, 8), initializer=tf.compat.v1.constant_initializer(0.125))
        y = tf.matmul(x, w, name="y")
        total = tf.reduce_sum(y, name="total")
        fed = tf.compat.v1.get_variable("fed", (4, 8), initializer=tf.compat.v1.zeros_initializer())
        store = tf.compat.v1.assign(fed, x, name="store")
        total_of_stored = tf.reduce_sum(tf.matmul(fed, w), name="total_of_stored")
        step = tf.compat.v1.train.get_or_create_global_step()
        bump = tf.compat.v1.assign_add(step, 1, name="bump")
        a = tf.compat.v1.placeholder(tf.float32, (), name="a")
        b = tf.compat.v1.placeholder(tf.float32, (), name="b")
        r1 = tf.add(a, b, name="r1")
        r2 = tf.reduce_sum(tf.matmul(x * r1, w), name="r2")
        init = tf.compat.v1.global_variables_initializer()
    ones = np.ones((4, 8), np.float32)
    with amp_rewrite.mixed_precision(target=TARGET):
        sess = tf.compat.v1.Session(graph=graph)
    sess.run(init)
    one_op, one_tensor = sess.make_callable(bump), sess.make_callable(step)
    structure = sess.make_callable({"step": step, "pair": (bump, total_of_stored)})
    one_op()
    one_op()
    out["steps"] = [int(one_tensor()), int(sess.run(step)), int(structure()["step"]), int(sess.run(step))]
    with_feeds = sess.make_callable([total, store], feed_list=[x])  # a feed list: through run()
    out["feed_list_total"] = float(with_feeds(2 * ones)[0])
    traced = sess.make_callable(total_of_stored, accept_options=True)  # reads what with_feeds stored
    meta = tf.compat.v1.RunMetadata()
    out["options_total"] = float(traced(options=TRACE, run_metadata=meta))
    out["options_executed"] = executed_matmuls(meta)
    options = config_pb2.CallableOptions(feed=["x:0"], fetch=["y:0", "total:0"], target=["bump"])
    from_options = sess._make_callable_from_options(options)  # pylint: disable=protected-access
    values = from_options(ones)
    out["from_options"] = {"dtypes": [str(v.dtype) for v in values], "total": float(values[1]),
                           "step": int(sess.run(step))}
    out["fed_converted"] = float(sess.run(total, {y: np.full((4, 8), 0.5, np.float32)}))  # y: bfloat16 in the copy
    handle = sess.partial_run_setup([r1, r2], [a, b, x])
    out["partial_run"] = [float(sess.partial_run(handle, r1, {a: 1.0, b: 2.0})),
                          float(sess.partial_run(handle, r2, {x: ones}))]
    mirror = sess._amp_rewrite_mirror  # pylint: disable=protected-access
    out["mirror_matmuls"] = sorted(
        types_pb2.DataType.Name(n.attr["T"].type) for n in mirror.graph.as_graph_def().node if n.op == "MatMul")
    sess.close()
    return out


def fetch_and_feed_structures() -> dict:
    """What Session.run takes, run in a plain Session and a mirrored one on the same graph:
    a dict keyed by a hook object and strings, a namedtuple, nested lists, ops, tensor names,
    SparseTensor and IndexedSlices fetches; feeds by name and a sparse placeholder."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 8), name="x")
        sparse = tf.compat.v1.sparse_placeholder(tf.float32, (4, 8), name="sparse")
        w = tf.compat.v1.get_variable("w", (8, 8), initializer=tf.compat.v1.constant_initializer(0.25))
        y = tf.matmul(x + tf.sparse.to_dense(sparse), w, name="y")
        relu = tf.nn.relu(y - 1.0)
        sparse_out = tf.sparse.from_dense(relu)
        slices = tf.gradients(tf.reduce_sum(tf.gather(w, [1, 3])), w)[0]
        noop = tf.no_op(name="noop")
        total = tf.reduce_sum(y)
        init = tf.compat.v1.global_variables_initializer()
    hook = tf.compat.v1.train.StopAtStepHook(last_step=1)
    fetches = {hook: [y, (relu, "y:0")], "point": Point(total, [w, [noop]]), "sparse": sparse_out,
               "slices": slices, "op": init}
    rng = np.random.RandomState(0)
    feeds = {"x:0": rng.rand(4, 8).astype(np.float32),
             sparse: tf.compat.v1.SparseTensorValue([[0, 0], [2, 5]], [1.0, 2.0], [4, 8])}
    plain = tf.compat.v1.Session(graph=graph)
    with amp_rewrite.mixed_precision(target=TARGET):
        mirrored = tf.compat.v1.Session(graph=graph)
    results = []
    for sess in (plain, mirrored):
        sess.run(init)
        results.append(sess.run(fetches, feeds))
        sess.close()
    return {"same": _same_structure(results[0], results[1], hook), "mirrored": amp_session.is_mirrored(mirrored)}


def _same_structure(expected, actual, hook) -> str:
    """"" if ``actual`` has ``expected``'s structure, types, dtypes and values (within bfloat16's
    tolerance), else what differs."""
    if type(expected) is not type(actual):
        return f"{type(actual).__name__} for {type(expected).__name__}"
    if isinstance(expected, dict):
        if set(expected) != set(actual):
            return f"keys {list(actual)} for {list(expected)}"
        return next((f"[{k if k is not hook else 'hook'}] {d}" for k in expected
                     if (d := _same_structure(expected[k], actual[k], hook))), "")
    if isinstance(expected, (list, tuple)) and not hasattr(expected, "indices"):
        if len(expected) != len(actual):
            return f"length {len(actual)} for {len(expected)}"
        return next((f"[{i}] {d}" for i, (e, a) in enumerate(zip(expected, actual))
                     if (d := _same_structure(e, a, hook))), "")
    if hasattr(expected, "_fields"):  # SparseTensorValue, IndexedSlicesValue
        return next((f".{f} {d}" for f in expected._fields
                     if (d := _same_structure(getattr(expected, f), getattr(actual, f), hook))), "")
    if expected is None:
        return ""
    expected, actual = np.asarray(expected), np.asarray(actual)
    if expected.dtype != actual.dtype or expected.shape != actual.shape:
        return f"{actual.dtype}{actual.shape} for {expected.dtype}{expected.shape}"
    if not np.allclose(actual, expected, rtol=2e-2, atol=2e-2 * float(np.max(np.abs(expected), initial=0))):
        return f"values {actual.ravel()[:4]} for {expected.ravel()[:4]}"
    return ""


def tf_keras_graph_mode_fit() -> dict:
    """tf_keras Model.fit in graph mode (disable_v2_behavior): K.function runs through
    ``_make_callable_from_options`` on the session tf_keras creates after enabling."""
    import tf_keras
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype("float32")
    out: dict = {}
    for target in (None, TARGET):
        tf_keras.backend.clear_session()
        tf_keras.utils.set_random_seed(0)
        model = tf_keras.Sequential([tf_keras.layers.Dense(64, activation="relu", input_shape=(64,)),
                                     tf_keras.layers.Dense(10)])
        opt = tf_keras.optimizers.legacy.Adam(1e-2)  # graph mode takes the legacy optimizers
        if target:
            opt = amp_rewrite.enable_mixed_precision_graph_rewrite(opt, target=target)
        model.compile(optimizer=opt, loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        model.fit(images[:1200], labels[:1200], batch_size=64, epochs=4, verbose=0, shuffle=False)
        loss, accuracy = model.evaluate(images[1200:], labels[1200:], verbose=0)
        session = tf_keras.src.backend.get_session()  # tf.compat.v1.keras.backend.get_session, for tf_keras
        key = target or "float32"
        out[key] = {"accuracy": float(accuracy), "loss": float(loss), "mirrored": amp_session.is_mirrored(session)}
        if target:
            mirror = session._amp_rewrite_mirror  # pylint: disable=protected-access
            out[key]["mirror_matmuls"] = sorted({types_pb2.DataType.Name(n.attr["T"].type)
                                                 for n in mirror.graph.as_graph_def().node if n.op == "MatMul"})
            out[key]["scale"] = float(session.run(opt.loss_scale))
            amp_rewrite.disable_mixed_precision_graph_rewrite()
    return out


def refused_growth() -> dict:
    """cross_function: a new caller of a function the Session runs would change its
    signature's painting: the run is refused with one line; the running ops still run."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (2, 4), name="x")
        double_relu = tf.function(lambda a: tf.nn.relu(a) * 2.0)
        first = double_relu(tf.matmul(x, tf.ones((4, 4))))
    with amp_rewrite.mixed_precision(target=TARGET, cross_function=True):
        sess = tf.compat.v1.Session(graph=graph)
    feed = {x: np.ones((2, 4), np.float32)}
    out = {"first": sess.run(first, feed).tolist()}
    with graph.as_default():
        second = double_relu(tf.exp(x, name="exp_input"))
    try:
        sess.run(second, feed)
        out["refused"] = ""
    except amp_rewrite.AmpRewriteError as error:
        out["refused"] = str(error)
    out["first_again"] = sess.run(first, feed).tolist()
    sess.close()
    return out


def fixed_scale_all_skipped() -> dict:
    """A fixed loss_scale with a loss that is never finite, in a Session: 12 steps, all skipped,
    counted in ``opt.skipped_steps``; the stuck warnings, recorded."""
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant([1.0, 2.0]))
        step = tf.compat.v1.train.get_or_create_global_step()
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf.compat.v1.train.GradientDescentOptimizer(0.1),
                                                               loss_scale=2.0**20, target=TARGET)
        train = opt.minimize(tf.reduce_sum(w * w) * float("inf"), global_step=step)
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as sess, warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        sess.run(init)
        for _ in range(12):
            sess.run(train)
        out = {"step": int(sess.run(step)), "w": sess.run(w).tolist(), "scale": float(sess.run(opt.loss_scale)),
               "skipped": int(sess.run(opt.skipped_steps)),
               "stuck": [str(r.message) for r in records if "training is stuck" in str(r.message)]}
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    return out


def digits_graph(target: str) -> tuple[tf.Graph, dict]:
    """A digits MLP (64-64-10) trained by Adam through ``opt.minimize``, wrapped for ``target``
    (FP8 training: 4-step amax histories), fed from placeholders; reference variables, as
    ``disable_v2_behavior()`` makes them."""
    graph = tf.Graph()
    with graph.as_default():
        tf.compat.v1.set_random_seed(0)
        x = tf.compat.v1.placeholder(tf.float32, (None, 64), name="x")
        y = tf.compat.v1.placeholder(tf.int64, (None,), name="y")
        w1 = tf.compat.v1.get_variable("w1", (64, 64), initializer=tf.compat.v1.glorot_uniform_initializer(seed=1))
        w2 = tf.compat.v1.get_variable("w2", (64, 10), initializer=tf.compat.v1.glorot_uniform_initializer(seed=2))
        logits = tf.matmul(tf.nn.relu(tf.matmul(x, w1)), w2)
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        accuracy = tf.reduce_mean(tf.cast(tf.equal(tf.argmax(logits, 1), y), tf.float32))
        extra = {"amax_history_length": 4} if target == "float8" else {}
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf.compat.v1.train.AdamOptimizer(1e-2), target=target,
                                                               **extra)
        train = opt.minimize(loss, global_step=tf.compat.v1.train.get_or_create_global_step())
    return graph, dict(x=x, y=y, train=train, accuracy=accuracy, opt=opt)


def float8_supported() -> bool:
    """FP8 training needs TensorFlow 2.18+ (``amp_rewrite.core.float8.inference.MIN_TENSORFLOW``)."""
    from amp_rewrite.core.float8 import inference as float8
    from amp_rewrite._tf import tensorflow_version

    return tensorflow_version() >= float8.MIN_TENSORFLOW


def float8_monitored(workdir: Path) -> dict:
    """FP8 training in a MonitoredTrainingSession that checkpoints, then a restart: its
    checkpoints hold the float8 state (the v1 wrapper made it variables of the user's graph),
    the restarted session starts from the saved state and trains on; held-out accuracy
    against the same loop in bfloat16."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split((images / 16.0).astype("float32"), labels, test_size=0.25,
                                                        random_state=0, stratify=labels)
    batches = [(x_train[i:i + 32], y_train[i:i + 32]) for i in range(0, len(x_train) - 31, 32)]
    out: dict = {}

    def train(target: str, checkpoints: str, steps: int) -> tuple[dict, dict]:
        graph, m = digits_graph(target)
        with graph.as_default():
            state = dict(m["opt"].float8_state.items()) if target == "float8" else {}
            with tf.compat.v1.train.MonitoredTrainingSession(checkpoint_dir=checkpoints, save_checkpoint_steps=10,
                                                             save_summaries_steps=None) as sess:
                start = {name: sess.run(v).tolist() for name, v in state.items()}
                for index in range(steps):
                    x, y = batches[index % len(batches)]
                    sess.run(m["train"], {m["x"]: x, m["y"]: y})
                end = {name: sess.run(v).tolist() for name, v in state.items()}
                end["accuracy"] = float(sess.run(m["accuracy"], {m["x"]: x_test, m["y"]: y_test}))
        amp_rewrite.disable_mixed_precision_graph_rewrite()
        return start, end

    checkpoints = str(workdir / "mts_float8")
    _, first = train("float8", checkpoints, 30)
    saved = tf.train.latest_checkpoint(checkpoints)
    out["checkpointed"] = sorted(name for name, _ in tf.train.list_variables(saved) if "amp_rewrite_float8" in name)
    out["saved"] = {name: tf.train.load_variable(saved, name).tolist() for name in out["checkpointed"]}
    out["first"] = first
    out["resumed_start"], out["resumed_end"] = train("float8", checkpoints, 10)
    out["saver"] = float8_saver_round_trip(workdir / "saver_float8", batches[:5])
    _, out["float8"] = train("float8", str(workdir / "float8_long"), 3 * len(batches))
    _, out["bfloat16"] = train("bfloat16", str(workdir / "bfloat16_long"), 3 * len(batches))
    return out


def float8_saver_round_trip(workdir: Path, batches: list) -> dict:
    """FP8 training in a plain ``tf.compat.v1.Session`` saved by a ``Saver`` made after the train
    op, then restored by another ``Saver`` into a freshly built graph's Session: the float8
    state as saved, and as restored."""
    def state(sess: tf.compat.v1.Session, m: dict) -> dict:
        return {name: sess.run(v).tolist() for name, v in m["opt"].float8_state.items()}

    graph, m = digits_graph("float8")
    with graph.as_default(), tf.compat.v1.Session() as sess:
        saver = tf.compat.v1.train.Saver()
        sess.run(tf.compat.v1.global_variables_initializer())
        for x, y in batches:
            sess.run(m["train"], {m["x"]: x, m["y"]: y})
        saved, path = state(sess, m), saver.save(sess, str(workdir / "model"))
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    graph, m = digits_graph("float8")
    with graph.as_default(), tf.compat.v1.Session() as sess:
        tf.compat.v1.train.Saver().restore(sess, path)
        restored = state(sess, m)
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    return {"saved": saved, "restored": restored}


def readme_example(workdir: Path) -> dict:
    """The training guide's TF1 example (the ```python block with a checkpointing
    MonitoredTrainingSession), run as written with target= and its checkpoint directory replaced."""
    text = (ROOT / "docs" / "guides" / "training.md").read_text(encoding="utf-8")
    blocks = [b for b in re.findall(r"```python\n(.*?)```", text, re.S) if "MonitoredTrainingSession(checkpoint_dir" in b]
    assert len(blocks) == 1, ("expected one block with MonitoredTrainingSession(checkpoint_dir in"
                              f" docs/guides/training.md, found {len(blocks)}")
    code = blocks[0]
    assert code.count("enable_mixed_precision_graph_rewrite(opt)") == 1 and code.count('"tf1_checkpoints"') == 1
    code = code.replace("enable_mixed_precision_graph_rewrite(opt)",
                        f"enable_mixed_precision_graph_rewrite(opt, target={TARGET!r})")
    code = code.replace('"tf1_checkpoints"', repr(str(workdir / "readme")))
    namespace: dict = {}
    with tf.Graph().as_default():
        exec(compile(code, "README TF1 example", "exec"), namespace)
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    return {"last_checkpoint": os.path.basename(tf.train.latest_checkpoint(str(workdir / "readme")) or ""),
            "losses": [float(v) for v in namespace.get("losses", [])]}


def main() -> None:
    workdir = Path(sys.argv[1])
    report = {
        "monitored": monitored_training(workdir, wrap=True),
        "float32_monitored": monitored_training(workdir, wrap=False),
        "singular": singular_and_nan(),
        "state": state_across_a_new_op(),
        "callables": callables_and_partial_runs(),
        "structures": fetch_and_feed_structures(),
        "tf_keras": tf_keras_graph_mode_fit(),
        "refused": refused_growth(),
        "fixed_scale": fixed_scale_all_skipped(),
        "readme": readme_example(workdir),
        "float8": float8_monitored(workdir) if float8_supported() else None,
    }
    print("RESULT " + json.dumps(report))


if __name__ == "__main__":
    main()
