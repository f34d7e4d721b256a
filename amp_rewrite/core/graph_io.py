"""GraphDef ⇄ networkx, and the tensor-name grammar, in one place.

The networkx form is a ``MultiDiGraph`` keyed by node name, in GraphDef order. Each node
carries its ``NodeDef`` (a working copy). Each edge, keyed by its position in the
consumer's input list, carries

* ``src_port``: the producer's output port, or ``CONTROL`` for a ``^name`` input;
* ``dst_port``: that position (data inputs come first, so for a data edge it is also the
  consumer's input port);
* ``tensor``: the input string exactly as written (``"x"``, ``"x:0"``, ``"^x"``),

so that ``to_graph_def(to_networkx(g)) == g`` byte for byte. A NodeDef's ``input`` list
always reads the same as its in-edges: change edges only through ``insert_node``, which
keeps both in step. The NodeDefs live in one working GraphDef,
``graph.graph["graph_def"]``, that ``take_graph_def`` hands back without copying them.
"""
from __future__ import annotations

import operator
from typing import Iterable, NamedTuple

import networkx as nx
from tensorflow.core.framework import graph_pb2, node_def_pb2

from amp_rewrite.core.errors import GraphError

CONTROL = -1


class TensorRef(NamedTuple):
    """A parsed input string: ``node:port``, or ``^node`` (port ``CONTROL``)."""

    node: str
    port: int

    @property
    def is_control(self) -> bool:
        return self.port == CONTROL


def parse_tensor_name(tensor: str, *, consumer: str = "") -> TensorRef:
    """Parses ``"x"``, ``"x:1"`` or ``"^x"``; a malformed name raises ``GraphError``."""
    if tensor.startswith("^"):
        name, port = tensor[1:], CONTROL
    else:
        name, sep, port_text = tensor.rpartition(":")
        if not sep:
            name, port = tensor, 0
        elif port_text.isdigit():
            port = int(port_text)
        else:
            raise _malformed(tensor, consumer)
    if not name or name.startswith("^"):
        raise _malformed(tensor, consumer)
    return _new_tuple(TensorRef, (name, port))  # TensorRef(name, port) without its Python-level __new__


_new_tuple = tuple.__new__


def _malformed(tensor: str, consumer: str) -> GraphError:
    where = f"node '{consumer}': " if consumer else ""
    return GraphError(f"{where}malformed input '{tensor}': expected 'name', 'name:port' or '^name'")


def tensor_name(node: str, port: int) -> str:
    """The input string that names output ``port`` of ``node`` (``^node`` for control)."""
    return f"^{node}" if port == CONTROL else f"{node}:{port}"


def to_networkx(graph_def: graph_pb2.GraphDef) -> nx.MultiDiGraph:
    """Builds the node graph; raises ``GraphError`` on duplicate names or dangling inputs.

    Fills networkx's adjacency dicts the way ``add_node``/``add_edge`` do (one key dict
    shared by successor and predecessor maps), without their per-item checks: on a
    7,000-node graph those checks cost more than the rest of the pass's graph building.
    """
    working = graph_pb2.GraphDef()
    working.CopyFrom(graph_def)  # one copy of everything; the caller's graph stays untouched
    graph = nx.MultiDiGraph(
        versions=working.versions if working.HasField("versions") else None,
        library=working.library if working.HasField("library") else None,
        graph_def=working,
    )
    node_data, succ, pred = graph._node, graph._succ, graph._pred
    node_defs = working.node
    for node_def in node_defs:
        name = node_def.name
        node_data[name] = {"node_def": node_def}
        succ[name] = {}
        pred[name] = {}
    if len(node_data) != len(node_defs):
        seen: set[str] = set()
        duplicate = next(name for name in (node_def.name for node_def in node_defs) if name in seen or seen.add(name))
        node_data.clear()
        raise GraphError(f"duplicate node name '{duplicate}'; node names must be unique")
    for name, in_edges in pred.items():
        node_def = node_data[name]["node_def"]
        seen_control = False
        for position, tensor in enumerate(node_def.input[:]):  # a slice iterates twice as fast
            # Most inputs are "name" or "name:port": only the others go through the parser.
            if ":" not in tensor and tensor[:1] not in ("^", ""):
                producer, port = tensor, 0
            else:
                producer, _, port_text = tensor.rpartition(":")
                if port_text.isdigit() and producer and tensor[0] != "^":
                    port = int(port_text)
                else:
                    producer, port = parse_tensor_name(tensor, consumer=name)
            keyed = in_edges.get(producer)
            if keyed is None:
                out_edges = succ.get(producer)
                if out_edges is None:
                    raise GraphError(
                        f"node '{name}': input '{tensor}' names a node that is not in the graph;"
                        " fix or remove that input"
                    )
                keyed = out_edges[name] = in_edges[producer] = {}
            if port == CONTROL:
                seen_control = True
            elif seen_control:
                raise GraphError(
                    f"node '{name}': data input '{tensor}' follows a control input;"
                    " put control inputs ('^name') last"
                )
            keyed[position] = {"src_port": port, "dst_port": position, "tensor": tensor}
    return graph


def to_graph_def(graph: nx.MultiDiGraph) -> graph_pb2.GraphDef:
    """Inverse of ``to_networkx``: nodes in graph order, each with its inputs."""
    graph_def = graph_pb2.GraphDef()
    for field in ("versions", "library"):
        if graph.graph[field] is not None:
            getattr(graph_def, field).CopyFrom(graph.graph[field])
    graph_def.node.extend(data["node_def"] for _, data in graph.nodes(data=True))
    return graph_def


def take_graph_def(graph: nx.MultiDiGraph) -> graph_pb2.GraphDef:
    """``to_graph_def(graph)`` without copying every node: the working GraphDef itself, with
    the nodes added since ``to_networkx`` appended (those from ``new_node_def`` are there
    already). The graph must not be used afterwards.

    Falls back to ``to_graph_def`` when the graph's first nodes, versions or library are
    no longer the working GraphDef's own (a node was removed or replaced, or one from
    ``new_node_def`` never inserted, say).
    """
    working = graph.graph.pop("graph_def", None)
    node_defs = [data["node_def"] for data in graph._node.values()]
    if working is None or len(node_defs) < len(working.node) or any(
        map(operator.is_not, node_defs, working.node)
    ) or any(
        graph.graph[field] is not (getattr(working, field) if working.HasField(field) else None)
        for field in ("versions", "library")
    ):
        return to_graph_def(graph)
    working.node.extend(node_defs[len(working.node):])
    return working


def new_node_def(graph: nx.MultiDiGraph) -> node_def_pb2.NodeDef:
    """An empty NodeDef for ``insert_node``, made inside the working GraphDef so that
    ``take_graph_def`` hands it back without a copy."""
    working = graph.graph.get("graph_def")
    return working.node.add() if working is not None else node_def_pb2.NodeDef()


def insert_node(
    graph: nx.MultiDiGraph, node_def: node_def_pb2.NodeDef, producer: str, port: int,
    consumers: Iterable[tuple[str, int]],
) -> None:
    """Adds ``node_def`` (from ``new_node_def``, no inputs yet) fed by ``producer:port``,
    and moves each (consumer, input position) in ``consumers``, a data input that reads
    ``producer:port``, onto its output 0: how a Cast goes between a tensor and readers.

    Fills networkx's dicts as ``add_node``/``add_edge``/``remove_edge`` would, without
    their checks, and keeps every NodeDef's inputs reading the same as its edges.
    """
    name, node_data, succ, pred = node_def.name, graph._node, graph._succ, graph._pred
    assert name not in node_data, f"node '{name}' is already in the graph"
    tensor = tensor_name(producer, port)
    node_def.input.append(tensor)
    node_data[name] = {"node_def": node_def}
    keyed = succ[producer][name] = {0: {"src_port": port, "dst_port": 0, "tensor": tensor}}
    out_edges = succ[name] = {}
    pred[name] = {producer: keyed}
    for consumer, position in consumers:
        in_edges = pred[consumer]
        old = in_edges[producer]
        del old[position]
        if not old:
            del in_edges[producer], succ[producer][consumer]
        keyed = out_edges.get(consumer)
        if keyed is None:
            keyed = out_edges[consumer] = in_edges[name] = {}
        keyed[position] = {"src_port": 0, "dst_port": position, "tensor": name}
        node_data[consumer]["node_def"].input[position] = name
