"""Our intended differences from grappler, modelled: which differences they explain, and how many.

A conformance test compares both ways, vertex by vertex and cast by cast
(``reference.compare_rewrites``): every vertex grappler lowers we lower, every vertex we
lower grappler lowers, and every cast is in both. README ("Where amp_rewrite differs from
grappler") names two places where we keep float32 what grappler lowers, because
grappler's graph then fails at run time; ``judge`` accepts a difference only where one of
them explains it:

* ``loop value``: a functional While's loop value (``T[i]`` of While/StatelessWhile),
  which grappler's bfloat16 lists make clear and paint while the body and cond keep
  float32 signatures ("passed bfloat16 expected float").
* ``list handed to a loop``: the element type of a TensorList whose handle reaches an op
  that calls a function (a loop's While), which grappler paints while the loop body reads
  the list as float32 ("op elements float but list elements half").

Around such a root, grappler also lowers what painting reaches from it through clear and
infer ops: ``downstream`` counts those vertices, and ``casts`` the casts that touch a
differing node (one side casts where the other does not). Every other difference, and any
vertex we lower that grappler keeps, is unexplained. The model reads the original graph
and the lists, never our rewrite's reasons.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tensorflow.core.framework import types_pb2
from tensorflow.core.framework.graph_pb2 import GraphDef

import amp_rewrite
from amp_rewrite.core import colouring, support, typegraph
from amp_rewrite.core.graph_io import parse_tensor_name
from amp_rewrite.testing.reference import Agreement, function_body

LOOP_VALUE, LIST_HANDED_TO_LOOP, DOWNSTREAM, CASTS = "loop value", "list handed to a loop", "downstream", "casts"
# A Keras 3 LSTM or GRU training step (amp_rewrite.testing.loops): the forward loop's input
# list, its output list and the stack read from it, and the gradient loop's input list;
# the Transpose after the stack; a cast on our side at each of three list ends.
KERAS_LOOP_STEP = {LIST_HANDED_TO_LOOP: 4, DOWNSTREAM: 1, CASTS: 3}
_LOOPS = frozenset({"While", "StatelessWhile"})
_LOW_NAMES = ("DT_HALF", "DT_BFLOAT16")
_KEPT_BY_US = re.compile(r"^(?P<node>.+) attr (?P<attr>\S+): ours=DT_FLOAT grappler=(?P<theirs>DT_\w+)$")
_CAST = re.compile(r"^(?P<source>.+)-\d+-CastTo(Fp16|Bf16|Fp32): (?P<rest>.*)$")
_CONSUMER = re.compile(r"\('(?P<node>[^']+)', \d+\)")


@dataclass(frozen=True)
class Deviations:
    """The differences of one comparison, sorted into the model's kinds."""

    counts: Counter = field(default_factory=Counter)  # kind -> differences of that kind
    unexplained: tuple[str, ...] = ()  # "item: difference"

    def explain(self) -> str:
        return f"explained {dict(self.counts)}; unexplained:\n" + "\n".join(self.unexplained)


def judge(agreement: Agreement, original: GraphDef, target: str) -> Deviations:
    """Sort every difference ``agreement`` found (main graph and each function body) into
    the model's kinds, or into ``unexplained``."""
    counts: Counter = Counter()
    unexplained = [f"library: {line}" for line in agreement.library_mismatches]
    items = [("main graph", original, agreement.mismatches, agreement.cast_mismatches)] + [
        (f"function '{f.name}'", function_body(original, f.name), f.mismatches, f.cast_mismatches)
        for f in agreement.functions
    ]
    lists = amp_rewrite.load_lists(target)
    for label, graph_def, mismatches, cast_mismatches in items:
        found, left = _judge_item(graph_def, mismatches, cast_mismatches, lists, target)
        counts += found
        unexplained += [f"{label}: {line}" for line in left]
    return Deviations(counts, tuple(unexplained))


def assert_agrees_but_for(agreement: Agreement, original: GraphDef, target: str, expected: Mapping[str, int]) -> None:
    """Every difference is one the model explains, and there are exactly ``expected`` of each kind."""
    deviations = judge(agreement, original, target)
    assert not deviations.unexplained, deviations.explain()
    assert dict(deviations.counts) == dict(expected), deviations.explain()


def _judge_item(
    graph_def: GraphDef, mismatches: Iterable[str], cast_mismatches: Iterable[str], lists, target: str
) -> tuple[Counter, list[str]]:
    node_to_op = {node.name: node.op for node in graph_def.node}
    differing: dict[str, list[str]] = {}  # node -> its vertex differences
    left: list[str] = []
    for mismatch in mismatches:
        match = _KEPT_BY_US.match(mismatch)
        if match is None or match["theirs"] not in _LOW_NAMES:
            left.append(mismatch)  # we lower what grappler keeps, or an op or node differs
        else:
            differing.setdefault(match["node"], []).append(match["attr"])
    roots: dict[str, str] = {}
    for node, attrs in differing.items():
        if target == "bfloat16" and node_to_op[node] in _LOOPS and all(a.startswith("T[") for a in attrs):
            roots[node] = LOOP_VALUE
        elif "TensorList" in node_to_op[node] and _handle_reaches_a_call(graph_def, node):
            roots[node] = LIST_HANDED_TO_LOOP
    passable = {name for name, op in node_to_op.items() if op in lists.clear or op in lists.infer}
    reached = _reach(graph_def, roots, passable | set(differing))
    counts: Counter = Counter()
    for node, attrs in differing.items():
        if node in roots:
            counts[roots[node]] += len(attrs)
        elif node in reached:
            counts[DOWNSTREAM] += len(attrs)
        else:
            left += [f"{node} attr {attr}: ours=DT_FLOAT grappler=low, reached from no modelled root" for attr in attrs]
    for mismatch in cast_mismatches:
        match = _CAST.match(mismatch)
        touched = {match["source"]} | {m["node"] for m in _CONSUMER.finditer(match["rest"])} if match else set()
        if touched & differing.keys():
            counts[CASTS] += 1
        else:
            left.append(mismatch)
    return counts, left


def _reach(graph_def: GraphDef, roots: Iterable[str], passable: set[str]) -> set[str]:
    """Nodes joined to a root by data edges (either way) through ``passable`` nodes."""
    neighbours: dict[str, set[str]] = {node.name: set() for node in graph_def.node}
    for node in graph_def.node:
        for tensor in node.input:
            if not tensor.startswith("^"):
                source = parse_tensor_name(tensor).node
                neighbours[node.name].add(source)
                neighbours.setdefault(source, set()).add(node.name)
    reached, frontier = set(roots), list(roots)
    while frontier:
        for neighbour in neighbours[frontier.pop()] - reached:
            if neighbour in passable:
                reached.add(neighbour)
                frontier.append(neighbour)
    return reached


def _handle_reaches_a_call(graph_def: GraphDef, start: str) -> bool:
    """Whether a TensorList handle (a variant edge) leads from ``start``, through other
    TensorList ops, to an op that calls a function."""
    name_to_node = {node.name: node for node in graph_def.node}
    op_defs = support.library_op_defs(graph_def.library)

    def variant_ports(name: str) -> tuple[set[int], set[int]]:
        node = name_to_node[name]
        op_def = support.resolve_op_def(node, op_defs)
        data = [t for t in node.input if not t.startswith("^")]
        types = typegraph.node_types(node, op_def, len(data))
        variant = {index for index, attr in enumerate(types.inputs)
                   if typegraph.dtype_of(node, attr) == types_pb2.DT_VARIANT}
        return variant, {port for port, attr in enumerate(types.outputs)
                         if typegraph.dtype_of(node, attr) == types_pb2.DT_VARIANT}

    consumers: dict[tuple[str, int], list[str]] = {}
    for node in graph_def.node:
        for tensor in node.input:
            if not tensor.startswith("^"):
                consumers.setdefault(tuple(parse_tensor_name(tensor)), []).append(node.name)
    seen, frontier = {start}, [start]
    while frontier:
        name = frontier.pop()
        inputs, outputs = variant_ports(name)
        data = [t for t in name_to_node[name].input if not t.startswith("^")]
        linked = [parse_tensor_name(data[index]).node for index in inputs if index < len(data)]
        linked += [consumer for port in outputs for consumer in consumers.get((name, port), ())]
        for other in linked:
            node = name_to_node.get(other)
            if node is None or other in seen:
                continue
            if node.op in op_defs or colouring.calls_functions(node.op):
                return True
            if "TensorList" in node.op:
                seen.add(other)
                frontier.append(other)
    return False

