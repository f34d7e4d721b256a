"""Training under faults with the live rewrite: NaN/Inf injected on chosen steps, and a run
killed half way and resumed from a checkpoint.

Each pattern runs a custom float16 training loop (the rewrite on, target float16, on CPU)
with the Keras 3 loss-scale wrapper, poisoning the loss on chosen steps. Whatever the
pattern: skipped steps leave weights and slots alone, weights never become non-finite,
the scale stays within [1, 2**15] and halves exactly once per bad step, and training
recovers (the loss falls once the faults stop).
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf

import amp_rewrite
from amp_rewrite.training import live

INF, NAN = float("inf"), float("nan")
PATTERNS = {
    "single": [1, 1, INF, 1, 1, 1, 1, 1],
    "consecutive": [1, INF, NAN, INF, INF, 1, 1, 1, 1, 1],
    "every-other": [1, NAN, 1, INF, 1, NAN, 1, INF, 1, 1, 1, 1],
    "twenty-in-a-row": [1] + [INF] * 20 + [1, 1, 1, 1],
}


@pytest.fixture(autouse=True)
def _rewrite_off_afterwards():
    yield
    live.stop()


def _train(poisons: list[float]) -> tuple[list[dict], keras.Model]:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(0.05), target="float16")
    opt.build(model.trainable_variables)
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (64, 8)).astype(np.float32)
    y = (x.sum(axis=1, keepdims=True) > 0).astype(np.float32)
    poison = tf.Variable(1.0)

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(model(x) - y)) * poison
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    history = []
    for value in poisons:
        before = [v.numpy().copy() for v in model.trainable_variables + opt.inner_optimizer.variables]
        poison.assign(value)
        loss = float(step())
        after = [v.numpy().copy() for v in model.trainable_variables + opt.inner_optimizer.variables]
        history.append({
            "poison": value, "loss": loss, "scale": float(opt.loss_scale), "iterations": int(opt.iterations.numpy()),
            "unchanged": all(np.array_equal(a, b) for a, b in zip(before, after)),
            "finite": all(np.all(np.isfinite(v.numpy())) for v in model.trainable_variables),
        })
    return history, model


@pytest.mark.parametrize("pattern", PATTERNS)
def test_injected_faults_are_skipped_and_training_recovers(pattern: str) -> None:
    history, _ = _train(PATTERNS[pattern])
    scale, iterations = 2.0**15, 0
    for record in history:
        assert record["finite"], record
        if np.isfinite(record["poison"]):
            iterations += 1
            assert not record["unchanged"], record
        else:
            scale = max(scale / 2, 1.0)
            assert record["unchanged"], f"a poisoned step changed weights or slots: {record}"
        assert record["scale"] == scale and record["iterations"] == iterations, (record, scale, iterations)
        assert 1.0 <= record["scale"] <= 2.0**15
    good = [r["loss"] for r in history if np.isfinite(r["poison"])]
    assert good[-1] < good[0], f"training did not recover: losses {good}"


_KILLED_RUN = textwrap.dedent("""
    import json, os, sys
    import numpy as np, tensorflow as tf, keras
    import amp_rewrite
    directory, steps, kill_after = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(1)])
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.05), target="float16")
    opt.build(model.trainable_variables)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=opt)
    manager = tf.train.CheckpointManager(checkpoint, directory, max_to_keep=2)
    if manager.latest_checkpoint:
        checkpoint.restore(manager.latest_checkpoint).assert_existing_objects_matched()
    rng = np.random.default_rng(int(opt.iterations.numpy()))
    poison = tf.Variable(1.0)

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            scaled = opt.get_scaled_loss(tf.reduce_mean(tf.square(model(x) - y)) * poison)
        opt.apply_gradients(zip(opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables)),
                                model.trainable_variables))

    print(json.dumps({"start_scale": float(opt.loss_scale), "start_iterations": int(opt.iterations.numpy())}), flush=True)
    for i in range(steps):
        x = rng.uniform(-1, 1, (16, 8)).astype("float32")
        poison.assign(float("inf") if i % 3 == 1 else 1.0)
        step(x, (x.sum(axis=1, keepdims=True) > 0).astype("float32"))
        manager.save()
        print(json.dumps({"scale": float(opt.loss_scale), "iterations": int(opt.iterations.numpy())}), flush=True)
        if i + 1 == kill_after:
            os._exit(9)  # killed: no clean shutdown
""")


def test_killed_run_resumes_from_checkpoint_with_same_scale_and_step(tmp_path) -> None:
    """A run killed after 4 steps (two of them poisoned) resumes in a new process from its
    last checkpoint with exactly the loss scale and step count it had saved."""
    command = [sys.executable, "-c", _KILLED_RUN, str(tmp_path / "ckpt")]
    first = subprocess.run(command + ["6", "4"], capture_output=True, text=True, timeout=300)
    assert first.returncode == 9, first.stderr[-2000:]
    states = [json.loads(line) for line in first.stdout.splitlines()]
    last = states[-1]
    assert last["scale"] < 2.0**15 and last["iterations"] < len(states) - 1  # faults were skipped
    second = subprocess.run(command + ["3", "0"], capture_output=True, text=True, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    resumed = [json.loads(line) for line in second.stdout.splitlines()]
    assert resumed[0] == {"start_scale": last["scale"], "start_iterations": last["iterations"]}
    assert resumed[-1]["iterations"] > last["iterations"]
