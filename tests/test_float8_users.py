"""FP8 training where users really train: code as they write it, checked for what they expect.

* a GAN: two float8 wrappers in one step, each recording only its own model's matmuls, and
  each ``tf.train.Checkpoint(optimizer=…)`` holding only its own state;
* a notebook: another model built first (Keras' layer names move on), then a resume from a
  checkpoint restores every state variable; a checkpoint of another model says, in one line,
  how little of it matched;
* ``keras.models.load_model`` and ``fit`` without enabling: one warning naming the call;
* MirroredStrategy (two logical CPUs, a subprocess): ``fit`` and a ``strategy.run`` loop train
  with one state per weight, mirrored, whose amax is the largest of any replica; held-out
  accuracy within 2 points of the single-device run;
* a model without matmuls, and matmuls in a loop body: a warning names what is not FP8.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

import amp_rewrite
from conftest import NEEDS_FLOAT8, within_points
from amp_rewrite.testing import digits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HISTORY = 4
pytestmark = [
    pytest.mark.usefixtures("no_live_rewrite"),
    NEEDS_FLOAT8,
    pytest.mark.filterwarnings("ignore:amp_rewrite.*run emulated without XLA"),
]


def _float8(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    return amp_rewrite.enable_mixed_precision_graph_rewrite(optimizer, target="float8", amax_history_length=HISTORY)


def _histories(opt) -> dict[str, np.ndarray]:
    return {name: variable.numpy() for name, variable in opt.float8_state.items() if name.endswith("amax_history")}


def _fit(model: keras.Model, opt, data: digits.Digits, samples: int) -> None:
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data.x_train[:samples], data.y_train[:samples], batch_size=32, epochs=1, verbose=0)


def test_a_gans_two_optimizers_each_record_their_own_matmuls_and_checkpoint_their_own_state(tmp_path):
    """A DCGAN-style step: the discriminator's update on real and generated samples, then the
    generator's through the discriminator. Each wrapper's state holds the three operands of
    each of its own model's two Dense layers — the discriminator's matmuls on the generator's
    samples record into the discriminator's state, whichever update they are in — and the
    discriminator's input amax is the real samples' (3 × N(0, 1)), not the generator's."""
    keras.utils.set_random_seed(0)
    generator = keras.Sequential([keras.Input((4,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(6)])
    discriminator = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="relu"),
                                      keras.layers.Dense(1)])
    g_opt, d_opt = _float8(keras.optimizers.Adam(1e-3)), _float8(keras.optimizers.Adam(1e-3))
    bce = keras.losses.BinaryCrossentropy(from_logits=True)

    @tf.function
    def step(real, noise):
        with tf.GradientTape() as tape:
            fake = generator(noise, training=True)
            d_loss = (bce(tf.ones((16, 1)), discriminator(real, training=True))
                      + bce(tf.zeros((16, 1)), discriminator(fake, training=True)))
        d_opt.apply(tape.gradient(d_loss, discriminator.trainable_variables), discriminator.trainable_variables)
        with tf.GradientTape() as tape:
            g_loss = bce(tf.ones((16, 1)), discriminator(generator(noise, training=True), training=True))
        g_opt.apply(tape.gradient(g_loss, generator.trainable_variables), generator.trainable_variables)
        return d_loss, g_loss

    real = 3.0 * np.random.RandomState(0).normal(size=(16, 6)).astype(np.float32)
    for _ in range(2):
        losses = step(real, tf.random.normal((16, 4), seed=1))
    assert all(np.isfinite(loss.numpy()) for loss in losses)
    layers = {f"v{index}_kernel/{operand}/amax_history" for index in (0, 2) for operand in ("input", "weight",
                                                                                             "output_grad")}
    assert set(_histories(g_opt)) == layers and set(_histories(d_opt)) == layers
    assert _histories(d_opt)["v0_kernel/input/amax_history"][0] == pytest.approx(np.abs(real).max(), rel=1e-2)
    assert _histories(g_opt)["v0_kernel/weight/amax_history"][0] == pytest.approx(
        np.abs(generator.trainable_variables[0].numpy()).max(), rel=1e-2)
    for opt in (g_opt, d_opt):
        path = tf.train.Checkpoint(optimizer=opt).save(tmp_path / f"{id(opt)}")
        saved = {name.split("by_name/")[1].partition("/.ATTRIBUTES")[0]: tf.train.load_variable(path, name)
                 for name, _ in tf.train.list_variables(path) if "by_name/" in name and "amax_history" in name}
        assert {name.replace(".S", "/") for name in saved} == layers or len(saved) == len(layers)
        assert sorted(value.tolist() for value in saved.values()) == sorted(
            value.tolist() for value in _histories(opt).values())


def test_a_notebook_that_built_another_model_first_resumes_every_state_variable(tmp_path):
    """Train, checkpoint, build another model (Keras' layer names move on: ``dense_5`` …), then
    the same architecture with a fresh wrapper restores the checkpoint and trains a step: all 18
    state variables came back (each history is the saved one, shifted by that step). A
    checkpoint of a different model restores into 3 of its 9 operands, or into none: one line
    says so."""
    data = digits.digits()
    keras.utils.set_random_seed(0)
    opt = _float8(keras.optimizers.Adam(1e-3))
    model = digits.build("mlp")
    _fit(model, opt, data, 128)
    saved = _histories(opt)
    path = tf.train.Checkpoint(model=model, optimizer=opt).save(tmp_path / "ckpt")
    amp_rewrite.disable_mixed_precision_graph_rewrite(opt)
    digits.build("cnn")(np.zeros((1, 64), np.float32))  # the notebook's other model

    resumed = _float8(keras.optimizers.Adam(1e-3))
    model = digits.build("mlp")
    tf.train.Checkpoint(model=model, optimizer=resumed).restore(path).expect_partial()
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a partial restore would warn
        warnings.filterwarnings("ignore", "amp_rewrite.*run emulated without XLA")
        _fit(model, resumed, data, 32)
    now = _histories(resumed)
    assert len(saved) == 9 and now.keys() == saved.keys()
    assert all(np.array_equal(now[name][1:], saved[name][:-1]) for name in saved)
    amp_rewrite.disable_mixed_precision_graph_rewrite(resumed)

    other = _float8(keras.optimizers.Adam(1e-3))
    tf.train.Checkpoint(optimizer=other).restore(path).expect_partial()
    with pytest.warns(UserWarning, match=r"the FP8 state read back holds 9 operand\(s\) and this training step"
                                         r" quantizes 3; 3 match \(e\.g\. 'v2_kernel/input' is in only one of them\)"):
        _fit(keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)]), other, data, 32)
    amp_rewrite.disable_mixed_precision_graph_rewrite(other)

    unrelated = _float8(keras.optimizers.Adam(1e-3))  # its one kernel is variable 1, after a LayerNorm's gamma
    tf.train.Checkpoint(optimizer=unrelated).restore(path).expect_partial()
    with pytest.warns(UserWarning, match=r"the FP8 state read back holds 9 operand\(s\) and this training step"
                                         r" quantizes 3; 0 match \(e\.g\. 'v0_kernel/input' is in only one of them\)"):
        _fit(keras.Sequential([keras.Input((64,)), keras.layers.LayerNormalization(center=False),
                               keras.layers.Dense(10)]), unrelated, data, 32)


def test_a_loaded_keras_file_that_trains_without_enabling_says_which_call_turns_it_on(tmp_path):
    """``load_model`` gives back the float8 wrapper with its state; ``fit`` without
    ``enable_mixed_precision_graph_rewrite`` trains in float32 — the state does not move — and
    one warning says so, naming the call that turns FP8 on again."""
    data = digits.digits()
    trained = digits.train("mlp", "float8", epochs=1, jit_compile=False, amax_history_length=HISTORY,
                           data=digits.Digits(data.x_train[:64], data.y_train[:64], data.x_test, data.y_test))
    trained.model.save(tmp_path / "model.keras")
    keras.backend.clear_session()
    model = keras.models.load_model(tmp_path / "model.keras")
    before = _histories(model.optimizer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(data.x_train[:64], data.y_train[:64], batch_size=32, epochs=2, verbose=0)
    messages = [str(w.message) for w in caught if "amp_rewrite" in str(w.message)]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "not enabled for it in this process, so its steps train in float32" in messages[0]
    assert "enable_mixed_precision_graph_rewrite(opt, target='float8', base_precision='bfloat16')" in messages[0]
    assert all(np.array_equal(value, before[name]) for name, value in _histories(model.optimizer).items())


def test_a_model_without_matmuls_says_nothing_trains_on_float8():
    """A float8 wrapper applying gradients in a step with no matmul (an elementwise model):
    one warning at the trace, naming the step."""
    scale = tf.Variable([1.0, 2.0])
    opt = _float8(keras.optimizers.SGD(0.1))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum((x * scale) ** 2)
        opt.apply(tape.gradient(loss, [scale]), [scale])

    with pytest.warns(UserWarning, match=r"step applies a float8 optimizer, but it has no matmul .* so nothing of it"
                                         " trains on float8"):
        step(tf.ones((3, 2)))


def test_a_matmul_without_a_gradient_matmul_is_named_and_one_nobody_reads_is_not():
    """A forward matmul under ``stop_gradient`` has no backward matmul to pair: the warning names
    it. One whose result nothing reads (as Keras' RNNs run their first time step, for its shapes
    alone) has nothing to miss: it is not named."""
    kernel, frozen = tf.Variable(tf.eye(4)), tf.Variable(tf.ones((4, 4)))
    opt = _float8(keras.optimizers.SGD(0.1))

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            features = tf.stop_gradient(tf.matmul(x, frozen, name="frozen"))
            tf.matmul(x, kernel, name="unread")
            loss = tf.reduce_sum(tf.matmul(features, kernel, name="trained"))
        opt.apply(tape.gradient(loss, [kernel]), [kernel])

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step(tf.ones((4, 4)))
    (message,) = {str(w.message) for w in caught if "paired" in str(w.message)}
    assert "1 matmul(s) have no paired gradient matmul: their gradients, if the step takes any, stay in the base" \
        " precision (frozen)" in message


_MIRRORED = textwrap.dedent(
    """
    import json
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras
    import amp_rewrite
    from amp_rewrite.testing import digits

    data, report = digits.digits(), {}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def fit(strategy, epochs=3):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(1e-3), target="float8",
                                                                   amax_history_length=4)
            model = digits.build("mlp")
            model.compile(optimizer=opt, loss=loss, metrics=["accuracy"])
        model.fit(data.x_train, data.y_train, batch_size=32, epochs=epochs, verbose=0, shuffle=False)
        accuracy = float(model.evaluate(data.x_test, data.y_test, verbose=0)[1])
        amp_rewrite.disable_mixed_precision_graph_rewrite(opt)
        return opt, accuracy

    def state(opt):
        return {name: {"type": type(v).__name__,
                       "values": [np.asarray(c.numpy()).tolist() for c in getattr(v, "values", [v])]}
                for name, v in opt.float8_state.items()}

    mirrored = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    opt, report["mirrored_accuracy"] = fit(mirrored)
    report["mirrored_state"] = state(opt)
    _, report["single_accuracy"] = fit(tf.distribute.get_strategy())

    # strategy.run: at step s, replica s % 2 sees 3 x the pixels, so the input amax is 3 (pixels reach 1)
    with mirrored.scope():
        keras.utils.set_random_seed(0)
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.01), target="float8",
                                                               amax_history_length=4)
        model = digits.build("mlp")
        opt.build(model.trainable_variables)

    def batch(context, step):
        large = context.replica_id_in_sync_group == step % 2
        return data.x_train[:16] * (3.0 if large else 1.0), data.y_train[:16]

    @tf.function
    def step(x, y):
        def replica(x, y):
            with tf.GradientTape() as tape:
                value = tf.reduce_mean(loss(y, model(x, training=True)))
            opt.apply(tape.gradient(value, model.trainable_variables), model.trainable_variables)
        mirrored.run(replica, args=(x, y))

    for index in range(2):
        step(*(mirrored.experimental_distribute_values_from_function(lambda c, i=i: batch(c, index)[i])
               for i in (0, 1)))
    report["run_state"] = state(opt)
    amp_rewrite.disable_mixed_precision_graph_rewrite(opt)

    # A strategy.run training loop as Keras 3 users write it (no loss scale: float8 on bfloat16's
    # fixed scale of 1), three epochs of digits, on two replicas and on one device.
    one_device = tf.distribute.get_strategy()
    report["run_accuracy"] = {"mirrored_float8": digits.strategy_run_accuracy(mirrored, "float8", data=data),
                              "single_float8": digits.strategy_run_accuracy(one_device, "float8", data=data),
                              "single_bfloat16": digits.strategy_run_accuracy(one_device, "bfloat16", data=data)}
    print("RESULT " + json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def mirrored() -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _MIRRORED], capture_output=True, text=True, timeout=600, env=env,
                          cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"the MirroredStrategy script failed:\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_mirrored_fit_keeps_one_mirrored_state_per_weight_and_matches_the_single_device_run(mirrored):
    """``model.fit`` under MirroredStrategy: one state per weight operand, not per replica (18
    variables for the MLP's 3 layers), each a MirroredVariable whose two components stay equal;
    held-out accuracy within 2 points of the same training on one device."""
    state = mirrored["mirrored_state"]
    assert len(state) == 18 and all(entry["type"] == "MirroredVariable" for entry in state.values())
    assert all(entry["values"][0] == entry["values"][1] for entry in state.values())
    assert all(np.all(np.array(entry["values"][0]) > 0) for name, entry in state.items() if "history" in name)
    assert mirrored["single_accuracy"] > 0.9
    assert within_points(mirrored["mirrored_accuracy"], mirrored["single_accuracy"], 2)


def test_strategy_run_records_the_largest_amax_of_any_replica(mirrored):
    """A ``strategy.run`` loop whose replica 0, then replica 1, sees 3 x the other's pixels: the
    first layer's input history holds 3 for both steps (the largest of any replica, whichever it
    is) on both replicas, so both scale alike."""
    history = mirrored["run_state"]["v0_kernel/input/amax_history"]["values"]
    assert history[0] == history[1] == [3.0, 3.0, 0.0, 0.0]
    scale = mirrored["run_state"]["v0_kernel/input/scale"]["values"]
    assert scale[0] == scale[1] == 2.0 ** np.floor(np.log2(448.0 / 3.0))


def test_a_strategy_run_training_loop_matches_the_single_device_run(mirrored):
    """A Keras 3 ``strategy.run`` loop (``tape.gradient``, ``opt.apply``), three epochs of
    digits on two replicas in FP8: held-out accuracy within 2 points of the same loop on one
    device, in FP8 and in bfloat16."""
    accuracy = mirrored["run_accuracy"]
    assert accuracy["single_bfloat16"] > 0.9
    assert within_points(accuracy["mirrored_float8"], accuracy["single_float8"], 2)
    assert within_points(accuracy["mirrored_float8"], accuracy["single_bfloat16"], 2)


def test_tf_keras_fit_trains_in_float8_and_checkpoints_its_state(tmp_path):
    """A tf_keras model compiled with the float8 wrapper of a tf_keras optimizer: ``fit``
    records into all 18 state variables (3 Dense layers), held-out accuracy within 2 points of
    the same training in bfloat16; ``tf.train.Checkpoint(optimizer=opt)`` holds the state, and a
    fresh wrapper that restores it trains on from it."""
    data, one_device = digits.digits(), tf.distribute.get_strategy()
    opt, float8 = digits.tf_keras_fit_accuracy(one_device, "float8", amax_history_length=HISTORY, data=data)
    _, bfloat16 = digits.tf_keras_fit_accuracy(one_device, "bfloat16", data=data)
    histories = _histories(opt)
    assert len(dict(opt.float8_state.items())) == 18 and all(np.all(h > 0) for h in histories.values())
    assert bfloat16 > 0.9 and abs(float8 - bfloat16) <= 0.02
    path = tf.train.Checkpoint(optimizer=opt).save(tmp_path / "ckpt")
    assert sum("float8_state" in name for name, _ in tf.train.list_variables(path)) >= 18

    import tf_keras  # resumed by a fresh wrapper: one more step shifts every saved history by one

    resumed = amp_rewrite.enable_mixed_precision_graph_rewrite(tf_keras.optimizers.Adam(1e-3), target="float8",
                                                               amax_history_length=HISTORY)
    tf.train.Checkpoint(optimizer=resumed).restore(path).expect_partial()
    layers = tf_keras.layers
    model = tf_keras.Sequential([layers.Dense(128, activation="relu", input_shape=(64,)),
                                 layers.Dense(64, activation="relu"), layers.Dense(10)])
    model.compile(optimizer=resumed, loss=tf_keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    model.fit(data.x_train[:32], data.y_train[:32], batch_size=32, epochs=1, verbose=0)
    now = _histories(resumed)
    assert now.keys() == histories.keys() and all(np.array_equal(now[k][1:], histories[k][:-1]) for k in histories)
