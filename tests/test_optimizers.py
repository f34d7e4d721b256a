"""Loss scaling around the live rewrite: skipped steps, scale arithmetic, saved state, replicas.

``enable_mixed_precision_graph_rewrite(opt, loss_scale, target)`` wraps ``opt`` in its own
family's loss-scale optimizer (Keras 3, tf_keras, ``tf.compat.v1.train``). A float16
gradient overflows where a float32 one does not, so what the wrapper must guarantee is
checked with real steps, not mocks:

* a step whose gradients hold Inf/NaN is skipped — weights and optimizer slots unchanged —
  and the dynamic scale is halved, once per bad step, for K bad steps in a row; training
  then resumes (the fault is a ``poison`` variable the loss is multiplied by);
* ``loss_scale`` arguments map onto each family, and the scale grows after the configured
  number of finite steps; bad arguments raise errors that say what to pass;
* the scale and its step counter survive ``tf.train.Checkpoint`` and ``model.save``;
* under ``MirroredStrategy`` every replica skips a bad step together (a subprocess, since
  logical CPU devices must be configured before TensorFlow starts).
"""
from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Callable, Sequence
from typing import Any
from dataclasses import dataclass

import keras

import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from tensorflow.python.eager import context

import amp_rewrite
from amp_rewrite import _tf
from amp_rewrite.training import live, optimizers

pytestmark = pytest.mark.usefixtures("no_live_rewrite")

INF, NAN = float("inf"), float("nan")
# One good step, K = 3 bad steps in a row (Inf and NaN), then two good steps.
POISONS = (1.0, INF, NAN, INF, 1.0, 1.0)
BAD_STREAK = 3


@dataclass(frozen=True)
class Snapshot:
    """Training state after one step: weights, optimizer slots, step count and loss scale."""

    weights: tuple[np.ndarray, ...]
    slots: tuple[np.ndarray, ...]
    iterations: int
    scale: float


def _assert_skipped(before: Snapshot, after: Snapshot, *, iterations_advance: int = 0) -> None:
    """A skipped step: nothing trained, the scale halved."""
    for old, new in zip(before.weights + before.slots, after.weights + after.slots):
        np.testing.assert_array_equal(new, old, err_msg="a skipped step changed a weight or slot")
    assert after.iterations == before.iterations + iterations_advance
    assert after.scale == before.scale / 2


def _assert_applied(before: Snapshot, after: Snapshot) -> None:
    """An applied step: finite weights that moved, one more iteration, the scale kept (growth is tested apart)."""
    assert all(np.all(np.isfinite(w)) for w in after.weights + after.slots)
    assert any(not np.array_equal(old, new) for old, new in zip(before.weights, after.weights))
    assert after.iterations == before.iterations + 1
    assert after.scale == before.scale


def _check_fault_sequence(snapshots: Sequence[Snapshot], *, iterations_advance_on_skip: int = 0) -> None:
    """``snapshots[i + 1]`` follows step ``POISONS[i]``: good, K bad (scale ÷2 each), good, good."""
    for poison, before, after in zip(POISONS, snapshots, snapshots[1:]):
        if math.isfinite(poison):
            _assert_applied(before, after)
        else:
            _assert_skipped(before, after, iterations_advance=iterations_advance_on_skip)
    assert snapshots[-1].scale == snapshots[0].scale / 2**BAD_STREAK


def _regression_data(seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Small inputs and targets: gradients × 2**15 stay inside float16's range."""
    rng = np.random.RandomState(seed)
    return (0.1 * rng.normal(size=(8, 4))).astype("float32"), (0.1 * rng.normal(size=(8, 3))).astype("float32")


# --------------------------------------------------------------------------------------
# Keras 3


def _keras_model() -> keras.Model:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def _keras_snapshot(model: keras.Model, opt: optimizers.LossScaleOptimizer) -> Snapshot:
    inner = opt.inner_optimizer
    slots = [v for v in inner.variables if v.name not in ("iteration", "learning_rate")]
    assert slots, "the inner optimizer should have slot variables"
    return Snapshot(tuple(np.array(w.numpy()) for w in model.trainable_variables),
                    tuple(np.array(v.numpy()) for v in slots), int(opt.iterations.numpy()), float(opt.loss_scale))


def _seed_api_step(model: Any, opt: Any, poison: tf.Variable) -> Callable:
    """One step with the seed API (get_scaled_loss / get_unscaled_gradients / apply_gradients),
    for any optimizer family that has it."""
    x, y = _regression_data()

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2) * poison
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))

    return step


def _quadratic_step(opt: Any, w: Any, poison: tf.Variable) -> Callable:
    """One seed-API step on the loss sum(w * w) * poison."""

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            scaled = opt.get_scaled_loss(tf.reduce_sum(w * w) * poison)
        opt.apply_gradients(list(zip(opt.get_unscaled_gradients(tape.gradient(scaled, [w])), [w])))

    return step


def _keras_minimize_callable_step(model: keras.Model, opt: optimizers.LossScaleOptimizer,
                                  poison: tf.Variable) -> Callable:
    x, y = _regression_data()

    @tf.function
    def step() -> None:
        opt.minimize(lambda: tf.reduce_mean((model(x) - y) ** 2) * poison, model.trainable_variables)

    return step


def _keras_minimize_tape_step(model: keras.Model, opt: optimizers.LossScaleOptimizer, poison: tf.Variable) -> Callable:
    x, y = _regression_data()

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x) - y) ** 2) * poison
        opt.minimize(loss, model.trainable_variables, tape=tape)

    return step


def _run_poisoned(step: Callable, poison: tf.Variable, snapshot: Callable[[], Snapshot]) -> list[Snapshot]:
    snapshots = [snapshot()]
    for value in POISONS:
        poison.assign(value)
        step()
        snapshots.append(snapshot())
    return snapshots


@pytest.mark.parametrize(
    "make_step",
    [_seed_api_step, _keras_minimize_callable_step, _keras_minimize_tape_step],
    ids=["seed-api", "minimize-callable", "minimize-tensor-and-tape"],
)
def test_keras_custom_loop_skips_bad_steps_and_recovers(make_step):
    """get_scaled_loss/get_unscaled_gradients/apply_gradients and minimize: a non-finite step
    changes no weight or slot and no iteration, and halves the scale; three in a row
    halve it three times; the next good steps train again."""
    model = _keras_model()
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(0.01), target="float16")
    assert isinstance(opt, optimizers.LossScaleOptimizer)
    opt.build(model.trainable_variables)
    poison = tf.Variable(1.0)
    step = make_step(model, opt, poison)
    snapshots = _run_poisoned(step, poison, lambda: _keras_snapshot(model, opt))
    assert snapshots[0].scale == 2.0**15
    _check_fault_sequence(snapshots)


def _keras3_step(model: keras.Model, opt: optimizers.LossScaleOptimizer) -> Callable:
    """A Keras-3-style step: ``scale_loss``, then ``apply`` with the scaled gradients."""
    x, y = _regression_data()

    @tf.function
    def step() -> None:
        with tf.GradientTape() as tape:
            scaled = opt.scale_loss(tf.reduce_mean((model(x) - y) ** 2))
        opt.apply(tape.gradient(scaled, model.trainable_variables), model.trainable_variables)

    return step


# --------------------------------------------------------------------------------------
# Gradients edited between unscaling and applying: each family's contract, against float32

GRADIENT_STEPS = 4


def _variable(family: str, value: np.ndarray) -> Any:
    return keras.Variable(value) if family == "keras" else tf.Variable(value)


def _plain_optimizer(family: str) -> Any:
    return {"keras": lambda: keras.optimizers.SGD(0.1), "tf_keras": lambda: tf_keras.optimizers.SGD(0.1),
            "v1": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)}[family]()


def _gradient_step(pattern: str, family: str, opt: Any, w: Any, wrapped: bool) -> Callable:
    """One training step of ``pattern`` as its users write it; with the plain optimizer
    (``wrapped`` False) the same code without the scaling calls is float32's reference."""
    x, y = _regression_data()
    accumulated = tf.Variable(tf.zeros_like(w)) if pattern == "accumulate" else None
    count = tf.Variable(0) if pattern == "accumulate" else None

    def loss_fn() -> tf.Tensor:
        return tf.reduce_mean((tf.matmul(x, w) - y) ** 2)

    def apply(grads: list) -> None:
        if family == "keras":
            opt.apply(grads, [w])
        else:
            opt.apply_gradients(list(zip(grads, [w])))

    @tf.function
    def step() -> None:
        if pattern == "minimize":
            if family == "keras" and not wrapped:  # Keras 3's own optimizer has no minimize
                with tf.GradientTape() as tape:
                    loss = loss_fn()
                apply(tape.gradient(loss, [w]))
            else:
                opt.minimize(loss_fn, var_list=[w])
            return
        with tf.GradientTape() as tape:
            loss = loss_fn()
            if pattern == "scale_loss":
                loss = opt.scale_loss(loss)
            elif wrapped:
                loss = opt.get_scaled_loss(loss)
        grads = tape.gradient(loss, [w])
        if pattern == "scale_loss":
            return apply(grads)
        if wrapped:
            grads = opt.get_unscaled_gradients(grads)
        if pattern == "clip":
            grads, _ = tf.clip_by_global_norm(grads, 0.05)  # clips: the gradients' norm is about 0.1
            return apply(grads)
        accumulated.assign_add(grads[0])  # "accumulate": apply the mean of every 2 steps' gradients
        count.assign_add(1)
        if count % 2 == 0:
            apply([accumulated / 2.0])
            accumulated.assign(tf.zeros_like(accumulated))

    return step


def _trained_update(pattern: str, family: str, target: str | None) -> np.ndarray:
    """How GRADIENT_STEPS steps of ``pattern`` move w: float32 with the plain optimizer (target
    None), or rewritten to ``target`` with the wrapper."""
    start = np.random.RandomState(1).uniform(-1, 1, (4, 3)).astype(np.float32)
    w = _variable(family, start)
    opt = _plain_optimizer(family)
    with amp_rewrite.mixed_precision(target=target) if target else contextlib.nullcontext():
        if target:
            opt = optimizers.wrap_optimizer(opt)
        step = _gradient_step(pattern, family, opt, w, wrapped=target is not None)
        step.get_concrete_function()  # traced (and rewritten) inside the block
    for _ in range(GRADIENT_STEPS):
        step()
    return np.asarray(w.numpy()) - start


GRADIENT_PATTERNS = [("keras", p) for p in ("clip", "accumulate", "scale_loss", "minimize")] + [
    (family, p) for family in ("tf_keras", "v1") for p in ("clip", "accumulate", "minimize")]


@pytest.mark.parametrize("family, pattern", GRADIENT_PATTERNS, ids=[f"{f}-{p}" for f, p in GRADIENT_PATTERNS])
def test_gradients_edited_after_unscaling_give_the_float32_update(family, pattern):
    """Each family's custom-loop patterns — unscale, clip_by_global_norm, apply; unscale,
    accumulate in variables, apply the mean every 2 steps; Keras 3's scale_loss, gradients,
    apply; minimize — move the weights as the same code does in float32 with the plain
    optimizer, within bfloat16's noise. (Keras 3 once took only the exact tensors
    get_unscaled_gradients returned as unscaled: clipped or accumulated ones were divided by
    the scale again, a step 2**15 times too small.)"""
    expected = _trained_update(pattern, family, None)
    actual = _trained_update(pattern, family, "bfloat16")
    assert np.max(np.abs(expected)) > 1e-3, "the float32 steps should move the weights"
    np.testing.assert_allclose(actual, expected, rtol=0.05, atol=0.05 * np.max(np.abs(expected)))


@pytest.mark.parametrize("family", ["keras", "tf_keras", "v1"])
def test_gradients_all_reduced_after_unscaling_give_the_float32_update(mirrored_report, family):
    """MirroredStrategy on two CPUs: unscale, all-reduce the MEAN by hand, apply (tf_keras
    told not to aggregate again): four steps move the weights as the same code does in float32
    with the plain optimizer, within bfloat16's noise."""
    expected, actual = (np.array(mirrored_report["all_reduced"][family][key]) for key in ("float32", "bfloat16"))
    assert np.max(np.abs(expected)) > 1e-3, "the float32 steps should move the weights"
    np.testing.assert_allclose(actual, expected, rtol=0.05, atol=0.05 * np.max(np.abs(expected)))


@pytest.mark.parametrize("contract", ["scale_loss", "get_unscaled_gradients"])
def test_keras_variables_overwritten_with_their_gradient_get_it_as_passed(contract):
    """A variable with ``overwrite_with_gradient`` (float8 scaling factors) is set to its
    "gradient", which Keras never unscales: either contract leaves that value as the code
    computed it, while the other variable's gradient is unscaled (SGD 0.5, gradient 2)."""
    w, amax = keras.Variable([1.0]), keras.Variable([0.0])
    amax.overwrite_with_gradient = True
    opt = optimizers.wrap_optimizer(keras.optimizers.SGD(0.5))
    opt.build([w, amax])
    with tf.GradientTape() as tape:
        loss = tf.reduce_sum(w * 2.0)
        scaled = opt.scale_loss(loss) if contract == "scale_loss" else opt.get_scaled_loss(loss)
    grads = [tape.gradient(scaled, w), tf.constant([5.0])]  # the new amax, computed as such
    if contract == "get_unscaled_gradients":
        grads = opt.get_unscaled_gradients(grads)
    opt.apply(grads, [w, amax])
    np.testing.assert_allclose([float(w.numpy()[0]), float(amax.numpy()[0])], [0.0, 5.0], rtol=1e-6)


def test_keras_apply_with_both_or_neither_contract_says_what_to_pass():
    """The Keras 3 wrapper takes scaled gradients after scale_loss (Keras 3) and unscaled ones
    after get_scaled_loss/get_unscaled_gradients (tf_keras): calling both on one optimizer is
    an error, and so is apply() with neither while the scale is not 1 — never a silent factor
    of the scale. A scale of 1 (loss_scale=None) needs neither."""
    w = keras.Variable([1.0, 2.0])
    opt = optimizers.wrap_optimizer(keras.optimizers.SGD(0.1))
    with pytest.raises(ValueError, match=r"apply\(\) cannot tell whether these gradients are of the scaled loss"):
        opt.apply([tf.constant([1.0, 1.0])], [w])
    opt.scale_loss(tf.constant(1.0))
    with pytest.raises(ValueError, match=r"get_unscaled_gradients\(\) called on an optimizer whose code already uses"
                                         r" scale_loss\(\).*use one of the two on one optimizer"):
        opt.get_unscaled_gradients([tf.constant([1.0])])
    other = optimizers.wrap_optimizer(keras.optimizers.SGD(0.1))
    other.get_scaled_loss(tf.constant(1.0))
    with pytest.raises(ValueError, match=r"scale_loss\(\) called on an optimizer whose code already uses"
                                         r" get_scaled_loss\(\)/get_unscaled_gradients\(\)"):
        other.scale_loss(tf.constant(1.0))
    unscaled = optimizers.wrap_optimizer(keras.optimizers.SGD(0.1), None)
    unscaled.apply([tf.constant([1.0, 1.0])], [w])
    np.testing.assert_allclose(np.asarray(w.numpy()), [0.9, 1.9], rtol=1e-6)


def test_keras_fit_skips_bad_batches_and_recovers():
    """model.fit scales the loss itself (Keras 3's trainer calls scale_loss): poisoned
    batches 1-3 are skipped, the scale halves per batch, batches 4-5 train."""
    model = _keras_model()
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(0.01), target="float16")
    poison = tf.Variable(1.0)
    model.compile(optimizer=opt, loss=lambda y, p: keras.losses.mean_squared_error(y, p) * poison, jit_compile=False)
    opt.build(model.trainable_variables)
    snapshots = [_keras_snapshot(model, opt)]

    class Poison(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            poison.assign(POISONS[batch])

        def on_train_batch_end(self, batch, logs=None):
            snapshots.append(_keras_snapshot(model, opt))

    x, y = _regression_data()
    x, y = np.tile(x, (3, 1))[: 4 * len(POISONS)], np.tile(y, (3, 1))[: 4 * len(POISONS)]
    model.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0, callbacks=[Poison()])
    assert len(snapshots) == len(POISONS) + 1
    _check_fault_sequence(snapshots)


def test_float16_overflow_is_skipped_until_the_scale_fits():
    """No injected fault: with the rewrite, d(loss·2**15)/dw = 4·2**15 overflows float16 in
    the rewritten MatMul gradient; the step is skipped and the scale halved until
    4·scale < 65504 (scale 8192). Without the rewrite (float32) the first step applies."""

    def scales_and_iterations(target: str | None) -> list[tuple[float, int]]:
        w = keras.Variable(np.full((3, 2), 0.01, "float32"))
        x = tf.fill((1, 3), 4.0)
        opt = optimizers.wrap_optimizer(keras.optimizers.SGD(1e-6))
        opt.build([w])
        with amp_rewrite.mixed_precision(target=target) if target else contextlib.nullcontext():
            @tf.function
            def step() -> None:
                with tf.GradientTape() as tape:
                    scaled = opt.get_scaled_loss(tf.reduce_sum(tf.matmul(x, w)))
                grads = opt.get_unscaled_gradients(tape.gradient(scaled, [w]))
                opt.apply_gradients(zip(grads, [w]))

            step.get_concrete_function()  # traced (and rewritten) inside the block
        out = []
        for _ in range(4):
            step()
            out.append((float(opt.loss_scale), int(opt.iterations.numpy())))
        assert step.experimental_get_tracing_count() == 1
        return out

    assert scales_and_iterations(None) == [(32768.0, 1), (32768.0, 2), (32768.0, 3), (32768.0, 4)]
    assert scales_and_iterations("float16") == [(16384.0, 0), (8192.0, 0), (8192.0, 1), (8192.0, 2)]


# --------------------------------------------------------------------------------------
# tf_keras and tf.compat.v1


def test_tf_keras_custom_loop_skips_bad_steps_and_recovers():
    """tf_keras' LossScaleOptimizer: weights and momentum unchanged and scale halved on a bad
    step. Unlike Keras 3 it counts a skipped step in ``iterations`` (tf_keras'
    do_not_apply_fn increments it so learning-rate schedules stay in step)."""
    model = tf_keras.Sequential([tf_keras.layers.Dense(3, input_shape=(4,), kernel_initializer="ones")])
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(tf_keras.optimizers.SGD(0.1, momentum=0.9), target="float16")
    assert isinstance(opt, tf_keras.mixed_precision.LossScaleOptimizer)
    poison = tf.Variable(1.0)
    step = _seed_api_step(model, opt, poison)

    def snapshot() -> Snapshot:
        slots = [v for v in opt.variables() if "iteration" not in v.name]
        return Snapshot(tuple(w.numpy() for w in model.trainable_variables), tuple(v.numpy() for v in slots),
                        int(opt.iterations.numpy()), float(opt.loss_scale))

    step()  # builds the momentum slots
    snapshots = _run_poisoned(step, poison, snapshot)
    assert len(snapshots[0].slots) == 2
    _check_fault_sequence(snapshots, iterations_advance_on_skip=1)


def test_v1_optimizer_in_graph_mode_skips_bad_steps():
    """tf.compat.v1 graph + Session: a bad step leaves w, the momentum slot and global_step
    alone and halves the scale; the good step after it applies."""
    graph = tf.Graph()
    with graph.as_default():
        w = tf.compat.v1.get_variable("w", initializer=tf.constant([1.0, 2.0]), use_resource=True)
        poison = tf.compat.v1.placeholder(tf.float32, ())
        global_step = tf.compat.v1.train.get_or_create_global_step()
        inner = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(inner, target="float16")
        train = opt.minimize(tf.reduce_sum(w * w) * poison, global_step=global_step)
        momentum = inner.get_slot(w, "momentum")
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            snapshots = []
            for value in (None,) + POISONS:
                if value is not None:
                    session.run(train, {poison: value})
                scale, step, w_value, m_value = session.run([opt.loss_scale, global_step, w, momentum])
                snapshots.append(Snapshot((w_value,), (m_value,), int(step), float(scale)))
    assert isinstance(opt, tf.compat.v1.mixed_precision.MixedPrecisionLossScaleOptimizer)
    np.testing.assert_allclose(snapshots[1].weights[0], [0.8, 1.6])  # SGD-momentum step of 2w·0.1
    _check_fault_sequence(snapshots)


def test_v1_optimizer_in_tf_function_skips_bad_steps():
    """A v1 optimizer in a TF2 tf.function (compute_gradients/apply_gradients), rewritten to
    float16: the body's MatMuls are half, bad steps are skipped, global_step waits."""
    w = tf.Variable([[0.1], [0.2]])
    x = tf.constant([[0.1, 0.1]])
    poison = tf.Variable(1.0)
    global_step = tf.Variable(0, dtype=tf.int64)
    inner = tf.compat.v1.train.MomentumOptimizer(0.1, 0.9)
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(inner, target="float16")

    @tf.function
    def step() -> None:
        grads_and_vars = opt.compute_gradients(lambda: tf.reduce_sum(tf.matmul(x, w) ** 2) * poison, var_list=[w])
        opt.apply_gradients(grads_and_vars, global_step=global_step)

    def snapshot() -> Snapshot:
        slot = inner.get_slot(w, "momentum")
        return Snapshot((w.numpy(),), (slot.numpy(),) if slot is not None else (np.zeros((2, 1), "float32"),),
                        int(global_step.numpy()), float(opt.loss_scale))

    snapshots = _run_poisoned(step, poison, snapshot)
    _check_fault_sequence(snapshots)
    body = context.context().get_function_def(step.get_concrete_function().name)
    assert {n.attr["T"].type for n in body.node_def if n.op == "MatMul"} == {tf.float16.as_datatype_enum}


# --------------------------------------------------------------------------------------
# loss_scale arguments

DYNAMIC_2 = dict(initial_loss_scale=64, increment_period=2)


@pytest.mark.parametrize(
    "loss_scale, expected",
    [
        ("dynamic", optimizers.ScalePlan(True, 2.0**15, 2000)),
        (128, optimizers.ScalePlan(False, 128.0)),
        (0.5, optimizers.ScalePlan(False, 0.5)),
        (None, optimizers.ScalePlan(False, 1.0)),
        (tf.compat.v1.mixed_precision.DynamicLossScale(**DYNAMIC_2), optimizers.ScalePlan(True, 64.0, 2)),
        (tf.compat.v1.mixed_precision.FixedLossScale(256), optimizers.ScalePlan(False, 256.0)),
        (np.float32(128), optimizers.ScalePlan(False, 128.0)),
        (np.int64(64), optimizers.ScalePlan(False, 64.0)),
    ],
    ids=["dynamic", "int", "float", "None", "v1-dynamic", "v1-fixed", "np.float32", "np.int64"],
)
def test_loss_scale_argument_plans(loss_scale, expected):
    """Each accepted form of loss_scale means one dynamic or fixed scale."""
    assert optimizers.plan_loss_scale(loss_scale) == expected


@pytest.mark.parametrize(
    "loss_scale, keras_, tf_keras_, v1_",
    [
        ("dynamic", (2.0**15, 2000, False), (True, 2.0**15, 2000), ("DynamicLossScale", 2.0**15, 2000)),
        (128, (128.0, optimizers.NEVER, True), (False, 128.0, None), ("_FixedLossScale", 128.0, optimizers.NEVER)),
        (None, (1.0, optimizers.NEVER, True), (False, 1.0, None), ("_FixedLossScale", 1.0, optimizers.NEVER)),
        (tf.compat.v1.mixed_precision.DynamicLossScale(**DYNAMIC_2), (64.0, 2, False), (True, 64.0, 2),
         ("DynamicLossScale", 64.0, 2)),
        (tf.compat.v1.mixed_precision.FixedLossScale(256), (256.0, optimizers.NEVER, True), (False, 256.0, None),
         ("_FixedLossScale", 256.0, optimizers.NEVER)),
    ],
    ids=["dynamic", "number", "None", "v1-dynamic", "v1-fixed"],
)
def test_loss_scale_maps_onto_every_family(loss_scale, keras_, tf_keras_, v1_):
    """The same loss_scale configures the Keras 3, tf_keras and v1 wrappers alike (a fixed
    v1 scale is our _FixedLossScale: it never changes, and still skips bad steps)."""
    k = optimizers.wrap_optimizer(keras.optimizers.SGD(), loss_scale)
    assert (k.initial_scale, k.dynamic_growth_steps, k.fixed) == keras_
    t = optimizers.wrap_optimizer(tf_keras.optimizers.SGD(), loss_scale)
    assert (t.dynamic, float(t.initial_scale), t.dynamic_growth_steps) == tf_keras_
    v = optimizers.wrap_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), loss_scale)
    scale = v._loss_scale
    period = scale.increment_period if isinstance(scale, tf.compat.v1.mixed_precision.DynamicLossScale) else None
    assert (type(scale).__name__, float(scale()), period) == v1_


def _growth_steps_keras_like(variable: Callable, make_optimizer: Callable) -> Callable:
    """Scale after each step of a custom loop with the seed API (Keras 3 or tf_keras)."""

    def run(loss_scale: object, poisons: Sequence[float]) -> list[float]:
        w = variable([1.0, 2.0])
        opt = optimizers.wrap_optimizer(make_optimizer(), loss_scale)
        poison = tf.Variable(1.0)

        return _scales_after(_quadratic_step(opt, w, poison), poison, poisons, lambda: opt.loss_scale)

    return run


_growth_steps_keras = _growth_steps_keras_like(keras.Variable, lambda: keras.optimizers.SGD(0.01))
_growth_steps_tf_keras = _growth_steps_keras_like(tf.Variable, lambda: tf_keras.optimizers.SGD(0.01))


def _growth_steps_v1(loss_scale: object, poisons: Sequence[float]) -> list[float]:
    w = tf.Variable([1.0, 2.0])
    opt = optimizers.wrap_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.01), loss_scale)
    poison = tf.Variable(1.0)

    @tf.function
    def step() -> None:
        opt.apply_gradients(opt.compute_gradients(lambda: tf.reduce_sum(w * w) * poison, var_list=[w]))

    return _scales_after(step, poison, poisons, lambda: opt.loss_scale)


def _scales_after(step: Callable, poison: tf.Variable, poisons: Sequence[float], scale: Callable) -> list[float]:
    out = []
    for value in poisons:
        poison.assign(value)
        step()
        out.append(float(scale()))
    return out


FAMILY_TO_STEPS = {"keras": _growth_steps_keras, "tf_keras": _growth_steps_tf_keras, "v1": _growth_steps_v1}


@pytest.mark.parametrize("family", FAMILY_TO_STEPS)
def test_dynamic_scale_doubles_after_increment_period_finite_steps(family):
    """DynamicLossScale(64, increment_period=2): ×2 after every 2 finite steps, ÷2 on a bad
    step, which also restarts the count."""
    scales = FAMILY_TO_STEPS[family](tf.compat.v1.mixed_precision.DynamicLossScale(**DYNAMIC_2),
                                     [1, 1, 1, 1, INF, 1, 1])
    assert scales == [64, 128, 128, 256, 128, 128, 256]


@pytest.mark.parametrize("family", FAMILY_TO_STEPS)
@pytest.mark.parametrize("loss_scale", [128, 0.5, None], ids=["number", "below-one", "None"])
def test_fixed_scale_never_changes(family, loss_scale):
    """A number (or None, meaning 1) is a fixed scale: finite and bad steps leave it alone
    (below 1 too: a dynamic scale stops halving at 1, a fixed one is not raised to it)."""
    scales = FAMILY_TO_STEPS[family](loss_scale, [1, 1, 1, INF, 1])
    assert scales == [loss_scale or 1.0] * 5


@pytest.mark.parametrize("family", FAMILY_TO_STEPS)
def test_fixed_scale_still_skips_bad_steps(family):
    """loss_scale=128: a non-finite step is skipped (weights stay finite and unchanged)
    without ever changing the scale — in Keras 3 and v1. tf_keras keeps its own documented
    fixed-scale contract (``dynamic=False`` applies every step): the step is applied."""
    if family == "keras":
        w = keras.Variable([1.0, 2.0])
        opt = optimizers.wrap_optimizer(keras.optimizers.SGD(0.1), 128)
    elif family == "tf_keras":
        w = tf.Variable([1.0, 2.0])
        opt = optimizers.wrap_optimizer(tf_keras.optimizers.SGD(0.1), 128)
    else:
        w = tf.Variable([1.0, 2.0])
        opt = optimizers.wrap_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1), 128)
    poison = tf.Variable(1.0)

    step = _quadratic_step(opt, w, poison)

    step()
    np.testing.assert_allclose(np.asarray(w.numpy()), [0.8, 1.6], rtol=1e-6)
    poison.assign(INF)
    step()
    if family == "tf_keras":
        assert not np.all(np.isfinite(np.asarray(w.numpy()))), "tf_keras' fixed scale applies every step"
    else:
        np.testing.assert_allclose(np.asarray(w.numpy()), [0.8, 1.6], rtol=1e-6,
                                   err_msg=f"{family}: a fixed loss scale applied a non-finite step")
    assert float(opt.loss_scale) == 128.0


def test_a_skipped_step_leaves_the_weights_but_not_batch_norm_statistics():
    """What a skipped step protects, in model.fit: an Inf loss (here a poisoned loss factor)
    leaves every weight and slot alone, but BatchNormalization's moving statistics were already
    updated by the forward pass, as with Keras' own loss-scale optimizer. A NaN *input* batch
    makes the step skipped and the moving mean NaN (README: the remedy)."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.BatchNormalization(), keras.layers.Dense(1)])
    poison = tf.Variable(1.0)
    model.compile(optimizer=amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), "dynamic",
                                                                            target="bfloat16"),
                  loss=lambda y, p: keras.losses.mean_squared_error(y, p) * poison, jit_compile=False)
    x, y = _regression_data()
    model.fit(x, y[:, :1], batch_size=8, epochs=1, verbose=0)
    bn = model.layers[0]

    def state() -> tuple:
        return ([np.array(w.numpy()) for w in model.trainable_variables], np.array(bn.moving_mean.numpy()))

    trainable, moving = state()
    poison.assign(INF)
    model.fit(x + 1.0, y[:, :1], batch_size=8, epochs=1, verbose=0)
    after, moved = state()
    assert all(np.array_equal(a, b) for a, b in zip(trainable, after)), "the Inf step was applied"
    assert not np.allclose(moved, moving), "the forward pass updates the moving mean"
    poison.assign(1.0)
    bad = x.copy()
    bad[0, 0] = NAN
    model.fit(bad, y[:, :1], batch_size=8, epochs=1, verbose=0)
    final, poisoned = state()
    assert all(np.array_equal(a, b) for a, b in zip(after, final)), "the NaN-input step was applied"
    assert np.isnan(poisoned[0]) and float(model.optimizer.loss_scale) == 2.0**13


@pytest.mark.parametrize("family", ["keras", "v1"])
def test_a_fixed_scale_whose_steps_are_all_skipped_says_so_once(family, recwarn):
    """loss_scale=2**20 and gradients that are never finite (the loss is Inf): 15 skipped steps,
    counted in ``skipped_steps``, and one warning that training is stuck, naming the scale and
    what to pass. (tf_keras' fixed scale applies every step, so it never skips.)"""
    w = _variable(family, np.array([1.0, 2.0], np.float32))
    opt = optimizers.wrap_optimizer(_plain_optimizer(family), 2.0**20)
    poison = tf.Variable(INF)
    step = _quadratic_step(opt, w, poison)
    for _ in range(15):
        step()
    said = [str(w.message) for w in recwarn if "training is stuck" in str(w.message)]
    assert len(said) == 1 and int(opt.skipped_steps) == 15, said
    assert "at the fixed loss scale 1.04858e+06 (pass a smaller loss_scale, or loss_scale=\"dynamic\"" in said[0]


def test_the_skipped_steps_count_compiles_under_xla(recwarn):
    """Inside jit_compile=True, which cannot call Python, the count goes on without the warning:
    the step compiles and runs, and skipped_steps holds the steps skipped."""
    w = keras.Variable([1.0, 2.0])
    opt = optimizers.wrap_optimizer(keras.optimizers.SGD(0.1), 2.0**20)
    opt.build([w])

    @tf.function(jit_compile=True)
    def step() -> None:
        with tf.GradientTape() as tape:
            scaled = opt.get_scaled_loss(tf.reduce_sum(w * w) * INF)
        opt.apply_gradients(zip(opt.get_unscaled_gradients(tape.gradient(scaled, [w])), [w]))

    for _ in range(12):
        step()
    assert int(opt.skipped_steps) == 12 and int(opt.iterations.numpy()) == 0
    assert not [w for w in recwarn if "training is stuck" in str(w.message)]


def test_wrapping_an_optimizer_a_live_wrapper_wraps_warns():
    """Two wrappers of one optimizer step it twice with two loss scales: the second wrapping
    warns while the first wrapper is in use, and not once it is gone."""
    inner = keras.optimizers.SGD(0.1)
    first = amp_rewrite.enable_mixed_precision_graph_rewrite(inner, target="bfloat16")
    with pytest.warns(UserWarning, match="this SGD is already wrapped by a loss-scale optimizer that is still in use"):
        second = amp_rewrite.enable_mixed_precision_graph_rewrite(inner, target="bfloat16")
    del first, second
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp_rewrite.enable_mixed_precision_graph_rewrite(inner, target="bfloat16")


HELP = 'pass loss_scale="dynamic", a positive number (a fixed scale), None (no scaling)'


@pytest.mark.parametrize(
    "loss_scale, error, what, hint",
    [
        ("static", ValueError, "loss_scale must be 'dynamic', not 'static'", HELP),
        ("", ValueError, "loss_scale must be 'dynamic', not ''", HELP),
        (-1, ValueError, "got -1", "must be a positive finite number in float32"),
        (0, ValueError, "got 0", "must be a positive finite number in float32"),
        (INF, ValueError, "got inf", "must be a positive finite number in float32"),
        (NAN, ValueError, "got nan", "must be a positive finite number in float32"),
        (True, TypeError, "cannot interpret loss_scale=True (bool)", HELP),
        (np.bool_(True), TypeError, "cannot interpret loss_scale=", HELP),
        (np.float32(-2), ValueError, f"got {np.float32(-2)!r}", "must be a positive finite number"),
        ([128], TypeError, "cannot interpret loss_scale=[128] (list)", HELP),
        (tf.constant(128.0), TypeError, "cannot interpret loss_scale=", HELP),
        (tf.compat.v1.mixed_precision.DynamicLossScale(multiplier=3), ValueError, "DynamicLossScale(multiplier=3.0)",
         "use multiplier=2"),
        (1e39, ValueError, "got 1e+39 (inf in float32)", "pass one between 2**-126 and 2**127"),
        (np.float64(1e39), ValueError, f"got {np.float64(1e39)!r}", "must be a positive finite number in float32"),
        (1e-46, ValueError, "got 1e-46 (0.0 in float32)", "pass one between 2**-126 and 2**127"),
        (tf.compat.v1.mixed_precision.FixedLossScale(1e39), ValueError, "FixedLossScale must be a positive finite",
         "got 1e+39"),
        (tf.compat.v1.mixed_precision.DynamicLossScale(initial_loss_scale=1e39), ValueError,
         "initial_loss_scale must be a positive finite number in float32", "got 1e+39"),
        (tf.compat.v1.mixed_precision.DynamicLossScale(initial_loss_scale=2.0**127), ValueError,
         "doubles past float32's largest value at its first growth", "start at 2**126 or below"),
        (tf.compat.v1.mixed_precision.DynamicLossScale(increment_period=0), ValueError,
         "DynamicLossScale(increment_period=0) must be between 1 and 2147483647", "int32"),
    ],
    ids=["other-string", "empty-string", "negative", "zero", "inf", "nan", "bool", "np.bool_", "np-negative", "list",
         "tensor", "multiplier", "1e39", "np-1e39", "1e-46", "v1-fixed-1e39", "v1-dynamic-1e39", "v1-dynamic-2**127",
         "v1-period-0"],
)
def test_bad_loss_scale_says_what_to_pass(loss_scale, error, what, hint):
    """Every rejected loss_scale names the bad value and says what to pass; nothing is enabled."""
    with pytest.raises(error) as raised:
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), loss_scale, target="float16")
    assert what in str(raised.value) and hint in str(raised.value)
    assert live.active() is None, "a rejected loss_scale must not leave the rewrite on"


@pytest.mark.parametrize(
    "make",
    [
        lambda: optimizers.wrap_optimizer(keras.optimizers.SGD()),
        lambda: keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD()),
        lambda: tf_keras.mixed_precision.LossScaleOptimizer(tf_keras.optimizers.SGD()),
        lambda: optimizers.wrap_optimizer(tf.compat.v1.train.GradientDescentOptimizer(0.1)),
    ],
    ids=["ours-keras", "keras", "tf_keras", "ours-v1"],
)
def test_already_wrapped_optimizer_is_rejected(make):
    with pytest.raises(ValueError, match="already a loss-scale optimizer .*pass the optimizer it wraps"):
        amp_rewrite.enable_mixed_precision_graph_rewrite(make(), target="float16")
    assert live.active() is None


@pytest.mark.parametrize("opt", ["sgd", None, keras.layers.Dense(1), tf.Variable(1.0)], ids=["str", "None", "layer", "variable"])
def test_non_optimizer_is_a_type_error(opt):
    with pytest.raises(TypeError, match='"opt" must be a Keras 3 optimizer, a tf_keras optimizer or a tf.compat.v1'):
        amp_rewrite.enable_mixed_precision_graph_rewrite(opt, target="float16")
    assert live.active() is None


# --------------------------------------------------------------------------------------
# State


def _growth_3() -> tf.compat.v1.mixed_precision.DynamicLossScale:
    return tf.compat.v1.mixed_precision.DynamicLossScale(initial_loss_scale=64, increment_period=3)


def _trained_keras() -> tuple[keras.Model, optimizers.LossScaleOptimizer]:
    """A model and wrapper after 1 good, 1 bad and 4 good fit steps: scale 64 → 32 → 64, counter 1;
    recompiled with a plain loss so it can be saved."""
    model = _keras_model()
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.Adam(0.01), _growth_3(), target="bfloat16")
    poison = tf.Variable(1.0)
    model.compile(optimizer=opt, loss=lambda y, p: keras.losses.mean_squared_error(y, p) * poison, jit_compile=False)

    class Poison(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            poison.assign(INF if batch == 1 else 1.0)

    x, y = _regression_data()
    model.fit(np.tile(x, (3, 1)), np.tile(y, (3, 1)), batch_size=4, epochs=1, shuffle=False, verbose=0,
              callbacks=[Poison()])
    assert (float(opt.loss_scale), int(opt.step_counter.numpy()), int(opt.iterations.numpy())) == (64.0, 1, 5)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    return model, opt


def _state(opt: optimizers.LossScaleOptimizer) -> tuple:
    return (float(opt.loss_scale), int(opt.step_counter.numpy()), int(opt.iterations.numpy()),
            [np.array(v.numpy()) for v in opt.inner_optimizer.variables])


def _assert_same_state(actual: tuple, expected: tuple) -> None:
    assert actual[:3] == expected[:3]
    for a, e in zip(actual[3], expected[3]):
        np.testing.assert_array_equal(a, e)


def test_checkpoint_restores_scale_counter_and_slots(tmp_path):
    """tf.train.Checkpoint(optimizer=opt, model=model) saves the dynamic scale and its step
    counter with the inner optimizer's slots; a fresh wrapper restores all of them."""
    model, opt = _trained_keras()
    saved = _state(opt)
    path = tf.train.Checkpoint(optimizer=opt, model=model).save(str(tmp_path / "ckpt"))
    names = {name for name, _ in tf.train.list_variables(path)}
    assert {"optimizer/dynamic_scale/.ATTRIBUTES/VARIABLE_VALUE", "optimizer/step_counter/.ATTRIBUTES/VARIABLE_VALUE"} <= names

    fresh_model = _keras_model()
    fresh = optimizers.wrap_optimizer(keras.optimizers.Adam(0.01), _growth_3())
    fresh.build(fresh_model.trainable_variables)
    assert float(fresh.loss_scale) == 64.0 and int(fresh.step_counter.numpy()) == 0
    fresh.dynamic_scale.assign(1.0)  # so a restore that skipped the scale would show
    tf.train.Checkpoint(optimizer=fresh, model=fresh_model).restore(path).assert_consumed()
    _assert_same_state(_state(fresh), saved)


def test_tf_keras_checkpoint_restores_scale_and_counter(tmp_path):
    """The tf_keras wrapper's scale and good-step counter go through tf.train.Checkpoint too."""
    w = tf.Variable([1.0, 2.0])
    opt = optimizers.wrap_optimizer(tf_keras.optimizers.SGD(0.01), _growth_3())
    poison = tf.Variable(1.0)

    step = _quadratic_step(opt, w, poison)

    assert _scales_after(step, poison, [1, INF, 1], lambda: opt.loss_scale) == [64, 32, 32]
    assert int(opt.dynamic_counter.numpy()) == 1
    path = tf.train.Checkpoint(optimizer=opt, w=w).save(str(tmp_path / "ckpt"))
    fresh = optimizers.wrap_optimizer(tf_keras.optimizers.SGD(0.01), _growth_3())
    tf.train.Checkpoint(optimizer=fresh, w=tf.Variable([0.0, 0.0])).restore(path)
    assert (float(fresh.loss_scale), int(fresh.dynamic_counter.numpy())) == (32.0, 1)


def test_keras_model_save_and_load_keep_the_wrapper_and_its_state(tmp_path):
    """model.save(.keras) + keras.models.load_model: the optimizer comes back as our
    registered class, with its configuration, scale, counter and slots, and trains on."""
    assert keras.saving.get_registered_name(optimizers.LossScaleOptimizer) == "amp_rewrite>LossScaleOptimizer"
    model, opt = _trained_keras()
    saved = _state(opt)
    model.save(tmp_path / "model.keras")
    live.stop()
    loaded = keras.models.load_model(tmp_path / "model.keras")
    restored = loaded.optimizer
    assert type(restored) is optimizers.LossScaleOptimizer
    assert (restored.initial_scale, restored.dynamic_growth_steps, restored.fixed) == (64.0, 3, False)
    _assert_same_state(_state(restored), saved)
    x, y = _regression_data()
    loaded.fit(x, y, batch_size=8, epochs=1, verbose=0)  # counter 1 → 2 (growth after 3)
    assert (float(restored.loss_scale), int(restored.step_counter.numpy())) == (64.0, 2)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# A new process that imports nothing of amp_rewrite but the package, then Keras.
_LOAD_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import amp_rewrite
    import keras
    import numpy as np

    model = keras.models.load_model(sys.argv[1])
    opt = model.optimizer
    state = lambda: [type(opt).__module__ + "." + type(opt).__name__, float(opt.loss_scale),
                     int(opt.step_counter.numpy()), int(opt.iterations.numpy())]
    loaded = state()
    x, y = np.load(sys.argv[2])["x"], np.load(sys.argv[2])["y"]
    model.fit(x[:8], y[:8], batch_size=8, epochs=1, verbose=0)
    print("RESULT " + json.dumps({"loaded": loaded, "resumed": state()}))
    """
)


def run_fresh_python(script: str, *args: str, timeout: int = 300) -> dict:
    """Run ``script`` in a new Python with this checkout first on the path; its ``RESULT`` line."""
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"the script failed:\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


def test_keras_file_loads_in_a_new_process_after_import_amp_rewrite(tmp_path):
    """``import amp_rewrite`` alone registers the wrapper: a new process loads the ``.keras``
    file with its class, scale 64, counter 1 and 5 iterations, and resumes training
    (counter 1 → 2, iterations 5 → 6; the scale grows only after 3 finite steps)."""
    model, opt = _trained_keras()
    saved = _state(opt)
    model.save(tmp_path / "model.keras")
    x, y = _regression_data()
    np.savez(tmp_path / "data.npz", x=x, y=y)
    result = run_fresh_python(_LOAD_SCRIPT, str(tmp_path / "model.keras"), str(tmp_path / "data.npz"))
    assert result["loaded"] == ["amp_rewrite.training.keras_optimizer.LossScaleOptimizer", *saved[:3]]
    assert result["resumed"][1:] == [saved[0], saved[1] + 1, saved[2] + 1]


def test_fixed_scale_round_trips_through_keras_saving(tmp_path):
    """A fixed scale stays fixed after load_model (``fixed`` is in get_config)."""
    model = _keras_model()
    opt = optimizers.wrap_optimizer(keras.optimizers.SGD(0.1), 128)
    model.compile(optimizer=opt, loss="mse", jit_compile=False)
    x, y = _regression_data()
    model.fit(x, y, batch_size=8, epochs=1, verbose=0)
    model.save(tmp_path / "fixed.keras")
    restored = keras.models.load_model(tmp_path / "fixed.keras").optimizer
    assert (restored.fixed, restored.initial_scale, float(restored.loss_scale)) == (True, 128.0, 128.0)


# --------------------------------------------------------------------------------------
# MirroredStrategy over two logical CPUs (a subprocess: devices are fixed at TF start-up)

_MIRRORED_SCRIPT = textwrap.dedent(
    """
    import contextlib, json, math
    import numpy as np
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    import keras, tf_keras
    from tensorflow.core.framework import types_pb2
    from tensorflow.python.eager import context
    import amp_rewrite
    from amp_rewrite.training import optimizers

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    rng = np.random.RandomState(0)
    x = (0.1 * rng.normal(size=(8, 4))).astype("float32")
    y = (0.1 * rng.normal(size=(8, 3))).astype("float32")
    result = {}

    def local(variable):
        return [np.asarray(v.numpy()).tolist() for v in strategy.experimental_local_results(variable)]

    for bad in ([0], [1], [0, 1]):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
            opt = amp_rewrite.enable_mixed_precision_graph_rewrite(
                keras.optimizers.SGD(0.1, momentum=0.9), "dynamic", target="bfloat16")
            opt.build(model.trainable_variables)
        poison = tf.Variable(1.0)
        data = iter(strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(8).repeat()))
        bad_ids = tf.constant(bad)

        @tf.function
        def step(batch):
            def replica_step(xb, yb):
                replica = tf.distribute.get_replica_context().replica_id_in_sync_group
                factor = tf.where(tf.reduce_any(tf.equal(bad_ids, replica)), poison, 1.0)
                with tf.GradientTape() as tape:
                    loss = tf.reduce_mean((model(xb) - yb) ** 2) * factor
                    scaled = opt.get_scaled_loss(loss)
                grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
                opt.apply_gradients(zip(grads, model.trainable_variables))
            strategy.run(replica_step, args=batch)

        kernel = model.layers[0].kernel.value
        momentum = [v for v in opt.inner_optimizer.variables if "momentum" in v.name][0].value
        states = []
        ctx = context.context()
        names_before = set(ctx.list_function_names())
        for i, value in enumerate([1.0, float("inf"), 1.0]):
            poison.assign(value)
            if i == 0:
                ctx.enable_run_metadata()
                ctx.export_run_metadata()
            step(next(data))
            if i == 0:
                executed = [(n.device, n.op, types_pb2.DataType.Name(n.attr["T"].type))
                            for g in ctx.export_run_metadata().function_graphs for p in g.partition_graphs
                            for n in p.node if "MatMul" in n.op]
                ctx.disable_run_metadata()
            states.append({"kernel": local(kernel), "momentum": local(momentum),
                           "scale": [float(v) for v in local(opt.dynamic_scale.value)],
                           "iterations": int(opt.iterations.numpy())})
        step_names = [n for n in set(ctx.list_function_names()) - names_before if n.startswith("__inference_step_")]
        assert len(step_names) == 1, step_names
        body = ctx.get_function_def(step_names[0])
        registered = [(n.device, types_pb2.DataType.Name(n.attr["T"].type)) for n in body.node_def if n.op == "MatMul"]
        result[",".join(map(str, bad))] = {"states": states, "registered": registered, "executed": executed}
        amp_rewrite.disable_mixed_precision_graph_rewrite()

    import warnings
    with strategy.scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target="float16")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):  # two traces, one warning
            tf.function(lambda: strategy.run(lambda: model(x)))()
    warned = [str(w.message) for w in caught if "amp_rewrite" in str(w.message)]
    amp_rewrite.disable_mixed_precision_graph_rewrite()

    # Unscale, all-reduce the MEAN by hand, apply: each family, float32 (plain optimizer) and bfloat16.
    rng = np.random.RandomState(0)
    xs, ys = (0.1 * rng.normal(size=(16, 4))).astype("float32"), (0.1 * rng.normal(size=(16, 3))).astype("float32")
    start = rng.uniform(-1, 1, (4, 3)).astype("float32")
    data = tf.data.Dataset.from_tensor_slices((xs, ys)).batch(16).repeat()
    PLAIN = {"keras": lambda: keras.optimizers.SGD(0.1), "tf_keras": lambda: tf_keras.optimizers.SGD(0.1),
             "v1": lambda: tf.compat.v1.train.GradientDescentOptimizer(0.1)}

    def update(family, target):
        with strategy.scope():
            w = keras.Variable(start) if family == "keras" else tf.Variable(start)
            opt = PLAIN[family]()
            if target:
                opt = optimizers.wrap_optimizer(opt)
            if family == "keras":  # Keras 3's loss-scale optimizer cannot build inside a replicated step
                opt.build([w])
        batches = iter(strategy.experimental_distribute_dataset(data))

        def replica_step(xb, yb):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((tf.matmul(xb, w) - yb) ** 2)
                if target:
                    loss = opt.get_scaled_loss(loss)
            grads = tape.gradient(loss, [w])
            if target:
                grads = opt.get_unscaled_gradients(grads)
            grads = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.MEAN, grads)
            if family == "keras":
                opt.apply(grads, [w])
            elif family == "tf_keras":
                opt.apply_gradients(zip(grads, [w]), experimental_aggregate_gradients=False)
            else:
                opt.apply_gradients(list(zip(grads, [w])))

        step = tf.function(lambda batch: strategy.run(replica_step, args=batch))
        with amp_rewrite.mixed_precision(target) if target else contextlib.nullcontext():
            step(next(batches))  # traced (and rewritten) inside the block
        for _ in range(3):
            step(next(batches))
        return (np.asarray(w.numpy()) - start).tolist()

    all_reduced = {family: {"float32": update(family, None), "bfloat16": update(family, "bfloat16")}
                   for family in PLAIN}
    print("RESULT " + json.dumps({"cases": result, "float16_warnings": warned, "all_reduced": all_reduced}))
    """
)


@pytest.fixture(scope="module")
def mirrored_report() -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, "-c", _MIRRORED_SCRIPT], capture_output=True, text=True, timeout=300,
                          env=env, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"the MirroredStrategy script failed:\n{done.stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def mirrored(mirrored_report: dict) -> dict:
    """The bad-replica cases, by which replicas were bad ("0", "1", "0,1")."""
    return mirrored_report["cases"]


def test_mirrored_step_runs_rewritten_on_both_replicas(mirrored):
    """Inside strategy.run the MatMuls (forward and gradients, one set per replica, placed
    on CPU:0 and CPU:1) are bfloat16 in the registered body and in the graphs that ran."""
    for case in mirrored.values():
        devices = {device.rsplit("/", 1)[-1] for device, _ in case["registered"]}
        assert devices == {"device:CPU:0", "device:CPU:1"}
        assert {dtype for _, dtype in case["registered"]} == {"DT_BFLOAT16"}
        assert len(case["registered"]) >= 4
        executed = case["executed"]
        assert {device.rsplit("/", 1)[-1] for device, _, _ in executed} == {"device:CPU:0", "device:CPU:1"}
        assert {dtype for _, _, dtype in executed} == {"DT_BFLOAT16"}, executed


@pytest.mark.parametrize("bad", ["0", "1", "0,1"], ids=["replica0-bad", "replica1-bad", "both-bad"])
def test_mirrored_replicas_skip_a_bad_step_together(mirrored, bad):
    """Inf in the loss of replica(s) ``bad`` only: every replica skips the step (weights and
    momentum unchanged, identical across replicas), the scale halves once on each, and
    the next step trains both again."""
    good, skipped, after = mirrored[bad]["states"]
    assert good["scale"] == [32768.0, 32768.0] and good["iterations"] == 1
    assert (skipped["scale"], skipped["iterations"]) == ([16384.0, 16384.0], 1), (
        f"the step with Inf on replica(s) {bad} was applied, not skipped: {skipped}")
    assert skipped["kernel"] == good["kernel"] and skipped["momentum"] == good["momentum"]
    for state in (good, skipped, after):
        assert state["kernel"][0] == state["kernel"][1], "replicas diverged"
        assert all(math.isfinite(v) for row in state["kernel"][0] for v in row), f"non-finite weights: {state}"
    assert after["kernel"] != skipped["kernel"]
    assert after["scale"] == [16384.0, 16384.0] and after["iterations"] == 2


def test_float16_under_mirrored_strategy_on_cpus_warns_once(mirrored_report):
    """MirroredStrategy places every replica's ops on a CPU, which float16 never converts: the
    first such trace says so and points to bfloat16; the next is silent."""
    (message,) = mirrored_report["float16_warnings"]
    assert "placed on a CPU" in message and "target='bfloat16'" in message


def test_keras_scale_never_drops_below_one_nor_overflows():
    """Twenty bad steps in a row stop halving at 1 (Keras alone would reach 2**-5), and a
    scale doubled past float32's range keeps its last finite value; training goes on."""
    w = keras.Variable([1.0, 2.0])
    opt = optimizers.wrap_optimizer(keras.optimizers.SGD(0.01), "dynamic")
    poison = tf.Variable(INF)

    step = _quadratic_step(opt, w, poison)

    scales = _scales_after(step, poison, [INF] * 20 + [1.0], lambda: opt.loss_scale)
    assert scales[14:] == [1.0] * 7 and min(scales) == 1.0, scales
    np.testing.assert_allclose(np.asarray(w.numpy()), [0.98, 1.96], rtol=1e-6)

    big = optimizers.wrap_optimizer(  # the largest start enable accepts: one doubling to go
        keras.optimizers.SGD(0.01),
        tf.compat.v1.mixed_precision.DynamicLossScale(initial_loss_scale=2.0**126, increment_period=1),
    )
    v = keras.Variable([1.0])

    @tf.function
    def grow() -> None:
        with tf.GradientTape() as tape:
            scaled = big.get_scaled_loss(tf.reduce_sum(v) * 1e-30)
        big.apply_gradients(zip(big.get_unscaled_gradients(tape.gradient(scaled, [v])), [v]))

    for _ in range(3):
        grow()
    assert float(big.loss_scale) == 2.0**127


# --------------------------------------------------------------------------------------
# Defaults that fit the target


@pytest.mark.parametrize("target, extra, expected", [
    ("bfloat16", {}, optimizers.ScalePlan(False, 1.0)),
    ("float16", {}, optimizers.ScalePlan(True, 2.0**15)),
    ("float8", {}, optimizers.ScalePlan(False, 1.0)),
    ("float8", {"base_precision": "float16"}, optimizers.ScalePlan(True, 2.0**15)),
], ids=["bfloat16", "float16", "float8-on-bfloat16", "float8-on-float16"])
def test_the_default_loss_scale_fits_the_target(target, extra, expected):
    """The README's table: bfloat16 (and float8 on it) has float32's exponent range and needs no
    scale — a fixed 1 that still skips non-finite steps; float16 keeps the dynamic one."""
    if target == "float8" and _tf.tensorflow_version() < (2, 18):
        pytest.skip("FP8 training needs TensorFlow 2.18+")
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target=target, **extra)
    assert (not opt.fixed, float(opt.initial_scale)) == (expected.dynamic, expected.initial_scale)


def test_the_plain_keras_3_loop_works_with_bfloat16_and_skips_a_non_finite_step():
    """The loop every ``mixed_bfloat16`` user writes — ``tape.gradient(loss)``, then
    ``apply_gradients`` — with ``target="bfloat16"`` and no loss_scale: it trains as float32
    SGD does, and a step whose gradients are not finite is skipped, the scale staying 1."""
    w = keras.Variable([1.0, 2.0])
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target="bfloat16")
    poison = tf.Variable(1.0)

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(w * w) * poison
        opt.apply_gradients(zip(tape.gradient(loss, [w]), [w]))

    step()
    np.testing.assert_allclose(np.asarray(w.numpy()), [0.8, 1.6], rtol=1e-6)
    poison.assign(float("inf"))
    step()
    np.testing.assert_allclose(np.asarray(w.numpy()), [0.8, 1.6], rtol=1e-6)
    assert float(opt.loss_scale) == 1.0


def test_resuming_a_wrapper_with_another_target_or_base_precision_is_refused():
    """A wrapper keeps the loss scale and state of the target it was made for: enabling it
    again with another target, or float8 on another base precision, says what to pass."""
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target="bfloat16")
    with pytest.raises(ValueError, match=r"was made for target='bfloat16', .* pass target='bfloat16' to resume"):
        amp_rewrite.enable_mixed_precision_graph_rewrite(opt, target="float16")
    assert amp_rewrite.enable_mixed_precision_graph_rewrite(opt, target="bfloat16") is opt
    if _tf.tensorflow_version() < (2, 18):
        return
    live.stop()
    fp8 = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target="float8")
    live.stop()
    with pytest.raises(ValueError, match=r"made for target='float8', base_precision='bfloat16'.*pass"
                                         r" target='float8', base_precision='bfloat16'") as caught:
        amp_rewrite.enable_mixed_precision_graph_rewrite(fp8, target="float8", base_precision="float16")
    assert "\n" not in str(caught.value) and live.active() is None
