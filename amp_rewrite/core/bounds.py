"""Which values an integer input may take: the rows of the tables it indexes.

Random validation inputs must be inputs the model accepts: an id past a table's last row
fails a Gather on CPU. ``index_bound`` follows an input forward through the ops that carry
its values unchanged (Identity, Cast, Reshape, ExpandDims, slices, selects, concats …),
through a constant offset (``ids + 1``), and into the functions a call, a loop or a branch
runs, to every op that looks its values up: a Gather's or a ResourceGather's table, a
OneHot's depth, an unsorted segment op's number of segments. Each table's rows are read
back from where its shape is written (a variable's handle, a Const, a node's
``_output_shapes``), through the reads, identities and call arguments in between. The bound
is the tightest over every table reached: conservative where an input indexes several.
A path it cannot follow (an offset that is not a constant, an op that changes values) bounds
nothing; Keras' guard for negative ids (``where(ids < 0, ids + rows, ids)``) keeps its
``ids`` branch, the only one non-negative ids take.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2, tensor_shape_pb2

from amp_rewrite.core.functions import LOOP_OPS
from amp_rewrite.core.graph_io import data_inputs, parse_tensor_name
from amp_rewrite.core.program import MAIN_GRAPH, Program

# op -> its data inputs whose values reach its output 0 unchanged (order, shape or selection aside)
CARRIERS: Mapping[str, tuple[int, ...] | None] = {  # None: every data input
    **{op: (0,) for op in ("Identity", "Cast", "Reshape", "ExpandDims", "Squeeze", "Transpose", "StridedSlice",
                           "Slice", "Tile", "BroadcastTo", "StopGradient", "Snapshot", "PreventGradient",
                           "EnsureShape", "ReverseV2", "GatherV2", "Gather", "Enter", "Exit", "Switch",
                           "NextIteration", "Merge", "Pad", "PadV2", "MirrorPad", "Roll")},
    "SelectV2": (1, 2), "Select": (1, 2), "Pack": None, "IdentityN": None, "ConcatV2": None, "Concat": None,
}
# op -> (the input port of the ids, how the table's size is found): ("rows", table port, axis port or None),
# ("count", port of a scalar Const)
LOOKUPS: Mapping[str, tuple[int, tuple]] = {
    "GatherV2": (1, ("rows", 0, 2)), "Gather": (1, ("rows", 0, None)), "ResourceGather": (1, ("rows", 0, None)),
    "OneHot": (0, ("count", 1)),
    **{op: (1, ("count", 2)) for op in ("UnsortedSegmentSum", "UnsortedSegmentMax", "UnsortedSegmentMin",
                                         "UnsortedSegmentProd")},
}
OFFSETS = {"Add": 1, "AddV2": 1, "Sub": -1}  # op -> the sign of its constant second operand (Add's either)
CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
SHAPE_CARRIERS = frozenset({"Identity", "ReadVariableOp", "Snapshot", "Enter", "StopGradient"})
VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "Variable"})

Frames = tuple[tuple[str, str], ...]  # the calls entered: (calling item, call node), outermost first


@dataclass(frozen=True)
class Bound:
    """Values ``low`` ≤ v < ``high`` are safe; ``table`` says what set ``high``."""

    low: int
    high: int
    table: str

    def describe(self) -> str:
        return f"{self.low}-{self.high - 1} (bounded by {self.table})"


@dataclass(frozen=True)
class _Callee:
    function: str
    first_input: int  # the call's input that is the function's argument 0
    returns: bool     # whether the function's outputs are the call's


class _Walk:
    """One program's bodies, their nodes by name and who reads each node, built once per item."""

    def __init__(self, program: Program) -> None:
        self.program = program
        self._nodes: dict[str, dict[str, node_def_pb2.NodeDef]] = {}
        self._readers: dict[str, dict[str, list[tuple[node_def_pb2.NodeDef, int, int]]]] = {}

    def nodes(self, item: str) -> dict[str, node_def_pb2.NodeDef]:
        if item not in self._nodes:
            body: graph_pb2.GraphDef = self.program.item(item)
            self._nodes[item] = {node.name: node for node in body.node}
            readers = self._readers[item] = defaultdict(list)
            for node in body.node:
                for index, tensor in enumerate(data_inputs(node)):
                    ref = parse_tensor_name(tensor, consumer=node.name)
                    readers[ref.node].append((node, index, ref.port))
        return self._nodes[item]

    def readers(self, item: str, node: str, port: int | None) -> Iterator[tuple[node_def_pb2.NodeDef, int]]:
        """Who reads output ``port`` of ``node`` (None: any output), and at which input."""
        self.nodes(item)
        for reader, index, read_port in self._readers[item].get(node, ()):
            if port is None or read_port == port:
                yield reader, index

    def callees(self, node: node_def_pb2.NodeDef) -> list[_Callee]:
        library = self.program.library
        if node.op in CALL_OPS:
            return [_Callee(node.attr["f"].func.name, 0, True)]
        if node.op in LOOP_OPS:
            return [_Callee(node.attr["body"].func.name, 0, True), _Callee(node.attr["cond"].func.name, 0, False)]
        if node.op in ("If", "StatelessIf"):
            return [_Callee(node.attr[b].func.name, 1, True) for b in ("then_branch", "else_branch")]
        return [_Callee(node.op, 0, True)] if node.op in library else []


def index_bound(program: Program, tensor: str) -> Bound | None:
    """The values the main graph's ``tensor`` (an integer input) may take without running
    past a table it indexes; None where it reaches no table whose size is known."""
    walk = _Walk(program)
    ref = parse_tensor_name(tensor)
    bounds = []
    pending: list[tuple[Frames, str, str, int | None, int]] = [((), MAIN_GRAPH, ref.node, ref.port, 0)]
    seen = set()
    while pending:
        state = pending.pop()
        if state in seen:
            continue
        seen.add(state)
        frames, item, node, port, offset = state
        for reader, index in walk.readers(item, node, port):
            bound = _lookup_bound(walk, frames, item, reader, index, offset)
            if bound is not None:
                bounds.append(bound)
            pending.extend(_next(walk, frames, item, reader, index, offset))
    if not bounds:
        return None
    tightest = min(bounds, key=lambda b: (b.high, b.table))
    return Bound(max(b.low for b in bounds), tightest.high, tightest.table)


def _next(walk: _Walk, frames: Frames, item: str, reader: node_def_pb2.NodeDef, index: int,
          offset: int) -> Iterator[tuple[Frames, str, str, int | None, int]]:
    """Where the values go from input ``index`` of ``reader``: its output, a callee's argument,
    or (from a function's result) the call's output."""
    op = reader.op
    if _carries(reader, index):
        yield frames, item, reader.name, index if op == "IdentityN" else None if op == "Switch" else 0, offset
        return
    if op in ("Unpack", "Split", "SplitV") and index == (1 if op == "Split" else 0):
        yield frames, item, reader.name, None, offset
        return
    if op in OFFSETS and (index == 0 or op != "Sub") and not _is_negative_guard(walk, item, reader):
        constant = _scalar(walk, item, data_inputs(reader)[1 - index])
        if constant is not None:
            yield frames, item, reader.name, 0, offset + (OFFSETS[op] if index == 0 else 1) * constant
        return
    if op == "_Retval" and frames:
        caller_item, call = frames[-1]
        yield frames[:-1], caller_item, call, reader.attr["index"].i, offset
        return
    for callee in walk.callees(reader):
        argument = index - callee.first_input
        if callee.function not in walk.program.library or argument < 0:
            continue
        arg_node = _argument(walk, callee.function, argument)
        if arg_node is not None:
            yield (*frames, (item, reader.name)), callee.function, arg_node, 0, offset


def _carries(node: node_def_pb2.NodeDef, index: int) -> bool:
    """Whether input ``index`` of ``node`` reaches its output with its values unchanged (a
    concat's axis does not)."""
    if node.op not in CARRIERS:
        return False
    ports = CARRIERS[node.op]
    if ports is not None:
        return index in ports
    if node.op == "ConcatV2":
        return index < len(data_inputs(node)) - 1
    return index > 0 if node.op == "Concat" else True


def _is_negative_guard(walk: _Walk, item: str, add: node_def_pb2.NodeDef) -> bool:
    """Whether ``add`` is the ``ids + rows`` branch of ``where(ids < 0, ids + rows, ids)``:
    taken by negative ids only, which random ids never are."""
    ids = data_inputs(add)[0]
    for reader, index in walk.readers(item, add.name, 0):
        if reader.op in ("SelectV2", "Select") and index == 1:
            condition = walk.nodes(item).get(parse_tensor_name(data_inputs(reader)[0]).node)
            if (condition is not None and condition.op == "Less" and data_inputs(condition)[0] == ids
                    and _scalar(walk, item, data_inputs(condition)[1]) == 0):
                return True
    return False


def _argument(walk: _Walk, function: str, index: int) -> str | None:
    for node in walk.nodes(function).values():
        if node.op == "_Arg" and node.attr["index"].i == index:
            return node.name
    return None


def _lookup_bound(walk: _Walk, frames: Frames, item: str, reader: node_def_pb2.NodeDef, index: int,
                  offset: int) -> Bound | None:
    """The bound a lookup ``reader`` puts on values that reach its input ``index`` as v + ``offset``."""
    if reader.op not in LOOKUPS or LOOKUPS[reader.op][0] != index:
        return None
    inputs = data_inputs(reader)
    kind, *where = LOOKUPS[reader.op][1]
    if kind == "count":
        size = _scalar(walk, item, inputs[where[0]])
        table = f"{reader.op} '{reader.name}' of {size}"
    else:
        axis = 0 if where[1] is None else _scalar(walk, item, inputs[where[1]])
        if reader.op == "ResourceGather":
            axis = reader.attr["batch_dims"].i if "batch_dims" in reader.attr else 0
        found = _shape(walk, frames, item, inputs[where[0]])
        if found is None or axis is None:
            return None
        dims, source = found
        size = dims[axis] if dims is not None and -len(dims) <= axis < len(dims) else None
        table = f"table '{source}' of {size} rows" if axis == 0 else f"'{source}', {size} wide on axis {axis}"
    if size is None or size <= 0:
        return None
    return Bound(max(0, -offset), size - offset, table)


def _scalar(walk: _Walk, item: str, tensor: str) -> int | None:
    """The value of a scalar (or one-element) integer Const, read through Identity."""
    node = walk.nodes(item).get(parse_tensor_name(tensor).node)
    while node is not None and node.op == "Identity":
        node = walk.nodes(item).get(parse_tensor_name(data_inputs(node)[0]).node)
    if node is None or node.op != "Const":
        return None
    try:
        value = tf.make_ndarray(node.attr["value"].tensor)
    except (TypeError, ValueError):
        return None
    if value.size != 1 or value.dtype.kind not in "iu":
        return None
    return int(value.reshape(()))


def _shape(walk: _Walk, frames: Frames, item: str, tensor: str) -> tuple[tuple[int | None, ...], str] | None:
    """The shape of ``tensor`` (a table, or a variable's handle) and the node that says it,
    read back through reads, identities and call arguments."""
    while True:
        ref = parse_tensor_name(tensor)
        node = walk.nodes(item).get(ref.node)
        if node is None:
            return None
        if node.op in VARIABLE_OPS:
            return _dims(node.attr["shape"].shape), _variable_name(walk.nodes(item), node)
        if node.op == "Const":
            return _dims(node.attr["value"].tensor.tensor_shape), node.name
        if node.op in SHAPE_CARRIERS and data_inputs(node):
            tensor = data_inputs(node)[0]
        elif node.op == "_Arg" and frames:
            (item, call), frames = frames[-1], frames[:-1]
            caller = walk.nodes(item)[call]
            first = next((c.first_input for c in walk.callees(caller)), 0)
            inputs = data_inputs(caller)
            if first + node.attr["index"].i >= len(inputs):
                return None
            tensor = inputs[first + node.attr["index"].i]
        elif "_output_shapes" in node.attr and ref.port < len(node.attr["_output_shapes"].list.shape):
            return _dims(node.attr["_output_shapes"].list.shape[ref.port]), node.name
        else:
            return None


def _variable_name(nodes: Mapping[str, node_def_pb2.NodeDef], node: node_def_pb2.NodeDef) -> str:
    """The variable's name (its shared name, else its node's), without the ``_1`` a SavedModel's
    main graph adds where the same variable has a second handle."""
    name = node.attr["shared_name"].s.decode() or node.name
    stem, _, suffix = name.rpartition("_")
    return stem if suffix.isdigit() and stem in nodes and nodes[stem].op in VARIABLE_OPS else name


def _dims(shape: tensor_shape_pb2.TensorShapeProto) -> tuple[int | None, ...] | None:
    if shape.unknown_rank:
        return None
    return tuple(d.size if d.size >= 0 else None for d in shape.dim)
