"""The numerics doctor for FP8 training: each quantized operand's amax as a ``tf.summary``
scalar, and ``diagnose_float8`` naming the matmul whose amax history is stale.

Checked with one hand-made matmul whose amaxes are exact (as ``test_float8_training``'s), and
with a digits model whose inputs are scaled up 1000x after some steps: the diagnosis names
its first Dense's matmul, and the keep it suggests takes that matmul out of FP8.
"""
from __future__ import annotations

import re

import keras
import numpy as np
import pytest
import tensorflow as tf

import amp_rewrite
from conftest import NEEDS_FLOAT8
from amp_rewrite.training import live

pytestmark = [
    pytest.mark.usefixtures("no_live_rewrite"),
    NEEDS_FLOAT8,
    pytest.mark.filterwarnings("ignore:amp_rewrite.*run emulated without XLA"),
]


def _matmul_step(opt, jit_compile: bool = False):
    """``product = x @ kernel`` (op "product"), loss ``sum(product)`` scaled by ``opt``; learning rate 0."""
    kernel = tf.Variable(np.array([[2.0, -1.0, 0.5], [1.0, 0.25, -2.0]], np.float32), name="kernel")

    @tf.function(jit_compile=jit_compile)
    def step(x):
        with tf.GradientTape() as tape:
            loss = opt.scale_loss(tf.reduce_sum(tf.cast(tf.matmul(x, kernel, name="product"), tf.float32)))
        opt.apply([tape.gradient(loss, kernel)], [kernel])

    return step


def _events(folder) -> dict[str, list[float]]:
    tag_to_values: dict[str, list[float]] = {}
    for path in sorted(folder.glob("events.*")):
        for event in tf.compat.v1.train.summary_iterator(str(path)):
            for value in event.summary.value:
                tag_to_values.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return tag_to_values


def test_each_operands_amax_of_each_step_reaches_tf_summary(tmp_path):
    """Under ``writer.as_default()`` every step writes ``amp_rewrite/amax/<matmul>/<operand>``:
    the amax that step records (3, 6, 1 for the input; the kernel's 2; the gradient of a sum: 1),
    not the history's previous entry; without a writer the same step trains as before."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=4)
    step = _matmul_step(opt)
    with tf.summary.create_file_writer(str(tmp_path / "on")).as_default():
        for amax in (3.0, 6.0, 1.0):
            step(np.array([[amax, 1.0], [-0.5, 0.25]], np.float32))
    amaxes = {tag: values for tag, values in _events(tmp_path / "on").items() if tag.startswith("amp_rewrite/amax/")}
    assert amaxes == {"amp_rewrite/amax/product/input": [3.0, 6.0, 1.0],
                      "amp_rewrite/amax/product/weight": [2.0, 2.0, 2.0],
                      "amp_rewrite/amax/product/output_grad": [1.0, 1.0, 1.0]}
    live.stop()
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=4)
    step = _matmul_step(opt)
    step(np.ones((2, 2), np.float32))  # no writer: the summary's nodes are left unread
    assert opt.float8_state.lookup("v0_kernel/input")[0].numpy()[0] == 1.0, "the step trained in FP8 all the same"


def _spiked_training(keep=(), *, history: int = 16, scales=(1.0,) * 6 + (1000.0,)):
    """A digits MLP trained in FP8 (``history``) on one batch of pixels in [0, 1] times each of
    ``scales`` in turn (default: 6 steps, then the batch scaled up 1000x). Returns the wrapper,
    the last step's loss and the float32 loss of the same weights on its batch (the model run
    eagerly, which the rewrite leaves alone)."""
    from amp_rewrite.testing.digits import digits

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu", name="hidden"),
                              keras.layers.Dense(10, name="logits")], name="spiked")
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(1e-3), target="float8",
                                                           amax_history_length=history, keep=keep)
    loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function(jit_compile=False)
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_object(y, model(x, training=True))
            scaled = opt.scale_loss(loss)
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
        return loss

    data = digits()
    x, y = data.x_train[:32], data.y_train[:32]
    for scale in scales[:-1]:
        step(x * scale, y)
    last = x * scales[-1]
    reference = float(loss_object(y, model(last)))
    return opt, float(step(last, y)), reference


def test_an_xla_step_writes_no_amax_summaries(tmp_path):
    """XLA cannot write summaries: a ``jit_compile=True`` step trains in FP8 and writes none."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=4)
    step = _matmul_step(opt, jit_compile=True)
    with tf.summary.create_file_writer(str(tmp_path)).as_default():
        step(np.array([[3.0, 1.0], [-0.5, 0.25]], np.float32))
    assert not [tag for tag in _events(tmp_path) if tag.startswith("amp_rewrite/amax/")]
    assert opt.float8_state.lookup("v0_kernel/input")[0].numpy()[0] == 3.0


def test_a_stale_amax_history_names_the_matmul_and_its_keep_stops_the_clipping():
    """Inputs 1000x above the history's largest amax: the step's E4M3 cast clips them, silently
    (no step is skipped), and its loss is far from float32's. ``diagnose_float8`` names the
    first Dense's matmul and its input first (the second's input, its activations, rose with
    it); with the keep it suggests for each, the step's loss is float32's within 5% and nothing
    is found."""
    opt, loss, reference = _spiked_training()
    assert int(opt.skipped_steps) == 0
    assert abs(loss - reference) > 0.5 * reference, (loss, reference)
    findings = amp_rewrite.diagnose_float8(opt)
    # Keras names the step's ops by layer, as traced (spiked_1/hidden_1/MatMul, its scopes uniquified in the graph)
    assert [(re.sub(r"_\d+", "", f.matmul), f.operand, f.kind, f.steps_ago) for f in findings] == [
        ("spiked/hidden/MatMul", "input", "saturated", 0), ("spiked/logits/MatMul", "input", "saturated", 0)]
    assert findings[0].amax == pytest.approx(1000.0) and findings[0].history_max == pytest.approx(1.0)
    line = findings[0].line()
    assert f"FP8 matmul {findings[0].matmul}, operand input" in line and f"keep=['{findings[0].matmul}']" in line
    live.stop()
    opt, loss, reference = _spiked_training(keep=[entry for f in findings for entry in f.keep])
    assert loss == pytest.approx(reference, rel=0.05)
    with pytest.raises(amp_rewrite.AmpRewriteError, match="no FP8 training step has been traced"):
        amp_rewrite.diagnose_float8(opt)  # both matmuls kept: nothing left in FP8 to go stale


def test_a_fallen_amax_says_to_shorten_the_history_and_a_shorter_one_fits():
    """Inputs back at [0, 1] after 6 steps at 1000: the history's 1000 sets a scale 2048x too small
    for them (1 * 2**-2 against E4M3's 448) for 10 more steps: an underflow, whose fix is a
    shorter history; with ``amax_history_length=1`` the same steps leave nothing to find."""
    fallen = (1000.0,) * 6 + (1.0,)
    opt, _, _ = _spiked_training(scales=fallen)
    findings = [f for f in amp_rewrite.diagnose_float8(opt) if f.key == "v0_kernel/input"]
    assert [(f.kind, f.amax, f.history_max) for f in findings] == [("underflow", 1.0, 1000.0)]
    assert "shorter amax_history_length (now 16)" in findings[0].line()
    live.stop()
    opt, _, _ = _spiked_training(scales=fallen, history=1)
    assert [f for f in amp_rewrite.diagnose_float8(opt) if f.key == "v0_kernel/input"] == []


def test_diagnose_float8_without_fp8_state_is_one_line():
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(), target="bfloat16")
    with pytest.raises(amp_rewrite.AmpRewriteError, match=r"this LossScaleOptimizer has no FP8 training state"):
        amp_rewrite.diagnose_float8(opt)


def test_a_skipped_fp8_step_is_replayed_and_its_keep_makes_the_skips_stop():
    """FP8 training on a float16 base with the issue's overflowing layer (``x * x * 5000``): its
    steps are skipped; ``diagnose_step`` replays one in the base precision (the float8 casts pass
    Inf and NaN through and clip the rest, so the first non-finite op is a float16 one) and names
    the Mul; with its keep, the skips stop: the last 5 of 20 steps are all applied, where without it all 20 are skipped."""
    from test_doctor import _custom_loop, build, data

    def run(keep=()):
        model = build("overflow")
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(), target="float8",
                                                               base_precision="float16", keep=keep)
        x, y = data("overflow", 32)
        return model, opt, x, y, _custom_loop(model, opt, x, y, steps=15)

    model, opt, x, y, loss_fn = run()
    _custom_loop(model, opt, x, y, steps=5)
    assert int(opt.skipped_steps) == 20 and float(opt.loss_scale) == 1.0, "every step skipped, at the scale's floor"
    diagnosis = amp_rewrite.diagnose_step(loss_fn, x, y, optimizer=opt)
    assert (re.sub(r"_\d+", "", diagnosis.node), diagnosis.op, diagnosis.cause) == ("overflow/square/mul", "Mul",
                                                                                    "precision")
    live.stop()
    model, opt, x, y, _ = run(keep=diagnosis.keep)  # the scale comes down over the first steps, as in float16
    skipped = int(opt.skipped_steps)
    _custom_loop(model, opt, x, y, steps=5)
    assert int(opt.skipped_steps) == skipped and int(opt.iterations) >= 5, (skipped, int(opt.iterations))


def test_the_doctor_in_fit_says_a_stale_history_once():
    """``Doctor`` in Keras 3 ``fit`` with FP8: the second epoch's inputs are 1000x the first's; at
    its end one warning names the first Dense's matmul (said once, kept in ``float8_findings``)."""
    from amp_rewrite.testing.digits import digits

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, activation="relu", name="hidden"),
                              keras.layers.Dense(10, name="logits")], name="spiked")
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(1e-3), target="float8",
                                                           amax_history_length=16)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    data = digits()
    x, y = data.x_train[:64], data.y_train[:64]
    doctor = amp_rewrite.Doctor()
    with pytest.warns(UserWarning, match=r"amp_rewrite doctor: FP8 matmul .*hidden.*/MatMul, operand input") as said:
        model.fit(x, y, batch_size=32, epochs=1, verbose=0, callbacks=[doctor])
        assert doctor.float8_findings == []
        model.fit(x * 1000.0, y, batch_size=32, epochs=1, verbose=0, callbacks=[doctor])
    lines = [str(w.message) for w in said if "FP8 matmul" in str(w.message)]
    assert len(lines) == len(doctor.float8_findings) and "hidden" in doctor.float8_findings[0].matmul, lines
