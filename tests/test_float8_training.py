"""FP8 training (``enable_mixed_precision_graph_rewrite(opt, target="float8")``): the matmuls
of a training step on float8 operands, forward E4M3 and backward E5M2 gradients, with
delayed scaling kept as state the optimizer wrapper carries.

Checked four ways: the state after known steps (one hand-made matmul whose amaxes are
exact), where the state goes (``tf.train.Checkpoint``, ``.keras`` files, a TF1 Session's
mirror), the HLO XLA gets for a whole training step (every dot and convolution, forward and
backward, reads dequantized float8 of the right type: MLP, CNN, Transformer block), and
accuracy on scikit-learn's digits against the bfloat16 rewrite of the same model and data.
"""
from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import keras
import numpy as np
import pytest
import tensorflow as tf

import amp_rewrite
from amp_rewrite import AmpRewriteError
from conftest import NEEDS_FLOAT8, within_points
from amp_rewrite.testing import digits
from amp_rewrite.training import live

pytestmark = [
    pytest.mark.usefixtures("no_live_rewrite"),
    NEEDS_FLOAT8,
    pytest.mark.filterwarnings("ignore:amp_rewrite.*run emulated without XLA"),  # its own test below
]

HISTORY = 4
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _scale(amax: float, fmt_max: float) -> float:
    """The delayed scale of an amax: the largest power of two with amax * scale <= fmt_max."""
    return float(2.0 ** np.floor(np.log2(fmt_max / amax)))


# --- delayed scaling on one matmul, by hand -----------------------------------------------------

WEIGHT = np.array([[2.0, -1.0, 0.5], [1.0, 0.25, -2.0]], np.float32)  # amax 2
GRADIENT = np.array([[1000.0, -3.0, 1.0]] * 4, np.float32)  # d loss / d product: amax 1000, exact in bfloat16


def _matmul_step(opt, jit_compile: bool = True, loss_scale: bool = False):
    """A step of ``product = x @ kernel`` (op "product"), loss ``sum(product * GRADIENT)``, applied
    by ``opt`` (with ``loss_scale``, through its scaled loss); it returns the product. Learning
    rate 0: the kernel's amax stays 2."""
    kernel = tf.Variable(WEIGHT, name="kernel")

    @tf.function(jit_compile=jit_compile)
    def step(x):
        with tf.GradientTape() as tape:
            product = tf.matmul(x, kernel, name="product")
            loss = tf.reduce_sum(tf.cast(product, tf.float32) * GRADIENT)
            if loss_scale:
                loss = opt.get_scaled_loss(loss)
        gradient = tape.gradient(loss, kernel)
        if loss_scale:
            gradient = opt.get_unscaled_gradients([gradient])[0]
        opt.apply_gradients([(gradient, kernel)])
        return product

    return step


def _values(state, key: str) -> tuple[list[float], float]:
    history, scale = state.lookup(key)
    return history.numpy().tolist(), float(scale.numpy())


def _x(amax: float) -> np.ndarray:
    return np.array([[amax, 1.0], [-0.5, 0.25], [1.0, 1.0], [0.0, 0.5]], np.float32)


def test_delayed_scaling_records_amax_rolls_history_and_sets_power_of_two_scales():
    """Keras' recipe with power-of-two scales: each step records its amax at the head of the
    history (newest first), the next scale is 2**floor(log2(max / max(history))); E4M3 (448)
    for the input and the kernel, E5M2 (57344) for the incoming gradient. The window is
    ``amax_history_length`` steps: after 4 more steps of amax 1 the 6 is gone."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=HISTORY)
    state = opt.float8_state
    step = _matmul_step(opt)
    step(_x(3.0))
    assert sorted(name for name, _ in state.items()) == sorted(
        f"v0_kernel/{operand}/{kind}" for operand in ("input", "weight", "output_grad")
        for kind in ("amax_history", "scale"))
    assert _values(state, "v0_kernel/input") == ([3.0, 0, 0, 0], _scale(3.0, E4M3_MAX))
    assert _values(state, "v0_kernel/weight") == ([2.0, 0, 0, 0], _scale(2.0, E4M3_MAX))
    assert _values(state, "v0_kernel/output_grad") == ([1000.0, 0, 0, 0], _scale(1000.0, E5M2_MAX))
    step(_x(6.0))
    assert _values(state, "v0_kernel/input") == ([6.0, 3.0, 0, 0], _scale(6.0, E4M3_MAX))
    for _ in range(3):
        step(_x(1.0))
    assert _values(state, "v0_kernel/input") == ([1.0, 1.0, 1.0, 6.0], _scale(6.0, E4M3_MAX))
    step(_x(1.0))
    assert _values(state, "v0_kernel/input") == ([1.0] * 4, _scale(1.0, E4M3_MAX))


def test_a_step_quantizes_with_the_scale_its_state_holds():
    """The step uses the state's scale, not its own amax: a scale of 2**10 on x's 3.0 clips
    it at E4M3's 448 (448/1024 = 0.4375 after unscaling). A fresh state's first step, with
    no history yet, scales by its own amax: 2**-12 gets through exactly (with the initial
    scale of 1 it would be below E4M3's smallest subnormal, 2**-9, and read 0)."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=HISTORY)
    step = _matmul_step(opt)
    tiny = np.array([[2.0**-12, 0.0]], np.float32)
    np.testing.assert_array_equal(step(tiny).numpy().astype(np.float32), tiny @ WEIGHT)
    x = np.array([[3.0, 0.0]], np.float32)
    history, scale = opt.float8_state.lookup("v0_kernel/input")
    scale.assign(2.0**10)
    history.assign([1.0, 0, 0, 0])  # keep the history from taking over the next scale's meaning
    np.testing.assert_array_equal(step(x).numpy().astype(np.float32), np.array([[448.0 / 1024, 0.0]]) @ WEIGHT)


def test_a_non_finite_step_records_no_amax():
    """An Inf in the input (a bad batch) leaves the input's history and scale as they were."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=HISTORY)
    step = _matmul_step(opt)
    step(_x(3.0))
    before = _values(opt.float8_state, "v0_kernel/input")
    step(_x(np.inf))
    assert _values(opt.float8_state, "v0_kernel/input") == before


def test_float16_base_with_the_loss_scale_skips_overflowing_steps():
    """``base_precision="float16"`` with the dynamic loss scale (2**15): the kernel's gradient,
    3.5 x 1000 x the loss scale, overflows float16 until the scale is 16, so the first 10
    steps are skipped, halving it each time. The incoming gradient's amax is taken in
    float32, before its cast to float16, so every step records a finite amax (1000 x the
    scale) and quantizes within E5M2's range; the overflow is in the float16 dequantized
    values, where the loss-scale optimizer sees it."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           base_precision="float16", amax_history_length=HISTORY)
    step = _matmul_step(opt, loss_scale=True)
    for _ in range(12):
        step(_x(3.0))
    assert float(opt.loss_scale) == 16.0
    assert _values(opt.float8_state, "v0_kernel/output_grad") == ([16000.0, 32000.0, 64000.0, 128000.0],
                                                                 _scale(128000.0, E5M2_MAX))
    assert _values(opt.float8_state, "v0_kernel/input")[0] == [3.0] * HISTORY


def test_mixed_precision_block_trains_in_float8_with_the_state_it_yields():
    """``mixed_precision(target="float8")`` without an optimizer wrapper: the yielded settings
    hold the state (checkpoint it yourself)."""
    with amp_rewrite.mixed_precision(target="float8", amax_history_length=HISTORY) as settings:
        _matmul_step(keras.optimizers.SGD(0.0))(_x(3.0))
    assert _values(settings.float8.state, "m0/input") == ([3.0, 0, 0, 0], _scale(3.0, E4M3_MAX))


def test_without_xla_it_warns_once_that_the_matmuls_run_emulated():
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=HISTORY)
    step = _matmul_step(opt, jit_compile=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(_x(3.0))
        step(_x(3.0)[:1])  # a second trace
    messages = [str(w.message) for w in caught if "emulated" in str(w.message)]
    assert len(messages) == 1 and "jit_compile=True" in messages[0] and "\n" not in messages[0]
    assert _values(opt.float8_state, "v0_kernel/input")[0][0] == 3.0  # and it trains as under XLA


# --- where the state goes -------------------------------------------------------------------------


def test_checkpoint_carries_the_state_into_a_fresh_wrapper(tmp_path):
    """``tf.train.Checkpoint(optimizer=wrapper)`` saves the state; a new wrapper restored before
    its first trace gets it when the trace makes its variables, and continues from it."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=HISTORY)
    step = _matmul_step(opt)
    step(_x(3.0))
    step(_x(6.0))
    saved = {name: variable.numpy().tolist() for name, variable in opt.float8_state.items()}
    path = tf.train.Checkpoint(optimizer=opt).save(tmp_path / "ckpt")
    live.stop()
    fresh = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                             amax_history_length=HISTORY)
    tf.train.Checkpoint(optimizer=fresh).restore(path).expect_partial()
    fresh_step = _matmul_step(fresh)
    fresh_step.get_concrete_function(tf.TensorSpec([4, 2], tf.float32))  # the trace makes the variables
    assert {name: variable.numpy().tolist() for name, variable in fresh.float8_state.items()} == saved
    fresh_step(_x(1.0))
    assert _values(fresh.float8_state, "v0_kernel/input")[0] == [1.0, 6.0, 3.0, 0.0]


def test_saved_model_carries_the_state(tmp_path):
    """A SavedModel of an object that tracks the wrapper holds the state's variables by name."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=HISTORY)
    _matmul_step(opt)(_x(3.0))
    module = tf.Module()
    module.optimizer = opt
    tf.saved_model.save(module, str(tmp_path / "saved"))
    live.stop()
    loaded = tf.saved_model.load(str(tmp_path / "saved")).optimizer.float8_state.by_name
    assert {name: loaded[name].numpy().tolist() for name, _ in opt.float8_state.items()} == {
        name: variable.numpy().tolist() for name, variable in opt.float8_state.items()}
    assert loaded["v0_kernel/input/amax_history"].numpy().tolist() == [3.0, 0, 0, 0]


def test_keras_file_carries_the_state_and_the_loaded_wrapper_resumes(tmp_path):
    """``model.save(.keras)`` writes the state beside the optimizer's variables; after
    ``load_model`` the optimizer is our wrapper with the same state, and passing it back to
    ``enable_mixed_precision_graph_rewrite(target="float8")`` resumes training with it."""
    data = digits.digits()
    small = digits.Digits(data.x_train[:256], data.y_train[:256], data.x_test[:64], data.y_test[:64])
    trained = digits.train("mlp", "float8", epochs=1, jit_compile=False, amax_history_length=HISTORY, data=small)
    saved = {name: variable.numpy().tolist() for name, variable in trained.optimizer.float8_state.items()}
    assert len(saved) == 2 * 3 * 3  # 3 Dense layers, 3 operands each, history and scale
    trained.model.save(tmp_path / "model.keras")
    keras.backend.clear_session()
    model = keras.models.load_model(tmp_path / "model.keras")
    restored = model.optimizer
    assert {name: variable.numpy().tolist() for name, variable in restored.float8_state.items()} == saved
    assert amp_rewrite.enable_mixed_precision_graph_rewrite(restored, target="float8") is restored  # its length
    model.fit(data.x_train[:64], data.y_train[:64], batch_size=32, epochs=1, verbose=0)  # 2 steps, same keys
    assert sorted(name for name, _ in restored.float8_state.items()) == sorted(saved)
    for name in (name for name in saved if name.endswith("amax_history")):
        assert restored.float8_state.by_name[name].numpy()[2:].tolist() == saved[name][:2]


def test_keras_fit_under_xla_trains_in_float8():
    """``model.compile(..., jit_compile=True)`` and ``fit``: Keras' XLA-compiled train step
    (no warning about emulation) records two steps' amax per operand."""
    data = digits.digits()
    keras.utils.set_random_seed(0)
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target="float8",
                                                           amax_history_length=HISTORY)
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True), jit_compile=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data.x_train[:64], data.y_train[:64], batch_size=32, epochs=1, verbose=0)
    assert not [w for w in caught if "emulated" in str(w.message)]  # XLA compiles it: no warning
    histories = {name: variable.numpy() for name, variable in opt.float8_state.items() if name.endswith("history")}
    assert len(histories) == 3
    (inputs,) = [history for name, history in histories.items() if name.endswith("/input/amax_history")]
    assert inputs.tolist() == [1.0, 1.0, 0.0, 0.0]  # digits' pixels reach 16/16 in every batch
    assert all(np.all(history[:2] > 0) and np.all(history[2:] == 0) for history in histories.values())


# --- bad input ------------------------------------------------------------------------------------


@pytest.mark.parametrize("length, error", [(0, ValueError), (-3, ValueError), (1.5, TypeError), (True, TypeError),
                                           ("16", TypeError)])
def test_bad_amax_history_length_is_one_line(length, error):
    with pytest.raises(error, match=r"amax_history_length must be an integer >= 1") as caught:
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target="float8",
                                                         amax_history_length=length)
    assert "\n" not in str(caught.value)
    assert live.active() is None


@pytest.mark.parametrize("first, second", [("bfloat16", "float8"), ("float8", "float16")])
def test_float8_and_another_target_do_not_take_turns(first, second):
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target=first)
    with pytest.raises(ValueError, match=rf"enabled for target '{first}'.*disable_mixed_precision_graph_rewrite"
                                         rf"\(\) before enabling '{second}'") as caught:
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target=second)
    assert "\n" not in str(caught.value)
    assert live.active().name == first


def test_resuming_with_another_history_length_says_which_to_pass():
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target="float8",
                                                           amax_history_length=HISTORY)
    live.stop()
    with pytest.raises(ValueError, match=rf"keeps amax histories of {HISTORY} steps; pass amax_history_length="
                                         rf"{HISTORY}$"):
        amp_rewrite.enable_mixed_precision_graph_rewrite(opt, target="float8", amax_history_length=1024)


def test_history_length_without_float8_is_refused():
    with pytest.raises(ValueError, match="apply to target='float8'"):
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target="bfloat16",
                                                         amax_history_length=16)


def test_refused_before_tensorflow_2_18(monkeypatch):
    monkeypatch.setattr(tf.version, "VERSION", "2.17.1")  # what _tf.tensorflow_version reads
    with pytest.raises(AmpRewriteError, match=r"needs TensorFlow 2\.18 or newer: TensorFlow 2\.17\.1") as caught:
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target="float8")
    assert "\n" not in str(caught.value)
    assert live.active() is None


# --- a TF1 Session graph ------------------------------------------------------------------------


def _tf1_graph(optimizer: Callable[[], Any]) -> tuple[tf.Graph, dict]:
    """A TF1 digits graph, one MatMul (64 -> 10), whose train op ``optimizer().minimize`` builds."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 64], name="x")
        y = tf.compat.v1.placeholder(tf.int32, [None], name="y")
        kernel = tf.compat.v1.get_variable("kernel", [64, 10], initializer=tf.compat.v1.glorot_uniform_initializer(0))
        logits = tf.matmul(x, kernel, name="logits")
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits))
        train = optimizer().minimize(loss)
        init = tf.compat.v1.global_variables_initializer()
    return graph, dict(x=x, y=y, loss=loss, train=train, init=init)


def test_session_graph_trains_with_its_state_in_the_mirror():
    """A TF1 graph (``tf.compat.v1.train`` optimizer, ``minimize``) run by a Session made while
    enabled: the mirror quantizes its MatMul and the two gradient MatMuls, holds the state as
    its own variables (initialized once), records each step's amax, and the loss falls."""
    data = digits.digits()
    graph, m = _tf1_graph(lambda: amp_rewrite.enable_mixed_precision_graph_rewrite(
        tf.compat.v1.train.GradientDescentOptimizer(0.5), target="float8", amax_history_length=HISTORY))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # emulated, without XLA: the test above
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(m["init"])
            feed = {m["x"]: data.x_train[:256], m["y"]: data.y_train[:256]}
            losses = [session.run([m["train"], m["loss"]], feed)[1] for _ in range(5)]
            mirror = session._amp_rewrite_mirror
            history = mirror.session.run("amp_rewrite_float8/kernel/input/amax_history/Read/ReadVariableOp:0")
    assert mirror.result.report.float8_matmuls == 3
    assert history.tolist() == [1.0] * 4  # digits' pixels reach 16/16 in every batch
    assert all(later < earlier for earlier, later in zip(losses, losses[1:])) and losses[-1] < losses[0] * 0.85


def test_a_session_graph_trained_by_an_unwrapped_optimizer_says_its_state_is_not_checkpointed():
    """A TF1 graph whose train op a plain ``GradientDescentOptimizer`` built, run by a Session
    made inside ``mixed_precision(target="float8")``: it trains FP8 (3 matmuls) on state the
    mirror alone holds, and one line says so — how many operands, one example, which call
    puts the state in the user's graph."""
    data = digits.digits()
    graph, m = _tf1_graph(lambda: tf.compat.v1.train.GradientDescentOptimizer(0.5))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amp_rewrite.mixed_precision(target="float8", amax_history_length=HISTORY):
            session = tf.compat.v1.Session(graph=graph)
        session.run(m["init"])
        session.run(m["train"], {m["x"]: data.x_train[:64], m["y"]: data.y_train[:64]})
    (message,) = [str(w.message) for w in caught if "no FP8 state variables" in str(w.message)]
    assert "\n" not in message and "for 3 operand(s) (e.g. 'kernel/input')" in message
    assert "enable_mixed_precision_graph_rewrite returned" in message
    assert session._amp_rewrite_mirror.result.report.float8_matmuls == 3
    session.close()

# --- proof: the HLO XLA gets, and accuracy on digits --------------------------------------------


@pytest.mark.parametrize("name", digits.MODELS + digits.LOOP_MODELS)
def test_every_matmul_of_a_training_step_reaches_xla_on_float8(name):
    """In the HLO of one jit-compiled training step, every dot and convolution of the forward
    pass reads both operands as ``multiply(convert(f8e4m3fn), broadcast(scale))`` and every
    one of the gradient reads f8e5m2 (the incoming gradient) and f8e4m3fn: the operands XLA's
    GEMM rewriter turns into cuBLASLt FP8 GEMMs on a GPU of compute capability 8.9+. The LSTM's
    include its loop bodies': 2 forward dots per time step there (and 2 for the first step Keras
    runs outside the loop, and the head's), 4 in the gradient loop's body (and the head's 2); the
    GRU's likewise (its input and recurrent kernels)."""
    count = digits.count_float8_matmuls(digits.training_step_hlo(name, "float8"))
    assert count.forward >= 3 and count.backward >= count.forward
    if name in digits.LOOP_MODELS:
        assert (count.forward, count.backward) == (5, 6)
    assert (count.forward_float8, count.backward_float8) == (count.forward, count.backward)


def test_digits_accuracy_within_two_points_of_bfloat16():
    """The CNN on scikit-learn's digits, same seed, weights and batches: FP8 training's held-out
    accuracy is within 2 points of the bfloat16 rewrite's (emulated, without XLA: the same
    float8 numbers, without the compile time)."""
    data = digits.digits()
    bfloat16 = digits.train("cnn", "bfloat16", epochs=3, jit_compile=False, data=data)
    float8 = digits.train("cnn", "float8", epochs=3, jit_compile=False, data=data)
    assert bfloat16.accuracy > 0.9
    assert within_points(float8.accuracy, bfloat16.accuracy, 2)
    assert float8.losses != bfloat16.losses  # the float8 run is not the bfloat16 one


# --- loops: a while loop's matmuls, forward and backward -------------------------------------


@pytest.mark.parametrize("loop", ["scan", "while_loop"])
def test_a_loops_matmuls_keep_one_history_whose_amax_is_the_largest_of_its_iterations(loop):
    """An RNN step written with ``tf.scan`` or ``tf.while_loop``: the matmuls in the loop body
    (and in its gradient's) record into one state per matmul, whose amax is the largest of all
    iterations — here the first iteration's input, 5, though later ones are smaller — and the
    next step quantizes with the scale that history sets (no iteration rescales itself)."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.0), target="float8",
                                                           amax_history_length=HISTORY)
    w = tf.Variable(np.full((2, 3), 0.5, np.float32), name="w")
    u = tf.Variable(np.full((3, 3), 0.25, np.float32), name="u")

    @tf.function(jit_compile=False)
    def step(xs):
        with tf.GradientTape() as tape:
            cell = lambda h, x: tf.tanh(tf.matmul(x, w) + tf.matmul(h, u))
            if loop == "scan":
                last = tf.scan(cell, xs, initializer=tf.zeros((4, 3)))[-1]
            else:
                last = tf.while_loop(lambda t, h: t < 5, lambda t, h: (t + 1, cell(h, xs[t])),
                                     (tf.constant(0), tf.zeros((4, 3))), maximum_iterations=5)[1]
            loss = tf.reduce_sum(last)
        opt.apply(tape.gradient(loss, [w, u]), [w, u])

    xs = np.stack([np.full((4, 2), 5.0 - t, np.float32) for t in range(5)])  # amax 5, 4, 3, 2, 1
    step(xs)
    step(xs)
    history, scale = opt.float8_state.lookup("v0_w/input")
    assert history.numpy().tolist() == [5.0, 5.0, 0.0, 0.0]
    assert float(scale.numpy()) == _scale(5.0, E4M3_MAX)
    for key in ("v0_w/weight", "v1_u/weight", "v1_u/input", "v0_w/output_grad", "v1_u/output_grad"):
        assert np.all(opt.float8_state.lookup(key)[0].numpy()[:2] > 0), key


def test_lstm_digits_accuracy_within_two_points_of_bfloat16():
    """A Keras LSTM over the digits' 8 rows (its matmuls in a while loop, forward and backward):
    FP8 training's held-out accuracy is within 2 points of the bfloat16 rewrite's."""
    data = digits.digits()
    bfloat16 = digits.train("lstm", "bfloat16", epochs=3, jit_compile=False, data=data, learning_rate=3e-2)
    float8 = digits.train("lstm", "float8", epochs=3, jit_compile=False, data=data, learning_rate=3e-2)
    assert bfloat16.accuracy > 0.85
    assert within_points(float8.accuracy, bfloat16.accuracy, 2)
    histories = [name for name, _ in float8.optimizer.float8_state.items() if name.endswith("amax_history")]
    assert {"v0_kernel/input/amax_history", "v1_recurrent_kernel/output_grad/amax_history"} <= set(histories)
