"""The only mutation: set painted dtypes and insert Cast nodes at colour boundaries.

Works on the working copy of the node graph (spec §2.6, normal path), knowing of the
colouring only its ALLOW set: every float32 vertex in ALLOW gets the target dtype, and
each output port whose consumers disagree with it in colour gets one Cast, shared by all
those consumers, named ``<src>-<port>-CastTo{Fp16,Bf16,Fp32}-<id>-AutoMixedPrecision``
and placed on the source's device.
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from typing import Iterable

from tensorflow.core.framework import node_def_pb2, types_pb2

from amp_rewrite.core import graph_io
from amp_rewrite.core.target import Target
from amp_rewrite.core.typegraph import TypeGraph, Vertex
from amp_rewrite.errors import GraphError

SUFFIX = "AutoMixedPrecision"
# Grappler does not count a cast to the target fed by these (nor by a Const).
VARIABLE_OPS = frozenset(
    {"Variable", "VariableV2", "AutoReloadVariable", "VarHandleOp", "_VarHandlesOp", "ReadVariableOp",
     "_ReadVariablesOp"}
)
CAST_TO_FLOAT32 = "CastToFp32"  # the <Kind> of a target → float32 cast; the other way is the target's
# The name every cast the rewrite adds has (spec §2.6); the index only keeps names unique.
CAST_NAME = re.compile(rf"^(?P<src>.+)-(?P<port>\d+)-(?P<kind>CastTo\w+)-(?P<index>\d+)-{SUFFIX}$")


def is_amp_cast(node_def: node_def_pb2.NodeDef) -> bool:
    """Whether ``node_def`` is a cast the rewrite (ours or grappler's) added: the one way to tell."""
    return node_def.op == "Cast" and node_def.name.endswith(SUFFIX) and CAST_NAME.match(node_def.name) is not None


@dataclass(frozen=True)
class CastStats:
    vertices_converted: int
    casts_added: int
    casts_to_target: int  # grappler's count: casts to the target not fed by Const or variables


def _cast_name(nodes: graph_io.WorkingGraph, src: str, port: int, kind: str) -> str:
    name, index = f"{src}-{port}-{kind}-0-{SUFFIX}", 0
    while name in nodes.node_defs:
        index += 1
        name = f"{src}-{port}-{kind}-{index}-{SUFFIX}"
    return name


@functools.cache
def _cast_template(src_dtype: int, dst_dtype: int) -> node_def_pb2.NodeDef:
    return graph_io.make_node_def("Cast", "", SrcT=src_dtype, DstT=dst_dtype, Truncate=False)


def change_types_and_insert_casts(types: TypeGraph, target: Target, allow: frozenset[Vertex]) -> CastStats:
    """Applies the painting's ``allow`` to ``types.nodes`` in place (the working copy): the
    ALLOW vertices' dtypes, then a cast on every output port whose readers' colours differ."""
    converted = _convert_dtypes(types, target, allow)
    added, to_target_counted = _insert_casts(types, target, allow)
    return CastStats(converted, added, to_target_counted)


def _convert_dtypes(types: TypeGraph, target: Target, allow: frozenset[Vertex]) -> int:
    """Each float32 vertex in ``allow`` takes the target dtype; returns how many."""
    node_defs, target_dtype = types.node_defs, target.dtype
    converted = 0
    for vertex in types.float32:  # graph order, so the first fixed port found is the one named
        if vertex not in allow:
            continue
        name, attr = vertex
        node_def = node_defs[name]
        if not attr.name:
            raise GraphError(
                f"node '{name}' ({node_def.op}): its {attr} port is fixed float32 and cannot be"
                f" converted; add '{name}' to keep_nodes or drop UNSAFE_FORCE_ALL"
            )
        value = node_def.attr[attr.name]
        if attr.index < 0:
            value.type = target_dtype
        else:
            value.list.type[attr.index] = target_dtype
        converted += 1
    return converted


def _insert_casts(types: TypeGraph, target: Target, allow: frozenset[Vertex]) -> tuple[int, int]:
    """One cast per output port of a float32 vertex and direction, for the readers whose
    colour differs from the vertex's: (casts added, grappler's count of those to the target)."""
    target_dtype, to_target_kind = target.dtype, target.cast_kind
    nodes, consumers_of, node_defs, ops = types.nodes, types.succ, types.node_defs, types.ops
    readers, inputs = nodes.readers, nodes.inputs
    added = to_target_counted = 0
    vertices, node_types = types.vertices, types.types
    by_port: dict[int, list] = {}
    by_port_node = None  # the node ``by_port`` lists the out-edges of
    for vertex in _cast_candidates(types, allow):
        src_allow = vertex in allow
        # A cast goes where a consumer's colour differs; most vertices have none.
        consumers = consumers_of[vertex]
        if allow.issuperset(consumers) if src_allow else allow.isdisjoint(consumers):
            continue
        name, attr = vertex
        if by_port_node != name:  # the node's out-edges before its first cast
            by_port_node, by_port = name, {}
            for dst, position in readers[name]:
                by_port.setdefault(inputs[dst][position].port, []).append((dst, position))
        for port in node_types[name].output_ports(attr):
            # Readers whose colour differs (an input of another dtype has no vertex: None, never ALLOW).
            moved = [(dst, position) for dst, position in by_port.get(port, ())
                     if (vertices[dst][node_types[dst].input_slots[position]] in allow) is not src_allow]
            if not moved:
                continue
            to_target = not src_allow
            kind = to_target_kind if to_target else CAST_TO_FLOAT32
            src_dtype, dst_dtype = (types_pb2.DT_FLOAT, target_dtype) if to_target else (target_dtype, types_pb2.DT_FLOAT)
            graph_io.insert_node(nodes, _cast_template(src_dtype, dst_dtype), _cast_name(nodes, name, port, kind),
                                 name, port, moved, device=node_defs[name].device)
            added += 1
            if to_target and ops[name] != "Const" and ops[name] not in VARIABLE_OPS and not types.reads_ref_variable(name):
                to_target_counted += 1
    return added, to_target_counted


def _cast_candidates(types: TypeGraph, allow: frozenset[Vertex]) -> Iterable[Vertex]:
    """The float32 vertices, in graph order, that may need a cast: ALLOW ones and the
    producers of ALLOW ones. When ALLOW vertices are few (float16), listing those producers
    first is cheaper than testing every other vertex's consumers; when many (bfloat16), all."""
    if 3 * len(allow) >= len(types.float32):
        return types.float32
    feeds_allow, fanins = set(allow), types.pred
    for vertex in allow:
        feeds_allow.update(fanins.get(vertex, ()))
    return [vertex for vertex in types.float32 if vertex in feeds_allow]
