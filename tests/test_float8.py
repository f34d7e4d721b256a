"""Target float8: the float16 rewrite, then converted matmuls take scaled float8_e4m3fn operands.

Checked three ways: structure (which matmuls, which scales, the report), numbers (the
rewritten graph runs under XLA on CPU within ``FLOAT8.tolerance`` of float32 on held-out
inputs) and the HLO XLA sees (every dot and convolution reads ``multiply(convert(f8),
broadcast(scalar))``, the shape ``MatchFp8Param`` in XLA's GPU GEMM rewriter fuses).
Here ``testing.float8.tensor_amax`` runs the float32 graph and takes each float32 tensor's
largest |x|, the statistic calibration hands over (tests/test_float8_cli.py: the whole
``amp-rewrite convert --target float8 --calibrate`` path).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

from amp_rewrite import AmpRewriteError, rewrite_graph_def
from amp_rewrite.core.float8 import inference as float8
from amp_rewrite.core.float8.formats import E4M3, MATMUL_OPS
from amp_rewrite.core.rules import Rule
from amp_rewrite.core.target import FLOAT8, lookup_target
from amp_rewrite.testing.float8 import hlo_instructions, scaled_float8_type
from amp_rewrite.testing.float8 import tensor_amax as _amax, xla_function as _xla_function
from amp_rewrite.testing.models import build_model_graph

from conftest import NEEDS_FLOAT8

pytestmark = NEEDS_FLOAT8

ROOT = Path(__file__).resolve().parent.parent
HALF = types_pb2.DT_HALF


# --- helpers: the HLO XLA sees -----------------------------------------------------------------


def _dots(hlo: str) -> dict[str, bool]:
    """Every dot and convolution of ``hlo`` -> whether both operands read a scaled float8_e4m3fn tensor."""
    instructions = hlo_instructions(hlo)
    return {name: all(scaled_float8_type(instructions, operand) == "f8e4m3fn" for operand in instruction.operands)
            for name, instruction in instructions.items() if instruction.opcode in ("dot", "convolution")}


def _relative_error(new: np.ndarray, old: np.ndarray) -> float:
    """The validator's measure: max |new - old| over max |old|."""
    old, new = np.asarray(old, np.float64), np.asarray(new, np.float64)
    return float(np.max(np.abs(new - old)) / np.max(np.abs(old)))


# --- one matmul, by hand -------------------------------------------------------------------------


def _matmul_graph(weight: np.ndarray, *, const: bool = False) -> graph_pb2.GraphDef:
    """x (placeholder) @ w -> out (Identity, fetched): allow1 is the only allow op. w is read
    from a variable (the resource placeholder "w", bound by ``variables={"w:0": weight}``), as
    a SavedModel holds weights, or with ``const`` a Const, as a frozen graph does."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, weight.shape[0]], name="x")
        if const:
            w = tf.constant(weight, name="w")
        else:
            w = tf.raw_ops.ReadVariableOp(resource=tf.compat.v1.placeholder(tf.resource, [], name="w"),
                                          dtype=tf.float32, name="w_read")
        product = tf.matmul(x, w, name="allow1")
        tf.identity(product, name="out")
    return graph.as_graph_def()


def _fake_quantized(value: np.ndarray, scale: float) -> np.ndarray:
    """What the graph computes for one operand: float16, scaled, clipped, E4M3, unscaled."""
    scaled = np.clip(value.astype(np.float16) * np.float16(scale), -448, 448)
    return scaled.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) / scale


def test_a_matmul_computes_the_product_of_its_fake_quantized_operands():
    """Rule: each operand is x * scale, clipped to ±448, cast to E4M3 and back, times 1/scale,
    with scale = 448/amax rounded down to a power of two (amax: calibration for x; for the
    variable w, its float16 value's, computed in the graph)."""
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((32, 16)).astype(np.float32) * 0.05
    calibration, held_out = rng.standard_normal((8, 32)).astype(np.float32), rng.standard_normal((8, 32))
    held_out = (held_out * 1.5).astype(np.float32)  # beyond the calibrated amax: must saturate, not NaN
    graph_def, variables = _matmul_graph(weight), {"w:0": weight}
    amax = _amax(graph_def, [{"x:0": calibration}], variables)
    result = rewrite_graph_def(graph_def, target="float8", fetches=["out"], amax=amax)

    decision = result.report.decision("allow1")
    x_scale = float8.power_of_two_scale(amax[("", "x", 0)])
    w_scale = float8.power_of_two_scale(np.abs(weight.astype(np.float16)).max())
    assert (decision.rule, decision.after) == (Rule.FLOAT8_MATMUL.value, "float16")
    assert f"x:0 (activation) amax {amax[('', 'x', 0)]:.4g} scale {x_scale:g}" in decision.reason
    assert "w_read:0 (variable) amax and scale computed in the graph" in decision.reason
    assert 224 < amax[("", "x", 0)] * x_scale <= 448
    float16 = rewrite_graph_def(graph_def, target="float16", fetches=["out"])
    added = {n.name: n.op for n in result.graph_def.node} .items() - {n.name: n.op for n in float16.graph_def.node}.items()
    assert sorted(op for _, op in added).count("Cast") == 2 * 2 + 3  # to E4M3 and back per operand; w: amax to float32, scales to float16
    quantized = [n for n in result.graph_def.node if n.op == "Cast" and n.attr["DstT"].type == E4M3.dtype]
    assert sorted(n.name for n in quantized) == ["w_read-0-Float8-0/quantized", "x-0-Float8-0/quantized"]

    (out,) = _xla_function(result.graph_def, ["x:0"], ["out"], variables)(tf.constant(held_out))
    expected = _fake_quantized(held_out, x_scale) @ _fake_quantized(weight, w_scale)
    assert np.all(np.isfinite(out.numpy()))
    np.testing.assert_allclose(out.numpy(), expected, rtol=2e-3, atol=2e-3 * np.abs(expected).max())


def test_an_activation_without_amax_keeps_the_matmul_float16_and_says_why():
    """Rule: no calibration amax for an activation operand: the matmul stays on the float16 path."""
    graph_def = _matmul_graph(np.ones((4, 4), np.float32))
    result = rewrite_graph_def(graph_def, target="float8", fetches=["out"], amax={})
    decision = result.report.decision("allow1")
    assert decision.rule == Rule.FLOAT8_NO_AMAX.value and decision.after == "float16"
    assert "no calibration amax for 'x:0'" in decision.reason
    assert not any(n.op == "Cast" and n.attr["DstT"].type == E4M3.dtype for n in result.graph_def.node)
    assert result.report.float8_matmuls == 0
    float16 = rewrite_graph_def(graph_def, target="float16", fetches=["out"])
    assert result.graph_def == float16.graph_def  # exactly the float16 rewrite


def test_a_const_operand_keeps_the_matmul_float16_and_says_why():
    """Rule: a Const weight is folded to a float16 constant before XLA sees it, so there would
    be FP8's error without an FP8 GEMM: the matmul stays on the float16 path, with the reason."""
    graph_def = _matmul_graph(np.ones((4, 4), np.float32), const=True)
    result = rewrite_graph_def(graph_def, target="float8", fetches=["out"], amax={("", "x", 0): 1.0})
    decision = result.report.decision("allow1")
    assert (decision.rule, decision.after) == (Rule.FLOAT8_CONST_OPERAND.value, "float16")
    assert "Const operand 'w:0' is folded into a float16 constant before XLA" in decision.reason
    assert result.graph_def == rewrite_graph_def(graph_def, target="float16", fetches=["out"]).graph_def


def test_the_xla_bridge_folds_even_a_float8_const_weight_to_float16():
    """Why Const operands stay float16: a weight stored as a float8_e4m3fn Const, cast and
    scaled, reaches XLA's dot as one float16 constant (folded before the first HLO), so the
    GEMM rewriter would see no FP8 operand. The activation's chain, a parameter, survives."""
    weight = np.random.default_rng(0).standard_normal((16, 8)).astype(ml_dtypes.float8_e4m3fn)

    @tf.function(jit_compile=True)
    def matmul(x):
        w = tf.cast(tf.constant(weight), tf.float16) * tf.constant(0.5, tf.float16)
        scaled = tf.cast(tf.clip_by_value(tf.cast(x, tf.float16), -448.0, 448.0), tf.dtypes.experimental.float8_e4m3fn)
        return tf.matmul(tf.cast(scaled, tf.float16) * tf.constant(0.5, tf.float16), w)

    instructions = hlo_instructions(matmul.experimental_get_compiler_ir(tf.ones((4, 16)))(stage="hlo"))
    (dot,) = [i for i in instructions.values() if i.opcode == "dot"]
    w = instructions[dot.operands[1]]
    assert (w.opcode, w.type.split("[")[0]) == ("constant", "f16")
    assert scaled_float8_type(instructions, dot.operands[0]) == "f8e4m3fn"


def test_a_lossy_matmul_stays_float16_with_the_measured_error():
    """Rule: a matmul in ``lossy`` (calibration measured FP8 too lossy there) stays on the float16
    path with rule float8-lossy and the measurement; the others are still quantized."""
    graph_def = _matmul_graph(np.ones((4, 4), np.float32))
    result = rewrite_graph_def(graph_def, target="float8", fetches=["out"], amax={("", "x", 0): 1.0},
                               lossy={("", "allow1"): "calibration: output drifted 0.9 from float32"})
    decision = result.report.decision("allow1")
    assert (decision.rule, decision.reason) == (Rule.FLOAT8_LOSSY.value,
                                                "stays float16: calibration: output drifted 0.9 from float32")
    assert result.graph_def == rewrite_graph_def(graph_def, target="float16", fetches=["out"]).graph_def
    other = rewrite_graph_def(graph_def, target="float8", fetches=["out"], amax={("", "x", 0): 1.0},
                              lossy={("some_function", "allow1"): "not this item"})
    assert other.report.decision("allow1").rule == Rule.FLOAT8_MATMUL.value


def test_float8_needs_amax_and_amax_needs_float8():
    """Rule: the errors say what is missing and what to do; the caller's graph is untouched."""
    graph_def = _matmul_graph(np.ones((4, 4), np.float32))
    before = graph_def.SerializeToString()
    with pytest.raises(AmpRewriteError, match="target 'float8' needs amax"):
        rewrite_graph_def(graph_def, target="float8")
    with pytest.raises(AmpRewriteError, match="amax applies to target 'float8', not 'float16'"):
        rewrite_graph_def(graph_def, target="float16", amax={})
    with pytest.raises(AmpRewriteError, match="lossy applies to target 'float8', not 'bfloat16'"):
        rewrite_graph_def(graph_def, target="bfloat16", lossy={})
    with pytest.raises(AmpRewriteError, match=r"amax for the main graph tensor 'x:0' is nan"):
        rewrite_graph_def(graph_def, target="float8", amax={("", "x", 0): float("nan")})
    rewrite_graph_def(graph_def, target="float8", fetches=["out"], amax={("", "x", 0): 1.0})
    assert graph_def.SerializeToString() == before


def test_float8_is_a_rewrite_target_but_has_no_lists_of_its_own():
    """Rule: float8 colours as float16 (its dtype, casts and lists); lookup_target takes it only
    from callers that say they take it (quantized=True)."""
    assert lookup_target("float8", quantized=True) is FLOAT8
    assert (FLOAT8.dtype, FLOAT8.cast_kind, FLOAT8.colouring) == (HALF, "CastToFp16", "float16")
    with pytest.raises(AmpRewriteError, match="unknown target 'float8'; use one of float16, bfloat16"):
        lookup_target("float8")


@pytest.mark.parametrize("amax, scale", [(448.0, 1.0), (447.0, 1.0), (449.0, 0.5), (3.2, 128.0), (0.41, 1024.0),
                                         (0.0, 2.0 ** 15), (1e-9, 2.0 ** 15), (1e9, 2.0 ** -22)])
def test_the_scale_is_448_over_amax_rounded_down_to_a_power_of_two(amax: float, scale: float):
    """Rule: amax * scale <= 448 always (no saturation on calibration data), within float16's exact range."""
    assert float8.power_of_two_scale(amax) == scale


# --- a function in the library: marked for XLA ---------------------------------------------------


def test_a_function_with_a_float8_matmul_is_marked_for_xla_like_jit_compile():
    """Rule: the function body that holds a float8 matmul gets _XlaMustCompile and _noinline,
    and so does every call of it, as tf.function(jit_compile=True) writes them."""
    weight = np.random.default_rng(1).standard_normal((8, 8)).astype(np.float32)

    variable = tf.Variable(weight)

    @tf.function
    def inner(x):
        return tf.matmul(x, variable, name="allow1")

    concrete = tf.function(lambda x: inner(x) + 1.0).get_concrete_function(tf.TensorSpec([2, 8], tf.float32, name="x"))
    graph_def = concrete.graph.as_graph_def()
    (name,) = [f.signature.name for f in graph_def.library.function]
    result = rewrite_graph_def(graph_def, target="float8", amax={(name, "x", 0): 2.0})
    (function,) = result.graph_def.library.function
    assert function.attr["_XlaMustCompile"].b and function.attr["_noinline"].b
    (call,) = [node for node in result.graph_def.node if node.op in ("PartitionedCall", "StatefulPartitionedCall")]
    assert call.attr["_XlaMustCompile"].b
    assert result.report.decision("allow1", function=name).rule == Rule.FLOAT8_MATMUL.value
    assert not any(f.attr.get("_XlaMustCompile") for f in graph_def.library.function)  # input untouched


# --- three models: numbers under XLA on CPU, and the HLO shape --------------------------------


def _inputs(model, seed: int) -> dict[str, np.ndarray]:
    rng, x = np.random.default_rng(seed), model.feeds["x:0"]
    if x.dtype == np.int32:
        return {"x:0": rng.integers(0, 100, size=x.shape, dtype=np.int32)}
    return {"x:0": rng.standard_normal(x.shape).astype(np.float32)}


@pytest.fixture(scope="module", params=["mlp", "cnn", "transformer"])
def rewritten(request):
    model = build_model_graph(request.param, training=False, batch=16)
    amax = _amax(model.graph_def, [_inputs(model, seed) for seed in range(4)], model.variables)
    result = rewrite_graph_def(model.graph_def, target="float8", fetches=model.fetches, amax=amax)
    return model, result


def test_every_converted_matmul_of_the_models_is_float8(rewritten):
    """Rule: with amax for every activation, every matmul the float16 rewrite converted is float8."""
    model, result = rewritten
    matmuls = [d for d in result.report.decisions if d.op in MATMUL_OPS]
    assert matmuls and all(d.rule == Rule.FLOAT8_MATMUL.value for d in matmuls)
    assert result.report.float8_matmuls == len(matmuls)
    assert "matmul(s) on float8_e4m3fn operands" in result.report.summary()
    # Keras weights are variables: their scale is computed in the graph on every call.
    assert all("(variable) amax and scale computed in the graph" in d.reason for d in matmuls if d.op != "Einsum")


def test_the_models_stay_within_tolerance_of_float32_under_xla(rewritten):
    """Rule: on inputs the amax did not come from, every output is within FLOAT8.tolerance of float32."""
    model, result = rewritten
    reference = _xla_function(model.graph_def, ["x:0"], model.fetches, model.variables)
    quantized = _xla_function(result.graph_def, ["x:0"], model.fetches, model.variables)
    errors = []
    for seed in range(100, 103):
        x = tf.constant(_inputs(model, seed)["x:0"])
        errors += [_relative_error(new, old) for new, old in zip(quantized(x), reference(x))]
    print(f"{model.name}: float8 max relative error {max(errors):.4f} over {len(errors)} outputs")
    assert max(errors) <= FLOAT8.tolerance


def test_xla_sees_every_matmul_read_scaled_float8_operands(rewritten):
    """Rule: in the HLO, each dot and convolution reads multiply(convert(f8e4m3fn), broadcast(scalar))
    on both sides, through nothing but ops MatchFp8Param lets commute with dequantization."""
    model, result = rewritten
    function = _xla_function(result.graph_def, ["x:0"], model.fetches, model.variables)
    dots = _dots(function.experimental_get_compiler_ir(tf.constant(_inputs(model, 0)["x:0"]))(stage="hlo"))
    assert len(dots) == result.report.float8_matmuls
    assert all(dots.values()), [name for name, ok in dots.items() if not ok]
    plain = _xla_function(model.graph_def, ["x:0"], model.fetches, model.variables)
    plain_dots = _dots(plain.experimental_get_compiler_ir(tf.constant(_inputs(model, 0)["x:0"]))(stage="hlo"))
    assert plain_dots and not any(plain_dots.values())  # the check can fail


# --- the GPU check's CPU branch --------------------------------------------------------------
# (its --smoke path on tiny models: tests/test_tools.py checks the tool's smoke run)


def test_the_gpu_check_says_why_it_does_not_run_here_and_exits_0():
    """Rule: without a GPU of compute capability 8.9+, tools/bench_fp8_gpu.py prints one line and exits 0."""
    environ = {**os.environ, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_fp8_gpu.py")], capture_output=True,
                          text=True, env=environ, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines() == [
        "bench_fp8_gpu: skipped: no GPU visible to TensorFlow; FP8 GEMMs need compute capability 8.9+ and CUDA 12"]
