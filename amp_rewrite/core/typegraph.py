"""The graph that colouring works on: (node, type attribute) vertices (spec §2.2).

A node such as ``FusedBatchNormV3`` has several independent dtypes (``T`` and ``U``), and
``IdentityN`` one per list element, so the unit of painting is not a node but a
*vertex*: a node together with one type attribute, one element of a ``list(type)``
attribute, or one fixed dtype of its op definition (e.g. an ``int32`` shape input).
An edge joins the producer's output vertex to the consumer's input vertex, once however
many tensors join them (the node graph has the ports).
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Iterable, NamedTuple, Sequence

import networkx as nx
from tensorflow.core.framework import (
    attr_value_pb2,
    node_def_pb2,
    op_def_pb2,
    types_pb2,
)

from amp_rewrite.core import support
from amp_rewrite.core.graph_io import WorkingGraph, arg_port_count
from amp_rewrite.errors import GraphError


QUANTIZED = frozenset(
    {types_pb2.DT_QINT8, types_pb2.DT_QUINT8, types_pb2.DT_QINT16, types_pb2.DT_QUINT16, types_pb2.DT_QINT32}
)


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

    @functools.cached_property
    def _attr_to_slot(self) -> dict[TypeAttr, int]:
        return {attr: slot for slot, attr in enumerate(self.attrs)}

    @functools.cached_property
    def input_slots(self) -> tuple[int, ...]:
        """Per data input port, the position of its attr in ``attrs``."""
        return tuple(map(self._attr_to_slot.__getitem__, self.inputs))

    @functools.cached_property
    def output_slots(self) -> tuple[int, ...]:
        """Per output port, the position of its attr in ``attrs``."""
        return tuple(map(self._attr_to_slot.__getitem__, self.outputs))


def _arg_type_attrs(
    node_def: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef, arg: op_def_pb2.OpDef.ArgDef
) -> list[TypeAttr]:
    """The type attribute of each port an op-def argument expands to (``node_def`` holds its
    defaults: the callers fill them in first)."""
    count = arg_port_count(node_def, op_def, arg)
    if arg.type_list_attr:
        if count is None:
            raise GraphError(
                f"node '{node_def.name}' ({node_def.op}): attribute '{arg.type_list_attr}' is missing"
            )
        return [TypeAttr(arg.type_list_attr, i) for i in range(count)]
    count = 1 if count is None else count  # no number attr: one port, and the port-count checks name the node
    if arg.type_attr:
        if arg.type_attr not in node_def.attr:
            raise GraphError(
                f"node '{node_def.name}' ({node_def.op}): type attribute '{arg.type_attr}' is missing"
            )
        return [TypeAttr(arg.type_attr)] * count
    return [TypeAttr(fixed=arg.type)] * count


def node_types(node_def: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef, num_data_inputs: int) -> NodeTypes:
    """Port → type-attribute maps for a node, validated against its op definition."""
    inputs = [a for arg in op_def.input_arg for a in _arg_type_attrs(node_def, op_def, arg)]
    if len(inputs) != num_data_inputs:
        raise _port_count_error(node_def, len(inputs))
    outputs = [a for arg in op_def.output_arg for a in _arg_type_attrs(node_def, op_def, arg)]
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


def _data_inputs(node_def: node_def_pb2.NodeDef) -> int:
    inputs = node_def.input  # data inputs first, then "^control" ones
    count = len(inputs)
    while count and inputs[count - 1].startswith("^"):
        count -= 1
    return count


def _port_count_error(node_def: node_def_pb2.NodeDef, expected: int) -> GraphError:
    return GraphError(
        f"node '{node_def.name}' ({node_def.op}): expected {expected} data input(s),"
        f" got {_data_inputs(node_def)}; fix the node's inputs"
    )


_REGISTERED_LAYOUTS: dict[tuple[str, tuple[str, ...]], _AttrLayout] = {}
_REGISTERED_NODE_TYPES: dict[tuple, NodeTypes] = {}


@dataclass(frozen=True)
class _AttrLayout:
    """What nodes of one op with one set of attr names share: the op definition, the
    defaults they lack, and the attrs whose values change their ports or vertices."""

    op_def: op_def_pb2.OpDef
    defaults: tuple[tuple[str, attr_value_pb2.AttrValue], ...]  # missing attrs with a default
    counted: tuple[tuple[str, bool], ...]  # present after defaults: (name, is a type list)
    labelled: bool  # has a "_kernel" label: its own kernels, not its op's usual ones


def _attr_layout(
    node_def: node_def_pb2.NodeDef, names: frozenset[str], functions: Mapping[str, op_def_pb2.OpDef]
) -> _AttrLayout:
    op_def = support.resolve_op_def(node_def, functions)
    defaults = tuple((name, value) for name, value in support.default_attrs(node_def.op, op_def) if name not in names)
    filled = names.union(name for name, _ in defaults)
    counted = tuple((name, is_list) for name, is_list in _counted_attrs(op_def) if name in filled)
    return _AttrLayout(op_def, defaults, counted, "_kernel" in names)


def _counted_attrs(op_def: op_def_pb2.OpDef) -> tuple[tuple[str, bool], ...]:
    """The attrs whose value changes a node's ports or vertices: (name, is a type list)."""
    if support.registered_op_def(op_def.name) is op_def:
        return _registered_counted_attrs(op_def.name)
    return _counted_attrs_of(op_def)


def _counted_attrs_of(op_def: op_def_pb2.OpDef) -> tuple[tuple[str, bool], ...]:
    counted = {a.name: a.type == "list(type)" for a in op_def.attr if a.type == "list(type)"}
    for arg in list(op_def.input_arg) + list(op_def.output_arg):
        if arg.number_attr:
            counted.setdefault(arg.number_attr, False)
    return tuple(sorted(counted.items()))


@functools.lru_cache(maxsize=None)
def _registered_counted_attrs(op: str) -> tuple[tuple[str, bool], ...]:
    return _counted_attrs_of(support.registered_op_def(op))


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


def output_dtypes(node_def: node_def_pb2.NodeDef, functions: Mapping[str, op_def_pb2.OpDef]) -> list[int]:
    """The dtype of each output port as the type graph reads it (``_arg_type_attrs``), the
    attrs the node lacks taking their op-def defaults as ``build_type_graph`` fills them;
    ``node_def`` is not modified. [] where a type attribute is missing altogether."""
    op_def = support.resolve_op_def(node_def, functions)
    defaults = [(name, value) for name, value in support.default_attrs(node_def.op, op_def) if name not in node_def.attr]
    if defaults:
        filled = node_def_pb2.NodeDef(name=node_def.name, op=node_def.op)
        for name, value in [*node_def.attr.items(), *defaults]:
            filled.attr[name].CopyFrom(value)
        node_def = filled
    try:
        return [dtype_of(node_def, attr)
                for arg in op_def.output_arg for attr in _arg_type_attrs(node_def, op_def, arg)]
    except GraphError:
        return []


@dataclass(frozen=True)
class TypeGraph:
    """Vertices and edges for colouring, over a node graph from ``graph_io``.

    ``succ`` and ``pred`` are the vertex graph: every vertex, in graph order, with the
    vertices its tensors reach and come from, each once, in the order first met (ports:
    see ``nodes``). Lists, not a networkx graph: the passes only walk them, and building a
    networkx graph of the same would be work no pass needs; ``graph`` makes one."""

    succ: dict[Vertex, list[Vertex]]
    pred: dict[Vertex, list[Vertex]]
    nodes: WorkingGraph                # the working copy it was built from
    types: dict[str, NodeTypes]        # node name -> port maps
    node_defs: dict[str, node_def_pb2.NodeDef]  # ``nodes.node_defs``: node name -> NodeDef
    # node name -> its vertices in ``NodeTypes.attrs`` order, None for those not in ``graph``
    # (``node_vertices`` makes them): most are never asked for.
    vertices: dict[str, list[Vertex | None]]
    ops: dict[str, str]                         # node name -> op
    labelled: frozenset[str]                    # nodes with a "_kernel" label attr
    quantized: frozenset[str]                   # nodes with a quantized dtype (never converted, spec §2.3 pass 6)
    float32: Mapping[Vertex, None]              # the vertices that were float32 when built, in graph order
    op_defs: Mapping[str, op_def_pb2.OpDef]     # library function name -> signature: the ops that call one

    @property
    def graph(self) -> nx.DiGraph:
        """The vertex graph as a networkx ``DiGraph``, made on each call (tests, tools)."""
        graph = nx.DiGraph()
        graph.add_nodes_from(self.succ)
        graph.add_edges_from((u, v) for u, vs in self.succ.items() for v in vs)
        return graph

    def node_def(self, name: str) -> node_def_pb2.NodeDef:
        return self.node_defs[name]

    def dtype(self, vertex: Vertex) -> int:
        return dtype_of(self.node_def(vertex.node), vertex.attr)

    def node_vertices(self, node: str) -> tuple[Vertex, ...]:
        """Every vertex of ``node``, in ``NodeTypes.attrs`` order."""
        return tuple(self._vertex(node, slot) for slot in range(len(self.vertices[node])))

    def input_vertex(self, node: str, port: int) -> Vertex:
        return self._vertex(node, self.types[node].input_slots[port])

    def _vertex(self, node: str, slot: int) -> Vertex:
        vertex = self.vertices[node][slot]
        return vertex if vertex is not None else Vertex(node, self.types[node].attrs[slot])

    def data_consumers(self, node: str, port: int) -> list[tuple[str, int]]:
        """(consumer, input port) for every data edge out of ``node:port``."""
        return self.nodes.data_readers(node, port)

    def reads_ref_variable(self, node: str) -> bool:
        """Identity of a ref Variable, or Enter chains over one (spec §2.7, PR #31178)."""
        op = self.ops[node]
        if op not in ("Identity", "Enter"):
            return False
        producer = self.data_producer(node, 0)
        if producer is None or producer[0] not in self.ops:
            return False  # no input, or a Cast the final pass inserted (never on a ref edge)
        source = producer[0]
        if op == "Identity":
            return self.ops[source] in ("Variable", "VariableV2")
        return self.reads_ref_variable(source)

    def data_producer(self, node: str, port: int) -> tuple[str, int] | None:
        inputs = self.nodes.inputs[node]
        return tuple(inputs[port]) if port < len(inputs) and inputs[port].port >= 0 else None


def add_implicit_edges(types: TypeGraph, edges: Iterable[tuple[Vertex, Vertex]]) -> None:
    """Adds edges no tensor makes, such as TensorList writer → reader element edges (spec
    §2.2, §2.5), between vertices of ``types``; an edge already there stays as it is."""
    for source, destination in edges:
        if destination not in types.succ[source]:
            types.succ[source].append(destination)
            types.pred[destination].append(source)


def build_type_graph(
    nodes: WorkingGraph, dtypes: frozenset[int] | None = None, op_defs: Mapping[str, op_def_pb2.OpDef] | None = None
) -> TypeGraph:
    """Builds the vertex graph; bad op references or port counts raise ``GraphError``.

    ``dtypes``: the dtypes whose vertices (and the edges between them) make up ``graph``;
    None for all. An edge joins two vertices of one dtype, its tensor's, so leaving a
    dtype out leaves out whole components: colouring, which paints only float32 vertices
    and follows TensorList handles (variant), never reaches them. ``float32`` lists the
    float32 vertices of ``graph``, so ``dtypes`` should hold DT_FLOAT. ``op_defs``: the
    signatures of the library functions the nodes may call (``Program.op_defs``); None
    reads them from the node graph's own library.

    Two steps: each node's port map and vertices (filling in the working copy's missing
    default attrs first; the caller's graph is untouched), then the edges between vertices.
    """
    functions = support.library_op_defs(nodes.graph_def.library) if op_defs is None else op_defs
    node_defs = nodes.node_defs  # casts join it later: nothing reads it for every node after they do
    succ: dict[Vertex, list[Vertex]] = {}
    pred: dict[Vertex, list[Vertex]] = {}
    found = _add_vertices(succ, pred, node_defs, functions, dtypes)
    _add_edges(succ, pred, nodes, found.types, found.vertices)
    return TypeGraph(succ, pred, nodes, found.types, node_defs, found.vertices, found.ops, frozenset(found.labelled),
                     frozenset(found.quantized), found.float32, functions)


class _Vertices(NamedTuple):
    """What ``_add_vertices`` found: ``TypeGraph``'s fields of the same names."""

    types: dict[str, NodeTypes]
    vertices: dict[str, list[Vertex | None]]
    ops: dict[str, str]
    labelled: set[str]
    quantized: set[str]
    float32: dict[Vertex, None]


def _add_vertices(
    succ: dict[Vertex, list[Vertex]], pred: dict[Vertex, list[Vertex]], node_defs: Mapping[str, node_def_pb2.NodeDef],
    functions: Mapping[str, op_def_pb2.OpDef], dtypes: frozenset[int] | None,
) -> _Vertices:
    """Each node's port map and its vertices of ``dtypes`` (all for None), each added to ``succ``
    and ``pred`` with no edges yet. Nodes of one op and
    attr names share a layout, and of equal counts (an ``AddN``'s ``N``) a port map: for any
    graph when every op is a registered one (no library functions), so kept across graphs."""
    found = _Vertices({}, {}, {}, set(), set(), {})
    types, node_vertices, ops, labelled, quantized, float32 = found
    layouts: dict[tuple[str, tuple[str, ...]], _AttrLayout] = {} if functions else _REGISTERED_LAYOUTS
    shared: dict[tuple, NodeTypes] = {} if functions else _REGISTERED_NODE_TYPES
    new_vertex = tuple.__new__
    keep_all, dt_float, dt_invalid = dtypes is None, types_pb2.DT_FLOAT, types_pb2.DT_INVALID
    for name, node_def in node_defs.items():
        attrs = node_def.attr
        op = ops[name] = node_def.op
        layout_key = (op, tuple(attrs))  # a tuple is cheaper to make than a frozenset; its order may vary
        layout = layouts.get(layout_key)
        if layout is None:
            layout = layouts[layout_key] = _attr_layout(node_def, frozenset(layout_key[1]), functions)
        if layout.labelled:
            labelled.add(name)
        for attr_name, default in layout.defaults:
            attrs[attr_name].CopyFrom(default)
        key = (layout_key, tuple(
            len(attrs[attr_name].list.type) if is_list else attrs[attr_name].i for attr_name, is_list in layout.counted
        )) if layout.counted else layout_key
        node_types_ = shared.get(key)
        if node_types_ is None:  # the other nodes' port counts are checked with their edges
            node_types_ = shared[key] = node_types(node_def, layout.op_def, _data_inputs(node_def))
        types[name] = node_types_
        vertices: list[Vertex | None] = []
        for attr in node_types_.attrs:
            attr_name, index, dtype = attr  # dtype_of, inlined: it runs once per vertex
            if attr_name:
                value = attrs.get(attr_name)
                if value is None:
                    dtype = dt_invalid
                elif index < 0:
                    dtype = value.type
                else:
                    listed = value.list.type
                    dtype = listed[index] if index < len(listed) else dt_invalid
            if dtype in QUANTIZED:
                quantized.add(name)
            if keep_all or dtype in dtypes:
                vertex = new_vertex(Vertex, (name, attr))
                succ[vertex] = []
                pred[vertex] = []
                if dtype == dt_float:
                    float32[vertex] = None
                vertices.append(vertex)
            else:
                vertices.append(None)
        node_vertices[name] = vertices
    return found


def _add_edges(
    succ: dict[Vertex, list[Vertex]], pred: dict[Vertex, list[Vertex]], nodes: WorkingGraph,
    types: Mapping[str, NodeTypes], node_vertices: Mapping[str, list[Vertex | None]],
) -> None:
    """An edge in ``succ`` and ``pred`` for every data edge of ``nodes`` between two vertices, once however
    many tensors join them; every node's data inputs are counted against its port map.

    A node's in-edges go in by producer, producers in the order of their first input (as the
    node graph lists them): which predecessor a vertex lists first decides walk orders and
    so which root a reason names. Only a node with three inputs or more can read a producer
    again after another one."""
    node_defs = nodes.node_defs
    for dst, refs in nodes.inputs.items():
        dst_vertices, dst_slots = node_vertices[dst], types[dst].input_slots
        data_inputs = 0
        seen: set[tuple[Vertex, Vertex]] | None = set() if len(refs) > 16 else None
        for position in _by_producer(refs) if len(refs) > 2 else range(len(refs)):
            src, out_port = refs[position]
            if out_port < 0:
                continue
            data_inputs += 1
            src_slots = types[src].output_slots
            if out_port >= len(src_slots):
                raise GraphError(
                    f"node '{dst}': input '{node_defs[dst].input[position]}' names output {out_port} of '{src}',"
                    f" which has {len(src_slots)} output(s)"
                )
            try:
                v = dst_vertices[dst_slots[position]]
            except IndexError:  # more data inputs than the op has
                raise _port_count_error(node_defs[dst], len(dst_slots)) from None
            u = node_vertices[src][src_slots[out_port]]
            if u is None or v is None:
                continue
            # A second tensor between u and v adds nothing; v's predecessors so far all come
            # from this node's inputs, so a short list is scanned, a long one's pairs kept.
            if seen is None:
                if u in pred[v]:
                    continue
            elif (u, v) in seen:
                continue
            else:
                seen.add((u, v))
            pred[v].append(u)
            succ[u].append(v)
        if data_inputs != len(dst_slots):
            raise _port_count_error(node_defs[dst], len(dst_slots))


def _by_producer(refs: Sequence[tuple[str, int]]) -> list[int]:
    """Input positions grouped by producer, producers in the order of their first input."""
    first: dict[str, int] = {}
    for position, (producer, _) in enumerate(refs):
        first.setdefault(producer, position)
    return sorted(range(len(refs)), key=lambda position: first[refs[position][0]])
