"""Where a converted model first diverges (``amp_rewrite.calibration.diverge``, ``explain
--diverge``, ``dump --diverge``), on Keras models built to fail in low precision:

1. an activation over float16's range (``x * x * 5000`` after Dense+ReLU): the Mul that
   overflows is named, not the MatMul after it that only carries the infinity;
2. a LayerNorm (BERT's epsilon 1e-12) on inputs of scale 1e-4 under lists that let its
   statistics run in float16: the variance's SquaredDifference is named;
3. a softmax fed large logits (a bias of 2e4: float16 rounds them to steps of 16): the
   Softmax is named, and, once it runs float32, the converted node that feeds it;
4. a float8 matmul whose amax is stale (an overlay's amax 10,000 times too small);

in each the suggested ``--keep`` is checked apart from the search: ``convert --keep ...
--inputs`` passes validation, and fails it without the keep. Then the order of execution
(a function body before its call), the report, a conversion on disk (``--converted``),
and bad input: no divergence (exit 0), a model without a numeric output, inputs that do
not fit, nothing asked (exit 2, one line).
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.framework.graph_pb2 import GraphDef

import amp_rewrite
from amp_rewrite.calibration import diverge
from amp_rewrite.calibration.savedmodel import read_model
from amp_rewrite.core import functions
from amp_rewrite.core.graph_io import make_node_def
from amp_rewrite.core.program import MAIN_GRAPH, Program, program_of

from conftest import NEEDS_FLOAT8
from test_cli import assert_ok, error_line, run_cli

FEATURES = 16
NORM_FEATURES = 64
# The lists a user loosened for speed: a layer norm's statistics in float16.
LOOSE_LISTS = "deny: {remove: [Mean]}\ninfer: {add: [Mean, SquaredDifference, Rsqrt]}\n"


def _square_model(path: Path) -> None:
    """x → Dense 32 + ReLU → x * x * 5000 (a custom layer) → Dense 4."""
    import keras

    class Square(keras.layers.Layer):
        def call(self, x: tf.Tensor) -> tf.Tensor:
            return x * x * 5000.0

    keras.utils.set_random_seed(0)
    x = keras.Input((FEATURES,), name="x")
    h = keras.layers.Dense(32, activation="relu", name="hidden")(x)
    # Named: an unnamed model's nodes are "functional_<n>_1/...", n counting the models this
    # process built before, and the tests below name its nodes.
    model = keras.Model(x, keras.layers.Dense(4, name="head")(Square(name="square")(h)), name="model")
    model.export(str(path), verbose=False)


def _norm_model(path: Path) -> None:
    """x → Dense 64 → LayerNormalization (epsilon 1e-12, as BERT's) → Dense 4."""
    import keras

    keras.utils.set_random_seed(0)
    x = keras.Input((NORM_FEATURES,), name="x")
    h = keras.layers.LayerNormalization(epsilon=1e-12, name="norm")(keras.layers.Dense(64, name="hidden")(x))
    keras.Model(x, keras.layers.Dense(4, name="head")(h), name="model").export(str(path), verbose=False)


def _softmax_model(path: Path) -> None:
    """x → Dense 32 + ReLU → Dense 8 with bias 2e4 (logits) → Softmax → Dense 4."""
    import keras

    keras.utils.set_random_seed(0)
    x = keras.Input((FEATURES,), name="x")
    h = keras.layers.Dense(32, activation="relu", name="hidden")(x)
    logits = keras.layers.Dense(8, bias_initializer=keras.initializers.Constant(2e4), name="logits")(h)
    keras.Model(x, keras.layers.Dense(4, name="head")(keras.layers.Softmax(name="probs")(logits)), name="model").export(
        str(path), verbose=False)


class _Text(tf.Module):
    """A dense layer whose only output is its values as strings."""

    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(np.ones((FEATURES, 4), np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, FEATURES], tf.float32, name="x")])
    def __call__(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"text": tf.strings.as_string(tf.matmul(x, self.w))}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("diverge")
    paths = {name: root / name for name in ("square", "norm", "softmax", "text")}
    _square_model(paths["square"])
    _norm_model(paths["norm"])
    _softmax_model(paths["softmax"])
    text = _Text()
    tf.saved_model.save(text, str(paths["text"]), signatures={"serving_default": text.__call__})
    return paths


def _inputs(path: Path, scale: float, features: int = FEATURES) -> Path:
    np.savez(path, x=(np.random.default_rng(0).standard_normal((16, features)) * scale).astype(np.float32))
    return path


def _find(model_path: Path, inputs: Path, target: str = "float16", overlay: Path | None = None) -> diverge.Divergence:
    return amp_rewrite.find_divergence(model_path, inputs, target=target, lists=overlay)


def _keep_args(divergence: diverge.Divergence) -> list[str]:
    return [part for entry in divergence.keep for part in ("--keep", entry)]


def _assert_keep_fixes(tmp_path: Path, model: Path, inputs: Path, divergence: diverge.Divergence,
                       *options: object) -> None:
    """Checked apart from the search: convert with the keeps passes validation on the inputs;
    without them it fails."""
    assert divergence.fixed and divergence.keep, "\n".join(divergence.lines())
    plain = run_cli("convert", model, tmp_path / "plain", "--inputs", inputs, *options)
    assert plain.code == 1 and "FAIL" in plain.out, plain.out + plain.err
    kept = run_cli("convert", model, tmp_path / "kept", "--inputs", inputs, *options, *_keep_args(divergence))
    assert_ok(kept)
    assert "FAIL" not in kept.out and re.search(r"^ *ok ", kept.out, re.M), kept.out


def test_an_activation_over_float16s_range_names_the_mul_that_overflows(tmp_path: Path,
                                                                        models: dict[str, Path]) -> None:
    """Rule: the first diverging node is the first whose output leaves the tolerance while
    what it reads is within it: the Mul by 5000 turns infinite; the head MatMul, infinite
    too, only carries it (it is named next, once the Mul runs float32 and its output
    overflows the MatMul's float16 cast)."""
    inputs = _inputs(tmp_path / "x.npz", 4.0)
    found = _find(models["square"], inputs)
    first = found.first
    assert first is not None and first.op == "Mul" and first.node[1].endswith("square_1/mul_1"), found.lines()
    assert first.error == float("inf") and first.converted and first.largest > 65504
    assert first.path[0] == first.node[1] and any(step.endswith("head_1/MatMul") for step in first.path)
    assert first.path[-1].startswith("output ")
    assert list(found.keep)[0] == re.escape(first.node[1])
    _assert_keep_fixes(tmp_path, models["square"], inputs, found)


def test_a_layernorm_whose_variance_underflows_in_float16_names_the_variance(tmp_path: Path,
                                                                            models: dict[str, Path]) -> None:
    """Inputs of scale 1e-4: the squared deviations (~1e-8) fall below float16's subnormals
    (6e-8 apart), the variance collapses and Rsqrt(variance + 1e-12) blows up. The default
    float16 lists keep a layer norm's statistics float32 (no divergence); under lists that
    let them run in float16, the variance's SquaredDifference is named."""
    inputs = _inputs(tmp_path / "x.npz", 1e-4, NORM_FEATURES)
    assert _find(models["norm"], inputs).first is None
    overlay = tmp_path / "loose.yaml"
    overlay.write_text(LOOSE_LISTS, encoding="utf-8")
    found = _find(models["norm"], inputs, overlay=overlay)
    first = found.first
    assert first is not None and first.op == "SquaredDifference" and "norm_1/moments" in first.node[1], found.lines()
    assert any("Rsqrt" in step for step in first.path), first.path
    _assert_keep_fixes(tmp_path, models["norm"], inputs, found, "--lists", overlay)


def test_a_softmax_fed_large_logits_names_the_softmax_then_what_feeds_it(tmp_path: Path,
                                                                        models: dict[str, Path]) -> None:
    """Logits 2e4 + O(1): float16 rounds them to steps of 16, within tolerance relative to
    their size, but the Softmax of them is far off. Kept float32 it still is (its inputs
    were rounded): a float32 node that diverges amplifies what feeds it, so the converted
    BiasAdd that makes the logits is kept next, and that fixes it."""
    inputs = _inputs(tmp_path / "x.npz", 1.0)
    found = _find(models["softmax"], inputs)
    first = found.first
    assert first is not None and first.op == "Softmax" and first.converted and first.error > 0.01, found.lines()
    second = found.steps[1].found
    assert second is not None and second.node == first.node and not second.converted
    assert [entry.rsplit("/", 1)[-1] for entry in found.keep] == ["Softmax", "BiasAdd"]
    _assert_keep_fixes(tmp_path, models["softmax"], inputs, found)


@NEEDS_FLOAT8
def test_a_float8_matmul_with_a_stale_amax_is_named(tmp_path: Path, models: dict[str, Path]) -> None:
    """The overlay's amax of the head MatMul's input is 1 where float32 reaches ~5e3: its
    operand is clipped there, the matmul's output is far off, and the report says the amax
    may be stale."""
    overlay = tmp_path / "stale.yaml"
    overlay.write_text("amax:\n  model_1/square_1/mul_1:0: 1.0\n", encoding="utf-8")
    inputs = _inputs(tmp_path / "x.npz", 0.5)
    found = _find(models["square"], inputs, "float8", overlay)
    first = found.first
    assert first is not None and first.runs_in == diverge.FLOAT8 and first.node[1].endswith("head_1/MatMul")
    assert any("amax may be stale" in line for line in found.lines())
    _assert_keep_fixes(tmp_path, models["square"], inputs, found, "--target", "float8", "--lists", overlay)


def test_a_trained_model_found_on_calibration_data_is_fixed_on_held_out_data(tmp_path: Path) -> None:
    """The trained diabetes MLP whose first hidden layer was rescaled ×2e4 (the same function
    in float32, activations ~1.1e5): searched on the calibration split, its first diverging
    node is in that layer; the keeps pass validation on the held-out split. The trained
    digits MLP on its data: no node diverges."""
    import trained_models

    model = trained_models.export("diabetes_overflow", tmp_path / "diabetes")
    calibration = trained_models.save_inputs("diabetes_overflow", "calibration", tmp_path / "calibration.npz")
    held_out = trained_models.save_inputs("diabetes_overflow", "held_out", tmp_path / "held_out.npz")
    found = _find(model, calibration)
    assert found.first is not None and "dense1" in found.first.node[1] and math.isinf(found.first.error), found.lines()
    _assert_keep_fixes(tmp_path, model, held_out, found)
    digits = trained_models.export("digits_mlp", tmp_path / "digits")
    assert _find(digits, trained_models.save_inputs("digits_mlp", "held_out", tmp_path / "digits.npz")).first is None


def test_the_order_is_topological_and_a_called_functions_body_runs_before_its_call(models: dict[str, Path]) -> None:
    """The order the first diverging node is the first of: every node once; in each item a
    node after every node it reads; a called function's body before each call that reaches it."""
    model = read_model(models["square"])
    order = diverge.execution_order(model.program)
    assert len(order) == len(set(order))
    position = {node: index for index, node in enumerate(order)}
    mul = next(node for node in order if node[1].endswith("square_1/mul_1"))
    for node_def in model.program.item(mul[0]).node:
        for tensor in node_def.input:
            producer = (mul[0], tensor.lstrip("^").split(":")[0])
            assert position[producer] < position[(mul[0], node_def.name)], (producer, node_def.name)
    reaching = [(item, name) for item, name in order
                if item == MAIN_GRAPH and mul[0] in _called(model.program, model.graph_def, name)]
    assert reaching and all(position[mul] < position[call] for call in reaching)


def test_a_graph_written_out_of_order_runs_in_topological_order() -> None:
    """GraphDef order is no promise: a node comes after what it reads, whatever the file's order."""
    graph_def = GraphDef()
    make_node_def("Relu", "relu", ["x"], into=graph_def.node, T=types_pb2.DT_FLOAT)
    make_node_def("Placeholder", "x", into=graph_def.node, dtype=types_pb2.DT_FLOAT)
    assert diverge.execution_order(program_of(graph_def)) == [(MAIN_GRAPH, "x"), (MAIN_GRAPH, "relu")]


def _called(program: Program, graph_def: GraphDef, name: str) -> set[str]:
    """Every function the main-graph node ``name`` reaches, through calls."""
    node_def = next(n for n in graph_def.node if n.name == name)
    found, pending = set(), list(functions.called_functions(node_def))
    while pending:
        function = pending.pop()
        if function in program.library and function not in found:
            found.add(function)
            pending.extend(called for n in program.library[function].node_def
                           for called in functions.called_functions(n))
    return found


# --------------------------------------------------------------------------------------
# The command


def test_cli_explain_and_dump_show_the_first_diverging_node(tmp_path: Path, models: dict[str, Path]) -> None:
    inputs = _inputs(tmp_path / "x.npz", 4.0)
    explained = run_cli("explain", models["square"], "--diverge", "--inputs", inputs)
    assert_ok(explained)
    assert re.search(r"first diverging node model_1/square_1/mul_1 \(Mul, converted to float16\)", explained.out)
    assert "path to the worst output: model_1/square_1/mul_1 -> " in explained.out
    assert "fix: --keep 'model_1/square_1/mul_1'" in explained.out
    dumped = run_cli("dump", models["square"], tmp_path / "dump", "--diverge", "--inputs", inputs)
    assert_ok(dumped)
    report = (tmp_path / "dump" / "report.html").read_text(encoding="utf-8")
    assert "first diverging node model_1/square_1/mul_1" in report and "fix: --keep" in report


def test_cli_a_conversion_on_disk_is_compared_as_it_was_written(tmp_path: Path, models: dict[str, Path]) -> None:
    """--converted DST: the first run is DST's. DST was converted with the Mul kept float32,
    so its first diverging node is the head MatMul (the options' own rewrite, keeping
    nothing, would name the Mul); the runs after it rewrite SRC with the options and keeps."""
    inputs = _inputs(tmp_path / "x.npz", 4.0)
    converted = run_cli("convert", models["square"], tmp_path / "dst", "--inputs", inputs, "--keep-failed",
                        "--keep", "model_1/square_1/mul_1")
    assert converted.code == 1 and (tmp_path / "dst" / "saved_model.pb").exists(), converted.err
    run = run_cli("explain", models["square"], "--diverge", "--converted", tmp_path / "dst", "--inputs", inputs)
    assert_ok(run)
    assert "first diverging node model_1/head_1/MatMul (MatMul, converted to float16)" in run.out, run.out
    assert f"run 1, {tmp_path / 'dst'}: " in run.out and "run 2, the options' rewrite with 1 keep entry" in run.out
    assert "fix: --keep 'model_1/head_1/MatMul'" in run.out
    line = error_line(run_cli("explain", models["square"], "x", "--converted", tmp_path / "dst"))
    assert "--converted DST: the conversion --diverge compares; add --diverge" in line


def test_cli_no_divergence_says_so_and_exits_0(tmp_path: Path, models: dict[str, Path]) -> None:
    run = run_cli("explain", models["square"], "--diverge", "--inputs", _inputs(tmp_path / "x.npz", 0.5))
    assert_ok(run)
    assert "Divergence: no node diverges beyond 0.01 from float32 in float16" in run.out


def test_cli_random_inputs_are_a_warning(models: dict[str, Path]) -> None:
    run = run_cli("explain", models["square"], "--diverge")
    assert_ok(run)
    assert "--diverge runs on random inputs" in run.err and "Divergence" in run.out


@pytest.mark.parametrize("case, expected", [
    ("text", "no output of the model is a number, so no run can show where it diverges"),
    ("misfit", "does not fit input 'x' of signature"),
    ("nothing", "name a NODE to explain, or pass --diverge"),
    ("other", "--converted takes a conversion of"),
])
def test_cli_bad_input_is_one_line_exit_2(tmp_path: Path, models: dict[str, Path], case: str, expected: str) -> None:
    args = {"text": [models["text"], "--diverge", "--inputs", _inputs(tmp_path / "x.npz", 1.0)],
            "misfit": [models["square"], "--diverge", "--inputs", _inputs(tmp_path / "narrow.npz", 1.0, 3)],
            "nothing": [models["square"]],
            "other": [models["square"], "--diverge", "--converted", models["softmax"], "--inputs",
                      _inputs(tmp_path / "y.npz", 1.0)]}[case]
    assert expected in error_line(run_cli("explain", *args))
