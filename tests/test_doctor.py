"""The training doctor: what a user whose float16 steps are all skipped is told, and what fixes it.

* ``enable_mixed_precision_graph_rewrite(..., lists=, keep=)``: the keep regex the doctor
  suggests, pasted into the call the user has, keeps that node float32 in the live rewrite;
* the Keras 3 wrapper counts skipped steps and says once when training is stuck;
* the doctor replays a skipped step's batch once and names the first op whose output is not
  finite, for models built to fail (float16 overflow, a LayerNorm variance that underflows,
  a softmax fed large logits); pasting its keep makes the skips stop; it never changes training.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_live import registered_compute, new_functions, function_names

import amp_rewrite
from amp_rewrite.training import live

pytestmark = pytest.mark.usefixtures("no_live_rewrite")


def _two_matmuls(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    with tf.name_scope("head"):
        kept = tf.matmul(a, b, name="kept")
    return tf.matmul(kept, tf.transpose(b), name="converted")


@pytest.mark.parametrize("how", ["keep", "lists"])
def test_a_keep_regex_on_the_entry_point_keeps_that_node_float32(how, tmp_path):
    """``keep=`` (as ``--keep``) and ``lists=`` (an overlay file's keep_nodes) on
    ``enable_mixed_precision_graph_rewrite``: the named MatMul stays float32, the other is float16."""
    if how == "keep":
        options = {"keep": [r"head/kep?t"]}
    else:
        (tmp_path / "keep.yaml").write_text('keep_nodes: ["head/kept"]\n')
        options = {"lists": tmp_path / "keep.yaml"}
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="float16", **options)
    before = function_names()
    a, b = tf.random.normal((4, 8)), tf.random.normal((8, 8))
    step = tf.function(_two_matmuls)  # held: its registered functions go with it
    step(a, b)
    nodes = {node.name: node.dtype for node in registered_compute(new_functions(before))}
    assert nodes == {"head/kept": "DT_FLOAT", "converted": "DT_HALF"}


def test_keep_on_the_entry_point_says_what_it_takes():
    with pytest.raises(ValueError, match=r"keep= takes node-name regexes \(strings\), got 3"):
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="float16", keep=[3])


# --------------------------------------------------------------------------------------
# Models built to fail in float16 (each trains in float32)

class Square(keras.layers.Layer):
    """The issue's layer: activations far outside float16's range (65504)."""

    def call(self, x):
        return x * x * 5000.0


class Attention(keras.layers.Layer):
    """Self-attention whose scores are not scaled down: a softmax fed large logits."""

    def call(self, h):
        scores = tf.matmul(h, h, transpose_b=True, name="scores")
        return tf.matmul(tf.nn.softmax(scores, name="softmax"), h, name="mix")


# model -> (input scale, the node the doctor must name first, its op)
FAILING = {
    "overflow": (4.0, "overflow_1/square_1/mul_1", "Mul"),
    # the inverse standard deviation of activations ~1e-6 (1e6), cast down to float16
    "layernorm": (1.0, "layernorm_1/norm_1/mul-0-CastToFp16-0-AutoMixedPrecision", "Cast"),
    "softmax": (300.0, "softmax_1/attention_1/scores", "BatchMatMulV2"),
}


def build(kind: str, dropout: float = 0.0) -> keras.Model:
    """Named layers, so a rebuilt model's step has the same node names (the keep is pasted into it)."""
    keras.utils.set_random_seed(0)
    if kind == "overflow":
        layers = [keras.layers.Dense(32, activation="relu", name="hidden"), Square(name="square")]
    elif kind == "layernorm":  # a frozen projection to ~1e-6, then a LayerNorm without epsilon
        layers = [keras.layers.Dense(32, name="hidden", trainable=False,
                                     kernel_initializer=keras.initializers.RandomNormal(stddev=2e-7)),
                  keras.layers.LayerNormalization(epsilon=0.0, name="norm")]
    else:
        layers = [keras.layers.Dense(64, name="hidden"), keras.layers.Reshape((8, 8)), Attention(name="attention"),
                  keras.layers.Flatten()]
    if dropout:
        layers.append(keras.layers.Dropout(dropout, name="dropout"))
    return keras.Sequential([keras.Input((64,)), *layers, keras.layers.Dense(10, name="logits")], name=kind)


def data(kind: str, n: int = 256) -> tuple[np.ndarray, np.ndarray]:
    from amp_rewrite.testing.digits import digits

    split = digits()
    return split.x_train[:n] * FAILING[kind][0], split.y_train[:n]


def fit(kind: str, *, epochs: int = 3, callbacks=(), dropout: float = 0.0, **options):
    """``kind`` trained with float16 and Adam for ``epochs`` epochs of 8 batches; returns (model, optimizer, history)."""
    model = build(kind, dropout)
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(), target="float16", **options)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = data(kind)
    history = model.fit(x, y, batch_size=32, epochs=epochs, verbose=0, callbacks=list(callbacks), shuffle=False)
    return model, opt, history


def stuck_warnings(records) -> list[str]:
    return [str(r.message) for r in records if "training is stuck" in str(r.message)]


def test_the_issue_s_model_is_stuck_and_says_so_once():
    """The issue's run: every step skipped, the scale at 1 — and now one warning saying so, a
    skipped_steps count of every step, and no warning per step."""
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        _, opt, history = fit("overflow")
    assert np.isnan(history.history["loss"]).all() and int(opt.iterations) == 0
    assert int(opt.skipped_steps) == 24 and float(opt.loss_scale) == 1.0
    said = stuck_warnings(records)
    assert len(said) == 1, said
    assert "the last 3 steps were all skipped" in said[0] and "amp_rewrite.Doctor()" in said[0]


@pytest.mark.parametrize("kind", list(FAILING))
def test_the_doctor_names_the_op_and_its_keep_stops_the_skips(kind):
    """In ``fit``, the Doctor warns once, when training is stuck, naming the first non-finite op;
    the same model trained again with the suggested keep= applies its steps (none skipped in its
    last epoch, the loss finite)."""
    doctor = amp_rewrite.Doctor()
    with warnings.catch_warnings(record=True) as records:
        warnings.simplefilter("always")
        _, opt, history = fit(kind, callbacks=[doctor])
    said = stuck_warnings(records)
    assert len(said) == 1 and len(doctor.diagnoses) == 1, said
    diagnosis = doctor.diagnoses[0]
    assert (diagnosis.node, diagnosis.op, diagnosis.float32_finite) == (FAILING[kind][1], FAILING[kind][2], True)
    assert diagnosis.line() in said[0] and "keep=[" in said[0]
    assert history.history["skipped_steps"] == [8, 16, 24] and int(opt.iterations) == 0
    live.stop()
    _, opt, history = fit(kind, callbacks=[amp_rewrite.Doctor()], keep=diagnosis.keep)
    skipped = history.history["skipped_steps"]
    assert skipped[-1] == skipped[-2] and int(opt.iterations) >= 8, skipped
    assert np.isfinite(history.history["loss"][-1])


def _custom_loop(model: keras.Model, opt, x: np.ndarray, y: np.ndarray, steps: int):
    """A GradientTape loop with Keras 3's scale_loss/apply; returns the loss function it differentiates."""
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def loss_fn(x, y):
        return loss_object(y, model(x, training=True))

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(loss_fn(x, y))
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    for _ in range(steps):
        step(x, y)
    return loss_fn


def test_diagnose_step_in_a_custom_loop_names_the_op():
    """A custom loop calls ``diagnose_step`` with its loss function and a skipped step's batch."""
    model = build("overflow")
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(), target="float16")
    x, y = data("overflow", 32)
    loss_fn = _custom_loop(model, opt, x, y, steps=2)
    assert int(opt.skipped_steps) == 2
    diagnosis = amp_rewrite.diagnose_step(loss_fn, x, y, optimizer=opt)
    assert (diagnosis.node, diagnosis.op, diagnosis.dtype, diagnosis.cause) == (
        "overflow_1/square_1/mul_1", "Mul", "float16", "precision")
    assert diagnosis.largest_input == 5000.0 and diagnosis.float32_largest > 65504
    assert diagnosis.loss_scale == float(opt.loss_scale) == 2.0**13
    assert diagnosis.keep[0] == "overflow_1/square_1/mul_1" and diagnosis.scope == "overflow_1/square_1"


def test_the_doctor_never_changes_training():
    """The same run with and without the Doctor, which replays the first skipped step (dropout's
    seed state and all): the same weights after its steps, skipped (the scale coming down) and applied."""
    runs = []
    keep = ["softmax_1/attention_1/scores", "softmax_1/attention_1/softmax"]  # so that it trains after a few skips
    for callbacks in ([], [amp_rewrite.Doctor(first_skip=True)]):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, opt, _ = fit("softmax", epochs=2, callbacks=callbacks, dropout=0.5, keep=keep)
        runs.append(([v.numpy() for v in model.variables], int(opt.iterations), int(opt.skipped_steps)))
        live.stop()
    assert len(callbacks[0].diagnoses) == 1, "the doctor replayed the first skipped step"
    (without, *counts), (with_doctor, *counts_doctor) = runs
    assert counts == counts_doctor and counts[0] > 0 and counts[1] > 0
    assert all(np.array_equal(a, b) for a, b in zip(without, with_doctor))


def test_diagnosis_where_nothing_is_wrong_says_so_in_one_line():
    """Bad input, one line each: a batch on which nothing is non-finite, a loss that is not a
    float, a one-shot iterator, an optimizer the rewrite did not wrap. A batch that overflows
    only in the backward pass, at the loss scale, is said to be the scale's (it comes down)."""
    model = build("overflow")
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(), target="float16")
    x, y = data("overflow", 32)
    loss_fn = _custom_loop(model, opt, x, y, steps=1)
    diagnosis = amp_rewrite.diagnose_step(loss_fn, x * 0, y, optimizer=opt)
    assert (diagnosis.node, diagnosis.cause, diagnosis.keep) == ("gradient_tape/overflow_1/square_1/mul_1/Mul",
                                                                 "scale", ())
    assert "a dynamic loss scale comes down to it by itself" in diagnosis.line()
    plain = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    plain_opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(), target="float16")
    plain_loss = _custom_loop(plain, plain_opt, x, y, steps=1)
    with pytest.raises(amp_rewrite.AmpRewriteError, match=r"no value of this step is Inf or NaN at loss scale"
                                                          r" 32768: nothing to diagnose"):
        amp_rewrite.diagnose_step(plain_loss, x, y, optimizer=plain_opt)
    with pytest.raises(amp_rewrite.AmpRewriteError, match=r"loss_fn returned a int32 tensor, not a float tensor"):
        amp_rewrite.diagnose_step(lambda x, y: tf.argmax(model(x), axis=-1, output_type=tf.int32), x, y,
                                  optimizer=opt)
    batches = iter(tf.data.Dataset.from_tensor_slices((x, y)).batch(8))
    with pytest.raises(amp_rewrite.AmpRewriteError, match=r"cannot replay a batch given as a .*Iterator.*: it yields"
                                                          r" each batch once"):
        amp_rewrite.diagnose_step(loss_fn, batches, optimizer=opt)
    with pytest.raises(amp_rewrite.AmpRewriteError, match=r"this Adam has no enabled rewrite"):
        amp_rewrite.diagnose_step(loss_fn, x, y, optimizer=keras.optimizers.Adam())


def summary_scalars(folder) -> dict[str, list[float]]:
    """The scalars of the event files in ``folder``, by tag, in the order written."""
    tag_to_values: dict[str, list[float]] = {}
    for path in folder.glob("events.*"):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                tag_to_values.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return tag_to_values


def test_loss_scale_and_skipped_steps_reach_tf_summary_and_keras_logs(tmp_path):
    """In a custom loop under ``writer.as_default()`` the wrapper writes both scalars each step;
    in fit the Doctor puts them into the epoch's logs (History, TensorBoard after it)."""
    model = build("overflow")
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(), target="float16")
    x, y = data("overflow", 32)
    with tf.summary.create_file_writer(str(tmp_path)).as_default():
        _custom_loop(model, opt, x, y, steps=3)
    assert summary_scalars(tmp_path) == {"amp_rewrite/loss_scale": [2.0**14, 2.0**13, 2.0**12],
                             "amp_rewrite/skipped_steps": [1.0, 2.0, 3.0]}


def test_diagnose_step_in_a_tf_keras_custom_loop_names_the_op_and_its_keep_applies_the_step():
    """tf_keras: its wrapper, ``get_scaled_loss``/``get_unscaled_gradients``, and ``variables=``
    given (tf_keras' optimizer does not list them for the doctor). 20 steps: without the keep none
    is applied (the scale falls to 1 and they go on overflowing), with it the last one is."""
    import tf_keras

    class SquareV2(tf_keras.layers.Layer):
        def call(self, x):
            return x * x * 5000.0

    def run(keep=()):
        tf.random.set_seed(0)
        model = tf_keras.Sequential([tf_keras.layers.Dense(32, activation="relu", name="hidden", input_shape=(64,)),
                                     SquareV2(name="square"), tf_keras.layers.Dense(10, name="logits")],
                                    name="overflow")
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf_keras.optimizers.Adam(), target="float16",
                                                               keep=keep)
        loss_object = tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True)

        def loss_fn(x, y):
            return loss_object(y, model(x, training=True))

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                scaled = opt.get_scaled_loss(loss_fn(x, y))
            gradients = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
            opt.apply_gradients(zip(gradients, model.trainable_variables))

        x, y = data("overflow", 32)
        first = [v.numpy() for v in model.trainable_variables]
        for _ in range(20):
            before = [v.numpy() for v in model.trainable_variables]
            step(x, y)
        moved = not all(np.array_equal(a, v.numpy()) for a, v in zip(before, model.trainable_variables))
        assert moved or all(np.array_equal(a, v.numpy()) for a, v in zip(first, model.trainable_variables))
        return moved, (loss_fn, x, y, opt, model)

    moved, (loss_fn, x, y, opt, model) = run()
    assert not moved, "every overflowing step was skipped"
    diagnosis = amp_rewrite.diagnose_step(loss_fn, x, y, optimizer=opt, variables=model.trainable_variables)
    assert (diagnosis.node, diagnosis.op, diagnosis.cause) == ("overflow/square/mul_1", "Mul", "precision")
    live.stop()
    moved, _ = run(keep=diagnosis.keep)
    assert moved, f"with keep={diagnosis.keep} the 20th step still was skipped"


# The doctor under MirroredStrategy over two logical CPUs (a subprocess: devices are fixed at
# TF start-up). bfloat16, as MirroredStrategy on CPUs places every op (float16 rewrites only
# GPU or unplaced nodes); a layer whose values leave float32's range too (``x * x * 1e37``).
_MIRRORED_DOCTOR = textwrap.dedent(
    """
    import json, warnings
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import amp_rewrite
    from amp_rewrite.testing.digits import digits

    class Huge(keras.layers.Layer):
        def call(self, x):
            return x * x * 1e37

    split = digits()
    x, y = split.x_train[:128] * 4.0, split.y_train[:128]

    def diagnoses(strategy):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu", name="hidden"),
                                      Huge(name="huge"), keras.layers.Dense(10, name="logits")], name="huge")
            opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(), target="bfloat16")
            model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        doctor = amp_rewrite.Doctor(first_skip=True)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model.fit(x, y, batch_size=32, epochs=1, verbose=0, shuffle=False, callbacks=[doctor])
        amp_rewrite.disable_mixed_precision_graph_rewrite()
        return [[d.node, d.op, d.dtype, d.cause, d.float32_finite] for d in doctor.diagnoses]

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    print("RESULT " + json.dumps({"mirrored": diagnoses(mirrored), "alone": diagnoses(tf.distribute.get_strategy())}))
    """)


def test_the_doctor_under_mirrored_strategy_names_the_op_it_names_without():
    """Keras 3 fit under MirroredStrategy (two logical CPUs): the first skipped step's diagnosis
    names the same op, dtype and cause as the same fit without a strategy (the replay runs the
    share of the batch one replica kept)."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _MIRRORED_DOCTOR], capture_output=True, text=True, timeout=300,
                          env=env, cwd=Path(__file__).resolve().parents[1])
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"the MirroredStrategy script failed:\n{done.stderr[-4000:]}"
    found = json.loads(lines[-1][len("RESULT "):])
    (mirrored, *_), (alone, *_) = found["mirrored"], found["alone"]
    assert re.fullmatch(r"huge_\d+/huge_\d+/mul_1", mirrored[0]) and re.fullmatch(r"huge_\d+/huge_\d+/mul_1", alone[0])
    assert mirrored[1:] == alone[1:] == ["Mul", "bfloat16", "scale", False], found
