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
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache

import numpy as np
import tensorflow as tf
from networkx.utils import UnionFind
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2
from tensorflow.core.protobuf import saved_object_graph_pb2

from amp_rewrite.core import functions
from amp_rewrite.core.errors import GraphError
from amp_rewrite.core.graph_io import parse_tensor_name
from amp_rewrite.core.program import MAIN_GRAPH, Program, program_of
from amp_rewrite.core.report import dtype_name
from amp_rewrite.core.target import Target, lookup_target

Place = tuple[str, str]        # (item, node): MAIN_GRAPH or a function, and a node or argument there
Port = tuple[str, int]         # (node, output port) within one item

RESOURCE = types_pb2.DT_RESOURCE
FLOAT32 = types_pb2.DT_FLOAT
READ_OPS = frozenset({"ReadVariableOp", "ResourceGather", "ResourceGatherNd"})  # value out, dtype attr
ASSIGN_OP = "AssignVariableOp"
# Ops that take a handle and neither read nor write its values.
HANDLE_ONLY_OPS = frozenset({"VarIsInitializedOp", "DisableCopyOnRead", "DestroyResourceOp", "VariableShape"})
FORWARD_OPS = frozenset({"Identity", "Snapshot"})  # output = input: a handle or a value seen through one
SHAPE_OPS = frozenset({"Shape", "Size", "Rank"})   # read a value's shape only: any dtype gives the same answer
LOOP_OPS = frozenset({"While", "StatelessWhile"})
BYTES = {FLOAT32: 4, types_pb2.DT_HALF: 2, types_pb2.DT_BFLOAT16: 2}
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
        return max(self.elements, 0) * BYTES[FLOAT32]

    @property
    def bytes_after(self) -> int:
        return max(self.elements, 0) * BYTES[self.dtype]


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
    variables: bool = True, constants: bool = False,
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
    """
    target = lookup_target(target, quantized=True)  # float8 reads its weights as float16
    kept = dict(kept or {})
    program = program_of(graph_def)
    indexes = {name: _Index.of(program.item(name)) for name in program.names}
    edits = _Edits()
    weights: list[Weight] = []
    if variables:
        weights += _store_variables(program, indexes, target.dtype, kept, objects, dict(blocked_keys or {}), edits)
    if constants:
        weights += _store_constants(program, indexes, target.dtype, kept, edits)
    return StoredWeights(edits.apply(program), dtype_name(target.dtype), tuple(weights))


# --------------------------------------------------------------------------------------
# Items and edits


@dataclass(frozen=True)
class _Index:
    """One item's nodes, and the data readers of each output."""

    nodes: Mapping[str, node_def_pb2.NodeDef]
    readers: Mapping[Port, list[tuple[str, int]]]  # (node, port) -> [(reader, input position)]
    order: tuple[str, ...]
    position: Mapping[str, int]  # node -> its place in ``order``
    decoded: dict[tuple[str, int], list[str] | None] = field(default_factory=dict, compare=False)

    @staticmethod
    def of(graph_def: graph_pb2.GraphDef) -> _Index:
        readers: dict[Port, list[tuple[str, int]]] = defaultdict(list)
        for node in graph_def.node:
            for position, tensor in enumerate(node.input):
                ref = parse_tensor_name(tensor)
                if not ref.is_control:
                    readers[(ref.node, ref.port)].append((node.name, position))
        order = tuple(node.name for node in graph_def.node)
        return _Index({node.name: node for node in graph_def.node}, readers, order,
                      {name: position for position, name in enumerate(order)})

    def readers_of(self, node: str, port: int = 0) -> list[tuple[str, int]]:
        return self.readers.get((node, port), [])

    def input_node(self, node: str, position: int) -> node_def_pb2.NodeDef:
        return self.nodes[parse_tensor_name(self.nodes[node].input[position]).node]


@dataclass
class _Edits:
    """Changes to make, by item; applied once, to copies (STYLE §4)."""

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

    def items(self) -> set[str]:
        places = [*self.types, *self.list_types, *self.rounded, *self.removed_casts, *self.cast_values]
        return {item for item, _ in places}

    def apply(self, program: Program) -> graph_pb2.GraphDef:
        """The edited copy. The main graph is copied a node at a time, a rounded Const built
        from its float32 value: a frozen graph's weights are never held twice in float32."""
        output = without_nodes(program.graph_def)
        for node in program.graph_def.node:
            if (MAIN_GRAPH, node.name) in self.rounded:
                _put_rounded(output.node.add(), node, self.types[(MAIN_GRAPH, node.name)]["dtype"])
            else:
                output.node.add().CopyFrom(node)
        for item in sorted(self.items()):
            body = output if item == MAIN_GRAPH else _copy(program.item(item))
            self._apply_to(item, body)
            if item != MAIN_GRAPH:
                program.put(output, item, body)
        return output

    def _apply_to(self, item: str, body: graph_pb2.GraphDef) -> None:
        replaced: dict[str, str] = {}  # removed cast -> the tensor its readers read now
        for node in body.node:
            place = (item, node.name)
            for attr, dtype in self.types.get(place, {}).items():
                node.attr[attr].type = dtype
            for (attr, index), dtype in self.list_types.get(place, {}).items():
                node.attr[attr].list.type[index] = dtype
            if place in self.rounded and item != MAIN_GRAPH:  # the main graph's: rounded as copied
                _put_rounded(node, node, self.types[place]["dtype"])
            if place in self.removed_casts:
                replaced[node.name] = node.input[0]
        for node in list(body.node):
            if (item, node.name) in self.cast_values:
                node.input[1] = _add_cast(body, node, self.types[(item, node.name)]["dtype"])
        if replaced:
            _bypass(body, replaced)


def without_nodes(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef:
    """A copy of ``graph_def`` but its nodes (library, versions, debug info)."""
    copy = graph_pb2.GraphDef()
    for field, value in graph_def.ListFields():
        if field.name == "node":
            continue
        if field.message_type is not None:
            getattr(copy, field.name).CopyFrom(value)
        else:
            setattr(copy, field.name, value)
    return copy


def _put_rounded(node: node_def_pb2.NodeDef, const: node_def_pb2.NodeDef, dtype: int) -> None:
    """``node``: the float32 Const ``const`` with its value rounded to ``dtype`` (``node`` may be ``const``)."""
    value = tf.make_tensor_proto(round_to(tf.make_ndarray(const.attr["value"].tensor), dtype))
    if node is not const:
        node.CopyFrom(const)  # one float32 value at a time, replaced at once
    node.attr["value"].tensor.CopyFrom(value)


def _copy(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef:
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
    return copy


def _add_cast(body: graph_pb2.GraphDef, assign: node_def_pb2.NodeDef, dtype: int) -> str:
    """A float32 -> ``dtype`` cast of ``assign``'s value: it writes a float32 value into a
    variable now stored low (a TF1 initializer), rounded once as every read was."""
    names = {node.name for node in body.node}
    name, index = f"{assign.name}/value-StoredAs-{dtype_name(dtype)}", 0
    while name in names:
        index += 1
        name = f"{assign.name}/value-StoredAs-{dtype_name(dtype)}_{index}"
    cast = body.node.add(name=name, op="Cast", input=[assign.input[1]], device=assign.device)
    cast.attr["SrcT"].type = FLOAT32
    cast.attr["DstT"].type = dtype
    cast.attr["Truncate"].b = False
    return name


def _bypass(body: graph_pb2.GraphDef, replaced: Mapping[str, str]) -> None:
    """Readers of each removed cast read the cast's input instead; the casts go."""
    for node in body.node:
        inputs, changed = [], False
        for tensor in node.input:
            ref = parse_tensor_name(tensor)
            if ref.node in replaced:
                changed = True
                tensor = f"^{parse_tensor_name(replaced[ref.node]).node}" if ref.is_control else replaced[ref.node]
            if tensor not in inputs or not tensor.startswith("^"):
                inputs.append(tensor)
        if changed:
            node.input[:] = inputs
    kept = [node for node in body.node if node.name not in replaced]
    del body.node[:]
    body.node.extend(kept)


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
    the same groups, in the same order, on every run."""
    seen = {place: position for position, place in enumerate(sets.parents)}
    return sorted((sorted(group, key=seen.__getitem__) for group in sets.to_sets()), key=lambda g: seen[g[0]])


@dataclass
class _Handles:
    """Step 1's findings: the handle groups, the ops on each handle, and what stops one."""

    sets: UnionFind = field(default_factory=UnionFind)  # one set per variable (with its copies)
    accesses: list[tuple[Place, Place]] = field(default_factory=list)   # (handle, read or assign op)
    blockers: dict[Place, list[str]] = field(default_factory=lambda: defaultdict(list))
    keys: dict[Place, set[str]] = field(default_factory=lambda: defaultdict(set))  # handle -> checkpoint keys


def _callees(node: node_def_pb2.NodeDef, position: int, program: Program) -> list[tuple[str, int]] | None:
    """(function, argument index) that a functional op hands its input ``position`` to;
    None when the op calls nothing (or calls what is not in the library)."""
    library = program.library

    def named(attr: str) -> str:
        return node.attr[attr].func.name if attr in node.attr else ""

    if node.op in library:
        names, index = [node.op], position
    elif node.op in ("PartitionedCall", "StatefulPartitionedCall"):
        names, index = [named("f")], position
    elif node.op in LOOP_OPS:
        names, index = [named("body"), named("cond")], position
    elif node.op in ("If", "StatelessIf"):
        names, index = [named("then_branch"), named("else_branch")], position - 1
    elif node.op in ("Case", "StatelessCase"):
        names, index = [f.name for f in node.attr["branches"].list.func], position - 1
    else:
        return None
    if index < 0 or not all(name in library for name in names):
        return None
    return [(name, index) for name in names]


def _arg_name(program: Program, function: str, index: int) -> str:
    return program.library[function].signature.input_arg[index].name


def _follow_handles(program: Program, indexes: Mapping[str, _Index], objects: ObjectGraph | None) -> _Handles:
    """Step 1: from every ``VarHandleOp`` and resource ``_Arg``, every op its handle reaches."""
    found = _Handles()
    loop_bodies = {node.attr["body"].func.name for index in indexes.values() for node in index.nodes.values()
                   if node.op in LOOP_OPS}
    for item, index in indexes.items():
        for name in index.order:
            node = index.nodes[name]
            if node.op == "VarHandleOp" or node.op == "_Arg" and node.attr["T"].type == RESOURCE:
                _follow(program, item, index, (item, name), found, item in loop_bodies)
    if objects is not None:  # a function the object graph binds a variable to reads it through that argument
        for function, saved in objects.proto.concrete_functions.items():
            if function not in program.library or not saved.bound_inputs:
                continue
            args = program.library[function].signature.input_arg
            for arg, node_id in zip(args[len(args) - len(saved.bound_inputs):], saved.bound_inputs):
                key = objects.object_to_key.get(node_id)
                if key is not None and arg.type == RESOURCE:
                    found.keys[(function, arg.name)].add(key)
                    found.sets[(function, arg.name)]
    return found


def _follow(program: Program, item: str, index: _Index, handle: Place, found: _Handles, loop_body: bool) -> None:
    found.sets[handle]
    stack, seen = [(handle[1], 0)], set()
    while stack:
        port = stack.pop()
        if port in seen:
            continue
        seen.add(port)
        for reader, position in index.readers_of(*port):
            node = index.nodes[reader]
            if node.op in FORWARD_OPS:
                stack.append((reader, 0))
            elif node.op == "IdentityN":
                stack.append((reader, position))
            elif node.op in READ_OPS or node.op == ASSIGN_OP and position == 0:
                found.accesses.append((handle, (item, reader)))
            elif node.op in HANDLE_ONLY_OPS:
                continue
            elif node.op == "_Retval" and loop_body:  # the loop hands the handle to its next iteration
                found.sets.union(handle, (item, _arg_name(program, item, node.attr["index"].i)))
            else:
                callees = _callees(node, position, program)
                if callees is None:
                    found.blockers[handle].append(f"its handle goes to {node.op} '{reader}'{_where(item)}")
                    continue
                for function, arg in callees:
                    found.sets.union(handle, (function, _arg_name(program, function, arg)))
                if node.op in LOOP_OPS:
                    stack.append((reader, position))


@dataclass
class _Reads:
    """Step 2's findings for one handle group: who reads its values, and how."""

    casts: set[Place] = field(default_factory=set)       # casts to the target: removed
    forwards: set[Place] = field(default_factory=set)    # Identity between: retyped
    shapes: set[Place] = field(default_factory=set)      # Shape/Size/Rank: retyped
    saves: set[tuple[Place, int]] = field(default_factory=set)  # (SaveV2, tensor index)
    float32: list[str] = field(default_factory=list)     # why it must stay float32


def _read_values(item: str, index: _Index, node: str, dtype: int, kept: Mapping[Place, str], reads: _Reads,
                 copies: list[tuple[Place, Place]], handle: Place, left_alone: frozenset[str]) -> None:
    """Step 2 for one read (``node``'s output 0) and what forwards it. ``left_alone``: the
    functions the rewrite did not convert (their readers read float32, said so)."""
    if (item, node) in kept:
        reads.float32.append(f"its read '{node}'{_where(item)} keeps its dtype: {kept[(item, node)]}")
    for reader, position in index.readers_of(node):
        reader_node = index.nodes[reader]
        place = (item, reader)
        if reader_node.op in FORWARD_OPS:
            reads.forwards.add(place)
            _read_values(item, index, reader, dtype, kept, reads, copies, handle, left_alone)
        elif _casts_to(reader_node, dtype):
            reads.casts.add(place)
        elif reader_node.op == "SaveV2" and position >= 3:
            reads.saves.add((place, position - 3))
        elif reader_node.op == ASSIGN_OP and position == 1:
            copies.append((handle, place))  # a copy of this variable: decided with it
        elif reader_node.op in SHAPE_OPS:
            reads.shapes.add(place)
        elif reader_node.op == "_Retval":
            reads.float32.append(f"returned as float32 by function {item}")
        else:
            alone = ", a function this rewrite leaves float32 (no signature calls it)" if item in left_alone else ""
            reads.float32.append(f"read as float32 by {reader_node.op} '{reader}'{_where(item)}{alone}")


def _strings(index: _Index, node: str, position: int) -> list[str] | None:
    """The string list a ``Const`` input holds (SaveV2/RestoreV2 tensor names), or None;
    decoded once per node (a saver's list names every key, and is asked for each)."""
    if (node, position) not in index.decoded:
        source = index.input_node(node, position)
        index.decoded[(node, position)] = None if source.op != "Const" else [
            value.decode() for value in np.asarray(tf.make_ndarray(source.attr["value"].tensor)).ravel()]
    return index.decoded[(node, position)]


def _string_at(index: _Index, item: str, node: str, position: int, at: int) -> str | None:
    """Entry ``at`` of a saver's string list (``_strings``), or None; a list too short for the
    tensors the op saves or restores is one line (TensorFlow fails on it when it runs)."""
    found = _strings(index, node, position)
    if found is None:
        return None
    if at >= len(found):
        op = index.nodes[node].op
        raise GraphError(f"{op} '{node}'{_where(item)} has tensor {at} but its input {position} lists"
                         f" {len(found)} name(s); the saver is malformed: export the model again")
    return found[at]


def _elements(node: node_def_pb2.NodeDef) -> int:
    shape = node.attr["shape"].shape
    if shape.unknown_rank or any(dim.size < 0 for dim in shape.dim):
        return -1
    return math.prod(dim.size for dim in shape.dim)


def _store_variables(
    program: Program, indexes: Mapping[str, _Index], dtype: int, kept: Mapping[Place, str],
    objects: ObjectGraph | None, blocked_keys: Mapping[str, str], edits: _Edits,
) -> list[Weight]:
    # 1. Every op each handle reaches; handles passed into calls join the callee's argument.
    handles = _follow_handles(program, indexes, objects)
    # 2. Who reads each value; a value assigned to another variable makes the two one group.
    access_handle = {access: handle for handle, access in handles.accesses}
    handle_reads: dict[Place, _Reads] = defaultdict(_Reads)
    copies: list[tuple[Place, Place]] = []
    restores: dict[Place, tuple[Place, int, list[Place]] | None] = {}  # assign -> (RestoreV2, port, forwards)
    left_alone = frozenset(program.library) - set(functions.reachable_functions(program.graph_def, program.library))
    for handle, (item, node) in handles.accesses:
        index = indexes[item]
        if index.nodes[node].op in READ_OPS:
            _read_values(item, index, node, dtype, kept, handle_reads[handle], copies, handle, left_alone)
        else:
            restores[(item, node)] = _restored_value(index, item, node)
    for handle, assign in copies:
        handles.sets.union(handle, access_handle[assign])
    for assign, restored in restores.items():
        if restored is not None:
            (item, restore), port, _ = restored
            key = _string_at(indexes[item], item, restore, 1, port)
            if key is not None:
                handles.keys[access_handle[assign]].add(key)
    sliced: set[str] = set()  # keys saved in slices: SaveV2 of the whole checkpoint would join them
    for handle, reads in handle_reads.items():
        for (item, save), tensor in reads.saves:
            key = _string_at(indexes[item], item, save, 1, tensor)
            if key is None:
                handles.blockers[handle].append(f"its checkpoint key in SaveV2 '{save}'{_where(item)} is computed"
                                                " at run time")
            else:
                handles.keys[handle].add(key)
            if _string_at(indexes[item], item, save, 2, tensor):
                sliced.add(key if key is not None else save)
    # 3. Decide per group; 4. the edits of a group stored low.
    weights = []
    key_to_objects: dict[str, list[int]] = defaultdict(list)
    for node_id, key in (objects.object_to_key.items() if objects else ()):
        key_to_objects[key].append(node_id)
    names = {node_id: objects.proto.nodes[node_id].variable.name for node_id in objects.object_to_key
             if node_id < len(objects.proto.nodes)} if objects else {}
    if sliced:
        why = (f"the checkpoint holds variables saved in slices ({', '.join(sorted(sliced))}), which amp-rewrite"
               " does not rewrite")
        for handle in list(handles.keys):
            handles.blockers[handle].append(why)
    handle_accesses: dict[Place, list[Place]] = defaultdict(list)
    for handle, access in handles.accesses:
        handle_accesses[handle].append(access)
    for places in _key_groups(handles):
        weight = _decide(places, indexes, handles, handle_reads, handle_accesses, restores, dtype, kept, blocked_keys,
                         key_to_objects, names, edits)
        if weight is not None:
            weights.append(weight)
    return weights


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


def _restored_value(index: _Index, item: str, assign: str) -> tuple[Place, int, list[Place]] | None:
    """Where an AssignVariableOp's value comes from, if it is a RestoreV2 output (through
    Identity ops nothing else reads): (RestoreV2, port, the Identity ops between)."""
    ref = parse_tensor_name(index.nodes[assign].input[1])
    between = []
    while index.nodes[ref.node].op in FORWARD_OPS and len(index.readers_of(ref.node, ref.port)) == 1:
        between.append((item, ref.node))
        ref = parse_tensor_name(index.nodes[ref.node].input[0])
    if index.nodes[ref.node].op == "RestoreV2" and len(index.readers_of(ref.node, ref.port)) == 1:
        return (item, ref.node), ref.port, between
    return None


def _decide(
    places: list[Place], indexes: Mapping[str, _Index], handles: _Handles, handle_reads: Mapping[Place, _Reads],
    handle_accesses: Mapping[Place, list[Place]], restores: Mapping[Place, tuple[Place, int, list[Place]] | None],
    dtype: int, kept: Mapping[Place, str], blocked_keys: Mapping[str, str],
    key_to_objects: Mapping[str, list[int]], names: Mapping[int, str], edits: _Edits,
) -> Weight | None:
    """Steps 3-4 for one group: its Weight (None if it is no float32 variable) and, when it
    is stored low, its edits."""
    variables = sorted((p for p in places if indexes[p[0]].nodes.get(p[1]) is not None
                        and indexes[p[0]].nodes[p[1]].op == "VarHandleOp"),
                       key=lambda p: (p[0] != MAIN_GRAPH, p[0], indexes[p[0]].position[p[1]]))
    accesses = [access for place in places for access in handle_accesses.get(place, ())]
    node_dtypes = {place: indexes[place[0]].nodes[place[1]].attr["dtype"].type for place in [*variables, *accesses]}
    if len(set(node_dtypes.values())) > 1:
        raise GraphError(_disagreement(node_dtypes, indexes))
    if set(node_dtypes.values()) != {FLOAT32}:
        return None  # not a float32 variable (or nothing says what it holds)
    keys = sorted({key for place in places for key in handles.keys.get(place, ())})
    reads = _Reads()
    for place in places:
        found = handle_reads.get(place)
        if found is not None:
            reads.casts |= found.casts
            reads.forwards |= found.forwards
            reads.shapes |= found.shapes
            reads.saves |= found.saves
            reads.float32 += found.float32
    reasons = [why for place in places for why in handles.blockers.get(place, ())] + reads.float32
    reasons += [f"its checkpoint key '{key}' {blocked_keys[key]}" for key in keys if key in blocked_keys]
    if not keys:
        if not reads.casts:
            return None  # a handle nothing saves and no converted op reads: no weight
        reasons.append("it is not in the checkpoint")
    if not reads.casts and not reasons:
        reasons.append("no converted op reads it")
    objects = tuple(sorted(node_id for key in keys for node_id in key_to_objects.get(key, ())))
    name = variables[0][1] if variables else places[0][1]
    if objects and names.get(objects[0]):
        name = names[objects[0]]  # the name the model gave it, as tf.saved_model.load shows it
    elements = _elements(indexes[variables[0][0]].nodes[variables[0][1]]) if variables else -1
    elements = elements * max(len(keys), 1) if elements >= 0 else -1
    if reasons:
        reasons = list(dict.fromkeys(reasons))
        more = f" (and {len(reasons) - 1} more)" if len(reasons) > 1 else ""
        return Weight(name, "variable", elements, FLOAT32, reasons[0] + more, tuple(keys), objects)
    _edit_low(variables, accesses, reads, restores, indexes, dtype, kept, edits)
    return Weight(name, "variable", elements, dtype, "", tuple(keys), objects)


def _edit_low(variables: list[Place], accesses: list[Place], reads: _Reads,
              restores: Mapping[Place, tuple[Place, int, list[Place]] | None], indexes: Mapping[str, _Index],
              dtype: int, kept: Mapping[Place, str], edits: _Edits) -> None:
    """Step 4 for a group stored low: every op on it, its savers' entries, its restores and
    initializers take ``dtype``; the casts that read it go."""
    for item, node in [*variables, *accesses, *reads.forwards, *reads.shapes]:
        attr = "T" if indexes[item].nodes[node].op in FORWARD_OPS | SHAPE_OPS else "dtype"
        edits.types[(item, node)][attr] = dtype
    for (item, save), tensor in reads.saves:
        edits.list_types[(item, save)][("dtypes", tensor)] = dtype
    edits.drop_casts(reads.casts, dtype, kept)
    for assign in accesses:
        if indexes[assign[0]].nodes[assign[1]].op != ASSIGN_OP:
            continue
        restored = restores.get(assign)
        value = indexes[assign[0]].input_node(assign[1], 1)
        if restored is not None:
            (item, restore), port, between = restored
            edits.list_types[(item, restore)][("dtypes", port)] = dtype
            for place in between:
                edits.types[place]["T"] = dtype
        elif not (value.op in READ_OPS | FORWARD_OPS and (assign[0], value.name) in
                  {*accesses, *reads.forwards}):
            edits.cast_values.add(assign)  # a float32 value (an initializer) rounded on the way in


def _disagreement(node_dtypes: Mapping[Place, int], indexes: Mapping[str, _Index]) -> str:
    """One line: the ops on one variable that say different dtypes (the first of each)."""
    first: dict[int, Place] = {}
    for place, dtype in node_dtypes.items():
        first.setdefault(dtype, place)
    said = ", ".join(f"{indexes[item].nodes[node].op} '{node}'{_where(item)} says {dtype_name(dtype)}"
                     for dtype, (item, node) in first.items())
    return (f"the ops on one variable disagree on its dtype: {said}; TensorFlow fails on it at run time:"
            " export the model again")


# --------------------------------------------------------------------------------------
# Constants


def _store_constants(program: Program, indexes: Mapping[str, _Index], dtype: int, kept: Mapping[Place, str],
                     edits: _Edits) -> list[Weight]:
    """float32 ``Const`` nodes read only through casts to ``dtype``: ``dtype`` constants."""
    weights = []
    for item, index in indexes.items():
        for name in index.order:
            node = index.nodes[name]
            if node.op != "Const" or node.attr["dtype"].type != FLOAT32:
                continue
            readers = index.readers_of(name)
            if (item, name) in kept or not readers or not all(_casts_to(index.nodes[r], dtype) for r, _ in readers):
                continue
            edits.types[(item, name)]["dtype"] = dtype
            edits.rounded.add((item, name))
            edits.drop_casts([(item, reader) for reader, _ in readers], dtype, kept)
            label = f"{item}::{name}" if item != MAIN_GRAPH else name
            elements = math.prod(dim.size for dim in node.attr["value"].tensor.tensor_shape.dim)
            weights.append(Weight(label, "constant", elements, dtype))
    return weights


def restored_keys(graph_def: graph_pb2.GraphDef) -> frozenset[str]:
    """The checkpoint keys a graph's savers restore (``RestoreV2`` in the main graph and its
    functions): another MetaGraphDef that shares ``variables/`` reads these."""
    program = program_of(graph_def)
    found = set()
    for item in program.names:
        index = _Index.of(program.item(item))
        for name in index.order:
            if index.nodes[name].op == "RestoreV2":
                found.update(_strings(index, name, 1) or ())
    return frozenset(found)

