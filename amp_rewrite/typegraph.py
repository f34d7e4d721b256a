"""The graph that colouring works on: (node, type attribute) vertices (spec §2.2).

A node such as ``FusedBatchNormV3`` has several independent dtypes (``T`` and ``U``), and
``IdentityN`` one per list element, so the unit of painting is not a node but a
*vertex*: a node together with one type attribute, one element of a ``list(type)``
attribute, or one fixed dtype of its op definition (e.g. an ``int32`` shape input).
An edge joins the producer's output vertex to the consumer's input vertex; each edge
records the (output port, input port) pairs it stands for.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import networkx as nx
from tensorflow.core.framework import node_def_pb2, op_def_pb2, types_pb2

from amp_rewrite import support
from amp_rewrite.errors import GraphError


class TypeAttr(NamedTuple):
    """One dtype slot of a node: attr name (+ list index), or a fixed dtype."""

    name: str = ""
    index: int = -1
    fixed: int = types_pb2.DT_INVALID

    def __str__(self) -> str:
        if not self.name:
            return types_pb2.DataType.Name(self.fixed)
        return self.name if self.index < 0 else f"{self.name}[{self.index}]"


class Vertex(NamedTuple):
    node: str
    attr: TypeAttr

    def __str__(self) -> str:
        return f"{self.node}:{self.attr}"


@dataclass(frozen=True)
class NodeTypes:
    """How one node's ports map onto its type attributes."""

    op_def: op_def_pb2.OpDef
    inputs: tuple[TypeAttr, ...]   # one per data input port
    outputs: tuple[TypeAttr, ...]  # one per output port
    attrs: tuple[TypeAttr, ...]    # every vertex of the node, in a stable order

    @functools.cached_property
    def _attr_to_outputs(self) -> dict[TypeAttr, tuple[int, ...]]:
        ports: dict[TypeAttr, list[int]] = {}
        for port, attr in enumerate(self.outputs):
            ports.setdefault(attr, []).append(port)
        return {attr: tuple(p) for attr, p in ports.items()}

    def output_ports(self, attr: TypeAttr) -> tuple[int, ...]:
        return self._attr_to_outputs.get(attr, ())


def _arg_type_attrs(node_def: node_def_pb2.NodeDef, arg: op_def_pb2.OpDef.ArgDef) -> list[TypeAttr]:
    """The type attribute of each port an op-def argument expands to."""
    attrs = node_def.attr
    if arg.type_list_attr:
        if arg.type_list_attr not in attrs:
            raise GraphError(
                f"node '{node_def.name}' ({node_def.op}): attribute '{arg.type_list_attr}' is missing"
            )
        count = len(attrs[arg.type_list_attr].list.type)
        return [TypeAttr(arg.type_list_attr, i) for i in range(count)]
    count = attrs[arg.number_attr].i if arg.number_attr in attrs else 1
    if arg.type_attr:
        if arg.type_attr not in attrs:
            raise GraphError(
                f"node '{node_def.name}' ({node_def.op}): type attribute '{arg.type_attr}' is missing"
            )
        return [TypeAttr(arg.type_attr)] * count
    return [TypeAttr(fixed=arg.type)] * count


def node_types(node_def: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef, num_data_inputs: int) -> NodeTypes:
    """Port → type-attribute maps for a node, validated against its op definition."""
    inputs = [a for arg in op_def.input_arg for a in _arg_type_attrs(node_def, arg)]
    if len(inputs) != num_data_inputs:
        raise GraphError(
            f"node '{node_def.name}' ({node_def.op}): expected {len(inputs)} data input(s),"
            f" got {num_data_inputs}; fix the node's inputs"
        )
    outputs = [a for arg in op_def.output_arg for a in _arg_type_attrs(node_def, arg)]
    attrs = dict.fromkeys(inputs + outputs)
    attr_defs = {a.name: a for a in op_def.attr}
    for name, value in node_def.attr.items():
        if name.startswith("_"):
            continue
        attr_def = attr_defs.get(name)
        if attr_def is None:
            raise GraphError(
                f"node '{node_def.name}' ({node_def.op}): attribute '{name}' is not in the op's"
                " definition; the graph may come from a newer TensorFlow"
            )
        if attr_def.type == "type":
            attrs.setdefault(TypeAttr(name))
        elif attr_def.type == "list(type)":
            for i in range(len(value.list.type)):
                attrs.setdefault(TypeAttr(name, i))
    return NodeTypes(op_def, tuple(inputs), tuple(outputs), tuple(attrs))


def _shape_key(node_def: node_def_pb2.NodeDef) -> tuple:
    """What ``node_types`` depends on: the op, its attr names, list lengths and counts."""
    shape = []
    for name, value in sorted(node_def.attr.items()):
        kind = value.WhichOneof("value")
        shape.append((name, len(value.list.type) if kind == "list" else value.i if kind == "i" else None))
    return node_def.op, tuple(shape)


def dtype_of(node_def: node_def_pb2.NodeDef, attr: TypeAttr) -> int:
    """The vertex's current dtype (its fixed dtype for fixed vertices)."""
    if not attr.name:
        return attr.fixed
    value = node_def.attr.get(attr.name) if attr.name in node_def.attr else None
    if value is None:
        return types_pb2.DT_INVALID
    if attr.index < 0:
        return value.type
    types = value.list.type
    return types[attr.index] if attr.index < len(types) else types_pb2.DT_INVALID


@dataclass(frozen=True)
class TypeGraph:
    """Vertices and edges for colouring, over a node graph from ``graph_io``."""

    graph: nx.DiGraph                  # Vertex -> Vertex; edge attr "ports": [(out, in)]
    nodes: nx.MultiDiGraph             # the node graph it was built from
    types: dict[str, NodeTypes]        # node name -> port maps
    node_defs: dict[str, node_def_pb2.NodeDef]  # node name -> NodeDef in ``nodes`` (same objects)

    def node_def(self, name: str) -> node_def_pb2.NodeDef:
        return self.node_defs[name]

    def dtype(self, vertex: Vertex) -> int:
        return dtype_of(self.node_def(vertex.node), vertex.attr)

    def input_vertex(self, node: str, port: int) -> Vertex:
        return Vertex(node, self.types[node].inputs[port])

    def data_consumers(self, node: str, port: int) -> Iterator[tuple[str, int]]:
        """(consumer, input port) for every data edge out of ``node:port``."""
        for dst, keyed in self.nodes._succ[node].items():
            for data in keyed.values():
                if data["src_port"] == port:
                    yield dst, data["dst_port"]

    def data_producer(self, node: str, port: int) -> tuple[str, int] | None:
        for src, keyed in self.nodes._pred[node].items():
            for data in keyed.values():
                if data["dst_port"] == port and data["src_port"] >= 0:
                    return src, data["src_port"]
        return None


def build_type_graph(nodes: nx.MultiDiGraph) -> TypeGraph:
    """Builds the vertex graph; bad op references or port counts raise ``GraphError``."""
    functions = support.library_op_defs(nodes.graph["library"])
    types: dict[str, NodeTypes] = {}
    node_defs = {name: data["node_def"] for name, data in nodes.nodes(data=True)}
    graph = nx.DiGraph()
    edges: dict[tuple[Vertex, Vertex], list[tuple[int, int]]] = {}
    shared: dict[tuple, NodeTypes] = {}  # nodes with the same op and attr shape share port maps
    for name, node_def in node_defs.items():
        num_inputs = sum(1 for keyed in nodes._pred[name].values() for d in keyed.values() if d["src_port"] >= 0)
        op_def = support.resolve_op_def(node_def, functions)
        support.fill_default_attrs(node_def, op_def)  # the working copy; the caller's graph is untouched
        key = _shape_key(node_def)
        if key not in shared:
            shared[key] = node_types(node_def, op_def, num_inputs)
        elif len(shared[key].inputs) != num_inputs:
            node_types(node_def, shared[key].op_def, num_inputs)  # raises the port-count error
        types[name] = shared[key]
    graph.add_nodes_from(Vertex(name, attr) for name in node_defs for attr in types[name].attrs)
    for dst, node_def in node_defs.items():
        for src, keyed in nodes._pred[dst].items():
            outputs = types[src].outputs
            for data in keyed.values():
                out_port, in_port = data["src_port"], data["dst_port"]
                if out_port < 0:
                    continue
                if out_port >= len(outputs):
                    raise GraphError(
                        f"node '{dst}': input '{data['tensor']}' names output {out_port} of '{src}',"
                        f" which has {len(outputs)} output(s)"
                    )
                key = (Vertex(src, outputs[out_port]), Vertex(dst, types[dst].inputs[in_port]))
                edges.setdefault(key, []).append((out_port, in_port))
    graph.add_edges_from((u, v, {"ports": ports}) for (u, v), ports in edges.items())
    return TypeGraph(graph, nodes, types, node_defs)
