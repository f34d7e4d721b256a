"""MultiWorkerMirroredStrategy with two local worker processes, bfloat16 and FP8 training.

Each worker (``_WORKER``) trains the same model twice — tf_keras ``model.fit`` and a Keras 3
custom loop with ``strategy.run`` — and on worker 1 alone the loss of step 1 is NaN. A
non-finite step must be skipped by both workers (the scale halves everywhere, the step
counter does not advance) and the weights must stay equal across workers. Keras 3
``model.fit`` under this strategy fails inside Keras itself (README), so it is not run.
An FP8 ``strategy.run`` loop on digits reaches the single-device run's held-out accuracy.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from conftest import NEEDS_FLOAT8

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEPS = 4  # step 1 is the bad one on worker 1

_WORKER = textwrap.dedent(
    """
    import json, os, sys
    task, ports = int(sys.argv[1]), sys.argv[2].split(",")
    os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": [f"localhost:{p}" for p in ports]},
                                          "task": {"type": "worker", "index": task}})
    import numpy as np
    import tensorflow as tf
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras, tf_keras
    import amp_rewrite

    STEPS = int(sys.argv[3])
    rng = np.random.RandomState(0)
    x = (0.1 * rng.normal(size=(8 * STEPS, 4))).astype("float32")
    y = (0.1 * rng.normal(size=(8 * STEPS, 3))).astype("float32")
    poison = tf.Variable(1.0)  # outside the scope: each worker's own
    BAD = float("nan") if task == 1 else 1.0
    options = tf.data.Options()
    options.experimental_distribute.auto_shard_policy = tf.data.experimental.AutoShardPolicy.OFF
    report = {}

    # tf_keras model.fit
    with strategy.scope():
        tf_keras.utils.set_random_seed(0)
        model = tf_keras.Sequential([tf_keras.layers.Dense(3, input_shape=(4,))])
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf_keras.optimizers.SGD(0.1), "dynamic",
                                                         target="bfloat16")
        model.compile(optimizer=opt, loss=lambda t, p: tf.reduce_mean((t - p) ** 2) * poison)

    class Poison(tf_keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            poison.assign(BAD if batch == 1 else 1.0)

    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(8).with_options(options)
    model.fit(data, epochs=1, verbose=0, callbacks=[Poison()])
    report["tf_keras"] = {"weights": [w.numpy().tolist() for w in model.weights],
                          "iterations": int(opt.iterations.numpy()), "scale": float(opt.loss_scale.numpy()),
                          "good_in_a_row": int(opt.dynamic_counter.numpy())}
    amp_rewrite.disable_mixed_precision_graph_rewrite()

    # Keras 3 custom loop
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), "dynamic", target="bfloat16")
        opt.build(model.trainable_variables)
    batches = iter(strategy.experimental_distribute_dataset(data))

    @tf.function
    def step(batch):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                scaled = opt.scale_loss(tf.reduce_mean((model(xb) - yb) ** 2) * poison)
            opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)
        strategy.run(replica_step, args=batch)

    for i in range(STEPS):
        poison.assign(BAD if i == 1 else 1.0)
        step(next(batches))
    report["keras"] = {"weights": [np.asarray(w.numpy()).tolist() for w in model.weights],
                       "iterations": int(opt.iterations.numpy()), "scale": float(opt.loss_scale.numpy()),
                       "good_in_a_row": int(opt.step_counter.numpy())}
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    from amp_rewrite.core.float8 import inference as core_float8
    from amp_rewrite._tf import tensorflow_version
    if tensorflow_version() < core_float8.MIN_TENSORFLOW:
        print("RESULT " + json.dumps(report))  # FP8 training needs TensorFlow 2.18+
        raise SystemExit(0)

    # Keras 3 custom loop, FP8 training: worker 1's inputs are 2 x worker 0's
    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target="float8",
                                                               amax_history_length=4)
        opt.build(model.trainable_variables)
    x8 = x * (2.0 if task == 1 else 1.0)
    batches = iter(strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x8, y)).batch(8).with_options(options)))

    @tf.function
    def float8_step(batch):
        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((model(xb) - yb) ** 2)
            opt.apply(tape.gradient(loss, model.trainable_variables), model.trainable_variables)
            return tf.reduce_max(tf.abs(xb))  # this worker's input amax
        return strategy.experimental_local_results(strategy.run(replica_step, args=batch))[0]

    amaxes = [float(float8_step(next(batches))) for _ in range(STEPS)]
    report["float8"] = {"state": {name: np.asarray(v.numpy()).tolist() for name, v in opt.float8_state.items()},
                        "weights": [np.asarray(w.numpy()).tolist() for w in model.weights], "amax": amaxes}
    amp_rewrite.disable_mixed_precision_graph_rewrite()

    # Digits in FP8 by a strategy.run loop and by tf_keras model.fit, each worker training on its
    # half of every batch; worker 0 then trains the same on one device.
    from amp_rewrite.testing import digits
    report["digits"] = {"workers": digits.strategy_run_accuracy(strategy, "float8"),
                        "fit_workers": digits.tf_keras_fit_accuracy(strategy, "float8")[1]}
    if task == 0:
        one_device = tf.distribute.get_strategy()
        report["digits"]["one_device"] = digits.strategy_run_accuracy(one_device, "float8")
        report["digits"]["fit_one_device"] = digits.tf_keras_fit_accuracy(one_device, "float8")[1]
    print("RESULT " + json.dumps(report))
    """
)


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


@pytest.fixture(scope="module")
def workers() -> list[dict]:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    ports = ",".join(map(str, _free_ports(2)))
    processes = [subprocess.Popen([sys.executable, "-c", _WORKER, str(task), ports, str(STEPS)], env=env, cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for task in range(2)]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=300))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    reports = []
    for process, (stdout, stderr) in zip(processes, outputs):
        lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
        assert process.returncode == 0 and lines, f"a worker failed:\n{stderr[-4000:]}"
        reports.append(json.loads(lines[-1][len("RESULT "):]))
    return reports


# tf_keras counts a skipped step in ``iterations`` (as it documents); Keras 3 does not.
PATH_TO_ITERATIONS = {"tf_keras": STEPS, "keras": STEPS - 1}


@pytest.mark.parametrize("path", ["tf_keras", "keras"], ids=["tf_keras-fit", "keras3-custom-loop"])
def test_both_workers_skip_one_workers_nan_and_end_equal(workers, path):
    """A NaN on worker 1 at step 1: both workers skip it — the scale halves (2**15 → 2**14) and
    the count of finite steps in a row restarts, so it is STEPS - 2 — and their weights are
    equal and finite."""
    first, second = (report[path] for report in workers)
    for report in (first, second):
        assert (report["iterations"], report["scale"], report["good_in_a_row"]) == (
            PATH_TO_ITERATIONS[path], 2.0**14, STEPS - 2)
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(np.array(a), np.array(b))
        assert np.all(np.isfinite(np.array(a)))


@NEEDS_FLOAT8
def test_float8_workers_record_the_largest_amax_of_any_worker_and_scale_alike(workers):
    """FP8 training in a Keras 3 ``strategy.run`` loop, worker 1's inputs twice worker 0's: each
    step's input amax is reduced to the largest across workers (one collective), so both
    workers hold the same state — the larger worker's amaxes, newest first — and end with
    equal weights."""
    first, second = (report["float8"] for report in workers)
    assert first["state"] == second["state"] and len(first["state"]) == 6
    largest = [max(a, b) for a, b in zip(first["amax"], second["amax"])]
    np.testing.assert_allclose(first["state"]["v0_kernel/input/amax_history"], largest[::-1], rtol=1e-6)
    assert largest == second["amax"]  # worker 1's, not the worker's own
    for a, b in zip(first["weights"], second["weights"]):
        np.testing.assert_array_equal(np.array(a), np.array(b))


@NEEDS_FLOAT8
@pytest.mark.parametrize("how", ["", "fit_"], ids=["keras3-strategy.run", "tf_keras-fit"])
def test_float8_digits_on_two_workers_match_the_single_device_run(workers, how):
    """Three epochs of digits in FP8 on two workers, by a Keras 3 ``strategy.run`` loop and by
    tf_keras ``model.fit``: both workers end with the same held-out accuracy, within 2 points
    of the same training on one device."""
    first, second = (report["digits"] for report in workers)
    assert first[f"{how}workers"] == second[f"{how}workers"]
    assert first[f"{how}one_device"] > 0.9 and abs(first[f"{how}workers"] - first[f"{how}one_device"]) <= 0.02
