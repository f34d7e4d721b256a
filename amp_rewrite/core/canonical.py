"""Canonicalisation: a graph that computes in float16 or bfloat16 already (a Keras
``mixed_float16``/``mixed_bfloat16`` export, casts placed by hand, grappler's or our own
rewrite) back to its float32 form, so that a rewrite to any target starts from what the
float32 model is: ``--target float32`` stops there, retargeting converts that.

Per item (the main graph and every library function body), three steps:

1. Widen: every float16/bfloat16 type attribute of a node becomes float32 (a low ``Const``
   holds its values widened, exactly), but for the nodes whose dtypes others see or
   hold: function boundaries (``_Arg``, ``_Retval``: signatures stay as they are), calls
   (their types are their function's signature), placeholders, outputs the caller keeps
   (fetches, custom gradients), stateful ops (a variable stored low keeps its dtype, read
   through a cast, unless the caller widens its stored values too: ``variables``) and
   ``Bitcast`` (whose meaning is its dtypes).
2. Casts where a widened tensor meets a reader that kept its low dtype (a float16 output
   the client sees stays float16: one Cast at the end), and the other way.
3. Drop the Casts that step 1 made float32 → float32: their readers read the cast's input.
   Casts between an integer and a float, and those float32 → float32 ones the source had
   already, stay.

The caller's GraphDef is never modified; an item without low dtypes is copied as it is.
"""
from __future__ import annotations

import collections
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2

from amp_rewrite.core import functions, graph_io, support, typegraph
from amp_rewrite.core.bounds import CALL_OPS
from amp_rewrite.core.graph_io import copy_graph_def, parse_tensor_name
from amp_rewrite.core.program import MAIN_GRAPH, Program, program_of
from amp_rewrite.core.report import dtype_name
from amp_rewrite.core.target import LOW_DTYPES, NAME_TO_TARGET
from amp_rewrite.errors import GraphError

FLOAT32 = types_pb2.DT_FLOAT
# Ops whose dtypes others see (signatures, feeds) or whose meaning is their dtype: never widened.
BOUNDARY_OPS = frozenset({"_Arg", "_Retval", "Placeholder", "PlaceholderWithDefault", "Bitcast"})
CAST_SUFFIX = "Canonical"  # the added casts' names: <src>-<port>-CastTo<Dtype>-<index>-Canonical
_CAST_KIND = {FLOAT32: "CastToFp32", **{target.dtype: target.cast_kind for target in NAME_TO_TARGET.values()}}
# Where a widened node's float32 kernel is looked for: a node that runs on one of them in its
# low dtypes must run there in float32 too, else it is refused (``_check_float32_kernel``).
KERNEL_DEVICES = ("CPU", "GPU")
# The stateful ops that hold, read, write, save or restore a variable's values: widened with
# ``variables=True``, when the caller widens the stored values (a SavedModel's checkpoint).
VARIABLE_OPS = frozenset({"VarHandleOp", "VariableV2", "ReadVariableOp", "AssignVariableOp", "ResourceGather",
                          "ResourceGatherNd", "SaveV2", "RestoreV2"})


@dataclass(frozen=True)
class Canonical:
    """The float32 form of a graph, and what canonicalisation changed to make it."""

    graph_def: graph_pb2.GraphDef
    low_nodes: Mapping[str, int]    # dtype name -> the source's nodes computing in it (Casts and Consts aside)
    widened: int                    # nodes whose low dtypes became float32 (Casts and Consts aside)
    casts_removed: int              # float casts that became float32 -> float32 and went
    casts_added: int                # casts where a widened tensor meets a reader that kept its dtype
    low_variables: tuple[str, ...]  # variables stored in a low dtype: widened (``variables``), else read through a cast
    variables_widened: bool = False  # whether ``low_variables`` are float32 in ``graph_def``
    low_constants: Mapping[str, int] = field(default_factory=dict)  # [FUNCTION::]Const widened -> its dtype before

    @property
    def changed(self) -> bool:
        return bool(self.widened or self.casts_removed or self.casts_added)

    @property
    def source_dtypes(self) -> tuple[str, ...]:
        """The low dtypes the source computes in, the most used first."""
        return tuple(name for name, _ in collections.Counter(self.low_nodes).most_common())

    def summary(self) -> str:
        """One line: what the source computed in and what going back to float32 changed."""
        if not self.changed:
            return "Source: computes in float32 already: nothing to change back"
        source = " and ".join(self.source_dtypes) or "float32"
        line = (f"retargeted from {source}: {self.widened} node(s) back to float32 first,"
                f" {self.casts_removed} cast(s) removed")
        if self.casts_added:
            line += f", {self.casts_added} cast(s) added where a tensor keeps its dtype (signatures, calls)"
        return line


@dataclass(frozen=True)
class _ItemChange:
    """One item's counts (``Canonical``'s fields of the same names)."""

    low_nodes: Mapping[str, int]
    widened: int
    casts_removed: int
    casts_added: int
    low_variables: tuple[str, ...]
    low_constants: Mapping[str, int]  # Const widened (in this item) -> its dtype before


def to_float32(graph_def: graph_pb2.GraphDef, *, fetches: Iterable[str] = (),
               preserved: Mapping[tuple[str, str], str] | None = None, variables: bool = False) -> Canonical:
    """``graph_def`` with every float16/bfloat16 compute node of the main graph and of each
    library function back to float32 (module doc); the input is never modified.

    ``fetches``: main-graph tensors or nodes whose dtypes the caller sees (a SavedModel's
    signature outputs): they keep them. ``preserved``: ``(function, node) -> why`` for more
    nodes that keep their dtypes (custom gradients; function ``""`` is the main graph).
    ``variables``: variables stored low become float32 too, with their reads, writes, saves
    and restores; the caller widens their stored values (else they stay, read through a cast).
    A low-precision node whose op has no float32 kernel is refused (``GraphError``)."""
    program = program_of(graph_def)
    functions.check_calls(graph_def, program.library)
    kept: dict[str, set[str]] = collections.defaultdict(set)
    kept[MAIN_GRAPH].update(parse_tensor_name(fetch).node for fetch in fetches)
    for function, node in (preserved or {}):
        kept[function].add(node)
    # Variable ops widen only where a variable is stored low: a low read of a float32 variable
    # is a broken export, for the weights step to refuse (core/weights.py), not to mend here.
    variables = variables and any(_is_low_variable(node) for node in graph_io.every_node(graph_def))
    output = copy_graph_def(graph_def)
    changes, low_constants = [], {}
    for name in program.names:
        item = program.item(name)
        if not _has_low(item):
            continue
        try:
            body, change = _canonicalise_item(item, program.op_defs, frozenset(kept[name]), variables)
        except GraphError as error:
            raise GraphError(f"function '{name}': {error}" if name != MAIN_GRAPH else str(error)) from None
        program.put(output, name, body)
        changes.append(change)
        low_constants.update({functions.scoped_name(name, node): dtype for node, dtype in change.low_constants.items()})
    low_nodes: collections.Counter[str] = collections.Counter()
    for change in changes:
        low_nodes.update(change.low_nodes)
    return Canonical(output, dict(low_nodes), sum(c.widened for c in changes), sum(c.casts_removed for c in changes),
                     sum(c.casts_added for c in changes), tuple(v for c in changes for v in c.low_variables), variables,
                     low_constants)


def low_dtypes(graph_def: graph_pb2.GraphDef) -> dict[str, int]:
    """Dtype name -> how many nodes of the main graph and the library functions compute in
    it (Casts and Consts aside): what the source already is, before anything changes."""
    found = collections.Counter(dtype_name(dtype) for node in graph_io.every_node(graph_def)
                                if node.op not in ("Cast", "Const") for dtype in set(_low_attrs(node)))
    return dict(found.most_common())


def _is_low_variable(node_def: node_def_pb2.NodeDef) -> bool:
    return node_def.op in ("VarHandleOp", "VariableV2") and bool(_low_attrs(node_def))


def _has_low(graph_def: graph_pb2.GraphDef) -> bool:
    """Whether any node of an item has a float16/bfloat16 type attribute."""
    return any(_low_attrs(node) for node in graph_def.node)


def _low_attrs(node_def: node_def_pb2.NodeDef) -> list[int]:
    """The low dtypes in ``node_def``'s type and type-list attributes (not its ``_``-private ones)."""
    found = []
    for name, value in node_def.attr.items():
        if name.startswith("_"):
            continue
        kind = value.WhichOneof("value")
        if kind == "type" and value.type in LOW_DTYPES:
            found.append(value.type)
        elif kind == "list":
            found.extend(dtype for dtype in value.list.type if dtype in LOW_DTYPES)
    return found


def _canonicalise_item(item: graph_pb2.GraphDef, op_defs: Mapping, kept: frozenset[str], variables: bool,
                       ) -> tuple[graph_pb2.GraphDef, _ItemChange]:
    """Steps 1-3 (module doc) on one item's GraphDef; ``kept``: its nodes whose dtypes stay;
    ``variables``: the variable ops widen too."""
    nodes = graph_io.working_copy(item)
    types = typegraph.build_type_graph(nodes, None, op_defs)  # fills the working copy's default attrs
    low_nodes = collections.Counter(dtype_name(dtype) for node in nodes.graph_def.node
                                    if node.op not in ("Cast", "Const") for dtype in set(_low_attrs(node)))
    low_variables = tuple(node.name for node in nodes.graph_def.node if _is_low_variable(node))
    # 1. Widen.
    widened = [name for name, node_def in nodes.node_defs.items()
               if _low_attrs(node_def) and not _keeps_dtypes(node_def, kept, op_defs, variables)]
    casts = {name for name in widened if nodes.node_defs[name].op == "Cast"}
    constants = {name: nodes.node_defs[name].attr["dtype"].type for name in widened if nodes.node_defs[name].op == "Const"}
    staying = {name for name, node_def in nodes.node_defs.items() if _low_attrs(node_def)} - set(widened)
    for name in widened:
        _widen(nodes.node_defs[name], _cast_sides_kept(nodes, name, staying) if name in casts else ())
    # 2. Casts where a widened tensor meets a reader that kept its dtype.
    added = _insert_casts(nodes, types)
    # 3. Casts now float32 -> float32 go.
    graph_def, removed = _drop_identity_casts(graph_io.take_graph_def(nodes), casts - kept)
    counted = sum(1 for name in widened if nodes.node_defs[name].op not in ("Cast", "Const"))
    return graph_def, _ItemChange(dict(low_nodes), counted, removed, added, low_variables, constants)


def _keeps_dtypes(node_def: node_def_pb2.NodeDef, kept: frozenset[str], op_defs: Mapping, variables: bool) -> bool:
    """Whether a node keeps its low dtypes (module doc, step 1); a node that would widen to an
    op without a float32 kernel is refused."""
    if node_def.name in kept or node_def.op in BOUNDARY_OPS:
        return True
    if any(name in op_defs for name in functions.called_functions(node_def)):
        return True  # a call: its types are its function's signature
    op_def = support.registered_op_def(node_def.op)
    if op_def is not None and op_def.is_stateful and not (variables and node_def.op in VARIABLE_OPS):
        return True
    if node_def.op == "Const" and graph_io.is_left_in_file(node_def.attr["value"].tensor):
        return True  # its values are still in the file: read there, then cast
    _check_float32_kernel(node_def)
    return False


def _check_float32_kernel(node_def: node_def_pb2.NodeDef) -> None:
    """A node that runs somewhere in its low dtypes must run in float32 too."""
    widened = node_def_pb2.NodeDef()
    widened.CopyFrom(node_def)
    _widen(widened)
    if any(support.has_kernel(node_def, node_def.attr, device) for device in KERNEL_DEVICES) and not any(
            support.has_kernel(widened, widened.attr, device) for device in KERNEL_DEVICES):
        low = dtype_name(_low_attrs(node_def)[0])
        raise GraphError(f"node '{node_def.name}' ({node_def.op}) computes in {low} and its op has no float32"
                         f" kernel, so it cannot go back to float32; convert the float32 original instead")


def _cast_sides_kept(nodes: graph_io.WorkingGraph, cast: str, staying: set[str]) -> tuple[str, ...]:
    """The attrs of a Cast that keep their low dtype: ``SrcT`` where it reads a node that
    keeps its dtypes (a signature's argument), ``DstT`` where only such nodes read it (a
    signature's output): the cast stays where it is, rather than one more cast beside it."""
    sides = []
    if nodes.inputs[cast][0].node in staying:
        sides.append("SrcT")
    readers = [reader for reader, _ in nodes.readers[cast]]
    if readers and all(reader in staying for reader in readers):
        sides.append("DstT")
    return tuple(sides)


def _widen(node_def: node_def_pb2.NodeDef, kept: Iterable[str] = ()) -> None:
    """Every low type attribute of ``node_def`` float32 (but those named in ``kept``); a
    Const's values widened with it."""
    for name, value in node_def.attr.items():
        if name.startswith("_") or name in kept:
            continue
        kind = value.WhichOneof("value")
        if kind == "type" and value.type in LOW_DTYPES:
            value.type = FLOAT32
        elif kind == "list" and any(dtype in LOW_DTYPES for dtype in value.list.type):
            value.list.type[:] = [FLOAT32 if dtype in LOW_DTYPES else dtype for dtype in value.list.type]
    if node_def.op == "Const":
        tensor = node_def.attr["value"].tensor
        if tensor.dtype in LOW_DTYPES:
            values = np.asarray(tf.make_ndarray(tensor), dtype=np.float32)  # exact: float32 holds every low value
            tensor.CopyFrom(tf.make_tensor_proto(values, dtype=tf.float32, shape=values.shape))


def _insert_casts(nodes: graph_io.WorkingGraph, types: typegraph.TypeGraph) -> int:
    """One Cast per output port and dtype where a reader's input dtype differs from the port's
    (after step 1), shared by those readers; returns how many."""
    node_types, node_defs = types.types, nodes.node_defs
    wanted: dict[tuple[str, int, int, int], list[tuple[str, int]]] = {}
    for name in list(node_defs):
        for position, ref in enumerate(nodes.inputs[name]):
            if ref.port == graph_io.CONTROL:
                continue
            have = typegraph.dtype_of(node_defs[ref.node], node_types[ref.node].outputs[ref.port])
            need = typegraph.dtype_of(node_defs[name], node_types[name].inputs[position])
            if have != need:
                wanted.setdefault((ref.node, ref.port, have, need), []).append((name, position))
    for (producer, port, have, need), readers in wanted.items():
        template = graph_io.make_node_def("Cast", "", SrcT=have, DstT=need, Truncate=False)
        graph_io.insert_node(nodes, template, _cast_name(nodes, producer, port, need), producer, port, readers,
                             device=node_defs[producer].device)
    return len(wanted)


def _cast_name(nodes: graph_io.WorkingGraph, producer: str, port: int, dtype: int) -> str:
    kind = _CAST_KIND.get(dtype, f"CastTo{dtype_name(dtype).capitalize()}")
    index = 0
    while f"{producer}-{port}-{kind}-{index}-{CAST_SUFFIX}" in nodes.node_defs:
        index += 1
    return f"{producer}-{port}-{kind}-{index}-{CAST_SUFFIX}"


def _drop_identity_casts(graph_def: graph_pb2.GraphDef, candidates: set[str]) -> tuple[graph_pb2.GraphDef, int]:
    """The ``candidates`` Casts now float32 -> float32 (and without control inputs) removed,
    their readers reading the cast's input; returns the graph and how many went."""
    by_name = {node.name: node for node in graph_def.node}
    source: dict[str, str] = {}  # a dropped cast -> the tensor it read
    for name in sorted(candidates):
        node = by_name[name]
        if node.attr["SrcT"].type == node.attr["DstT"].type == FLOAT32 and len(node.input) == 1:
            source[name] = node.input[0]
    if not source:
        return graph_def, 0

    def resolved(tensor: str) -> str:
        """The tensor a reader reads once the casts go: the cast's input as it was written
        (``^`` that node's, for a control input), through chains of dropped casts."""
        ref = parse_tensor_name(tensor)
        while ref.node in source and ref.port in (0, graph_io.CONTROL):
            tensor = source[ref.node] if ref.port == 0 else f"^{parse_tensor_name(source[ref.node]).node}"
            ref = parse_tensor_name(tensor)
        return tensor

    output = graph_pb2.GraphDef()
    output.CopyFrom(graph_def)
    del output.node[:]
    for node in graph_def.node:
        if node.name in source:
            continue
        copy = output.node.add()
        copy.CopyFrom(node)
        inputs = [resolved(tensor) for tensor in node.input]
        data = [tensor for tensor in inputs if not tensor.startswith("^")]
        control = dict.fromkeys(tensor for tensor in inputs if tensor.startswith("^"))  # once each
        copy.input[:] = data + list(control)
    return output, len(source)



def widen_outputs(graph_def: graph_pb2.GraphDef, outputs: Mapping[str, Iterable[int]], *,
                  fixed: Container[str] = ()) -> tuple[graph_pb2.GraphDef, dict[str, frozenset[int]]]:
    """``graph_def`` with the float16/bfloat16 outputs ``outputs`` names (function -> output
    positions: a SavedModel's signature functions) float32; the input is never modified.

    A Cast to float32 goes before each such output, and each call of the function casts the
    output back for the readers it had, so every caller still type-checks. Where an output is
    a called function's output (through Identities: a signature wrapper returning its model's
    call), that function's output widens too, and so on inwards, but for functions in
    ``fixed`` and those named otherwise than by calls (loop bodies, branches): so that the
    float32 value reaches the signature without a round trip through the low dtype once
    ``to_float32`` drops the casts that became float32 -> float32. Returns the graph and
    every function's outputs widened."""
    program = program_of(graph_def)
    widened = _outputs_to_widen(program, outputs, fixed)
    result = copy_graph_def(graph_def)
    for name in program.names:
        nodes = graph_io.working_copy(program.item(name))
        changed = _cast_calls_back(nodes, program, widened)
        if name in widened:
            _cast_returns(nodes, widened[name])
        if changed or name in widened:
            program.put(result, name, graph_io.take_graph_def(nodes))
    return result, widened


def function_called(node_def: node_def_pb2.NodeDef, library: Mapping[str, Any]) -> str | None:
    """The library function ``node_def`` calls as a function call (not a loop or a branch)."""
    if node_def.op in CALL_OPS:
        return node_def.attr["f"].func.name
    return node_def.op if node_def.op in library else None


def _outputs_to_widen(program: Program, outputs: Mapping[str, Iterable[int]],
                      fixed: Container[str]) -> dict[str, frozenset[int]]:
    """``outputs``' low ones, and inwards the called functions' outputs they return."""
    named = {name for node in graph_io.every_node(program.graph_def) if function_called(node, program.library) is None
             for name in functions.called_functions(node)}  # a body, a branch, a gradient: its signature stays
    named |= {gradient.gradient_func for gradient in program.graph_def.library.registered_gradients}
    wanted: dict[str, set[int]] = collections.defaultdict(set)
    todo = [(function, port) for function, ports in outputs.items() for port in ports]
    while todo:
        function, port = todo.pop()
        found = program.library.get(function)
        if found is None or port in wanted[function] or found.signature.output_arg[port].type not in LOW_DTYPES:
            continue
        wanted[function].add(port)
        inner = _returned_call(program, function, port)
        if inner is not None and inner[0] not in fixed and inner[0] not in named:
            todo.append(inner)
    return {function: frozenset(ports) for function, ports in wanted.items() if ports}


def _returned_call(program: Program, function: str, port: int) -> tuple[str, int] | None:
    """(callee, its output) where ``function``'s output ``port`` is, through Identities, a call's output."""
    body = program.item(function)
    nodes = {node.name: node for node in body.node}
    retval = next(node for node in body.node if node.op == "_Retval" and node.attr["index"].i == port)
    ref = parse_tensor_name(retval.input[0])
    while nodes[ref.node].op == "Identity":
        ref = parse_tensor_name(nodes[ref.node].input[0])
    callee = function_called(nodes[ref.node], program.library)
    return (callee, ref.port) if callee in program.library else None


def _cast_calls_back(nodes: graph_io.WorkingGraph, program: Program, widened: Mapping[str, frozenset[int]]) -> bool:
    """Each call of a widened function: its ``Tout`` float32 there, and a Cast back to the
    dtype its readers had; returns whether any call was changed."""
    changed = False
    for name, node_def in list(nodes.node_defs.items()):
        callee = function_called(node_def, program.library)
        for port in sorted(widened.get(callee, ())):
            low = program.library[callee].signature.output_arg[port].type
            if node_def.op in CALL_OPS:
                node_def.attr["Tout"].list.type[port] = FLOAT32
            readers = nodes.data_readers(name, port)
            if readers:
                template = graph_io.make_node_def("Cast", "", SrcT=FLOAT32, DstT=low, Truncate=False)
                graph_io.insert_node(nodes, template, _cast_name(nodes, name, port, low), name, port, readers,
                                     device=node_def.device)
            changed = True
    return changed


def _cast_returns(nodes: graph_io.WorkingGraph, ports: frozenset[int]) -> None:
    """A Cast to float32 before each ``_Retval`` of ``ports``, which then returns float32."""
    for name, node_def in list(nodes.node_defs.items()):
        if node_def.op != "_Retval" or node_def.attr["index"].i not in ports:
            continue
        ref = nodes.inputs[name][0]
        template = graph_io.make_node_def("Cast", "", SrcT=node_def.attr["T"].type, DstT=FLOAT32, Truncate=False)
        graph_io.insert_node(nodes, template, _cast_name(nodes, ref.node, ref.port, FLOAT32), ref.node, ref.port,
                             [(name, 0)], device=nodes.node_defs[ref.node].device)
        node_def.attr["T"].type = FLOAT32
