"""The float8 step: the matmuls the float16 rewrite converted take float8_e4m3fn operands.

Each operand of a converted MatMul, BatchMatMul(V2), two-operand Einsum or Conv2D is
quantized with a per-tensor scale and dequantized right before the matmul, in the form
XLA's GPU GEMM rewriter (``MatchFp8Param`` in ``gemm_rewriter.cc``) fuses into a cuBLASLt
FP8 GEMM on compute capability 8.9+ with CUDA 12 (cuDNN's fused-conv rewriter does the
same for convolutions):

    x ─ Mul(scale) ─ ClipByValue(±448) ─ Cast(float8_e4m3fn) ─ Cast(float16) ─ Mul(1/scale) ─ MatMul

XLA lowers the last three to ``convert(f8) → multiply(·, broadcast(scalar)) → dot``. E4M3FN
has no infinity and a cast of a value beyond ±448 gives NaN, hence the clip. The scale is
``448 / amax`` rounded down to a power of two: then ``scale`` and ``1/scale`` are exact in
float16 (subnormals included), so dequantizing undoes the scaling exactly and the only
error is E4M3's rounding; the power of two costs at most one binade at the bottom of E4M3's
range, not precision (Transformer Engine's first scaling recipe did the same).

Where amax comes from, per operand (found through the rewrite's own casts and Identity):

* a ``ReadVariableOp`` (also through Reshape, Transpose, ...): computed in the graph,
  ``Max(Abs(w))`` on every call, so the scale follows whatever the variable holds; the GEMM
  rewriter takes any scalar as the scale;
* anything else (an activation): ``amax[(function, node, port)]``, the calibration's
  largest finite |x| of that float32 tensor. Without one, the matmul stays float16 and the
  report says why.

A matmul stays float16, with its reason, where FP8 would cost accuracy and give no FP8
GEMM: an operand that is a ``Const`` (TensorFlow's XLA bridge folds a constant subgraph,
a float8_e4m3fn ``Const`` included, into a float16 constant before XLA sees it: measured
in the HLO of a ``jit_compile`` function), and the matmuls calibration measured too lossy
(``lossy``).

XLA only sees this in functions it compiles: ``mark_xla_must_compile`` marks the library
functions that hold a float8 matmul as ``tf.function(jit_compile=True)`` does.
"""
from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2

from amp_rewrite import _tf
from amp_rewrite.core import functions
from amp_rewrite.core.casts import is_amp_cast
from amp_rewrite.core.float8.formats import E4M3, EXACT_POWERS, MATMUL_OPS
from amp_rewrite.core.float8.nodes import NodeWriter, origin
from amp_rewrite.core.graph_io import (TensorRef, copy_graph_def, data_inputs, make_node_def, parse_tensor_name,
                                      tensor_name)
from amp_rewrite.core.program import program_of
from amp_rewrite.core.rules import Reason, Rule
from amp_rewrite.errors import AmpRewriteError, GraphError

TARGET_NAME = "float8"  # target.FLOAT8's name: the rewrite runs this step for it
# XLA before TensorFlow 2.18 folds convert(convert(x, float8), wider) into convert(x, wider):
# the float8 rounding and the pattern FP8 GEMMs need both vanish (2.16.2 and 2.17.1, CPU).
MIN_TENSORFLOW = (2, 18)


def check_tensorflow() -> None:
    """Refuse the float8 target where XLA would silently undo it."""
    if _tf.tensorflow_version() < MIN_TENSORFLOW:
        raise AmpRewriteError(
            f"target 'float8' needs TensorFlow {'.'.join(map(str, MIN_TENSORFLOW))} or newer: TensorFlow"
            f" {_tf.tensorflow_release()}'s XLA drops a round trip through float8 (no float8 numbers, no FP8 GEMM);"
            " upgrade TensorFlow, or use target float16")


Amax = Mapping[tuple[str, str, int], float]  # (function, node, port) -> largest finite |x| (calibration)

# The matmul dtypes this step quantizes: the float16 rewrite's, and float32.
_DTYPES = frozenset({types_pb2.DT_HALF, types_pb2.DT_FLOAT})
_VARIABLE_READS = frozenset({"ReadVariableOp"})
XLA_MUST_COMPILE = "_XlaMustCompile"  # what tf.function(jit_compile=True) puts on the function and its calls


@dataclass(frozen=True)
class Float8Calibration:
    """What calibration hands the float8 step, as an overlay's ``amax`` and ``lossy`` hold it."""

    amax: Amax                            # (function, node, port) -> largest finite |x|
    lossy: Mapping[tuple[str, str], str]  # (function, node) -> the FP8 error measured there


def resolve(calibration: Float8Calibration, graph_def: graph_pb2.GraphDef) -> tuple[Float8Calibration, list[str]]:
    """``calibration`` keyed by the items of ``graph_def`` (the main graph "" and every library
    function), and the overlay keys (``key_text``) that name nothing in it. An overlay names
    a node plainly (a node of that name in any item), or as ``FUNCTION::node`` with the
    function's exact or stable name (``functions.scope_matches``), so it survives a
    re-export, which changes TensorFlow's trace counters. An exact key wins over the others."""
    nodes_in = {"": {node.name for node in graph_def.node}}  # a body's nodes and _Arg nodes, without building it
    for function in graph_def.library.function:
        nodes_in[function.signature.name] = ({node.name for node in function.node_def}
                                             | {arg.name for arg in function.signature.input_arg})
    unmatched: list[str] = []

    def exact(entries: Mapping[tuple, object]) -> dict[tuple, object]:
        found: dict[tuple, tuple[int, object]] = {}
        for key, value in entries.items():
            scope, node = key[0], key[1]
            items = [item for item in nodes_in if node in nodes_in[item]
                     and (not scope or (item and functions.scope_matches(scope, item)))]
            if not items:
                unmatched.append(key_text(key))
            for item in items:
                rank = 0 if scope == item else 1 if scope else 2
                if (item, *key[1:]) not in found or rank < found[(item, *key[1:])][0]:
                    found[(item, *key[1:])] = (rank, value)
        return {key: value for key, (_, value) in found.items()}

    resolved = Float8Calibration(exact(calibration.amax), exact(calibration.lossy))
    return resolved, unmatched


def key_text(key: tuple[str, ...]) -> str:
    """``(function, node, port)`` → ``FUNCTION::node:port`` (``node:port`` in the main graph);
    ``(function, node)`` → ``FUNCTION::node``: how an overlay names a tensor or a matmul."""
    function, node, *port = key
    name = f"{node}:{port[0]}" if port else node
    return functions.scoped_name(function, name)


def parse_key(text: str, *, port: bool) -> tuple:
    """``key_text``'s inverse; ValueError naming the form expected."""
    scope, name = functions.split_scope(text)
    function = scope or ""
    form = "FUNCTION::node:port or node:port" if port else "FUNCTION::node or node"
    if not name or scope == "":
        raise ValueError(f"{text!r} is not {form}")
    if not port:
        if ":" in name:
            raise ValueError(f"{text!r} is not {form} (a node name has no ':')")
        return function, name
    try:
        ref = parse_tensor_name(name)
    except GraphError:
        ref = None
    if ref is None or ref.is_control or ":" not in name:  # a port written out, no "^"
        raise ValueError(f"{text!r} is not {form}")
    return function, ref.node, ref.port


def activation_operands(graph_def: graph_pb2.GraphDef) -> frozenset[tuple[str, str, int]]:
    """(function, node, port) of every tensor a two-operand matmul of ``graph_def`` (main graph
    and library functions) reads that is not a weight: the amax the float8 step asks for."""
    program = program_of(graph_def)
    found = set()
    for function in program.names:
        body = program.item(function)
        nodes = {node.name: node for node in body.node}
        for node in body.node:
            operand_tensors = data_inputs(node)
            if node.op not in MATMUL_OPS or len(operand_tensors) != MATMUL_OPS[node.op]:
                continue
            for tensor in operand_tensors:
                ref = parse_tensor_name(tensor)
                if ref.node in nodes and origin(nodes, ref.node).op not in ("Const", *_VARIABLE_READS):
                    found.add((function, ref.node, ref.port))
    return frozenset(found)


@dataclass(frozen=True)
class Operand:
    """How one operand of a float8 matmul is scaled."""

    tensor: str         # the float32 tensor the amax is of ("node:port"), named as in the input graph
    kind: str           # "activation" (calibration amax), "variable" (in-graph) or "constant" (never quantized)
    amax: float | None  # None for a variable (computed on every call), or an activation without one
    scale: float | None

    def describe(self) -> str:
        if self.amax is None:
            return f"{self.tensor} ({self.kind}) amax and scale computed in the graph"
        return f"{self.tensor} ({self.kind}) amax {self.amax:.4g} scale {self.scale:g}"


@dataclass(frozen=True)
class Float8Decision:
    """What happened to one converted matmul: quantized (``operands``), or left float16 (``kept``, why)."""

    node: str
    op: str
    operands: tuple[Operand, ...] = ()
    kept: Reason | None = None

    @property
    def quantized(self) -> bool:
        return self.kept is None

    @property
    def reason(self) -> Reason:
        if self.kept is not None:
            return self.kept
        text = "float8_e4m3fn operands: " + "; ".join(operand.describe() for operand in self.operands)
        return Reason(Rule.FLOAT8_MATMUL, text)


def power_of_two_scale(amax: float, dtype: int = types_pb2.DT_HALF) -> float:
    """``448 / amax`` rounded down to a power of two, within what ``dtype`` holds exactly
    with its reciprocal; the largest such scale for ``amax == 0``."""
    low, high = EXACT_POWERS[dtype]  # scale and 1/scale are both constants of dtype
    if amax <= 0.0:
        return 2.0 ** high
    exponent = math.floor(math.log2(E4M3.max / amax))
    if 2.0 ** exponent * amax > E4M3.max:  # log2's rounding just below a power of two
        exponent -= 1
    return 2.0 ** min(max(exponent, low), high)


def quantize_matmuls(
    graph_def: graph_pb2.GraphDef, *, function: str, amax: Amax, converted: Collection[str],
    lossy: Mapping[str, str] | None = None,
) -> tuple[graph_pb2.GraphDef, tuple[Float8Decision, ...]]:
    """The float8 step on one item (the main graph, or ``function``'s body with ``_Arg`` and
    ``_Retval`` nodes): a new GraphDef, and one decision per two-operand matmul in
    ``converted`` (the nodes the float16 rewrite converted). ``lossy``: node -> the error
    calibration measured, for the matmuls to leave float16. ``graph_def`` is not modified."""
    lossy = lossy or {}
    output = copy_graph_def(graph_def)
    nodes = {node.name: node for node in output.node}
    builder = _Builder(output, nodes)
    decisions = []
    for node in list(output.node):
        if node.op not in MATMUL_OPS or node.name not in converted:
            continue
        dtype = node.attr["T"].type
        operand_tensors = data_inputs(node)
        if len(operand_tensors) != MATMUL_OPS[node.op] or dtype not in _DTYPES:
            continue  # a one-operand Einsum: no product to quantize
        operands = [_operand(nodes, tensor, function, amax, dtype) for tensor in operand_tensors]
        kept = _kept(operands, lossy.get(node.name))
        if kept is not None:
            decisions.append(Float8Decision(node.name, node.op, tuple(operands), kept))
            continue
        for position, (tensor, operand) in enumerate(zip(operand_tensors, operands)):
            node.input[position] = builder.dequantized(tensor, operand, dtype)
        decisions.append(Float8Decision(node.name, node.op, tuple(operands)))
    return output, tuple(decisions)


def _kept(operands: Iterable[Operand], lossy: str | None) -> Reason | None:
    """Why a matmul with these operands stays float16, or None: it is quantized."""
    operands = tuple(operands)
    constants = [operand.tensor for operand in operands if operand.kind == "constant"]
    if constants:
        return Reason(Rule.FLOAT8_CONST_OPERAND,
                      f"stays float16: Const operand {', '.join(map(repr, constants))} is folded into a float16"
                      " constant before XLA sees it, so FP8 would add its error without an FP8 GEMM; hold the weight"
                      " in a variable, as a SavedModel does")
    missing = [operand.tensor for operand in operands if operand.kind == "activation" and operand.amax is None]
    if missing:
        return Reason(Rule.FLOAT8_NO_AMAX, f"stays float16: no calibration amax for {', '.join(map(repr, missing))};"
                                           " calibrate with inputs that reach it")
    if lossy is not None:
        return Reason(Rule.FLOAT8_LOSSY, f"stays float16: {lossy}")
    return None


def _operand(nodes: Mapping[str, node_def_pb2.NodeDef], tensor: str, function: str, amax: Amax,
             dtype: int) -> Operand:
    """Where ``tensor``'s amax comes from: the float32 tensor behind the rewrite's casts,
    then, through ops that only move values (Identity, Reshape, ...), a Const, a variable
    read or neither."""
    ref = amp_source(nodes, tensor)
    source = tensor_name(*ref)
    found_origin = origin(nodes, ref.node)
    if found_origin.op == "Const":
        return Operand(source, "constant", None, None)
    if found_origin.op in _VARIABLE_READS:
        return Operand(source, "variable", None, None)
    found = amax.get((function, ref.node, ref.port))
    if found is None:
        return Operand(source, "activation", None, None)
    if not (isinstance(found, (int, float, np.floating)) and math.isfinite(found) and found >= 0):
        raise AmpRewriteError(
            f"amax for {function or 'the main graph'} tensor '{source}' is {found!r}; it must be the largest"
            " finite |x| (a number >= 0): recalibrate"
        )
    found = float(found)
    return Operand(source, "activation", found, power_of_two_scale(found, dtype))


def amp_source(nodes: Mapping[str, node_def_pb2.NodeDef], tensor: str) -> TensorRef:
    """The tensor behind the rewrite's own casts that ``tensor`` is (itself if it is no such cast);
    a node not in ``nodes`` ends the walk."""
    ref = parse_tensor_name(tensor)
    while ref.node in nodes and is_amp_cast(nodes[ref.node]):
        ref = parse_tensor_name(nodes[ref.node].input[0])
    return ref


class _Builder(NodeWriter):
    """Adds the quantize/dequantize nodes to one item: one chain per (tensor, dtype), shared by
    every matmul that reads the tensor, named ``<node>-<port>-Float8-<id>/<step>`` after the
    float32 tensor the amax is of."""

    def __init__(self, graph_def: graph_pb2.GraphDef, nodes: dict[str, node_def_pb2.NodeDef]) -> None:
        super().__init__(graph_def, nodes)
        self.chains: dict[tuple[str, int], str] = {}

    def dequantized(self, tensor: str, operand: Operand, dtype: int) -> str:
        tensor = tensor_name(*parse_tensor_name(tensor))
        if (tensor, dtype) not in self.chains:
            self.chains[(tensor, dtype)] = self._chain(tensor, operand, dtype)
        return self.chains[(tensor, dtype)]

    def _chain(self, tensor: str, operand: Operand, dtype: int) -> str:
        source = parse_tensor_name(operand.tensor)  # named after the float32 tensor, not the rewrite's cast
        index = 0
        while f"{source.node}-{source.port}-Float8-{index}/unscaled" in self.nodes:
            index += 1
        base = f"{source.node}-{source.port}-Float8-{index}"
        device = self.nodes[parse_tensor_name(tensor).node].device
        add = self.under(base, device)
        if operand.scale is not None:
            scale = self.const(f"{base}/scale", operand.scale, dtype, device)
            unscale = self.const(f"{base}/unscale", 1.0 / operand.scale, dtype, device)
        else:
            scale, unscale = self._scales_in_graph(base, tensor, dtype, device)
        scaled = add("scaled", "Mul", [tensor, scale], T=dtype)
        low = self.const(f"{base}/min", -E4M3.max, dtype, device)
        high = self.const(f"{base}/max", E4M3.max, dtype, device)
        clipped = add("clipped", "ClipByValue", [scaled, low, high], T=dtype)
        quantized = add("quantized", "Cast", [clipped], SrcT=dtype, DstT=E4M3.dtype, Truncate=False)
        dequantized = add("dequantized", "Cast", [quantized], SrcT=E4M3.dtype, DstT=dtype, Truncate=False)
        return add("unscaled", "Mul", [dequantized, unscale], T=dtype)

    def _scales_in_graph(self, base: str, tensor: str, dtype: int, device: str) -> tuple[str, str]:
        """``2**e`` and ``2**-e`` with ``e = floor(log2(448 / max|w|))`` clipped to ``dtype``'s
        exact range, computed in float32 on every call (a variable's weights)."""
        f32 = types_pb2.DT_FLOAT
        add = self.under(base, device)
        amax = self.amax(base, tensor, dtype, device)
        exponent = self.exponent(base, amax, E4M3.max, EXACT_POWERS[dtype], device)
        two = self.const(f"{base}/two", 2.0, f32, device)
        scale = add("scale_float32", "Pow", [two, exponent], T=f32)
        unscale = add("unscale_float32", "Pow", [two, add("negated", "Neg", [exponent], T=f32)], T=f32)
        if dtype != f32:
            scale = add("scale", "Cast", [scale], SrcT=f32, DstT=dtype, Truncate=False)
            unscale = add("unscale", "Cast", [unscale], SrcT=f32, DstT=dtype, Truncate=False)
        return scale, unscale


_PROBE = "Float8Probe"  # in the names of add_probes' nodes


def add_probes(graph_def: graph_pb2.GraphDef, matmuls: Iterable[str]) -> tuple[graph_pb2.GraphDef, dict[str, str]]:
    """A copy of one item of a float8 rewrite in which each of ``matmuls`` (quantized) also
    runs on the float16 operands its float8 chains start from, and their difference is a
    tensor: matmul -> (the float16 copy's name, the difference's name). On calibration
    inputs the difference is the matmul's own FP8 error, element by element, whatever error
    its inputs already carry; calibration ranks matmuls by it. ``graph_def`` is not modified."""
    output = copy_graph_def(graph_def)
    nodes = {node.name: node for node in output.node}
    probes = {}
    for name in matmuls:
        node = nodes[name]
        reference = output.node.add()
        reference.CopyFrom(node)
        reference.name = f"{name}-{_PROBE}/float16"
        reference.input[:] = [tensor if tensor.startswith("^") else _chain_source(nodes, tensor)
                              for tensor in node.input]
        difference = make_node_def("Sub", f"{name}-{_PROBE}/error", [name, reference.name], device=node.device,
                                   into=output.node, T=node.attr["T"].type)
        probes[name] = (reference.name, difference.name)
    return output, probes


def _chain_source(nodes: Mapping[str, node_def_pb2.NodeDef], tensor: str) -> str:
    """The tensor a float8 chain (``_Builder._chain``) quantizes, given its ``unscaled`` output."""
    steps = ("Mul", "Cast", "Cast", "ClipByValue", "Mul")  # unscaled, dequantized, quantized, clipped, scaled
    ref = parse_tensor_name(tensor)
    if not (ref.node.endswith("/unscaled") and "-Float8-" in ref.node):
        return tensor
    for op in steps:
        node = nodes[ref.node]
        if node.op != op:
            return tensor
        source = node.input[0]
        ref = parse_tensor_name(source)
    return source


def mark_xla_must_compile(graph_def: graph_pb2.GraphDef, names: Iterable[str]) -> None:
    """Marks library functions ``names`` and every call of them for XLA, as
    ``tf.function(jit_compile=True)`` does: ``_XlaMustCompile`` and ``_noinline`` on the
    function, ``_XlaMustCompile`` on each call node. Changes ``graph_def`` (the rewrite's output)."""
    names = set(names)
    if not names:
        return
    for function in graph_def.library.function:
        if function.signature.name in names:
            function.attr[XLA_MUST_COMPILE].b = True
            function.attr["_noinline"].b = True

    def mark_calls(nodes: Iterable[node_def_pb2.NodeDef]) -> None:
        for node in nodes:
            called = node.op in names or any(
                value.HasField("func") and value.func.name in names for key, value in node.attr.items() if key == "f")
            if called:
                node.attr[XLA_MUST_COMPILE].b = True

    mark_calls(graph_def.node)
    for function in graph_def.library.function:
        mark_calls(function.node_def)
