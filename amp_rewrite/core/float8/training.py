"""FP8 training: the matmuls of a training step, forward and backward, on float8 operands.

After the base rewrite (bfloat16 or float16) of one training step, every MatMul,
BatchMatMul(V2), two-operand Einsum and Conv2D it converted (a *forward* matmul) takes
float8_e4m3fn operands, and the matmuls of its gradient (*backward* ones: the
MatMul/BatchMatMul/Einsum of its gradient formula, Conv2DBackpropInput/Filter for a
Conv2D) take the incoming gradient as float8_e5m2 and the forward operand as the forward
matmul's own E4M3 values — Transformer Engine's "hybrid" recipe. Each chain ends in the
matmul's own dtype, the form XLA's GEMM rewriter (``MatchFp8Param``) fuses into an FP8 GEMM:

    x ─ [Cast(float32)] ─ Mul(scale) ─ clip to ±max, non-finite kept ─ Cast(float8) ─ Cast(bfloat16) ─ Mul(1/scale) ─ MatMul

The quantizing half runs in float32 (XLA fuses it; a float16 ``x * scale`` near E5M2's
57344 would overflow), the dequantizing half in the matmul's dtype, with ``1/scale`` a power
of two exact in it. A value that is Inf or NaN stays so, so a loss-scale optimizer still
sees the overflow and skips the step.

**Delayed scaling.** In a training step each quantized operand — a forward matmul's input 0
and 1, and the gradient of its output — has a state: a float32 ``scale`` and an
``amax_history`` of the last N steps' largest |x|, two resource variables the caller provides
as ``ReadVariableOp`` nodes in the graph (``State``). A step quantizes with the scale as it
was, then records its own amax (a non-finite amax is not recorded: the history stays as it
was) and sets the scale for the next step from the history:
``2**floor(log2(max / max(history)))``, kept while the history holds nothing but 0. While
it does (a fresh state, or steps that saw only zeros or non-finite values), the step scales
each operand by its own amax, as a function without gradients (evaluate, predict, an
export) always does: such a function has no state.

**Which matmul is whose gradient** (``find_matmuls``): a backward matmul lives in the name
scope TensorFlow gives a gradient (``gradient_tape/<forward op>/…`` for a GradientTape,
``gradients/<forward op>_grad/…`` for ``tf.gradients``) and reads one of the forward
matmul's own input tensors, as TensorFlow's gradient formulas do; the other operand it
reads is the incoming gradient. Matmuls in a gradient scope that pass neither test are no
forward matmul and stay in the base precision.
"""
from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2, tensor_shape_pb2, types_pb2

from amp_rewrite.core.casts import is_amp_cast
from amp_rewrite.core.float8.formats import E4M3, E5M2, EXACT_POWERS, MATMUL_OPS, Format
from amp_rewrite.core.float8.nodes import NodeWriter, origin
from amp_rewrite.core.graph_io import copy_graph_def, data_inputs, parse_tensor_name, tensor_name
from amp_rewrite.core.program import MAIN_GRAPH
from amp_rewrite.core.report import Report
from amp_rewrite.core.rules import Reason, Rule


STATE_SCOPE = "amp_rewrite_float8"  # the state's read nodes and every node of the chains live under it
HISTORY, SCALE = "amax_history", "scale"
# An operand's amax as a training step writes it to tf.summary: an Identity the trace adds
# (``training.float8``), reading its history's newest entry until ``quantize_training_step``
# points it at the step's own amax.
SUMMARY_AMAX = "summary_amax"
BASE_DTYPES = frozenset({types_pb2.DT_HALF, types_pb2.DT_BFLOAT16})  # the base rewrite's: what is quantized
# The backward ops of each forward op, and which of their inputs are the two matmul operands.
BACKWARD_OPS = {
    "MatMul": frozenset({"MatMul"}),
    "BatchMatMul": frozenset({"BatchMatMul", "BatchMatMulV2", "MatMul"}),
    "BatchMatMulV2": frozenset({"BatchMatMul", "BatchMatMulV2", "MatMul"}),
    "Einsum": frozenset({"Einsum"}),
    "Conv2D": frozenset({"Conv2DBackpropInput", "Conv2DBackpropFilter"}),
}
OPERAND_POSITIONS = {"MatMul": (0, 1), "BatchMatMul": (0, 1), "BatchMatMulV2": (0, 1), "Einsum": (0, 1),
                     "Conv2DBackpropInput": (1, 2), "Conv2DBackpropFilter": (0, 2)}
# The name scope TensorFlow opens for an op's gradient: GradientTape's, tf.gradients' (and its _N).
_GRADIENT_ROOT = re.compile(r"(?:^|/)(?:gradient_tape|gradients(?:_\d+)?)/")
_UNIQUIFIED = re.compile(r"_\d+$")  # the suffix TensorFlow gives a name taken in its scope
_VARIABLE_HANDLES = frozenset({"VarHandleOp", "VariableV2", "Variable", "Placeholder", "_Arg"})


@dataclass(frozen=True)
class Backward:
    """One backward matmul of a forward one: where it reads the forward operand (which of the
    forward's inputs) and where it reads the incoming gradient."""

    node: str
    operand_position: int
    forward_input: int
    gradient_position: int


@dataclass(frozen=True)
class Matmul:
    """A forward matmul the base rewrite converts, its two operands and its backward matmuls.

    ``weight``: which input reads a variable (``weight_of``), if one does. ``base``: the name its
    state keys start with — the node's name unless the caller gives a stable one (a variable's
    place in its optimizer: ``training.float8``), so that several matmuls of one weight (its
    replicas) share one state."""

    node: str
    op: str
    inputs: tuple[str, str]  # the tensors it reads, as in the input graph
    backward: tuple[Backward, ...] = ()
    weight: int | None = None
    base: str = ""

    def key(self, operand: int | None) -> str:
        """The state key of input ``operand``, or (None) of the gradient of its output; a weight's
        matmul names its operands by role (``weight``, ``input``), as a weight may be either input."""
        base = self.base or self.node
        if operand is None:
            return f"{base}/output_grad"
        if self.weight is not None:
            return f"{base}/weight" if operand == self.weight else f"{base}/input"
        return f"{base}/input_{operand}"

    def keys(self) -> tuple[tuple[str, Format], ...]:
        """The operands it quantizes, as state keys with their formats."""
        forward = ((self.key(0), E4M3), (self.key(1), E4M3))
        return (*forward, (self.key(None), E5M2)) if self.backward else forward


@dataclass(frozen=True)
class Plan:
    """The forward matmuls of one item, with their backward ones; and the converted matmuls
    that stay in the base precision, with why."""

    matmuls: tuple[Matmul, ...]
    kept: Mapping[str, str] = field(default_factory=dict)

    @property
    def trains(self) -> bool:
        """Whether the item takes gradients of its matmuls: a training step, which records amax."""
        return any(matmul.backward for matmul in self.matmuls)

    def keys(self) -> tuple[tuple[str, Format], ...]:
        """Every operand's key once (replicas of one matmul share theirs), with its format."""
        return tuple(dict.fromkeys(key for matmul in self.matmuls for key in matmul.keys()))

    def with_bases(self, node_to_base: Mapping[str, str]) -> Plan:
        """The plan with each matmul's stable key ``base`` (``Matmul``); others keep their node's name."""
        return replace(self, matmuls=tuple(replace(matmul, base=node_to_base.get(matmul.node, ""))
                                           for matmul in self.matmuls))


@dataclass(frozen=True)
class State:
    """One operand's state in a graph: the ``ReadVariableOp`` nodes of its scale and its amax
    history; their inputs are the variables' handles. ``mirrors``: the reads of the other
    components of mirrored state variables (a distribution strategy's), which each update sets alike."""

    scale: str
    history: str
    mirrors: tuple[State, ...] = ()


@dataclass(frozen=True)
class Workers:
    """A training step that each of ``group_size`` workers runs (MultiWorkerMirroredStrategy):
    its amaxes are reduced to their largest across workers by one collective of ``group_key``
    and ``instance_key``, so every worker records and scales alike."""

    group_size: int
    group_key: int
    instance_key: int


def in_gradient_scope(name: str) -> bool:
    return _GRADIENT_ROOT.search(name) is not None


def find_matmuls(graph_def: graph_pb2.GraphDef, converted: Collection[str]) -> Plan:
    """The forward matmuls of one item (a main graph, or a body with ``_Arg``/``_Retval``
    nodes) among ``converted`` (the nodes the base rewrite converts), and their backward
    matmuls: see the module doc. ``graph_def`` is the item before the rewrite."""
    nodes = {node.name: node for node in graph_def.node}
    forward: dict[str, Matmul] = {}
    kept: dict[str, str] = {}
    for node in graph_def.node:
        operand_tensors = data_inputs(node)
        if (node.op not in MATMUL_OPS or node.name not in converted or in_gradient_scope(node.name)
                or len(operand_tensors) != MATMUL_OPS[node.op]):
            continue
        constants = [tensor for tensor in operand_tensors
                     if origin(nodes, parse_tensor_name(tensor).node).op == "Const"]
        if constants:
            kept[node.name] = (f"stays in the base precision: Const operand {constants[0]!r} is folded before XLA"
                               " sees it, so FP8 would add its error without an FP8 GEMM")
            continue
        first, second = (tensor_name(*parse_tensor_name(tensor)) for tensor in operand_tensors)
        forward[node.name] = Matmul(node.name, node.op, (first, second),
                                    weight=next((index for index, _ in weight_of(nodes, operand_tensors)), None))
    backward: dict[str, list[Backward]] = {}
    for node in graph_def.node:
        if node.op in OPERAND_POSITIONS and in_gradient_scope(node.name):
            found = _forward_of(node, forward)
            if found is not None:
                backward.setdefault(found[0], []).append(found[1])
    matmuls = tuple(replace(matmul, backward=tuple(backward.get(name, ()))) for name, matmul in forward.items())
    return Plan(matmuls, kept)


def weight_of(nodes: Mapping[str, node_def_pb2.NodeDef], inputs: Iterable[str]) -> list[tuple[int, str]]:
    """The operands among ``inputs`` that read a variable — through ops that only move values,
    a ``ReadVariableOp`` (or a ref variable's read ``Identity``) — as (input index, the node the
    variable's handle comes from: ``variable_handle``)."""
    found = []
    for index, tensor in enumerate(inputs):
        source = origin(nodes, parse_tensor_name(tensor).node)
        if source.op == "ReadVariableOp":
            handle = variable_handle(nodes, source.input[0])
        else:
            handle = source.name if source.op in ("VariableV2", "Variable") else None
        if handle is not None:
            found.append((index, handle))
    return found


def variable_handle(nodes: Mapping[str, node_def_pb2.NodeDef], tensor: str) -> str | None:
    """The node resource ``tensor`` comes from, through ops that only move values, if it is a
    variable's: ``VarHandleOp`` (a TF1 graph), or a function's resource input (a captured variable)."""
    source = origin(nodes, parse_tensor_name(tensor).node)
    if source.op in _VARIABLE_HANDLES and (source.op not in ("Placeholder", "_Arg") or _is_resource(source)):
        return source.name
    return None


def _is_resource(node: node_def_pb2.NodeDef) -> bool:
    # ``in`` first: indexing a NodeDef's attr map inserts the key, and these nodes are shared.
    return any(name in node.attr and node.attr[name].type == types_pb2.DT_RESOURCE for name in ("dtype", "T"))


def _forward_of(node: node_def_pb2.NodeDef, forward: Mapping[str, Matmul]) -> tuple[str, Backward] | None:
    """The forward matmul whose gradient ``node`` computes, and how it reads it; None if none."""
    positions = OPERAND_POSITIONS[node.op]
    if len(node.input) <= max(positions):
        return None
    operands = [tensor_name(*parse_tensor_name(node.input[position])) for position in positions]
    for name in forward_names(node.name):
        matmul = forward.get(name)
        if matmul is None or node.op not in BACKWARD_OPS[matmul.op]:
            continue
        shared = [(index, matmul.inputs.index(tensor)) for index, tensor in enumerate(operands)
                  if tensor in matmul.inputs]
        if len(shared) == 1:  # one forward operand; the other one is the incoming gradient
            index, forward_input = shared[0]
            return name, Backward(node.name, positions[index], forward_input, positions[1 - index])
    return None


def forward_names(name: str) -> Iterator[str]:
    """The names of the forward op whose gradient node ``name`` may be part of, by the scope
    TensorFlow gives a gradient (``gradient_tape/<op>/…``, ``gradients/<op>_grad/…``): the
    longest first, the whole name too — an Einsum's gradient einsums sit beside it, uniquified
    (a/einsum/Einsum's are gradient_tape/a/einsum/Einsum and Einsum_1), a MatMul's under it."""
    for match in _GRADIENT_ROOT.finditer(name):
        segments = name[match.end():].split("/")
        for length in range(len(segments), 0, -1):
            scope = "/".join(segments[:length])
            if length == len(segments):
                yield from (scope, _UNIQUIFIED.sub("", scope))
            yield scope.removesuffix("_grad")


def converted_nodes(report: Report, function: str = MAIN_GRAPH) -> frozenset[str]:
    """The nodes of ``function``'s item whose ``T`` the base rewrite converted."""
    return frozenset(vertex.node for item in report.pending if item.function == function
                     for vertex in item.converted if vertex.attr.name == "T")


def quantize_training_step(
    graph_def: graph_pb2.GraphDef, plan: Plan, state: Mapping[str, State], history_length: int, *,
    workers: Workers | None = None, in_function: bool = False, loop_amaxes: Mapping[str, Sequence[Any]] = {},
) -> tuple[graph_pb2.GraphDef, dict[str, Reason], list[str]]:
    """One item after the base rewrite, with the chains of ``plan``'s matmuls (the module doc).
    A forward matmul is quantized where the base rewrite converted it; a backward one where
    it also has its forward matmul's dtype. ``state``: key -> its read nodes in ``graph_def``;
    an operand without one (a function without gradients: ``evaluate``, ``predict``, an
    export) is scaled by its own amax in that call, so such a function needs no state. Where a
    state has a history, the step records amax — the largest of every chain of its key, so
    replicas of one matmul in one graph record and scale alike — and updates it. In a function
    (``in_function``) the updates are returned, to become its control outputs: a key's chains may
    sit in several phases of one step (a GAN's two updates), which only the end of the step
    follows. In a main graph, run by what it fetches, they are control inputs of the backward
    matmuls (of the forward matmul itself where it has none), so they run whenever the step
    trains. Returns the new GraphDef, the reason of each quantized matmul and those updates;
    ``graph_def`` is not modified. ``workers``: the amaxes are the largest of every worker's
    (``Workers``). ``loop_amaxes``: key -> the loops' outputs holding its amax over their
    iterations (``loops.LoopAmax``), recorded with the key's chains here."""
    output = copy_graph_def(graph_def)
    nodes = {node.name: node for node in output.node}
    builder = ChainBuilder(output, nodes, history_length)
    reasons: dict[str, Reason] = {}
    consumers: list[tuple[list[node_def_pb2.NodeDef], list[str]]] = []
    for matmul in plan.matmuls:  # every chain first: an update takes the amax of all chains of its key
        quantized = _quantize_matmul(builder, nodes, matmul, state, reasons)
        if quantized is not None:
            consumers.append(quantized)
    for key, amaxes in loop_amaxes.items():
        builder.amaxes.setdefault(key, []).extend(amax.tensor for amax in amaxes)
        builder.formats.setdefault(key, (amaxes[0].fmt, amaxes[0].dtype, amaxes[0].device))
    consumers.append(([], list(loop_amaxes)))
    if workers is not None:
        builder.reduce_across(workers, [key for _, keys in consumers for key in keys if key in state])
    control_outputs: list[str] = []
    for nodes_to_order, keys in consumers:
        updates = [update for key in keys if key in state for update in builder.update(key, state[key])]
        if in_function:
            control_outputs += [update for update in updates if update not in control_outputs]
            continue
        for consumer in nodes_to_order:
            consumer.input.extend(f"^{update}" for update in updates if f"^{update}" not in consumer.input)
    _summarize_step_amax(nodes, builder.updated)
    return output, reasons, control_outputs


def _summarize_step_amax(nodes: Mapping[str, node_def_pb2.NodeDef], updated: Iterable[str]) -> None:
    """Each recorded key's ``SUMMARY_AMAX`` node (where the trace wrote one) reads the amax this
    step records (its update's entry), not the history's newest entry from the step before."""
    for key in updated:
        summary, entry = (nodes.get(f"{STATE_SCOPE}/{key}/{name}") for name in (SUMMARY_AMAX, "update/entry"))
        if summary is not None and entry is not None:
            summary.input[0] = entry.input[0]


def _quantize_matmul(builder: ChainBuilder, nodes: dict[str, node_def_pb2.NodeDef], matmul: Matmul,
                     state: Mapping[str, State],
                     reasons: dict[str, Reason]) -> tuple[list[node_def_pb2.NodeDef], list[str]] | None:
    """The chains of one forward matmul and its backward ones; returns the nodes its updates must
    precede and the keys it records, or None where the base rewrite left it alone."""
    node = nodes.get(matmul.node)
    dtype = node.attr["T"].type if node is not None else None
    if dtype not in BASE_DTYPES:
        return None
    chains = [builder.chain(matmul.key(index), E4M3, node.input[index], dtype, state.get(matmul.key(index)))
              for index in (0, 1)]
    node.input[0], node.input[1] = chains
    gradient_key = matmul.key(None)
    quantized_backward = []
    for backward in matmul.backward:
        backward_node = nodes[backward.node]
        if backward_node.attr["T"].type != dtype:
            continue
        backward_node.input[backward.operand_position] = chains[backward.forward_input]
        backward_node.input[backward.gradient_position] = builder.chain(
            gradient_key, E5M2, backward_node.input[backward.gradient_position], dtype, state.get(gradient_key))
        quantized_backward.append(backward_node)
        reasons[backward.node] = Reason(
            Rule.FLOAT8_TRAINING, f"gradient of {matmul.node}: the incoming gradient {E5M2.name}, input"
            f" {backward.forward_input} {E4M3.name} as in the forward matmul", matmul.node)
    scaling = "delayed scaling" if matmul.key(0) in state else "scales from this call's amax"
    reasons[matmul.node] = Reason(
        Rule.FLOAT8_TRAINING, f"inputs {E4M3.name}" + (f", {len(quantized_backward)} backward matmul(s) on"
                                                       f" {E5M2.name} gradients" if quantized_backward else "")
        + f", {scaling}")
    keys = [matmul.key(0), matmul.key(1)] + ([gradient_key] if quantized_backward else [])
    return quantized_backward or [node], keys


class ChainBuilder(NodeWriter):
    """The chains and updates of one item, named under ``STATE_SCOPE/<key>``: one chain per
    (key, tensor), shared by every matmul that reads it with that key; one update per key."""

    def __init__(self, graph_def: graph_pb2.GraphDef, nodes: dict[str, node_def_pb2.NodeDef],
                 history_length: int) -> None:
        super().__init__(graph_def, nodes)
        self.history_length = history_length
        self.chains: dict[tuple[str, str], str] = {}
        self.amaxes: dict[str, list[str]] = {}  # key -> the amax of each of its chains' float32 sources
        self.formats: dict[str, tuple[Format, int, str]] = {}  # key -> format, matmul dtype, device
        self.updated: dict[str, list[str]] = {}
        self.reduced: dict[str, str] = {}  # key -> its amax, the largest across workers (``reduce_across``)

    def chain(self, key: str, fmt: Format, tensor: str, dtype: int, state: State | None,
              given: str | None = None) -> str:
        """The dequantized ``tensor`` (an input of a matmul of ``dtype``), quantized with ``key``'s
        scale: the state's once its history has seen an amax, else (or without a state) one from
        the tensor's own amax. ``given``: instead of a state, a float32 scalar holding the scale
        where it is > 0 (a loop body's, ``loops``)."""
        tensor = tensor_name(*parse_tensor_name(tensor))
        if (key, tensor) in self.chains:
            return self.chains[(key, tensor)]
        amaxes = self.amaxes.setdefault(key, [])
        base = f"{STATE_SCOPE}/{key}" + (f"_{len(amaxes)}" if amaxes else "")
        device = self.nodes[parse_tensor_name(tensor).node].device
        self.formats[key] = (fmt, dtype, device)
        f32 = types_pb2.DT_FLOAT
        add = self.under(base, device)
        source = _float32_source(self.nodes, tensor)
        if source is None:
            source = add("float32", "Cast", [tensor], SrcT=dtype, DstT=f32, Truncate=False)
        amax = self.amax(base, source, f32, device)
        scale = self._power_of_two(f"{base}/current", amax, fmt, dtype, device)
        given = self.given_scale(key, state, device) if state is not None else given
        if given is not None:
            delayed = add("delayed", "Greater", [given, self.const(f"{base}/zero", 0.0, f32, device)], T=f32)
            scale = add("step_scale", "SelectV2", [delayed, given, scale], T=f32)
        unscale = self._unscale(base, scale, dtype, device)
        scaled = add("scaled", "Mul", [source, scale], T=f32)
        clipped = add("clipped", "ClipByValue", [scaled, self.const(f"{base}/min", -fmt.max, f32, device),
                                                 self.const(f"{base}/max", fmt.max, f32, device)], T=f32)
        saturated = add("saturated", "SelectV2", [add("finite", "IsFinite", [scaled], T=f32), clipped, scaled], T=f32)
        quantized = add("quantized", "Cast", [saturated], SrcT=f32, DstT=fmt.dtype, Truncate=False)
        dequantized = add("dequantized", "Cast", [quantized], SrcT=fmt.dtype, DstT=dtype, Truncate=False)
        unscaled = add("unscaled", "Mul", [dequantized, unscale], T=dtype)
        amaxes.append(amax)
        self.chains[(key, tensor)] = unscaled
        return unscaled

    def given_scale(self, key: str, state: State, device: str) -> str:
        """``key``'s scale where its history has seen an amax (``max(history) > 0``), else 0: what
        its chains use (``chain``'s ``given``), here and in loop bodies. One per key."""
        base = f"{STATE_SCOPE}/{key}/given_scale"
        if base not in self.nodes:
            f32, i32 = types_pb2.DT_FLOAT, types_pb2.DT_INT32
            largest = self.add(f"{base}/largest", "Max", [f"{state.history}:0",
                                                         self.const(f"{base}/axis", 0, i32, device)],
                               device, {"T": f32, "Tidx": i32, "keep_dims": False})
            zero = self.const(f"{base}/zero", 0.0, f32, device)
            seen = self.add(f"{base}/seen", "Greater", [largest, zero], device, {"T": f32})
            self.add(base, "SelectV2", [seen, f"{state.scale}:0", zero], device, {"T": f32})
        return base

    def _power_of_two(self, base: str, amax: str, fmt: Format, dtype: int, device: str) -> str:
        """``2**floor(log2(fmt.max / amax))``, a float32 scalar, within the exponents whose
        ``1/scale`` is exact in ``dtype`` (the chain applies the scale itself in float32)."""
        f32 = types_pb2.DT_FLOAT
        lowest, highest = EXACT_POWERS[dtype]  # 1/scale = 2**-e
        exponent = self.exponent(base, amax, fmt.max, (-highest, -lowest), device)
        return self.add(f"{base}/scale", "Pow", [self.const(f"{base}/two", 2.0, f32, device), exponent], device,
                        {"T": f32})

    def _unscale(self, base: str, scale: str, dtype: int, device: str) -> str:
        """``base/unscale``: ``1/scale`` in ``dtype`` (exact: ``_power_of_two`` keeps it in ``EXACT_POWERS``)."""
        name = f"{base}/unscale"
        if name not in self.nodes:
            f32 = types_pb2.DT_FLOAT
            inverse = self.add(f"{name}_float32", "Reciprocal", [scale], device, {"T": f32})
            self.add(name, "Cast", [inverse], device, {"SrcT": f32, "DstT": dtype, "Truncate": False})
        return name

    def local_amax(self, key: str) -> str:
        """The largest amax of ``key``'s chains in this graph (its replicas' too)."""
        amax, *others = self.amaxes[key]
        device = self.formats[key][2]
        for index, other in enumerate(others):
            amax = self.add(f"{STATE_SCOPE}/{key}/update/amax_{index + 1}", "Maximum", [amax, other], device,
                            {"T": types_pb2.DT_FLOAT})
        return amax

    def reduce_across(self, workers: Workers, keys: list[str]) -> None:
        """One collective for every key's amax: the largest of each across ``workers``. A
        non-finite amax goes in as +Inf, so that every worker skips recording it."""
        keys = list(dict.fromkeys(keys))
        if not keys:
            return
        f32, i32 = types_pb2.DT_FLOAT, types_pb2.DT_INT32
        device = self.formats[keys[0]][2]
        base = f"{STATE_SCOPE}/workers"
        add = self.under(base, device)
        infinity = self.const(f"{base}/infinity", float("inf"), f32, device)
        finite = []
        for index, key in enumerate(keys):
            amax = self.local_amax(key)
            finite.append(add(f"finite_{index}", "SelectV2", [add(f"is_finite_{index}", "IsFinite", [amax], T=f32),
                                                               amax, infinity], T=f32))
        packed = add("amaxes", "Pack", finite, T=f32, N=attr_value_pb2.AttrValue(i=len(keys)),
                     axis=attr_value_pb2.AttrValue(i=0))
        reduced = add("largest", "CollectiveReduceV2", [
            packed, *(self.const(f"{base}/{name}", value, i32, device) for name, value in (
                ("group_size", workers.group_size), ("group_key", workers.group_key),
                ("instance_key", workers.instance_key)))],
            T=f32, merge_op=attr_value_pb2.AttrValue(s=b"Max"), final_op=attr_value_pb2.AttrValue(s=b"Id"),
            communication_hint=attr_value_pb2.AttrValue(s=b"auto"), timeout_seconds=attr_value_pb2.AttrValue(f=0.0),
            is_stateless=False, Nordering_token=attr_value_pb2.AttrValue(i=0),
            max_subdivs_per_device=attr_value_pb2.AttrValue(i=-1))
        unpacked = add("each", "Unpack", [reduced], T=f32, num=attr_value_pb2.AttrValue(i=len(keys)),
                       axis=attr_value_pb2.AttrValue(i=0))
        self.reduced = {key: f"{unpacked}:{index}" for index, key in enumerate(keys)}

    def update(self, key: str, state: State) -> list[str]:
        """The nodes that record this step's amax of ``key``'s chains and set the next scale."""
        if key in self.updated:
            return self.updated[key]
        fmt, dtype, device = self.formats[key]
        f32, i32 = types_pb2.DT_FLOAT, types_pb2.DT_INT32
        base = f"{STATE_SCOPE}/{key}/update"
        add = self.under(base, device)
        amax = self.reduced.get(key) or self.local_amax(key)
        history = f"{state.history}:0"
        entry = add("entry", "Reshape", [amax, self.const(f"{base}/entry_shape", [1], i32, device)], T=f32, Tshape=i32)
        older = add("older", "Slice", [history, self.const(f"{base}/begin", [0], i32, device),
                                       self.const(f"{base}/size", [self.history_length - 1], i32, device)],
                    T=f32, Index=i32)
        rolled = add("rolled", "ConcatV2", [entry, older, self.const(f"{base}/axis", 0, i32, device)],
                     T=f32, Tidx=i32, N=attr_value_pb2.AttrValue(i=2))
        finite = add("finite", "IsFinite", [amax], T=f32)
        new_history = add("history", "SelectV2", [finite, rolled, history], T=f32)
        largest = add("largest", "Max", [new_history, self.const(f"{base}/history_axis", 0, i32, device)],
                      T=f32, Tidx=i32, keep_dims=False)
        candidate = self._power_of_two(base, largest, fmt, dtype, device)
        seen = add("seen", "Greater", [largest, self.const(f"{base}/zero", 0.0, f32, device)], T=f32)
        scale = add("next_scale", "SelectV2", [seen, candidate, f"{state.scale}:0"], T=f32)
        handle = lambda read: self.nodes[read].input[0]
        assigns = []
        for index, target in enumerate((state, *state.mirrors)):
            suffix = f"_{index}" if index else ""
            # validate_shape: its default, which TensorFlow writes into a registered function (a caller's rewrite
            # reads it)
            assigns += [add(f"assign_history{suffix}", "AssignVariableOp", [handle(target.history), new_history],
                            dtype=f32, validate_shape=False),
                        add(f"assign_scale{suffix}", "AssignVariableOp", [handle(target.scale), scale], dtype=f32,
                            validate_shape=False)]
        self.updated[key] = assigns
        return assigns


def _float32_source(nodes: Mapping[str, node_def_pb2.NodeDef], tensor: str) -> str | None:
    """The float32 tensor the base rewrite cast to give ``tensor``, or None if it made none."""
    ref = parse_tensor_name(tensor)
    node = nodes[ref.node]
    if not is_amp_cast(node) or node.attr["SrcT"].type != types_pb2.DT_FLOAT:
        return None
    return tensor_name(*parse_tensor_name(node.input[0]))


def add_state(graph_def: graph_pb2.GraphDef, keys: Iterable[tuple[str, Format]], history_length: int,
              device: str = "") -> tuple[graph_pb2.GraphDef, dict[str, State], list[str]]:
    """A copy of ``graph_def`` (a main graph) with a resource variable per state of ``keys`` that
    it lacks — ``VarHandleOp`` ``STATE_SCOPE/<key>/scale`` (and ``/amax_history``), read by
    ``…/read`` — and the initializers (a scale of 1, a history of zeros) to run once before the
    graph first runs. Returns the GraphDef, every key's state and the initializers' names."""
    output = copy_graph_def(graph_def)
    nodes = {node.name: node for node in output.node}
    writer = NodeWriter(output, nodes)
    f32 = types_pb2.DT_FLOAT
    state, initializers = {}, []
    for key, _ in keys:
        reads = {}
        for kind, shape, initial in ((SCALE, [], 1.0), (HISTORY, [history_length], [0.0] * history_length)):
            base = f"{STATE_SCOPE}/{key}/{kind}"
            reads[kind] = f"{base}/read"
            if base in nodes:
                continue
            shape_proto = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=n)
                                                                 for n in shape])
            writer.add(base, "VarHandleOp", [], device, {
                "dtype": f32, "shape": attr_value_pb2.AttrValue(shape=shape_proto),
                "shared_name": attr_value_pb2.AttrValue(s=base.encode())})
            writer.add(reads[kind], "ReadVariableOp", [base], device, {"dtype": f32})
            initializers.append(writer.add(f"{base}/initial", "AssignVariableOp",
                                           [base, writer.const(f"{base}/initial_value", initial, f32, device)],
                                           device, {"dtype": f32, "validate_shape": False}))
        state[key] = State(reads[SCALE], reads[HISTORY])
    return output, state, initializers
