"""Which of the ops a rewrite converted to keep float32, so the converted ops and their
casts cost least on this machine: a minimum cut.

Each converted node is float32 or the target. Its cost is its own time in that precision
(timed alone, ``timing``), and the casts it causes: a float32 tensor read in the target
needs a cast down, a target tensor read in float32 a cast back; one cast per tensor and
direction, however many readers share it, as the rewrite inserts them. Costs of this form
(a time per node and precision, a time per tensor paid when its producer and some reader
differ) are minimised exactly by a minimum s-t cut, where the float32 side holds the
source and every node that is not converted; a tensor's shared cast is an extra vertex
between its producer and its readers. So a run of ops decides together: one op kept
float32 in a converted chain costs two casts, and stays converted unless it saves more.

Several batch sizes are one cost, each batch's weighed by one over its float32 time; a
batch the plan predicts slower than float32 weighs more, until none does (or every
converted node stays float32). Ops measured faster in the target by less than ``MARGIN``
count as float32's equal: a decision to keep float32 needs the target clearly slower.
"""
from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import networkx as nx
import numpy as np
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2

from amp_rewrite.core import support
from amp_rewrite.core.graph_io import (arg_port_count, attr_or_default, data_inputs, parse_tensor_name,
                                      tensor_name)
from amp_rewrite.core.program import Program, program_of
from amp_rewrite.core.rewrite import RewriteResult
from amp_rewrite.core.rules import MEASURED_PREFIX
from amp_rewrite.core.target import Target
from amp_rewrite.tuning.cache import TimingCache
from amp_rewrite.tuning.shapes import Shapes, TensorInfo, infer_shapes
from amp_rewrite.tuning.timing import Budget, OpRun, Pair, Timings, cast_pair, op_run, time_pairs

MARGIN = 0.1  # the target must be over 10% slower (with its casts) before an op is kept float32
_REWEIGHTS = 6
# Readers of a weight: where weights are stored in the target (convert's default), reading
# one costs no cast.
WEIGHT_OPS = frozenset({"ReadVariableOp", "Const", "ResourceGather"})

Node = tuple[str, str]  # (item, node name)


@dataclass(frozen=True)
class Candidate:
    """A converted node: the two forms that are timed, per batch size (None: not timeable)."""

    node: Node
    op: str
    runs: Mapping[int, Pair | None]


@dataclass
class Problem:
    """The cost graph before weights: per batch size, each node's and each tensor's times."""

    batch_sizes: tuple[int, ...]
    candidates: dict[Node, Candidate] = field(default_factory=dict)
    fused: dict[Node, Node] = field(default_factory=dict)  # a candidate the remapper fuses -> the op it fuses into
    # tensor (item, "node:port") -> (producer, candidate readers, has other readers, is a weight, shape per batch)
    tensors: dict[tuple[str, str], tuple[Node, list[Node], bool, bool, dict[int, tuple[int, ...] | None]]] = field(
        default_factory=dict)
    # item -> how many times one call of the model runs it (a loop's body: its iterations); 1 where absent
    repeats: dict[str, float] = field(default_factory=dict)
    # batch -> what the target's seconds in a loop's body (its ops', its casts') count for: the
    # loop run whole against the same ops timed alone (``loop_scale``); 1 where absent
    loop_scale: dict[int, float] = field(default_factory=dict)

    def looped(self, item: str) -> bool:
        return self.repeats.get(item, 1.0) > 1

    def pairs(self, low: int, weights_low: bool = True) -> list[Pair]:
        """Everything to time: each candidate's two forms and each boundary's casts (not a
        weight's, where weights are stored in the target), weighed by their size over
        their batch size's total, so each batch size gets its share of a short budget."""
        totals = {b: sum(c.runs[b].weight for c in self.candidates.values() if c.runs.get(b)) or 1.0
                  for b in self.batch_sizes}
        found = [replace(pair, weight=pair.weight * self.repeats.get(c.node[0], 1.0) / totals[batch])
                 for c in self.candidates.values()
                 if c.node not in self.fused for batch, pair in c.runs.items() if pair is not None]
        shapes = {shape: batch for producer, _, _, weight, by_batch in self.tensors.values()
                  if not (weight and weights_low and producer not in self.candidates)
                  for batch, shape in by_batch.items() if shape}
        casts = [cast_pair(shape, low) for shape in sorted(shapes)]
        return found + [replace(pair, weight=pair.weight / totals[shapes[pair.first.inputs[0].shape]])
                        for pair in casts]


def input_dtypes(node_def: node_def_pb2.NodeDef) -> list[int] | None:
    """The dtype of each data input as ``node_def``'s attrs say, an attr it lacks taking its
    op-def default (None: not a registered op, or one whose attrs do not say)."""
    op_def = support.registered_op_def(node_def.op)
    if op_def is None:
        return None
    found: list[int] = []
    for arg in op_def.input_arg:
        count = arg_port_count(node_def, op_def, arg)
        typed_by = arg.type_list_attr or arg.type_attr  # else the arg's own fixed type
        value = attr_or_default(node_def, op_def, typed_by) if typed_by else None
        if count is None or typed_by and value is None:
            return None
        found += value.list.type if arg.type_list_attr else [value.type if typed_by else arg.type] * count
    return found


def _form(node_def: node_def_pb2.NodeDef, infos: Sequence[TensorInfo], out: TensorInfo | None) -> OpRun | None:
    """``node_def`` timed on inputs of ``infos``' shapes in its own dtypes; a chain where its
    output 0 (``out``) is input 0's shape and dtype."""
    dtypes = input_dtypes(node_def)
    if dtypes is None or len(dtypes) != len(infos):
        return None
    chain = bool(infos) and out is not None and out.shape == infos[0].shape and out.dtype == infos[0].dtype
    return op_run(node_def, [TensorInfo(dtype, info.shape, info.value) for dtype, info in zip(dtypes, infos)], chain)


def build_problem(source: Program, converted: Program, nodes: Mapping[str, set[str]],
                  shapes: Mapping[int, Shapes]) -> Problem:
    """The candidates (``nodes``: item -> the nodes the rewrite converted there, bodies from
    ``source`` and, converted, from ``converted``) and the float32 tensors around them,
    with their shapes at each batch size (``shapes``)."""
    problem = Problem(tuple(sorted(shapes)))
    for item, names in sorted(nodes.items()):
        low_nodes = {n.name: n for n in converted.item(item).node if n.name in names}
        body = source.item(item).node
        readers: dict[str, dict[int, list[str]]] = {}  # node -> port -> the nodes reading it
        for node_def in body:
            for tensor in data_inputs(node_def):
                ref = parse_tensor_name(tensor)
                readers.setdefault(ref.node, {}).setdefault(ref.port, []).append(node_def.name)
        for node_def in body:
            if node_def.name in low_nodes:
                problem.candidates[(item, node_def.name)] = _candidate(item, node_def, low_nodes[node_def.name], shapes)
        for node_def in body:
            _add_tensors(problem, item, node_def, readers.get(node_def.name, {}), names, shapes)
        problem.fused.update(_fusions(item, body, readers, names, next(iter(shapes.values()))))
    return problem


# What grappler's remapper fuses on CPU (oneDNN), in float32 and bfloat16 alike: a bias add
# (and an activation after it) into a convolution or matmul, a Pad into the Conv2D it feeds. A
# fused op costs next to nothing in either precision, but timed alone a bfloat16 BiasAdd or
# Relu is slow, and keeping it float32 would break the fusion: it follows its head instead.
FUSION_HEADS = frozenset({"Conv2D", "Conv3D", "DepthwiseConv2dNative", "MatMul"})
BIAS_ADDS = frozenset({"BiasAdd", "Add", "AddV2"})
ACTIVATIONS = frozenset({"Relu", "Relu6", "Elu", "LeakyRelu", "Tanh", "Sigmoid"})


def _fusions(item: str, body, readers: Mapping[str, Mapping[int, list[str]]], converted: set[str],
             shapes: Shapes) -> dict[Node, Node]:
    """Candidates the remapper fuses (above) -> the candidate they fuse into."""
    nodes = {n.name: n for n in body}

    def only_reader(name: str) -> node_def_pb2.NodeDef | None:
        ports = readers.get(name, {})
        found = ports.get(0, [])
        reader = nodes.get(found[0]) if len(found) == 1 and set(ports) == {0} else None
        return reader if reader is not None and reader.name in converted else None

    fused: dict[Node, Node] = {}
    for head in (n for n in body if n.name in converted and n.op in FUSION_HEADS):
        out = shapes.info(item, tensor_name(head.name, 0))
        member = only_reader(head.name)
        if member is not None and member.op in BIAS_ADDS and out is not None and out.shape and len(member.input) >= 2:
            bias = shapes.info(item, member.input[1])
            if bias is not None and bias.shape is not None and math.prod(bias.shape) == out.shape[-1]:
                fused[(item, member.name)] = (item, head.name)
                member = only_reader(member.name)  # an activation fuses only after the bias add
                if member is not None and member.op in ACTIVATIONS:
                    fused[(item, member.name)] = (item, head.name)
        pad = nodes.get(parse_tensor_name(head.input[0]).node) if head.op == "Conv2D" and head.input else None
        if pad is not None and pad.op == "Pad" and pad.name in converted and only_reader(pad.name) is head:
            fused[(item, pad.name)] = (item, head.name)
    return fused


# Ops with an input that holds their output's shape: where shape inference knows the output's
# shape but cannot fold that input's value (computed from a Shape inside a loop, say), the
# shape is its value.
SHAPE_INPUTS = {"Reshape": 1, "BroadcastTo": 1}
# Ops with an input of indices into another: where its value is unknown (a loop's position,
# say), it is timed as zeros, an index every table holds; the op's time hardly depends on
# which rows it reads or writes.
INDEX_INPUTS = {"TensorScatterUpdate": 1, "TensorScatterAdd": 1, "GatherNd": 1, "GatherV2": 1, "ResourceGather": 1}


def _known_values(op: str, infos: list[TensorInfo], out: TensorInfo | None) -> list[TensorInfo]:
    """``infos`` with the values an input of unknown value is timed with: a shape input
    the shape ``out`` has (``SHAPE_INPUTS``), indices zeros (``INDEX_INPUTS``)."""
    infos = list(infos)
    index = SHAPE_INPUTS.get(op)
    if index is not None and index < len(infos) and infos[index].value is None and out is not None \
            and out.shape is not None and infos[index].shape == (len(out.shape),):
        infos[index] = TensorInfo(infos[index].dtype, infos[index].shape, np.array(out.shape))
    index = INDEX_INPUTS.get(op)
    if index is not None and index < len(infos) and infos[index].value is None and infos[index].shape is not None:
        infos[index] = TensorInfo(infos[index].dtype, infos[index].shape, np.zeros(infos[index].shape, np.int32))
    return infos


def _candidate(item: str, source: node_def_pb2.NodeDef, low: node_def_pb2.NodeDef, shapes: Mapping[int, Shapes]
               ) -> Candidate:
    data = data_inputs(source)
    runs: dict[int, Pair | None] = {}
    for batch, found in shapes.items():
        infos = [found.info(item, t) for t in data]
        runs[batch] = None
        if all(info is not None for info in infos):
            out = found.info(item, tensor_name(source.name, 0))
            infos = _known_values(source.op, infos, out)
            first, second = _form(source, infos, out), _form(low, infos, out)
            if first is not None and second is not None:
                size = math.prod(out.shape) if out is not None and out.shape else 1
                runs[batch] = Pair(first, second, float(size))
    return Candidate((item, source.name), source.op, runs)


def _add_tensors(problem: Problem, item: str, node_def: node_def_pb2.NodeDef, readers: Mapping[int, list[str]],
                 converted: set[str], shapes: Mapping[int, Shapes]) -> None:
    """The float32 outputs of ``node_def`` (``readers``: port -> the nodes reading it) that a
    candidate writes or reads."""
    for port, read_by in sorted(readers.items()):
        tensor = tensor_name(node_def.name, port)
        low = [(item, r) for r in read_by if r in converted]
        if node_def.name not in converted and not low:
            continue
        infos = {batch: found.info(item, tensor) for batch, found in shapes.items()}
        if any(info is None or info.dtype != types_pb2.DT_FLOAT for info in infos.values()):
            continue
        problem.tensors[(item, tensor)] = ((item, node_def.name), sorted(set(low)), len(low) < len(read_by),
                                           node_def.op in WEIGHT_OPS, {b: i.shape for b, i in infos.items()})


@dataclass(frozen=True)
class Plan:
    """The nodes to keep float32, with why, and the modeled seconds per batch size of the
    converted ops and their casts: all float32, as the lists convert them, as planned."""

    keep: Mapping[Node, str]
    modeled: Mapping[int, tuple[float, float, float]]


class _Costs:
    """The seconds of each candidate form and each cast, per batch: timed, or where the budget
    left one untimed, estimated per output element from the timed ones of its op type (the
    timed casts, for a cast); 0 where nothing like it was timed."""

    def __init__(self, problem: Problem, timings: Timings, low: int, weights_low: bool) -> None:
        self.problem, self.timings, self.low, self.weights_low = problem, timings, low, weights_low
        self.casts: dict[tuple[int, ...], tuple[float, float]] = {}
        self.rates: dict[object, tuple[float, float] | None] = {}

    def measured(self, node: Node, batch: int) -> bool:
        pair = None if node in self.problem.fused else self.problem.candidates[node].runs.get(batch)
        return pair is not None and self.timings.ratio(pair) is not None

    def node(self, node: Node, batch: int, margin: float = MARGIN) -> tuple[float, float]:
        """(float32, target) seconds of a candidate (nothing for a fused one); the target's
        discounted by ``margin``."""
        pair = None if node in self.problem.fused else self.problem.candidates[node].runs.get(batch)
        if pair is None or self.timings.too_small(pair):
            return 0.0, 0.0
        if self.timings.ratio(pair) is not None:
            first, second = self.timings.seconds[pair.first.key], self.timings.seconds[pair.second.key]
        else:
            first, second = (rate * pair.weight for rate in self.rate(self.problem.candidates[node].op, batch))
        repeats = self.problem.repeats.get(node[0], 1.0)
        return first * repeats, second * repeats * self.scale(node[0], batch) / (1 + margin)

    def scale(self, item: str, batch: int) -> float:
        """What a second of the target's counts for in ``item`` (``Problem.loop_scale``)."""
        return self.problem.loop_scale.get(batch, 1.0) if self.problem.looped(item) else 1.0

    def rate(self, op: str, batch: int) -> tuple[float, float]:
        """Median (float32, target) seconds per output element of the ``op`` candidates timed at ``batch``."""
        if (op, batch) not in self.rates:
            pairs = [c.runs.get(batch) for c in self.problem.candidates.values() if c.op == op]
            self.rates[(op, batch)] = _median_rates(self.timings, [p for p in pairs if p is not None])
        return self.rates[(op, batch)] or (0.0, 0.0)

    def boundary(self, key: tuple[str, str], batch: int) -> tuple[float, float]:
        """(back, down) seconds per call of the model of the casts of tensor ``key``: back to
        float32 (its producer in the target, a reader float32), down to the target (the other
        way round); once per run of its item (each iteration, in a loop's body)."""
        repeats = self.problem.repeats.get(key[0], 1.0) * self.scale(key[0], batch)
        down, back = self.cast(self.problem.tensors[key][4][batch])
        return back * repeats, down * repeats

    def cast(self, shape: tuple[int, ...] | None) -> tuple[float, float]:
        """(down, back) seconds of the casts of a tensor of ``shape``, each at least what the
        executor takes to run one more node (``Timings.node_s``): a cast too small to time
        is still a node to run, in a loop's body once per iteration."""
        if shape is None:
            return 0.0, 0.0
        if shape not in self.casts:
            pair = cast_pair(shape, self.low)
            node_s = self.timings.node_s
            if self.timings.too_small(pair):
                self.casts[shape] = (node_s, node_s)
            elif self.timings.ratio(pair) is None:
                if "casts" not in self.rates:
                    shapes = {s for *_, by_batch in self.problem.tensors.values() for s in by_batch.values() if s}
                    self.rates["casts"] = _median_rates(self.timings, [cast_pair(s, self.low) for s in shapes])
                self.casts[shape] = tuple(max(r * pair.weight, node_s) for r in self.rates["casts"] or (0.0, 0.0))
            else:
                self.casts[shape] = (max(self.timings.seconds[pair.first.key], node_s),
                                     max(self.timings.seconds[pair.second.key], node_s))
        return self.casts[shape]


def _median_rates(timings: Timings, pairs: Sequence[Pair]) -> tuple[float, float] | None:
    """Median seconds per element (``weight``) of each form of the timed ``pairs``; None: none timed."""
    timed = [p for p in pairs if timings.ratio(p) is not None and p.weight > 0]
    if not timed:
        return None
    return (statistics.median(timings.seconds[p.first.key] / p.weight for p in timed),
            statistics.median(timings.seconds[p.second.key] / p.weight for p in timed))


def _cost(costs: _Costs, batch: int, low: set[Node], margin: float = MARGIN,
          tensors: Callable[[tuple[str, str]], bool] = lambda key: True) -> float:
    """Modeled seconds at ``batch`` of the candidates and casts (at the ``tensors`` it holds
    for), ``low`` the nodes in the target (their time discounted by ``margin``)."""
    total = sum(costs.node(node, batch, margin)[node in low] for node in costs.problem.candidates)
    for key, (producer, readers, others, weight, _) in costs.problem.tensors.items():
        if not tensors(key):
            continue
        back, down = costs.boundary(key, batch)
        if producer in low and (others or any(r not in low for r in readers)):
            total += back
        elif producer not in low and any(r in low for r in readers) and not (weight and costs.weights_low):
            total += down
    return total


LOOP_SCALES = (0.25, 10.0)  # the least and most a loop's run whole may scale its target seconds by


def loop_scale(problem: Problem, timings: Timings, low: int, weights_low: bool, batch: int, *,
               source_s: float, lists_s: float) -> float | None:
    """What the target's seconds in loop bodies count for at ``batch``, from one whole run:
    the source took ``source_s`` a call and the lists' conversion ``lists_s``. Ops timed
    alone model the lists' extra seconds; what the run shows beyond that is put on the
    target's seconds in the loops (their ops' and casts'), the place where ops timed alone
    say least (a body's ops are small, and run thousands of times). The casts of weights
    read low, which the run pays and a written model does not (it stores them low), come
    off first. None: no target seconds in a loop to scale (nothing timed there)."""
    unscaled = replace(problem, loop_scale={})
    costs = _Costs(unscaled, timings, low, weights_low)
    everything = set(problem.candidates)
    looped = {node for node in everything if problem.looped(node[0])}
    in_loops = sum(costs.node(node, batch, 0.0)[1] for node in looped) + _casts(
        costs, batch, everything, lambda key: problem.looped(key[0]))
    if in_loops <= 0:
        return None
    modeled = _cost(costs, batch, everything, 0.0) - _cost(costs, batch, set(), 0.0)
    weight_casts = sum(costs.cast(by_batch[batch])[0] for producer, readers, others, weight, by_batch
                       in problem.tensors.values()
                       if weight and weights_low and producer not in everything and readers and not others)
    measured = lists_s - source_s - weight_casts
    return min(max(1.0 + (measured - modeled) / in_loops, LOOP_SCALES[0]), LOOP_SCALES[1])


def modeled_seconds(problem: Problem, timings: Timings, low: int, weights_low: bool, batch: int,
                    low_nodes: set[Node]) -> float:
    """Modeled seconds at ``batch`` of the candidates and their casts with ``low_nodes`` in
    the target and the rest float32 (the plan's own figures are ``Plan.modeled``)."""
    return _cost(_Costs(problem, timings, low, weights_low), batch, low_nodes, 0.0)


def _casts(costs: _Costs, batch: int, low: set[Node], where: Callable[[tuple[str, str]], bool]) -> float:
    """Seconds of the casts ``low`` needs at the tensors ``where`` holds for."""
    return _cost(costs, batch, low, 0.0, where) - sum(
        costs.node(n, batch, 0.0)[n in low] for n in costs.problem.candidates)


def _cut(costs: _Costs, weights: Mapping[int, float]) -> set[Node]:
    """The candidates on the target side of a minimum cut with these batch weights."""
    graph = nx.DiGraph()
    source, sink = "float32", "target"

    def add(u: object, v: object, capacity: float) -> None:
        if capacity > 0:
            old = graph.get_edge_data(u, v, {}).get("capacity", 0.0)
            graph.add_edge(u, v, capacity=old + capacity)

    for member, head in costs.problem.fused.items():  # one precision for both: the fusion holds
        graph.add_edge(member, head, capacity=math.inf)
        graph.add_edge(head, member, capacity=math.inf)
    for node in costs.problem.candidates:
        graph.add_node(node)
        for batch, weight in weights.items():
            first, second = costs.node(node, batch)
            add(source, node, weight * second)
            add(node, sink, weight * first)
    for key, (producer, readers, others, weight_op, _) in costs.problem.tensors.items():
        for batch, weight in weights.items():
            back, down = costs.boundary(key, batch)
            if producer in costs.problem.candidates:
                if others:
                    add(source, producer, weight * back)
                elif readers:
                    add(("back", key), producer, weight * back)
            if readers and not (weight_op and costs.weights_low and producer not in costs.problem.candidates):
                add(producer if producer in costs.problem.candidates else source, ("down", key), weight * down)
        for reader in readers:
            graph.add_edge(reader, ("back", key), capacity=math.inf)
            graph.add_edge(("down", key), reader, capacity=math.inf)
    if source not in graph or sink not in graph:
        return set(costs.problem.candidates)
    _, (_, target_side) = nx.minimum_cut(graph, source, sink)
    return {node for node in costs.problem.candidates if node in target_side}


def plan_keeps(problem: Problem, timings: Timings, target: str, low: int, weights_low: bool = True) -> Plan:
    """The candidates to keep float32 (-> the reason the report shows) and the modeled costs.

    Each batch size weighs one over its float32 time; while the plan is modeled slower than
    float32 at a batch size, that batch weighs four times more (``_REWEIGHTS`` times at
    most). A plan modeled less than ``MARGIN`` faster than float32 at every batch size is
    within what timing alone can tell apart: then every candidate stays float32, which is
    float32's speed for sure. Nothing timed (an empty cache, no budget): nothing moves."""
    costs = _Costs(problem, timings, low, weights_low)
    everything = set(problem.candidates)
    float32 = {b: _cost(costs, b, set()) for b in problem.batch_sizes}
    weights = {b: 1.0 / max(float32[b], 1e-9) for b in problem.batch_sizes}
    low_side: set[Node] = set()
    for _ in range(_REWEIGHTS):
        low_side = _cut(costs, weights)
        slower = [b for b in problem.batch_sizes if _cost(costs, b, low_side, 0.0) > float32[b]]
        if not slower:
            break
        for batch in slower:
            weights[batch] *= 4
    modeled = {b: (float32[b], _cost(costs, b, everything, 0.0), _cost(costs, b, low_side, 0.0))
               for b in problem.batch_sizes}
    known = any(f32 > 0 for f32, _, _ in modeled.values())  # else nothing was timed: the lists decide
    pays = not known or all(tuned <= f32 for f32, _, tuned in modeled.values()) and any(
        tuned < f32 / (1 + MARGIN) for f32, _, tuned in modeled.values())
    if not pays and low_side:
        low_side = set()
        modeled = {b: (f32, lists, f32) for b, (f32, lists, _) in modeled.items()}
    keep = {node: _reason(costs, node, target, pays) for node in sorted(everything - low_side)}
    return Plan(keep, modeled)


def _speeds(costs: _Costs, node: Node) -> dict[int, float]:
    """float32's time over the target's, per batch size where both are timed."""
    found = {}
    for batch in costs.problem.batch_sizes:
        first, second = costs.node(node, batch, margin=0.0)
        if first > 0 and second > 0 and costs.measured(node, batch):
            found[batch] = first / second
    return found


def _reason(costs: _Costs, node: Node, target: str, pays: bool) -> str:
    """Why ``node`` stays float32, as ``explain`` shows it: its speed in the target per batch
    size, and whether it is slower itself, kept for the casts around it, or kept because
    the converted ops together would not be clearly faster (``pays`` False)."""
    head = costs.problem.fused.get(node)
    if head is not None:
        return (f"{MEASURED_PREFIX}fused into {head[1]!r} by grappler's remapper, so it takes that op's precision;"
                f" {_reason(costs, head, target, pays).removeprefix(MEASURED_PREFIX)}")
    speeds = _speeds(costs, node)
    shown = ", ".join(f"{s:.2f}x at batch {b}" for b, s in speeds.items())
    alone = f"{target} runs it at {shown} float32's speed on this machine" if speeds else _estimated(costs, node)
    if not pays:
        return (f"{MEASURED_PREFIX}{alone}; the converted ops together would not be over {MARGIN:.0%} faster"
                " than float32 here")
    if not speeds:
        return f"{MEASURED_PREFIX}{alone}" + ("; kept float32 with its neighbours, which saves casts"
                                              if alone == "not timed alone" else "")
    if all(s < 1 / (1 + MARGIN) for s in speeds.values()):
        return f"{MEASURED_PREFIX}{alone}"
    return f"{MEASURED_PREFIX}{alone}, not enough to pay for the casts it needs next to float32 neighbours"


def _estimated(costs: _Costs, node: Node) -> str:
    """How an untimed candidate's cost was taken: none where it is too small to time, from
    the timed ops of its type, or not at all."""
    runs = costs.problem.candidates[node].runs
    if any(pair is not None and costs.timings.too_small(pair) for pair in runs.values()):
        return "too small to time here (no longer than an empty call), so it costs nothing measurable either way"
    op = costs.problem.candidates[node].op
    rates = {b: costs.rate(op, b) for b in costs.problem.batch_sizes if costs.problem.candidates[node].runs.get(b)}
    shown = ", ".join(f"{f32 / low:.2f}x at batch {b}" for b, (f32, low) in rates.items() if f32 > 0 and low > 0)
    if not shown:
        return "not timed alone"
    return (f"left untimed by the budget; the {op} ops timed here run at {shown} float32's speed in the target,"
            " and so it is taken to")


def costliest(problem: Problem, timings: Timings, low: int, weights_low: bool, converted: set[Node], batch: int, *,
              count: int = 3) -> str:
    """The op types of ``converted`` whose target time exceeds float32's most at ``batch``
    (summed over their nodes), and the casts between them and float32, as one phrase."""
    costs = _Costs(problem, timings, low, weights_low)
    extra: dict[str, list[float]] = {}
    for node in converted & set(problem.candidates):
        first, second = costs.node(node, batch, margin=0.0)
        if first > 0:
            extra.setdefault(problem.candidates[node].op, []).append(second - first)
    casts = _casts(costs, batch, converted, lambda key: True)
    ranked = sorted(((sum(v), op, len(v)) for op, v in extra.items() if sum(v) > 0), reverse=True)[:count]
    parts = [f"{op} +{total * 1e3:.2f} ms over float32 ({n} node(s))" for total, op, n in ranked]
    return ", ".join(parts + [f"casts {casts * 1e3:.2f} ms" + ("" if parts else "; no converted op is slower alone")])


def plan_rewrite(program: Program, base: RewriteResult, target: Target, shapes: Mapping[int, Shapes],
                 cache: TimingCache, budget: Budget, *, weights_low: bool = True,
                 repeats: Mapping[str, float] | None = None) -> tuple[Problem, Timings, Plan]:
    """What a rewrite ``base`` of ``program``'s graph converted, timed (the cache first, then
    measured while ``budget`` lasts) at the ``shapes`` of each batch size, and the plan.
    ``weights_low``: weights are stored in the target, so reading one costs no cast.
    ``repeats``: item -> how many times a call of the model runs it (``Problem.repeats``)."""
    nodes: dict[str, set[str]] = {}
    for decision in base.report.decisions:
        if decision.converted:
            nodes.setdefault(decision.function, set()).add(decision.node)
    problem = build_problem(program, base.program, nodes, shapes)
    problem.repeats.update(repeats or {})
    timings = time_pairs(problem.pairs(target.dtype, weights_low), cache, budget)
    return problem, timings, plan_keeps(problem, timings, target.name, target.dtype, weights_low)


def cached_keeps(graph_def: graph_pb2.GraphDef, base: RewriteResult, target: Target,
                 feed_shapes: Mapping[str, tuple[int, ...]], cache: TimingCache,
                 handles: Mapping[str, tuple[int, tuple[int, ...]]] | None = None) -> dict[Node, str]:
    """The plan from the cache alone, nothing timed: for the live training rewrite, which
    must not time ops on a training step's path. ``feed_shapes``: placeholder -> shape;
    ``handles``: variable placeholder -> (dtype, shape) (``infer_shapes``). What the cache
    does not hold counts as no faster nor slower (its neighbours decide)."""
    program = program_of(graph_def)
    shapes = infer_shapes(program, feed_shapes, handles=handles)
    batch = next((shape[0] for shape in feed_shapes.values() if shape), 1)
    return dict(plan_rewrite(program, base, target, {batch: shapes}, cache, Budget(0.0))[2].keep)
