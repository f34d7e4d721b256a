"""Weights stored in the target precision: a variable every reader reads through a cast to
the target holds the target dtype itself, and the casts go.

After the rewrite a converted op reads each weight through a ``Cast`` to the target, on
every call. Where every reader of a resource variable reads it so, the variable can hold
that dtype: its value rounded once, as the cast rounds it on each call, so the outputs do
not change while half the bytes are stored, loaded and read. One variable's dtype is in
many places, and they change together (``store_weights``):

* its handle and every op on it: ``VarHandleOp``, ``ReadVariableOp`` (``ResourceGather``),
  ``AssignVariableOp``, in the main graph and in every function the handle reaches
  through calls, loops and conditionals (its ``_Arg``\\ s), or that a SavedModel's object
  graph binds it to (``bound_inputs``);
* the checkpoint's ops: the ``SaveV2``/``RestoreV2`` ``dtypes`` entry of its key, in the
  TF1 saver of the main graph or in ``__inference__traced_save/restore_*``;
* the values in ``variables/`` and the object graph's ``SavedVariable.dtype``: the
  caller's (``cli/weights.py``), keyed by the checkpoint keys and object ids found here.

A variable with any other reader (a float32 op, a signature output, an op of the model
that this rewrite did not convert, another ``MetaGraphDef``'s saver) stays float32 and its
``Weight`` says why. In a frozen GraphDef the weights are ``Const`` nodes: a float32 one
read only through casts to the target becomes a target ``Const``.
"""
from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from networkx.utils import UnionFind
from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2, op_def_pb2, tensor_pb2, \
    tensor_shape_pb2, types_pb2
from tensorflow.core.protobuf import saved_object_graph_pb2

from amp_rewrite.core import functions
from amp_rewrite.core.functions import LOOP_OPS
from amp_rewrite.core.graph_io import CONTROL, LEFT_IN_FILE, TensorRef, copy_graph_def, input_node, \
    is_left_in_file, make_node_def, parse_tensor_name
from amp_rewrite.core.program import MAIN_GRAPH, Program, program_of
from amp_rewrite.core.report import dtype_name
from amp_rewrite.core.target import FLOAT_DTYPES, Target, lookup_target
from amp_rewrite.errors import GraphError

Place = tuple[str, str]        # (item, node): MAIN_GRAPH or a function, and a node or argument there
_Restored = tuple[Place, int, list[Place]]  # an assign's value: (RestoreV2, its port, the Identity ops between)

RESOURCE = types_pb2.DT_RESOURCE
FLOAT32 = types_pb2.DT_FLOAT
READ_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})  # value out, dtype attr
ASSIGN_OP = "AssignVariableOp"
# Ops that take a handle and neither read nor write its values.
HANDLE_ONLY_OPS = frozenset({"VarIsInitializedOp", "DisableCopyOnRead", "DestroyResourceOp", "VariableShape"})
FORWARD_OPS = frozenset({"Identity", "Snapshot"})  # output = input: a handle or a value seen through one
SHAPE_OPS = frozenset({"Shape", "Size", "Rank"})   # read a value's shape only: any dtype gives the same answer
T_OPS = FORWARD_OPS | SHAPE_OPS                     # the ops of those whose dtype attr is T
VALUE_OPS = READ_OPS | FORWARD_OPS                  # what gives a variable's value
MARKED_OPS = frozenset({"VarHandleOp", "_Arg", "Const", "RestoreV2", *LOOP_OPS})  # indexed by op: the walks' starts
SHOWN_KEPT = 5  # float32 variables named, one per line, with their reason; the rest counted


@dataclass(frozen=True)
class Weight:
    """A variable (all its copies: every checkpoint key one handle group reaches) or a Const."""

    name: str                  # a variable: its SavedVariable name, else its VarHandleOp; a Const: [FUNCTION::]node
    kind: str                  # "variable" or "constant"
    elements: int              # values stored, over all its keys; -1 if a shape is unknown
    dtype: int                 # the dtype stored: the target's, or DT_FLOAT
    reason: str = ""           # why it stays float32; "" when stored low
    keys: tuple[str, ...] = ()  # a variable's checkpoint keys
    objects: tuple[int, ...] = ()  # a variable's SavedVariable node ids in the object graph

    @property
    def low(self) -> bool:
        return self.dtype != FLOAT32

    @property
    def bytes_before(self) -> int:
        return max(self.elements, 0) * FLOAT_DTYPES[FLOAT32].item_bytes

    @property
    def bytes_after(self) -> int:
        return max(self.elements, 0) * FLOAT_DTYPES[self.dtype].item_bytes


@dataclass(frozen=True)
class StoredWeights:
    """The graph with its weights stored low, and each weight's fate."""

    graph_def: graph_pb2.GraphDef
    target: str
    weights: tuple[Weight, ...]

    @property
    def low_keys(self) -> frozenset[str]:
        return frozenset(key for weight in self.weights if weight.low for key in weight.keys)

    @property
    def low_objects(self) -> frozenset[int]:
        return frozenset(node for weight in self.weights if weight.low for node in weight.objects)

    def summary(self, every: bool = False) -> list[str]:
        """One line of counts and bytes per kind of weight, then a line per float32 variable
        saying why (the first 5, or ``every`` one)."""
        lines = []
        for kind in ("variable", "constant"):
            found = [weight for weight in self.weights if weight.kind == kind]
            if not found:
                continue
            low = [weight for weight in found if weight.low]
            before = sum(weight.bytes_before for weight in found)
            after = sum(weight.bytes_after for weight in found)
            line = (f"Weights: {len(low)} of {len(found)} float32 {kind}(s) stored as {self.target}"
                    f" ({_size(before)} -> {_size(after)})")
            kept = [weight for weight in found if not weight.low]
            if kept and kind == "variable":
                line += f"; {len(kept)} stay{'s' if len(kept) == 1 else ''} float32:"
            lines.append(line)
            if kind == "variable" and low:
                lines.append(f"  the {self.target} ones are saved non-trainable (an update smaller than their precision"
                             " rounds away): to fine-tune the result, convert with --float32-weights")
            if kind == "variable":
                shown = kept if every else kept[:SHOWN_KEPT]
                lines += [f"  {weight.name}: {weight.reason}" for weight in shown]
                if len(kept) > len(shown):
                    lines.append(f"  ... and {len(kept) - len(shown)} more (amp-rewrite inspect --all lists them)")
        return lines


def _size(count: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def round_to(values: np.ndarray, dtype: int) -> np.ndarray:
    """float32 ``values`` in ``dtype`` (DT_HALF, DT_BFLOAT16), rounded to nearest even as
    TensorFlow's ``Cast`` rounds them: each weight rounded once, as the per-call cast did."""
    with np.errstate(over="ignore", invalid="ignore"):  # beyond the dtype's range is inf, as the cast gives
        return np.asarray(values, np.float32).astype(tf.as_dtype(dtype).as_numpy_dtype)


@dataclass(frozen=True)
class ObjectGraph:
    """What a SavedModel's object graph and its checkpoint say about the variables."""

    proto: saved_object_graph_pb2.SavedObjectGraph
    object_to_key: Mapping[int, str]  # SavedVariable node id -> its checkpoint key (the checkpoint's object graph)


def store_weights(
    graph_def: graph_pb2.GraphDef, target: str | Target, *, kept: Mapping[Place, str] | None = None,
    objects: ObjectGraph | None = None, blocked_keys: Mapping[str, str] | None = None,
    variables: bool = True, constants: bool = False, roots: Iterable[str] = (),
) -> StoredWeights:
    """``graph_def`` (a rewrite's output) with its weights in the target dtype; the input is
    never modified.

    ``variables``: resource variables whose every reader reads them through a cast to the
    target (their checkpoint keys and SavedVariable ids are in the result, for the caller
    to change). ``constants``: float32 ``Const`` nodes read only through such casts.
    ``kept``: (item, node) -> why, for nodes whose dtypes must not change (signature
    outputs, custom gradients): a variable read there stays float32. ``objects``: the
    SavedModel's object graph, whose functions see variables through ``bound_inputs``.
    ``blocked_keys``: checkpoint key -> why it must stay float32 (another MetaGraphDef restores it).
    ``roots``: the functions the rewrite reached from outside the graph (``rewrite_graph_def``'s),
    to tell a float32 read in a function it left alone.
    """
    target = lookup_target(target, quantized=True)  # float8 reads its weights as float16
    program = program_of(graph_def)
    model = _Model(program, {name: _index(program, name) for name in program.names}, target.dtype, dict(kept or {}),
                   tuple(roots))
    edits = _Edits()
    weights: list[Weight] = []
    if variables:
        weights += _store_variables(model, objects, dict(blocked_keys or {}), edits)
    if constants:
        weights += _store_constants(model, edits)
    return StoredWeights(edits.apply(program, model.indexes), dtype_name(target.dtype), tuple(weights))


def _index(program: Program, item: str) -> _Index:
    if item == MAIN_GRAPH:
        return _Index.of(program.graph_def.node)
    function = program.library[item]
    return _Index.of(function.node_def, function, program.op_defs)


# --------------------------------------------------------------------------------------
# Items and edits


@dataclass(frozen=True)
class _Index:
    """One item, read once as it is written: its nodes' places, the nodes the walks start
    from, and who reads each input string (control inputs too). A function is read from its
    FunctionDef, no body GraphDef built (most of a large model's nodes are in functions, and
    few are a variable's): its arguments and outputs stand for the body's ``_Arg`` and
    ``_Retval`` nodes, its inputs keep their ``node:output_arg:index`` names."""

    nodes: Mapping[str, node_def_pb2.NodeDef]  # the main graph's nodes, or a function's node_def, by name
    position: Mapping[str, int]                # node -> its place among them
    ops: Mapping[str, str]                     # node -> its op; a function's argument: _Arg, output: _Retval
    readers: Mapping[str, list[tuple[str, int]]]  # input as written -> [(reader, input position)]
    marked: Mapping[str, list[str]]        # op of MARKED_OPS -> its nodes, in order
    function: function_pb2.FunctionDef | None = None
    op_defs: Mapping[str, op_def_pb2.OpDef] = field(default_factory=dict)
    args: Mapping[str, int] = field(default_factory=dict)     # a function's argument -> its dtype
    returns: Mapping[str, int] = field(default_factory=dict)  # its output, as the body's _Retval -> index
    decoded: dict[tuple[str, int], list[str] | None] = field(default_factory=dict, compare=False)
    names: dict[str, list[str]] = field(default_factory=dict, compare=False)       # node -> its outputs' names
    ports: dict[str, dict[str, int]] = field(default_factory=dict, compare=False)  # node -> name -> port

    @staticmethod
    def of(nodes: Sequence[node_def_pb2.NodeDef], function: function_pb2.FunctionDef | None = None,
           op_defs: Mapping[str, op_def_pb2.OpDef] | None = None) -> _Index:
        readers: dict[str, list[tuple[str, int]]] = defaultdict(list)
        by_name: dict[str, node_def_pb2.NodeDef] = {}  # holding each node's wrapper: read again without building it
        position: dict[str, int] = {}
        ops: dict[str, str] = {}
        marked: dict[str, list[str]] = defaultdict(list)
        for place, node in enumerate(nodes):
            name, op = node.name, node.op
            by_name[name], position[name], ops[name] = node, place, op
            if op in MARKED_OPS:
                marked[op].append(name)
            for at, tensor in enumerate(node.input):
                readers[tensor].append((name, at))
        if function is None:
            return _Index(by_name, position, ops, readers, marked)
        signature, returns = function.signature, {}
        for at, arg in enumerate(signature.output_arg):
            if arg.name not in function.ret:
                raise GraphError(f"function '{signature.name}': output '{arg.name}' has no value in 'ret'")
            returns[arg.name + functions.RETVAL_SUFFIX] = at
            ops[arg.name + functions.RETVAL_SUFFIX] = "_Retval"
            readers[function.ret[arg.name]].append((arg.name + functions.RETVAL_SUFFIX, 0))
        args = {arg.name: arg.type for arg in signature.input_arg}
        ops.update(dict.fromkeys(args, "_Arg"))
        return _Index(by_name, position, ops, readers, marked, function, op_defs or {}, args, returns)

    def node(self, name: str) -> node_def_pb2.NodeDef:
        return self.nodes[name]

    def op(self, name: str) -> str:
        """A node's op; a function's arguments and outputs are the body's ``_Arg`` and ``_Retval``."""
        return self.ops[name]

    def handles(self) -> list[str]:
        """The resource ``_Arg``\\ s and ``VarHandleOp``\\ s, in the body's order (arguments first)."""
        found = [name for name, dtype in self.args.items() if dtype == RESOURCE]
        nodes = sorted([*self.marked.get("_Arg", ()), *self.marked.get("VarHandleOp", ())], key=self.position.get)
        return found + [name for name in nodes
                        if self.ops[name] == "VarHandleOp" or self.nodes[name].attr["T"].type == RESOURCE]

    def tensors(self, node: str) -> list[str]:
        """What inputs call ``node``'s outputs: ``node:output_arg:index`` in a function, by
        port; else ``node`` and ``node:port`` (a cast's, whose one output is port 0)."""
        if self.function is None or node in self.args:
            return [node, f"{node}:0"]
        names = self.names.get(node)
        if names is None:
            names = self.names[node] = functions.output_names(self.nodes[node], self.op_defs)
        return names

    def readers_of(self, node: str, port: int = 0) -> list[tuple[str, int]]:
        """(reader, input position) of each input that reads output ``port`` of ``node``, in the body's order."""
        if self.function is None or node in self.args:
            found = self.readers.get(f"{node}:{port}", [])
            bare = self.readers.get(node, []) if port == 0 else []
            if found and bare:  # both spellings: in the order a body's readers would be
                return sorted([*bare, *found], key=self._reader_place)
            return found or bare
        names = self.tensors(node)
        return self.readers.get(names[port], []) if port < len(names) else []

    def _reader_place(self, reader: tuple[str, int]) -> tuple[int, int]:
        name, position = reader
        return self.position.get(name, len(self.position) + self.returns.get(name, 0)), position

    def input_ref(self, node: str, position: int) -> TensorRef:
        """What input ``position`` of ``node`` reads, as (node, port)."""
        tensor = self.nodes[node].input[position]
        if self.function is None:
            return parse_tensor_name(tensor)
        if tensor.startswith("^"):
            return TensorRef(tensor[1:], CONTROL)
        name, _, rest = tensor.partition(":")
        if name in self.args and rest in ("", "0"):
            return TensorRef(name, 0)
        if name in self.nodes:
            ports = self.ports.get(name)
            if ports is None:
                ports = self.ports[name] = {output: port for port, output in enumerate(self.tensors(name))}
            if tensor in ports:
                return TensorRef(name, ports[tensor])
        raise GraphError(f"function '{self.function.signature.name}', node '{node}': input '{tensor}' names no"
                         " argument or node output")

    def source(self, tensor: str) -> str:
        """The node (or argument) an input string names: a GraphDef's checked, a FunctionDef's read
        as written (``node:output_arg:index``)."""
        return parse_tensor_name(tensor).node if self.function is None else input_node(tensor)


@dataclass(frozen=True)
class _Model:
    """What every step reads, built once: the items, each read once, the dtype weights are
    stored as, and the nodes whose dtypes must not change."""

    program: Program
    indexes: Mapping[str, _Index]  # item -> its index
    dtype: int                     # the target's
    kept: Mapping[Place, str]      # (item, node) -> why its dtypes stay
    roots: tuple[str, ...] = ()    # functions the rewrite reached from outside the graph (a loader's)


@dataclass
class _Edits:
    """Changes to make, by item; applied once, to a copy (STYLE §4)."""

    types: dict[Place, dict[str, int]] = field(default_factory=lambda: defaultdict(dict))       # attr -> dtype
    list_types: dict[Place, dict[tuple[str, int], int]] = field(default_factory=lambda: defaultdict(dict))
    rounded: set[Place] = field(default_factory=set)                # Consts whose value is rounded to their dtype
    removed_casts: set[Place] = field(default_factory=set)          # casts whose readers read their input instead
    cast_values: set[Place] = field(default_factory=set)            # AssignVariableOps whose value gets a cast

    def drop_casts(self, casts: Iterable[Place], dtype: int, kept: Mapping[Place, str]) -> None:
        """The casts that read a weight now stored as ``dtype`` go; one whose name must stay (an
        output) casts ``dtype`` to ``dtype``, which TensorFlow's optimizers remove at run time."""
        for place in casts:
            if place in kept:
                self.types[place]["SrcT"] = dtype
            else:
                self.removed_casts.add(place)

    def apply(self, program: Program, indexes: Mapping[str, _Index]) -> graph_pb2.GraphDef:
        """The edited copy: copied once, each edited node changed where it sits (the same place
        as in the source), then the casts that go removed. A main graph with rounded Consts is
        copied a node at a time, each built from its float32 value: a frozen graph's weights
        are never held twice in float32."""
        if any(item == MAIN_GRAPH for item, _ in self.rounded):
            output = without_nodes(program.graph_def)
            for node in program.graph_def.node:
                if (MAIN_GRAPH, node.name) in self.rounded:
                    _put_rounded(output.node.add(), node, self.types[(MAIN_GRAPH, node.name)]["dtype"])
                else:
                    output.node.add().CopyFrom(node)
        else:
            output = copy_graph_def(program.graph_def)

        def nodes_of(item: str) -> Sequence[node_def_pb2.NodeDef]:
            return output.node if item == MAIN_GRAPH else output.library.function[program.positions[item]].node_def

        live: dict[str, list[node_def_pb2.NodeDef]] = {}  # an edited item's nodes, each wrapper built once

        def live_nodes(item: str) -> list[node_def_pb2.NodeDef]:
            if item not in live:
                live[item] = list(nodes_of(item))
            return live[item]

        def node_at(place: Place) -> node_def_pb2.NodeDef:
            return live_nodes(place[0])[indexes[place[0]].position[place[1]]]

        for (item, name), attrs in self.types.items():
            attr_values = live_nodes(item)[indexes[item].position[name]].attr
            for attr, dtype in attrs.items():
                attr_values[attr].type = dtype
        for place, entries in self.list_types.items():
            attr_values = node_at(place).attr
            for (attr, at), dtype in entries.items():
                attr_values[attr].list.type[at] = dtype
        for place in self.rounded:
            if place[0] != MAIN_GRAPH:  # the main graph's: rounded as copied
                _put_rounded(node_at(place), node_at(place), self.types[place]["dtype"])
        removed, valued = _by_item(self.removed_casts), _by_item(self.cast_values)
        for item in sorted({*removed, *valued}):
            function = None if item == MAIN_GRAPH else output.library.function[program.positions[item]]
            _bypass(indexes[item], live_nodes(item), function, removed.get(item, []))
            _add_casts(indexes[item], nodes_of(item), live_nodes(item), valued.get(item, []), self.types)
            for place in sorted((indexes[item].position[cast] for cast in removed.get(item, [])), reverse=True):
                del nodes_of(item)[place]
        return output


def _by_item(places: Iterable[Place]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = defaultdict(list)
    for item, node in places:
        found[item].append(node)
    return found


def without_nodes(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef:
    """A copy of ``graph_def`` but its nodes (library, versions, debug info)."""
    copy = graph_pb2.GraphDef()
    for described, value in graph_def.ListFields():
        if described.name == "node":
            continue
        if described.message_type is not None:
            getattr(copy, described.name).CopyFrom(value)
        else:
            setattr(copy, described.name, value)
    return copy


def _put_rounded(node: node_def_pb2.NodeDef, const: node_def_pb2.NodeDef, dtype: int) -> None:
    """``node``: the float32 Const ``const`` with its value rounded to ``dtype`` (``node`` may be
    ``const``). Values left in the file stay there, rounded as they are written (``calibration/frozen.py``)."""
    tensor = const.attr["value"].tensor
    if is_left_in_file(tensor):
        shape = tensor_shape_pb2.TensorShapeProto(dim=[{"size": dim.size} for dim in tensor.tensor_shape.dim])
        value = tensor_pb2.TensorProto(dtype=dtype, tensor_shape=shape, tensor_content=LEFT_IN_FILE)
    else:  # make_tensor_proto's fields: dtype, the shape's sizes, the content
        value = tf.make_tensor_proto(round_to(tf.make_ndarray(tensor), dtype))
    if node is not const:
        node.CopyFrom(const)  # one float32 value at a time, replaced at once
    node.attr["value"].tensor.CopyFrom(value)


def _add_casts(index: _Index, nodes: Sequence[node_def_pb2.NodeDef], live: Sequence[node_def_pb2.NodeDef],
               assigns: list[str], types: Mapping[Place, Mapping[str, int]]) -> None:
    """For each AssignVariableOp of ``assigns``, a float32 -> its dtype cast of its value: it
    writes a float32 value into a variable now stored low (a TF1 initializer), rounded once
    as every read was. Each cast is named after its assign, unlike every name in the item."""
    if not assigns:
        return
    names = {*index.position, *index.args, *index.returns}
    item = MAIN_GRAPH if index.function is None else index.function.signature.name
    for assign_name in sorted(assigns, key=index.position.__getitem__):
        assign, dtype = live[index.position[assign_name]], types[(item, assign_name)]["dtype"]
        name, count = f"{assign.name}/value-StoredAs-{dtype_name(dtype)}", 0
        while name in names:
            count += 1
            name = f"{assign.name}/value-StoredAs-{dtype_name(dtype)}_{count}"
        names.add(name)
        cast = make_node_def("Cast", name, [assign.input[1]], device=assign.device, into=nodes, SrcT=FLOAT32,
                             DstT=dtype, Truncate=False)
        assign.input[1] = name if index.function is None else functions.output_names(cast, index.op_defs)[0]


def _bypass(index: _Index, nodes: Sequence[node_def_pb2.NodeDef], function: function_pb2.FunctionDef | None,
            casts: list[str]) -> None:
    """Readers of each removed cast read the cast's input instead (a control reader: its
    input's node, once); the caller removes the casts."""
    replaced = {cast: nodes[index.position[cast]].input[0] for cast in casts}
    readers = {reader for cast in casts for tensor in (*index.tensors(cast), f"^{cast}")
               for reader, _ in index.readers.get(tensor, ())}
    for reader in readers:
        if reader not in index.position:  # a function's output
            arg = function.signature.output_arg[index.returns[reader]].name
            function.ret[arg] = replaced.get(index.source(function.ret[arg]), function.ret[arg])
            continue
        node = nodes[index.position[reader]]
        inputs, changed = [], False
        for tensor in node.input:
            source = index.source(tensor)
            if source in replaced:
                changed = True
                tensor = f"^{index.source(replaced[source])}" if tensor.startswith("^") else replaced[source]
            if tensor not in inputs or not tensor.startswith("^"):
                inputs.append(tensor)
        if changed:
            node.input[:] = inputs


def _casts_to(node: node_def_pb2.NodeDef, dtype: int) -> bool:
    """A cast float32 -> ``dtype`` that rounds to nearest, as the per-call cast of a weight does."""
    return (node.op == "Cast" and node.attr["SrcT"].type == FLOAT32 and node.attr["DstT"].type == dtype
            and not ("Truncate" in node.attr and node.attr["Truncate"].b))


def _where(item: str) -> str:
    return f" in {item}" if item != MAIN_GRAPH else " in the main graph"


# --------------------------------------------------------------------------------------
# Variables: 1. follow every handle, 2. who reads each value, 3. decide per group, 4. edits


def _groups(sets: UnionFind) -> list[list[Place]]:
    """The sets, each in the order its places were first seen, ordered by their first place:
    the same groups, in the same order, on every run (a ``UnionFind`` iterates its elements
    in the order first seen)."""
    found: dict[Place, list[Place]] = {}
    for place in sets:
        found.setdefault(sets[place], []).append(place)
    return list(found.values())


@dataclass
class _Handles:
    """Step 1's findings: the handle groups, the ops on each handle, and what stops one."""

    sets: UnionFind = field(default_factory=UnionFind)  # one set per variable (with its copies)
    accesses: list[tuple[Place, Place]] = field(default_factory=list)   # (handle, read or assign op)
    blockers: dict[Place, list[str]] = field(default_factory=lambda: defaultdict(list))
    keys: dict[Place, set[str]] = field(default_factory=lambda: defaultdict(set))  # handle -> checkpoint keys
    calls: dict[Place, tuple[list[str], int] | None] = field(default_factory=dict)  # read once per op (_calls)
    arg_names: dict[str, list[str]] = field(default_factory=dict)  # function -> its arguments, read once

    def callees(self, program: Program, item: str, index: _Index, node: str, position: int
                ) -> list[tuple[str, str]] | None:
        """(function, argument) that a functional op hands its input ``position`` to; None when
        the op calls nothing (or calls what is not in the library)."""
        if (item, node) not in self.calls:
            self.calls[(item, node)] = _calls(index.node(node), program)
        call = self.calls[(item, node)]
        if call is None or position < call[1]:
            return None
        return [(function, self.arg_name(program, function, position - call[1])) for function in call[0]]

    def arg_name(self, program: Program, function: str, index: int) -> str:
        if function not in self.arg_names:
            self.arg_names[function] = [arg.name for arg in program.library[function].signature.input_arg]
        return self.arg_names[function][index]


def _calls(node: node_def_pb2.NodeDef, program: Program) -> tuple[list[str], int] | None:
    """The functions a functional op calls, and its first input that is their first argument
    (an If's or Case's predicate is none); None when it calls nothing in the library."""
    library = program.library

    def named(attr: str) -> str:
        return node.attr[attr].func.name if attr in node.attr else ""

    if node.op in library:
        names, first = [node.op], 0
    elif node.op in ("PartitionedCall", "StatefulPartitionedCall"):
        names, first = [named("f")], 0
    elif node.op in LOOP_OPS:
        names, first = [named("body"), named("cond")], 0
    elif node.op in ("If", "StatelessIf"):
        names, first = [named("then_branch"), named("else_branch")], 1
    elif node.op in ("Case", "StatelessCase"):
        names, first = [f.name for f in node.attr["branches"].list.func], 1
    else:
        return None
    return (names, first) if all(name in library for name in names) else None


def _follow_handles(model: _Model, objects: ObjectGraph | None) -> _Handles:
    """Step 1: from every ``VarHandleOp`` and resource ``_Arg``, every op its handle reaches."""
    program, indexes, found = model.program, model.indexes, _Handles()
    loop_bodies = {index.node(name).attr["body"].func.name for index in indexes.values() for op in LOOP_OPS
                   for name in index.marked.get(op, ())}
    for item, index in indexes.items():
        for name in index.handles():
            _follow(_HandleWalk(program, item, index, (item, name), item in loop_bodies), found)
    if objects is not None:  # a function the object graph binds a variable to reads it through that argument
        for function, saved in objects.proto.concrete_functions.items():
            if function not in program.library or not saved.bound_inputs:
                continue
            args = program.library[function].signature.input_arg
            for arg, node_id in zip(args[len(args) - len(saved.bound_inputs):], saved.bound_inputs):
                key = objects.object_to_key.get(node_id)
                if key is not None and arg.type == RESOURCE:
                    found.keys[(function, arg.name)].add(key)
                    found.sets.union((function, arg.name))  # a set of its own until joined
    return found


@dataclass(frozen=True)
class _HandleWalk:
    """Step 1 from one handle: where it starts, in which item."""

    program: Program
    item: str
    index: _Index
    handle: Place
    loop_body: bool  # the item is a loop's body: a handle it returns goes to the next iteration


def _follow(walk: _HandleWalk, found: _Handles) -> None:
    """Every op the handle reaches in its item, through ops that forward it (``_reach``)."""
    found.sets.union(walk.handle)  # a set of its own until joined
    stack, seen = [(walk.handle[1], 0)], set()
    while stack:
        port = stack.pop()
        if port in seen:
            continue
        seen.add(port)
        for reader, position in walk.index.readers_of(*port):
            stack += _reach(walk, found, reader, position)


def _reach(walk: _HandleWalk, found: _Handles, reader: str, position: int) -> list[tuple[str, int]]:
    """What ``reader`` does with the handle at its input ``position``, noted in ``found``: an
    access, a join, or what blocks it. Returns the outputs the handle goes on through."""
    op = walk.index.ops[reader]
    if op in FORWARD_OPS:
        return [(reader, 0)]
    if op == "IdentityN":
        return [(reader, position)]
    if op in READ_OPS or op == ASSIGN_OP and position == 0:
        found.accesses.append((walk.handle, (walk.item, reader)))
    elif op == "_Retval" and walk.loop_body:  # the loop hands the handle to its next iteration
        found.sets.union(walk.handle, (walk.item, found.arg_name(walk.program, walk.item, walk.index.returns[reader])))
    elif op not in HANDLE_ONLY_OPS:
        return _into_calls(walk, found, reader, position)
    return []


def _into_calls(walk: _HandleWalk, found: _Handles, reader: str, position: int) -> list[tuple[str, int]]:
    """A handle given to a call joins the callee's argument (a loop's output is the handle
    again, followed); given to any other op, or returned by a function, it is blocked."""
    op = walk.index.ops[reader]
    callees = None if op == "_Retval" else found.callees(walk.program, walk.item, walk.index, reader, position)
    if callees is None:
        found.blockers[walk.handle].append(f"its handle goes to {op} '{reader}'{_where(walk.item)}")
        return []
    for callee in callees:
        found.sets.union(walk.handle, callee)
    return [(reader, position)] if op in LOOP_OPS else []


@dataclass
class _Reads:
    """Step 2's findings for one handle group: who reads its values, and how."""

    casts: set[Place] = field(default_factory=set)       # casts to the target: removed
    forwards: set[Place] = field(default_factory=set)    # Identity between: retyped
    shapes: set[Place] = field(default_factory=set)      # Shape/Size/Rank: retyped
    saves: set[tuple[Place, int]] = field(default_factory=set)  # (SaveV2, tensor index)
    float32: list[str] = field(default_factory=list)     # why it must stay float32


class _LeftAlone:
    """The functions the rewrite did not convert (neither the graph nor a loader calls them),
    found when first asked: only a variable read as float32 asks, and finding them reads every node."""

    def __init__(self, program: Program, roots: tuple[str, ...]) -> None:
        self.program, self.roots, self.names = program, roots, None

    def __contains__(self, function: str) -> bool:
        if self.names is None:
            program = self.program
            self.names = frozenset(program.library) - set(functions.reachable_functions(
                program.graph_def, program.library, roots=self.roots))
        return function in self.names


@dataclass(frozen=True)
class _ValueWalk:
    """Step 2 from one read of one handle: where it is, and where its findings go."""

    item: str
    handle: Place
    reads: _Reads                      # the handle's findings, filled in
    copies: list[tuple[Place, Place]]  # (handle, AssignVariableOp writing its value into another variable)
    left_alone: _LeftAlone             # the functions the rewrite did not convert (their readers read float32)


def _read_values(model: _Model, walk: _ValueWalk, node: str) -> None:
    """Step 2 for one read (``node``'s output 0) and what forwards it."""
    item, index, reads = walk.item, model.indexes[walk.item], walk.reads
    if (item, node) in model.kept:
        reads.float32.append(f"its read '{node}'{_where(item)} keeps its dtype: {model.kept[(item, node)]}")
    for reader, position in index.readers_of(node):
        op = index.ops[reader]
        place = (item, reader)
        if op in FORWARD_OPS:
            reads.forwards.add(place)
            _read_values(model, walk, reader)
        elif op == "Cast" and _casts_to(index.node(reader), model.dtype):
            reads.casts.add(place)
        elif op == "SaveV2" and position >= 3:
            reads.saves.add((place, position - 3))
        elif op == ASSIGN_OP and position == 1:
            walk.copies.append((walk.handle, place))  # a copy of this variable: decided with it
        elif op in SHAPE_OPS:
            reads.shapes.add(place)
        elif op == "_Retval":
            reads.float32.append(f"returned as float32 by function {item}")
        else:
            alone = (", a function this rewrite leaves float32 (neither the graph, its signatures nor its"
                     " restored functions call it)" if item in walk.left_alone else "")
            reads.float32.append(f"read as float32 by {op} '{reader}'{_where(item)}{alone}")


def _strings(index: _Index, node: str, position: int) -> list[str] | None:
    """The string list a ``Const`` input holds (SaveV2/RestoreV2 tensor names), or None;
    decoded once per node (a saver's list names every key, and is asked for each)."""
    if (node, position) not in index.decoded:
        source = index.input_ref(node, position).node
        index.decoded[(node, position)] = None if index.op(source) != "Const" else [
            value.decode() for value in np.asarray(tf.make_ndarray(index.node(source).attr["value"].tensor)).ravel()]
    return index.decoded[(node, position)]


def _string_at(index: _Index, item: str, node: str, position: int, at: int) -> str | None:
    """Entry ``at`` of a saver's string list (``_strings``), or None; a list too short for the
    tensors the op saves or restores is one line (TensorFlow fails on it when it runs)."""
    found = _strings(index, node, position)
    if found is None:
        return None
    if at >= len(found):
        op = index.op(node)
        raise GraphError(f"{op} '{node}'{_where(item)} has tensor {at} but its input {position} lists"
                         f" {len(found)} name(s); the saver is malformed: export the model again")
    return found[at]


def _elements(node: node_def_pb2.NodeDef) -> int:
    shape = node.attr["shape"].shape
    if shape.unknown_rank or any(dim.size < 0 for dim in shape.dim):
        return -1
    return math.prod(dim.size for dim in shape.dim)


def _store_variables(model: _Model, objects: ObjectGraph | None, blocked_keys: Mapping[str, str],
                     edits: _Edits) -> list[Weight]:
    """Resource variables every reader reads through a cast to the target: stored as it (the
    module doc's four steps)."""
    # 1. Every op each handle reaches; handles passed into calls join the callee's argument.
    handles = _follow_handles(model, objects)
    # 2. Who reads each value; a value assigned to another variable makes the two one group.
    handle_reads, restores = _find_reads(model, handles)
    _saved_keys(model, handles, handle_reads)
    # 3. Decide per group; 4. the edits of a group stored low.
    handle_accesses: dict[Place, list[Place]] = defaultdict(list)
    for handle, access in handles.accesses:
        handle_accesses[handle].append(access)
    key_to_objects, names = _object_names(objects)
    facts = _Facts(model, handles, handle_reads, handle_accesses, restores, blocked_keys, key_to_objects, names)
    weights = []
    for places in _key_groups(handles):
        weight = _decide(places, facts, edits)
        if weight is not None:
            weights.append(weight)
    return weights


def _find_reads(model: _Model, handles: _Handles) -> tuple[dict[Place, _Reads], dict[Place, _Restored | None]]:
    """Step 2: who reads each handle's values, and where each assign's value comes from (a
    RestoreV2 output, or None). A value assigned to another variable joins the two; a
    restored one gives its variable's checkpoint key."""
    access_handle = {access: handle for handle, access in handles.accesses}
    handle_reads: dict[Place, _Reads] = defaultdict(_Reads)
    copies: list[tuple[Place, Place]] = []
    restores: dict[Place, _Restored | None] = {}
    left_alone = _LeftAlone(model.program, model.roots)
    for handle, (item, node) in handles.accesses:
        index = model.indexes[item]
        if index.op(node) in READ_OPS:
            _read_values(model, _ValueWalk(item, handle, handle_reads[handle], copies, left_alone), node)
        else:
            restores[(item, node)] = _restored_value(index, item, node)
    for handle, assign in copies:
        handles.sets.union(handle, access_handle[assign])
    for assign, restored in restores.items():
        if restored is not None:
            (item, restore), port, _ = restored
            key = _string_at(model.indexes[item], item, restore, 1, port)
            if key is not None:
                handles.keys[access_handle[assign]].add(key)
    return handle_reads, restores


def _saved_keys(model: _Model, handles: _Handles, handle_reads: Mapping[Place, _Reads]) -> None:
    """Each handle's checkpoint keys from the SaveV2 ops that read it. A key computed at run
    time blocks its variable; keys saved in slices block every one (SaveV2 of the whole
    checkpoint would join them)."""
    sliced: set[str] = set()
    for handle, reads in handle_reads.items():
        for (item, save), tensor in reads.saves:
            key = _string_at(model.indexes[item], item, save, 1, tensor)
            if key is None:
                handles.blockers[handle].append(f"its checkpoint key in SaveV2 '{save}'{_where(item)} is computed"
                                                " at run time")
            else:
                handles.keys[handle].add(key)
            if _string_at(model.indexes[item], item, save, 2, tensor):
                sliced.add(key if key is not None else save)
    if sliced:
        why = (f"the checkpoint holds variables saved in slices ({', '.join(sorted(sliced))}), which amp-rewrite"
               " does not rewrite")
        for handle in list(handles.keys):
            handles.blockers[handle].append(why)


def _object_names(objects: ObjectGraph | None) -> tuple[dict[str, list[int]], dict[int, str]]:
    """From the object graph: checkpoint key -> its SavedVariable node ids, and node id -> the
    variable's name."""
    key_to_objects: dict[str, list[int]] = defaultdict(list)
    for node_id, key in (objects.object_to_key.items() if objects else ()):
        key_to_objects[key].append(node_id)
    names = {node_id: objects.proto.nodes[node_id].variable.name for node_id in objects.object_to_key
             if node_id < len(objects.proto.nodes)} if objects else {}
    return key_to_objects, names


@dataclass(frozen=True)
class _Facts:
    """What steps 3-4 read for every group, gathered once by steps 1-2, passed whole."""

    model: _Model
    handles: _Handles
    handle_reads: Mapping[Place, _Reads]
    handle_accesses: Mapping[Place, list[Place]]  # handle -> its read and assign ops
    restores: Mapping[Place, _Restored | None]    # assign -> where its value comes from, if restored
    blocked_keys: Mapping[str, str]               # checkpoint key -> why it must stay float32
    key_to_objects: Mapping[str, list[int]]       # checkpoint key -> its SavedVariable node ids
    names: Mapping[int, str]                      # SavedVariable node id -> the variable's name


def _key_groups(handles: _Handles) -> list[list[Place]]:
    """Handle groups, where handles with one checkpoint key are one variable (the object
    graph binds a function's argument to a variable the main graph holds as a VarHandleOp)."""
    by_key: dict[str, Place] = {}
    for handle, keys in handles.keys.items():
        for key in keys:
            if key in by_key:
                handles.sets.union(by_key[key], handle)
            by_key[key] = handle
    return _groups(handles.sets)


def _restored_value(index: _Index, item: str, assign: str) -> _Restored | None:
    """Where an AssignVariableOp's value comes from, if it is a RestoreV2 output (through
    Identity ops nothing else reads): (RestoreV2, port, the Identity ops between)."""
    ref = index.input_ref(assign, 1)
    between = []
    while index.op(ref.node) in FORWARD_OPS and len(index.readers_of(ref.node, ref.port)) == 1:
        between.append((item, ref.node))
        ref = index.input_ref(ref.node, 0)
    if index.op(ref.node) == "RestoreV2" and len(index.readers_of(ref.node, ref.port)) == 1:
        return (item, ref.node), ref.port, between
    return None


def _decide(places: list[Place], facts: _Facts, edits: _Edits) -> Weight | None:
    """Steps 3-4 for one group: its Weight (None if it is no float32 variable) and, when it
    is stored low, its edits."""
    indexes = facts.model.indexes
    variables = sorted((p for p in places if indexes[p[0]].ops.get(p[1]) == "VarHandleOp"),
                       key=lambda p: (p[0] != MAIN_GRAPH, p[0], indexes[p[0]].position[p[1]]))
    accesses = [access for place in places for access in facts.handle_accesses.get(place, ())]
    node_dtypes = {place: indexes[place[0]].node(place[1]).attr["dtype"].type for place in [*variables, *accesses]}
    if len(set(node_dtypes.values())) > 1:
        raise GraphError(_disagreement(node_dtypes, indexes))
    if set(node_dtypes.values()) != {FLOAT32}:
        return None  # not a float32 variable (or nothing says what it holds)
    keys = sorted({key for place in places if place in facts.handles.keys for key in facts.handles.keys[place]})
    reads = _group_reads(places, facts.handle_reads)
    reasons = [why for place in places for why in facts.handles.blockers.get(place, ())]
    reasons += reads.float32
    reasons += [f"its checkpoint key '{key}' {facts.blocked_keys[key]}" for key in keys if key in facts.blocked_keys]
    if not keys:
        if not reads.casts:
            return None  # a handle nothing saves and no converted op reads: no weight
        reasons.append("it is not in the checkpoint")
    if not reads.casts and not reasons:
        reasons.append("no converted op reads it")
    objects = tuple(sorted(node_id for key in keys for node_id in facts.key_to_objects.get(key, ())))
    name = variables[0][1] if variables else places[0][1]
    if objects and facts.names.get(objects[0]):
        name = facts.names[objects[0]]  # the name the model gave it, as tf.saved_model.load shows it
    elements = _elements(indexes[variables[0][0]].node(variables[0][1])) if variables else -1
    elements = elements * max(len(keys), 1) if elements >= 0 else -1
    if reasons:
        reasons = list(dict.fromkeys(reasons))
        more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
        return Weight(name, "variable", elements, FLOAT32, reasons[0] + more, tuple(keys), objects)
    _edit_low(variables, accesses, reads, facts, edits)
    return Weight(name, "variable", elements, facts.model.dtype, "", tuple(keys), objects)


def _group_reads(places: list[Place], handle_reads: Mapping[Place, _Reads]) -> _Reads:
    """A group's reads: its handles', together, in the group's order."""
    reads = _Reads()
    for place in places:
        found = handle_reads.get(place)
        if found is not None:
            reads.casts |= found.casts
            reads.forwards |= found.forwards
            reads.shapes |= found.shapes
            reads.saves |= found.saves
            reads.float32 += found.float32
    return reads


def _edit_low(variables: list[Place], accesses: list[Place], reads: _Reads, facts: _Facts, edits: _Edits) -> None:
    """Step 4 for a group stored low: every op on it, its savers' entries, its restores and
    initializers take the target dtype; the casts that read it go."""
    indexes, dtype = facts.model.indexes, facts.model.dtype
    for item, node in [*variables, *accesses, *reads.forwards, *reads.shapes]:
        attr = "T" if indexes[item].op(node) in T_OPS else "dtype"
        edits.types[(item, node)][attr] = dtype
    for (item, save), tensor in reads.saves:
        edits.list_types[(item, save)][("dtypes", tensor)] = dtype
    edits.drop_casts(reads.casts, dtype, facts.model.kept)
    values = {*accesses, *reads.forwards}  # what a copy reads: this variable's own value
    for assign in accesses:
        if indexes[assign[0]].op(assign[1]) != ASSIGN_OP:
            continue
        restored = facts.restores.get(assign)
        if restored is not None:
            (item, restore), port, between = restored
            edits.list_types[(item, restore)][("dtypes", port)] = dtype
            for place in between:
                edits.types[place]["T"] = dtype
            continue
        value = indexes[assign[0]].input_ref(assign[1], 1).node
        if not (indexes[assign[0]].op(value) in VALUE_OPS and (assign[0], value) in values):
            edits.cast_values.add(assign)  # a float32 value (an initializer) rounded on the way in


def _disagreement(node_dtypes: Mapping[Place, int], indexes: Mapping[str, _Index]) -> str:
    """One line: the ops on one variable that say different dtypes (the first of each)."""
    first: dict[int, Place] = {}
    for place, dtype in node_dtypes.items():
        first.setdefault(dtype, place)
    said = ", ".join(f"{indexes[item].op(node)} '{node}'{_where(item)} says {dtype_name(dtype)}"
                     for dtype, (item, node) in first.items())
    return (f"the ops on one variable disagree on its dtype: {said}; TensorFlow fails on it at run time:"
            " export the model again")


# --------------------------------------------------------------------------------------
# Constants


def _store_constants(model: _Model, edits: _Edits) -> list[Weight]:
    """float32 ``Const`` nodes read only through casts to the target dtype: constants of it."""
    dtype, kept = model.dtype, model.kept
    weights = []
    for item, index in model.indexes.items():
        for name in index.marked.get("Const", ()):
            node = index.node(name)
            if node.attr["dtype"].type != FLOAT32:
                continue
            readers = index.readers_of(name)
            if (item, name) in kept or not readers or not all(
                    r in index.position and _casts_to(index.node(r), dtype) for r, _ in readers):
                continue
            edits.types[(item, name)]["dtype"] = dtype
            edits.rounded.add((item, name))
            edits.drop_casts([(item, reader) for reader, _ in readers], dtype, kept)
            label = functions.scoped_name(item, name)  # the main graph's item name is ""
            elements = math.prod(dim.size for dim in node.attr["value"].tensor.tensor_shape.dim)
            weights.append(Weight(label, "constant", elements, dtype))
    return weights


def restored_keys(graph_def: graph_pb2.GraphDef) -> frozenset[str]:
    """The checkpoint keys a graph's savers restore (``RestoreV2`` in the main graph and its
    functions): another MetaGraphDef that shares ``variables/`` reads these."""
    program = program_of(graph_def)
    found = set()
    for item in program.names:
        index = _index(program, item)
        for name in index.marked.get("RestoreV2", ()):
            found.update(_strings(index, name, 1) or ())
    return frozenset(found)

