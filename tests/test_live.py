"""The live rewrite: from ``enable_mixed_precision_graph_rewrite`` on, traced functions run in low precision.

What the runtime executes is read two ways, never from Python-side graphs:

* the graphs TensorFlow actually ran (``RunMetadata`` partition graphs, after grappler and
  oneDNN's own rewrites: ``_MklNativeFusedMatMul`` etc.), for ``model.fit``/``evaluate``/
  ``predict`` and custom ``tf.function`` loops;
* the FunctionDefs registered in the eager context (``context.get_function_def``), which
  is what every call — and XLA, for ``jit_compile=True`` — starts from; for XLA the
  numbers show the low-precision body ran (float32 XLA matches float32 to ~1e-7).

Plus: functions traced before enabling stay float32; ``disable_…`` and the
``mixed_precision`` context bound the rewrite; digits accuracy matches float32 for both
targets; the README example runs as written; ``target``/policy/hardware arguments.
Grappler's own AMP is off throughout, so every low-precision op seen is ours.
"""
from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf
import tf_keras
from conftest import TARGET_TO_TOLERANCE, TARGETS, within_points
from tensorflow.core.framework import function_pb2, types_pb2
from tensorflow.core.protobuf import saved_model_pb2
from tensorflow.python.client import session as session_lib
from tensorflow.python.eager import context
from tensorflow.python.eager.polymorphic_function import transform
from tensorflow.python.training.experimental import mixed_precision_global_state

import amp_rewrite
from amp_rewrite.core.functions import called_functions
from amp_rewrite import _tf
from amp_rewrite.training import live, optimizers
from amp_rewrite.training import session as amp_session

ROOT = Path(__file__).resolve().parents[1]
TARGET_TO_LOW = {"float16": "DT_HALF", "bfloat16": "DT_BFLOAT16"}
# A low-precision MatMul is this far from float32 at least (measured on 32×256·256×16
# normal inputs: float16 3e-4, bfloat16 2e-3; float32 under XLA 4e-7).
LOW_PRECISION_MIN_ERROR = 5e-5


@pytest.fixture(autouse=True)
def _no_live_rewrite() -> None:
    """Each test starts and ends with no live rewrite, Keras' float32 policy and grappler's AMP off."""
    live.stop()
    keras.config.set_dtype_policy("float32")
    options = tf.config.optimizer.get_experimental_options()
    assert not options.get("auto_mixed_precision") and not options.get("auto_mixed_precision_onednn_bfloat16")
    yield
    live.stop()
    keras.config.set_dtype_policy("float32")


# --------------------------------------------------------------------------------------
# Reading what runs


@dataclass(frozen=True)
class ComputeNode:
    """A MatMul- or Conv2D-family node of an executed graph or registered function."""

    where: str
    name: str
    op: str
    dtype: str
    device: str

    @property
    def kind(self) -> str:
        return "Conv2D" if "Conv2D" in self.op else "MatMul"


def _compute_nodes(where: str, nodes: Iterable) -> list[ComputeNode]:
    return [ComputeNode(where, n.name, n.op, types_pb2.DataType.Name(n.attr["T"].type), n.device)
            for n in nodes if ("MatMul" in n.op or "Conv2D" in n.op)]


def executed_compute(run: Callable[[], object]) -> list[ComputeNode]:
    """MatMul/Conv2D nodes of every graph partition the runtime executed while ``run`` ran."""
    ctx = context.context()
    ctx.enable_run_metadata()
    try:
        ctx.export_run_metadata()  # drop anything recorded before
        run()
        metadata = ctx.export_run_metadata()
    finally:
        ctx.disable_run_metadata()
    return [node for graph in metadata.function_graphs for partition in graph.partition_graphs
            for node in _compute_nodes("executed", partition.node)]


def registered_compute(names: Iterable[str]) -> list[ComputeNode]:
    """MatMul/Conv2D nodes of the registered functions ``names`` and every function they call."""
    ctx = context.context()
    todo, seen, found = list(names), set(), []
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        function = ctx.get_function_def(name)
        found += _compute_nodes(name, function.node_def)
        todo += [callee for node in function.node_def for callee in called_functions(node) if ctx.has_function(callee)]
    return found


def new_functions(before: set[str], pattern: str = r"__inference_.*") -> list[str]:
    """Functions registered since ``before`` was taken whose name matches ``pattern``."""
    return sorted(n for n in set(context.context().list_function_names()) - before if re.fullmatch(pattern, n))


# Keras 3's per-batch step (train and test; predict's without jit), not its outer wrappers.
ONE_STEP = r"__inference_one_step_on_data_\d+"
ANY_STEP = r"__inference_one_step_on_data.*"


def function_names() -> set[str]:
    return set(context.context().list_function_names())


def assert_all_low(nodes: list[ComputeNode], target: str, kinds: set[str]) -> None:
    """Every node is in the target dtype, and each of ``kinds`` occurs."""
    assert {n.kind for n in nodes} == kinds, f"expected {kinds}, found {[(n.where, n.name, n.op) for n in nodes]}"
    wrong = [(n.where, n.name, n.op, n.dtype) for n in nodes if n.dtype != TARGET_TO_LOW[target]]
    assert not wrong, f"not {target}: {wrong}"


def assert_all_float32(nodes: list[ComputeNode]) -> None:
    assert nodes, "no MatMul/Conv2D found"
    wrong = [(n.where, n.name, n.op, n.dtype) for n in nodes if n.dtype != "DT_FLOAT"]
    assert not wrong, f"rewritten although it should not be: {wrong}"


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


# --------------------------------------------------------------------------------------
# Models and data

MODEL_TO_KINDS = {"mlp": {"MatMul"}, "cnn": {"MatMul", "Conv2D"}}


def build_model(kind: str, classes: int = 3) -> keras.Model:
    keras.utils.set_random_seed(0)
    if kind == "mlp":
        return keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"),
                                 keras.layers.Dense(classes)])
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Conv2D(4, 3, activation="relu"),
                             keras.layers.Flatten(), keras.layers.Dense(classes)])


def model_data(kind: str, n: int = 64) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(0)
    shape = (n, 8) if kind == "mlp" else (n, 8, 8, 1)
    return rng.rand(*shape).astype("float32"), rng.randint(0, 3, size=n)


def compile_model(model: keras.Model, opt, jit_compile: bool = False) -> None:
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  jit_compile=jit_compile)


@pytest.fixture(scope="module")
def matmul_inputs() -> tuple[tf.Tensor, tf.Tensor, np.ndarray]:
    a = tf.random.normal((32, 256), seed=1)
    b = tf.random.normal((256, 16), seed=2)
    return a, b, (a @ b).numpy()


def _matmul(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
    return tf.matmul(a, b)


# --------------------------------------------------------------------------------------
# 1. Executed bodies


@pytest.mark.parametrize("kind", MODEL_TO_KINDS)
@pytest.mark.parametrize("target", TARGETS)
def test_fit_evaluate_predict_execute_in_target_dtype(target, kind):
    """Keras 3 model.fit/evaluate/predict (jit_compile=False): every MatMul and Conv2D the
    runtime executed — forward and gradients — is in the target dtype."""
    before = function_names()
    model = build_model(kind)
    compile_model(model, amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.05), target=target))
    x, y = model_data(kind)
    fit = executed_compute(lambda: model.fit(x, y, batch_size=16, epochs=1, verbose=0))
    assert_all_low(fit, target, MODEL_TO_KINDS[kind])
    assert sum(n.kind == "MatMul" for n in fit) >= 3, "expected the forward MatMul and both of its gradients"
    assert_all_low(executed_compute(lambda: model.evaluate(x, y, verbose=0)), target, MODEL_TO_KINDS[kind])
    assert_all_low(executed_compute(lambda: model.predict(x, verbose=0)), target, MODEL_TO_KINDS[kind])
    steps = new_functions(before, ANY_STEP)
    assert len(steps) >= 3  # train, test and predict steps
    assert_all_low(registered_compute(steps), target, MODEL_TO_KINDS[kind])


@pytest.mark.parametrize("target", TARGETS)
def test_custom_training_loop_executes_in_target_dtype(target):
    """A tf.function loop with get_scaled_loss/get_unscaled_gradients/apply_gradients runs
    its CNN forward and backward in the target dtype and trains (the loss falls)."""
    model = build_model("cnn")
    opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target=target)
    opt.build(model.trainable_variables)
    x, y = model_data("cnn", 32)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step() -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x))
            scaled = opt.get_scaled_loss(loss)
        grads = opt.get_unscaled_gradients(tape.gradient(scaled, model.trainable_variables))
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss

    losses = []
    executed = executed_compute(lambda: losses.append(float(step())))
    assert_all_low(executed, target, {"MatMul", "Conv2D"})
    assert_all_low(registered_compute([step.get_concrete_function().name]), target, {"MatMul", "Conv2D"})
    losses += [float(step()) for _ in range(10)]
    assert int(opt.iterations.numpy()) == 11
    assert losses[-1] < losses[0]


@pytest.mark.parametrize("target", TARGETS)
def test_function_traced_before_enabling_stays_float32(target, matmul_inputs):
    """Only new traces are rewritten: functions traced (or already run) before the call keep
    computing in float32 — bit-for-bit the eager result; the same body traced after runs
    in low precision."""
    a, b, expected = matmul_inputs
    traced, ran = tf.function(_matmul), tf.function(_matmul)
    traced.get_concrete_function(a, b)
    ran(a, b)
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target=target)
    assert_all_float32(executed_compute(lambda: traced(a, b)))
    assert_all_float32(registered_compute([ran.get_concrete_function(a, b).name]))
    np.testing.assert_array_equal(ran(a, b).numpy(), expected)
    late = tf.function(_matmul)
    assert_all_low(executed_compute(lambda: late(a, b)), target, {"MatMul"})
    error = relative_error(late(a, b).numpy(), expected)
    assert LOW_PRECISION_MIN_ERROR < error < TARGET_TO_TOLERANCE[target]


def _relu_of_nested(inner: Callable) -> Callable:
    def outer(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        return tf.nn.relu(inner(a, b)) * 2.0

    return outer


def _called_functions(name: str) -> list:
    """The FunctionDefs the registered function ``name`` calls directly."""
    ctx = context.context()
    return [ctx.get_function_def(node.attr["f"].func.name) for node in ctx.get_function_def(name).node_def
            if node.op in ("PartitionedCall", "StatefulPartitionedCall")]


@pytest.mark.parametrize("cross_function", [False, True], ids=["per-function", "cross_function"])
def test_shared_nested_function_is_rewritten_as_a_private_copy(cross_function, matmul_inputs):
    """A nested tf.function called by a function traced before enabling and by one traced
    after: the later caller runs a rewritten private copy (with cross_function, its result
    is bfloat16: the signature changed), the earlier one keeps calling the float32 original
    and returns exactly what it did; after ``disable_…`` a new trace calls the original."""
    a, b, expected = matmul_inputs
    outer = _relu_of_nested(tf.function(_matmul))
    before = tf.function(outer)
    first = before(a, b).numpy()
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16",
                                                     cross_function=cross_function)
    assert live.active().cross_function is cross_function
    after = tf.function(outer)
    after_name = live.compat_name(after.get_concrete_function(a, b).name)
    (copy,) = _called_functions(after_name)
    assert copy.signature.name.endswith(f"_amp_{after_name}")
    output_type = types_pb2.DataType.Name(copy.signature.output_arg[0].type)
    assert output_type == ("DT_BFLOAT16" if cross_function else "DT_FLOAT")
    (original,) = _called_functions(live.compat_name(before.get_concrete_function(a, b).name))
    assert types_pb2.DataType.Name(original.signature.output_arg[0].type) == "DT_FLOAT"

    assert_all_low(executed_compute(lambda: after(a, b)), "bfloat16", {"MatMul"})
    assert_all_float32(registered_compute([live.compat_name(before.get_concrete_function(a, b).name)]))
    np.testing.assert_array_equal(before(a, b).numpy(), first)  # it ran before: no new partition graphs
    error = relative_error(after(a, b).numpy(), 2.0 * np.maximum(expected, 0))
    assert LOW_PRECISION_MIN_ERROR < error < TARGET_TO_TOLERANCE["bfloat16"]
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    assert_all_float32(executed_compute(lambda: tf.function(outer)(a, b)))


def test_disable_stops_rewriting_new_traces(matmul_inputs):
    """After disable_…, new traces stay float32; a function rewritten before stays rewritten.
    Disabling twice warns that nothing is enabled."""
    a, b, _ = matmul_inputs
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")
    rewritten = tf.function(_matmul)
    rewritten.get_concrete_function(a, b)
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    assert live.active() is None
    after = tf.function(_matmul)
    assert_all_float32(executed_compute(lambda: after(a, b)))
    assert_all_low(executed_compute(lambda: rewritten(a, b)), "bfloat16", {"MatMul"})
    with pytest.warns(UserWarning, match="called, but the rewrite is not enabled"):
        amp_rewrite.disable_mixed_precision_graph_rewrite()


@pytest.mark.parametrize("target", TARGETS)
def test_mixed_precision_context_scopes_the_rewrite(target, matmul_inputs):
    """``with mixed_precision(target=…)`` rewrites the traces inside the block only."""
    a, b, _ = matmul_inputs
    outside_before = tf.function(_matmul)
    outside_before.get_concrete_function(a, b)
    inside = tf.function(_matmul)
    with amp_rewrite.mixed_precision(target=target) as settings:
        assert settings.target == target and live.active() is settings
        inside.get_concrete_function(a, b)
    assert live.active() is None
    outside_after = tf.function(_matmul)
    assert_all_float32(executed_compute(lambda: outside_before(a, b)))
    assert_all_low(executed_compute(lambda: inside(a, b)), target, {"MatMul"})
    assert_all_float32(executed_compute(lambda: outside_after(a, b)))


def test_mixed_precision_context_restores_the_enabled_rewrite(matmul_inputs):
    """Inside an enabled bfloat16 rewrite, a float16 block applies to its traces only; after
    it, new traces are bfloat16 again."""
    a, b, _ = matmul_inputs
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")
    inside = tf.function(_matmul)
    with amp_rewrite.mixed_precision(target="float16"):
        inside.get_concrete_function(a, b)
    after = tf.function(_matmul)
    assert_all_low(executed_compute(lambda: inside(a, b)), "float16", {"MatMul"})
    assert_all_low(executed_compute(lambda: after(a, b)), "bfloat16", {"MatMul"})
    assert live.active().target == "bfloat16"


# Whether the installed TensorFlow's XLA compiles the registered (rewritten) body.
XLA_REACHED = _tf.tensorflow_version() >= live.XLA_REWRITE_MIN_TENSORFLOW


@pytest.mark.parametrize("target", TARGETS)
def test_jit_compiled_function_compiles_the_rewritten_body(target, matmul_inputs):
    """tf.function(jit_compile=True): the registered body (what XLA compiles) holds the
    low-precision MatMul, and the XLA result carries low-precision error — float32 XLA of
    the same function is within 1e-6 of float32. On a TensorFlow whose XLA compiles the
    traced body instead, the trace warns, naming the function, and it runs in float32."""
    a, b, expected = matmul_inputs
    float32_jit = tf.function(_matmul, jit_compile=True)
    assert relative_error(float32_jit(a, b).numpy(), expected) < 1e-6
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target=target)
    jit = tf.function(_matmul, jit_compile=True)
    if not XLA_REACHED:
        with pytest.warns(UserWarning, match=r"compiles a jit_compile=True function .* may run in float32") as caught:
            name = jit.get_concrete_function(a, b).function_def.signature.name
        assert any(name in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert relative_error(jit(a, b).numpy(), expected) < 1e-6  # what the warning warns of
        return
    body = context.context().get_function_def(jit.get_concrete_function(a, b).name)
    assert body.attr["_XlaMustCompile"].b
    assert_all_low(_compute_nodes("jit", body.node_def), target, {"MatMul"})
    error = relative_error(jit(a, b).numpy(), expected)
    assert LOW_PRECISION_MIN_ERROR < error < TARGET_TO_TOLERANCE[target]


@pytest.mark.parametrize("target", TARGETS)
def test_keras_jit_compile_runs_the_rewritten_step(target):
    """model.compile(jit_compile=True): the XLA-compiled train/predict steps are registered
    rewritten; predictions carry low-precision error yet stay within tolerance of the same
    model in float32, and the fit losses track float32's."""
    kind = "mlp"
    x, y = model_data(kind)
    reference = build_model(kind)
    compile_model(reference, keras.optimizers.SGD(0.1), jit_compile=True)
    expected_predictions = reference.predict(x, verbose=0)
    expected_losses = reference.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history["loss"]

    before = function_names()
    model = build_model(kind)
    compile_model(model, amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.1), target=target),
                  jit_compile=True)
    if XLA_REACHED:
        predictions = model.predict(x, verbose=0)
    else:
        with pytest.warns(UserWarning, match="may run in float32; use TensorFlow 2.18 or newer"):
            predictions = model.predict(x, verbose=0)
    error = relative_error(predictions, expected_predictions)
    assert (LOW_PRECISION_MIN_ERROR if XLA_REACHED else -1.0) < error < TARGET_TO_TOLERANCE[target]
    losses = model.fit(x, y, batch_size=16, epochs=2, verbose=0, shuffle=False).history["loss"]
    np.testing.assert_allclose(losses, expected_losses, rtol=TARGET_TO_TOLERANCE[target])
    assert losses[1] < losses[0]
    steps = new_functions(before, ONE_STEP)
    assert len(steps) >= 2  # predict's and train's jit steps
    for name in steps:
        body = context.context().get_function_def(name)
        assert body.attr["_XlaMustCompile"].b, f"{name} is not XLA-compiled"
        assert_all_low(_compute_nodes(name, body.node_def), target, {"MatMul"})


# --------------------------------------------------------------------------------------
# 2. Convergence

DIGITS_EPOCHS = 8


@pytest.fixture(scope="module")
def digits() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    images, labels = load_digits(return_X_y=True)
    images = (images / 16.0).astype("float32").reshape(-1, 8, 8, 1)
    return tuple(train_test_split(images, labels, test_size=0.25, random_state=0, stratify=labels))


def digits_accuracy(digits, target: str | None) -> tuple[float, list[str]]:
    """Test accuracy of a small CNN after DIGITS_EPOCHS epochs, and its train-step functions."""
    x_train, x_test, y_train, y_test = digits
    before = function_names()
    model = build_model("cnn", classes=10)
    opt = keras.optimizers.Adam(1e-2)
    if target is not None:
        opt = amp_rewrite.enable_mixed_precision_graph_rewrite(opt, target=target)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"], jit_compile=False)
    model.fit(x_train, y_train, batch_size=32, epochs=DIGITS_EPOCHS, verbose=0)
    accuracy = model.evaluate(x_test, y_test, verbose=0)[1]
    return accuracy, new_functions(before, ANY_STEP)


@pytest.fixture(scope="module")
def float32_digits_accuracy(digits) -> float:
    accuracy, steps = digits_accuracy(digits, None)
    assert_all_float32(registered_compute(steps))
    return accuracy


@pytest.mark.parametrize("target", TARGETS)
def test_digits_accuracy_matches_float32(target, digits, float32_digits_accuracy):
    """load_digits, CNN, 8 epochs of Adam: the rewritten model's test accuracy is within
    one point of float32's (which is ≥ 95%, past the steep part of the curve)."""
    assert float32_digits_accuracy >= 0.95
    accuracy, steps = digits_accuracy(digits, target)
    assert_all_low(registered_compute(steps), target, {"MatMul", "Conv2D"})
    assert within_points(accuracy, float32_digits_accuracy, 1), (target, accuracy, float32_digits_accuracy)


# --------------------------------------------------------------------------------------
# 7. The README example


def readme_example() -> str:
    """The ```python block of README.md that calls enable_mixed_precision_graph_rewrite(opt)."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        if "enable_mixed_precision_graph_rewrite(opt)" in block:
            return block
    pytest.fail("no ```python block calling enable_mixed_precision_graph_rewrite(opt) in README.md")


@pytest.mark.parametrize("target", TARGETS)
def test_readme_example_works_as_written(target, capsys):
    """The documented example, run as written with only target= added: it trains 2 epochs
    with our loss-scale optimizer and every MatMul that ran is in the target dtype."""
    code = readme_example()
    assert code.count("enable_mixed_precision_graph_rewrite(opt)") == 1
    code = code.replace("enable_mixed_precision_graph_rewrite(opt)",
                        f"enable_mixed_precision_graph_rewrite(opt, target={target!r})")
    namespace: dict = {}
    executed = executed_compute(lambda: exec(compile(code, "README example", "exec"), namespace))
    assert_all_low(executed, target, {"MatMul"})
    opt = namespace["opt"]
    assert isinstance(opt, optimizers.LossScaleOptimizer) and namespace["model"].optimizer is opt
    assert int(opt.iterations.numpy()) == 2 * 256 // 32
    assert "accuracy" in capsys.readouterr().out


# --------------------------------------------------------------------------------------
# 6. target, policies and hardware


def test_unknown_target_is_rejected_and_nothing_is_enabled():
    with pytest.raises(ValueError, match=r"unknown target 'int8'; use one of float16, bfloat16"):
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="int8")
    assert live.active() is None


@pytest.mark.parametrize("dtype", [tf.float16, tf.bfloat16, np.float16], ids=["tf.float16", "tf.bfloat16", "np.float16"])
def test_a_dtype_names_its_target(dtype):
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target=dtype)
    assert live.active().target == tf.as_dtype(dtype).name


def test_a_dtype_that_is_no_target_says_which_to_use():
    with pytest.raises(ValueError, match=r"unknown target 'int32'; use one of float16, bfloat16"):
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target=tf.int32)
    assert live.active() is None


def test_enabling_again_with_another_target_warns():
    """Switching target while enabled warns (earlier traces keep theirs); the same target again,
    or a switch after disable_…, is silent."""
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")
    with pytest.warns(UserWarning, match="enabled for bfloat16 and is now enabled for float16"):
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="float16")
    assert live.active().target == "float16"
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")


def test_float16_with_every_matmul_on_a_cpu_warns_once(matmul_inputs):
    """float16 converts GPU or unplaced nodes only; a trace whose MatMuls are all placed on a CPU
    (as MirroredStrategy on CPUs places them) runs in float32 and warns, once per enabling;
    an unplaced MatMul is rewritten and does not warn."""
    a, b, _ = matmul_inputs

    def on_cpu(a: tf.Tensor, b: tf.Tensor) -> tf.Tensor:
        with tf.device("/CPU:0"):
            return tf.matmul(a, b)

    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="float16")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert_all_low(executed_compute(lambda: tf.function(_matmul)(a, b)), "float16", {"MatMul"})
    with pytest.warns(UserWarning, match="placed on a CPU .* use target='bfloat16'"):
        first = tf.function(on_cpu)
        assert_all_float32(executed_compute(lambda: first(a, b)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tf.function(on_cpu)(a, b)
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="float16")
    with pytest.warns(UserWarning, match="placed on a CPU"):
        tf.function(on_cpu)(a, b)


def test_disable_puts_back_everything_enabling_installed():
    """Enabling installs TensorFlow's trace callback, a wrapper of ``BaseSession.__init__`` and
    TensorFlow's "graph rewrite enabled" flag, once however often it is enabled or nested;
    ``disable_…`` puts each back as it was. A Session created while it was on keeps running
    its mirror (bfloat16) after that; one created after runs the graph as it is."""
    init, callbacks = session_lib.BaseSession.__init__, list(transform.CONCRETE_FUNCTION_CALLBACKS)
    flag = mixed_precision_global_state.is_mixed_precision_graph_rewrite_enabled()
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, (4, 4))
        product = tf.matmul(x, x)
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")
    with amp_rewrite.mixed_precision(target="float16"):
        assert len(transform.CONCRETE_FUNCTION_CALLBACKS) == len(callbacks) + 1
    assert session_lib.BaseSession.__init__ is not init and live.active().target == "bfloat16"
    assert mixed_precision_global_state.is_mixed_precision_graph_rewrite_enabled()
    during = tf.compat.v1.Session(graph=graph)
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    assert session_lib.BaseSession.__init__ is init
    assert list(transform.CONCRETE_FUNCTION_CALLBACKS) == callbacks
    assert mixed_precision_global_state.is_mixed_precision_graph_rewrite_enabled() == flag
    after = tf.compat.v1.Session(graph=graph)
    assert (amp_session.is_mirrored(during), amp_session.is_mirrored(after)) == (True, False)
    for session, dtype in ((during, "DT_BFLOAT16"), (after, "DT_FLOAT")):
        metadata = tf.compat.v1.RunMetadata()
        session.run(product, {x: np.ones((4, 4))}, tf.compat.v1.RunOptions(output_partition_graphs=True), metadata)
        assert [n.dtype for n in _compute_nodes("session", (node for g in metadata.partition_graphs for node in g.node))
                ] == [dtype]
        session.close()


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_keras_mixed_policy_before_enabling_is_an_error(policy):
    """A global Keras 3 mixed policy and the graph rewrite must not both cast: ValueError that
    says how to get out of it."""
    keras.config.set_dtype_policy(policy)
    with pytest.raises(ValueError, match=rf"global Keras dtype policy is '{policy}'.*set_dtype_policy\('float32'\)"):
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")
    assert live.active() is None


def test_tf_keras_mixed_policy_before_enabling_is_an_error():
    tf_keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with pytest.raises(ValueError, match="a tf_keras mixed precision policy"):
            amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="float16")
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


def test_tf_keras_refuses_a_mixed_policy_after_enabling():
    """Enabling sets TensorFlow's global 'graph rewrite enabled' flag, which tf_keras checks."""
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="float16")
    try:
        with pytest.raises(ValueError, match="graph rewrite"):
            tf_keras.mixed_precision.set_global_policy("mixed_float16")
    finally:
        tf_keras.mixed_precision.set_global_policy("float32")


def test_keras_mixed_policy_after_enabling_warns_at_the_next_trace(matmul_inputs):
    a, b, _ = matmul_inputs
    amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")
    keras.config.set_dtype_policy("mixed_float16")
    with pytest.warns(UserWarning, match="mixed precision Keras policy was set after enabling"):
        tf.function(_matmul)(a, b)


def _fake_hardware(monkeypatch, cpu_flags: set[str], gpu_capabilities: list[tuple[int, int]]) -> None:
    gpus = [tf.config.PhysicalDevice(name=f"/physical_device:GPU:{i}", device_type="GPU")
            for i in range(len(gpu_capabilities))]
    name_to_capability = {g.name: c for g, c in zip(gpus, gpu_capabilities)}
    monkeypatch.setattr(live, "cpu_flags", lambda: set(cpu_flags))
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: list(gpus) if kind == "GPU" else [])
    monkeypatch.setattr(tf.config.experimental, "get_device_details",
                        lambda device: {"compute_capability": name_to_capability[device.name]})


@pytest.mark.parametrize(
    "cpu_flags, gpus, target, reason",
    [
        ({"avx512f", "avx512_bf16"}, [], "bfloat16", "the CPU has avx512_bf16"),
        ({"amx_bf16"}, [], "bfloat16", "the CPU has amx_bf16"),
        ({"avx512_bf16", "amx_bf16"}, [], "bfloat16", "the CPU has avx512_bf16 and amx_bf16"),
        ({"avx2"}, [], None, "neither AVX512-BF16 nor AMX"),
        (set(), [(8, 0), (7, 0)], "float16", "2 GPU(s) of compute capability 7.0 or higher"),
        ({"avx512_bf16"}, [(8, 0), (6, 1)], None, "GPU:1 (6.1) are below compute capability 7.0"),
    ],
    ids=["avx512-bf16", "amx", "both", "plain-cpu", "volta+", "one-old-gpu"],
)
def test_detect_target(monkeypatch, cpu_flags, gpus, target, reason):
    """float16 only if every GPU is 7.0+; else bfloat16 on an AVX512-BF16/AMX CPU when there is no GPU."""
    _fake_hardware(monkeypatch, cpu_flags, gpus)
    detected, why = live.detect_target()
    assert detected == target
    assert reason in why


def test_no_suitable_hardware_warns_once_and_leaves_functions_alone(monkeypatch, matmul_inputs):
    """target=None without a 7.0+ GPU or a bf16 CPU: one warning, no rewrite, yet the
    optimizer is wrapped (its loss scaling still works in float32)."""
    a, b, _ = matmul_inputs
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with monkeypatch.context() as patch:
            _fake_hardware(patch, {"avx2"}, [])
            opt = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD())
        after = tf.function(_matmul)
        nodes = executed_compute(lambda: after(a, b))
    ours = [str(w.message) for w in caught if "amp_rewrite" in str(w.message)]
    assert len(ours) == 1 and "stays off" in ours[0] and "pass target= to force one" in ours[0], ours
    assert live.active() is None
    assert isinstance(opt, optimizers.LossScaleOptimizer)
    assert_all_float32(nodes)


def test_detected_target_is_used(monkeypatch, matmul_inputs):
    """target=None on a bf16 CPU (faked) rewrites to bfloat16."""
    a, b, _ = matmul_inputs
    with monkeypatch.context() as patch:
        _fake_hardware(patch, {"amx_bf16"}, [])
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD())
    assert live.active().target == "bfloat16"
    late = tf.function(_matmul)
    assert_all_low(executed_compute(lambda: late(a, b)), "bfloat16", {"MatMul"})


# --------------------------------------------------------------------------------------
# Exporting


def _saved_compute(path: Path) -> list[ComputeNode]:
    """MatMul/Conv2D nodes of every function in a SavedModel (what TF Serving would run)."""
    proto = saved_model_pb2.SavedModel.FromString((path / "saved_model.pb").read_bytes())
    return [node for graph in proto.meta_graphs for function in graph.graph_def.library.function
            for node in _compute_nodes(function.signature.name, function.node_def)]


def test_export_after_enabling_is_low_precision_and_float32_after_disabling(tmp_path):
    """``model.export`` traces new functions, so while the rewrite is on the SavedModel computes
    in bfloat16 (and loads and serves, with the private copies it calls); exported after
    ``disable_…`` it is float32 again — the README's recipe for a float32 export."""
    model = build_model("mlp")
    compile_model(model, amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(0.05), target="bfloat16"))
    x, y = model_data("mlp")
    model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    expected = model.predict(x, verbose=0)
    model.export(tmp_path / "low", verbose=False)
    assert_all_low(_saved_compute(tmp_path / "low"), "bfloat16", {"MatMul"})
    low = tf.saved_model.load(str(tmp_path / "low"))  # held: serve() needs its variables
    served = low.serve(x).numpy()
    assert relative_error(served, expected) < TARGET_TO_TOLERANCE["bfloat16"]
    amp_rewrite.disable_mixed_precision_graph_rewrite()
    model.export(tmp_path / "float32", verbose=False)
    assert_all_float32(_saved_compute(tmp_path / "float32"))
    exported = tf.saved_model.load(str(tmp_path / "float32"))
    float32 = exported.serve(x).numpy()
    np.testing.assert_allclose(float32, model(x).numpy(), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------
# What enabling owns: hooks put back in any order, TensorFlow's internals checked first, a
# failed function swap leaves the user's function registered


def _tensorflow_hooks() -> tuple:
    """What enabling changes in TensorFlow: the trace hooks, ``BaseSession.__init__``, the global flag."""
    return (tuple(transform.CONCRETE_FUNCTION_CALLBACKS), tuple(transform.FUNC_GRAPH_TRANSFORMS),
            session_lib.BaseSession.__init__, mixed_precision_global_state.is_mixed_precision_graph_rewrite_enabled())


@pytest.mark.parametrize("order", ["first-first", "second-first"])
def test_two_enables_and_their_disables_in_any_order_leave_tensorflow_as_it_was(order):
    """Each enable is an enablement its wrapper holds; ``disable_…(opt)`` stops exactly that one.
    The hooks stay while either is active — new traces take the newest active one's settings —
    and every one is put back when the last goes, whichever order they go in."""
    before = _tensorflow_hooks()
    first = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")
    with pytest.warns(UserWarning, match="now enabled for float16"):
        second = amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="float16")
    installed = _tensorflow_hooks()
    assert installed != before and live.active().target == "float16"
    gone, kept = (first, second) if order == "first-first" else (second, first)
    amp_rewrite.disable_mixed_precision_graph_rewrite(gone)
    assert _tensorflow_hooks() == installed
    assert live.active().target == {first: "bfloat16", second: "float16"}[kept]
    with pytest.warns(UserWarning, match=r"disable_mixed_precision_graph_rewrite\(opt\) called, but"):
        amp_rewrite.disable_mixed_precision_graph_rewrite(gone)  # once is enough: the other stays
    assert live.active() is not None
    amp_rewrite.disable_mixed_precision_graph_rewrite(kept)
    assert _tensorflow_hooks() == before and live.active() is None


_REMOVE_AND_ENABLE = """
import sys
from tensorflow.python.client import session
from tensorflow.python.eager.polymorphic_function import transform
from tensorflow.python.training.experimental import mixed_precision_global_state as flag
from tensorflow.python.ops import control_flow_v2_func_graphs as loops
import keras
import amp_rewrite

def hooks():
    return (list(transform.CONCRETE_FUNCTION_CALLBACKS), list(transform.FUNC_GRAPH_TRANSFORMS),
            session.BaseSession.__init__, flag.is_mixed_precision_graph_rewrite_enabled())

for owner, name, target in [(session.BaseSession, "_call_tf_sessionprun", "bfloat16"),
                            (keras.mixed_precision.LossScaleOptimizer, "_tf_apply", "bfloat16"),
                            (transform, "FUNC_GRAPH_TRANSFORMS", "bfloat16"),
                            (loops, "ControlFlowFuncGraph", "float8")]:
    saved = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    before = hooks()
    delattr(owner, name)
    try:
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target=target,
                                                         **({"amax_history_length": 4} if target == "float8" else {}))
        print("ENABLED", name)
    except amp_rewrite.AmpRewriteError as error:
        print("REFUSED", name, "|", error)
    setattr(owner, name, saved)
    print("UNCHANGED", name, hooks() == before)
"""


def test_enabling_refuses_in_one_line_before_installing_anything_when_a_private_name_is_gone():
    """In a fresh process, one private name a feature of enabling needs is removed (the Session
    path's, the loss-scale optimizer's, the live rewrite's, FP8 training's) and ``enable_…`` itself is called:
    it refuses in one line naming TensorFlow's version, the name and the feature, and leaves
    the hooks, ``BaseSession.__init__`` and the global flag as they were."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _REMOVE_AND_ENABLE], capture_output=True, text=True, timeout=300,
                         env={**__import__("os").environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
    lines = [line for line in run.stdout.splitlines() if line.startswith(("REFUSED", "ENABLED", "UNCHANGED"))]
    assert len(lines) == 8, run.stdout + run.stderr[-3000:]
    for name, feature in (("_call_tf_sessionprun", "the Session path"), ("_tf_apply", "loss-scale optimizer"),
                          ("FUNC_GRAPH_TRANSFORMS", "the live rewrite"), ("ControlFlowFuncGraph", "FP8 training")):
        (refused,) = [line for line in lines if line.startswith(f"REFUSED {name} ")]
        message = refused.partition("| ")[2]
        assert f"TensorFlow {tf.__version__}" in message and f"{name} is gone" in message and feature in message
        assert f"UNCHANGED {name} True" in lines


def test_a_failed_function_swap_leaves_the_users_function_registered(monkeypatch, matmul_inputs):
    """The rewritten body replaces the traced one under its name; when TensorFlow refuses that
    registration, the traced body is registered again, no private copy of ours is left behind
    (``inner``, traced before enabling, is copied into ``outer``'s rewrite), a warning says so and
    the call runs the traced body."""
    a, b, expected = matmul_inputs
    traced: dict = {}
    transform.CONCRETE_FUNCTION_CALLBACKS.insert(0, lambda f: traced.setdefault(
        f.function_def.signature.name, function_pb2.FunctionDef.FromString(f.function_def.SerializeToString())))
    original_add = context.Context.add_function_def

    def add_failing_for_rewritten_bodies(self, fdef):
        calls_a_copy = any("f" in node.attr and "_amp_" in node.attr["f"].func.name for node in fdef.node_def)
        if fdef.signature.name in traced and calls_a_copy:  # the rewritten body, not the traced one
            raise tf.errors.InvalidArgumentError(None, None, "registration failed")
        return original_add(self, fdef)

    inner = tf.function(_matmul)
    outer = tf.function(lambda a, b: inner(a, b) + 1.0)
    inner(a, b)
    before = function_names()
    try:
        amp_rewrite.enable_mixed_precision_graph_rewrite(keras.optimizers.SGD(), target="bfloat16")
        monkeypatch.setattr(context.Context, "add_function_def", add_failing_for_rewritten_bodies)
        with pytest.warns(UserWarning, match=r"did not register the rewritten .*\(registration failed\), so it runs"
                                             " as traced"):
            result = outer(a, b)
    finally:
        transform.CONCRETE_FUNCTION_CALLBACKS.pop(0)
    assert traced, "the trace reached the callbacks"
    for name in traced:
        registered = context.context().get_function_def(name)
        assert [node.op for node in registered.node_def] == [node.op for node in traced[name].node_def]
    assert not [name for name in function_names() - before if "_amp_" in name]
    assert relative_error(result.numpy(), expected + 1.0) < 1e-6  # float32
