"""GraphDef ⇄ the pass's working copy, the tensor-name grammar, and building NodeDefs, in one place.

``working_copy`` copies a GraphDef and indexes it for the pass (``WorkingGraph``): each
node's NodeDef by name in GraphDef order, its inputs parsed into ``TensorRef``s (data
inputs first, ``CONTROL`` for ``^name``) and, per node, the (consumer, input position) of
every data input that names it. ``take_graph_def`` hands the working GraphDef back without
copying a node; change edges only through ``insert_node``, which keeps NodeDef inputs and
indexes in step (it is the only way to add a node). Plain dicts and lists: a networkx
graph of the same is slower to build and to walk, for every node of every item
(``tools/compare_pass_speed.py`` measures the two).
``to_networkx`` gives the networkx view for analyses: a ``MultiDiGraph`` keyed by node
name, in GraphDef order, each node carrying its ``NodeDef``, each edge, keyed by its
position in the consumer's input list,

* ``src_port``: the producer's output port, or ``CONTROL`` for a ``^name`` input;
* ``dst_port``: that position (data inputs come first, so for a data edge it is also the
  consumer's input port);
* ``tensor``: the input string exactly as written (``"x"``, ``"x:0"``, ``"^x"``),

so that ``to_graph_def(to_networkx(g)) == g`` byte for byte. ``make_node_def`` is the one
NodeDef builder: attrs typed by the op's definition. What a node's op definition says of it
is read here too: an attr or its default (``attr_or_default``), the ports an argument
expands to (``arg_port_count``).
"""
from __future__ import annotations

import numbers
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Iterable, NamedTuple

import networkx as nx
from google.protobuf.message import Message
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2, op_def_pb2, tensor_pb2, \
    tensor_shape_pb2, types_pb2

from amp_rewrite.core import support
from amp_rewrite.errors import GraphError

CONTROL = -1
# In a Const's tensor_content: its values were left in the file it was read from
# (``calibration/frozen.py``). No valid tensor holds these bytes (17 of them: no whole number
# of any multi-byte element, and too few for a tensor large enough to be left), so reading
# them fails, never gives zeros as a tensor with no values would.
LEFT_IN_FILE = b"\x00left in its file"


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


def is_left_in_file(tensor: tensor_pb2.TensorProto) -> bool:
    """Whether ``tensor`` holds ``LEFT_IN_FILE`` in place of its values."""
    return tensor.tensor_content == LEFT_IN_FILE


def _malformed(tensor: str, consumer: str) -> GraphError:
    where = f"node '{consumer}': " if consumer else ""
    return GraphError(f"{where}malformed input '{tensor}': expected 'name', 'name:port' or '^name'")


def data_inputs(node_def: node_def_pb2.NodeDef) -> list[str]:
    """``node_def``'s data inputs as written: its input list without the ``^name`` control ones."""
    return [tensor for tensor in node_def.input if not tensor.startswith("^")]


def tensor_name(node: str, port: int) -> str:
    """The input string that names output ``port`` of ``node`` (``^node`` for control)."""
    return f"^{node}" if port == CONTROL else f"{node}:{port}"


def input_node(tensor: str) -> str:
    """The node (or function argument) an input string reads, in a GraphDef's grammar (``"x"``,
    ``"x:1"``, ``"^x"``) or a FunctionDef's (``"x:output:0"``): what comes before the first
    ``:``, as a node name holds none. Unchecked: ``parse_tensor_name`` checks a GraphDef's."""
    return tensor[1:].partition(":")[0] if tensor[:1] == "^" else tensor.partition(":")[0]


def every_node(graph_def: graph_pb2.GraphDef) -> Iterator[node_def_pb2.NodeDef]:
    """The NodeDefs of the main graph and of every library function, read from the protos (no body is built)."""
    yield from graph_def.node
    for function in graph_def.library.function:
        yield from function.node_def


def copy_graph_def(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef:
    """A copy of ``graph_def`` to change, so the caller's is never touched (STYLE §4)."""
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
    return copy


# --------------------------------------------------------------------------------------
# What an op definition says of a node


def attr_or_default(node_def: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef,
                    name: str) -> attr_value_pb2.AttrValue | None:
    """``node_def``'s attr ``name``, or ``op_def``'s default for it where the node lacks it
    (SavedModels strip default-valued attrs); None where it has neither."""
    if name in node_def.attr:
        return node_def.attr[name]
    return next((attr.default_value for attr in op_def.attr if attr.name == name and attr.HasField("default_value")),
                None)


def arg_port_count(
    node_def: node_def_pb2.NodeDef, op_def: op_def_pb2.OpDef, arg: op_def_pb2.OpDef.ArgDef
) -> int | None:
    """How many ports ``arg`` of ``op_def`` is on ``node_def``: one per type of its
    ``type_list_attr``, its ``number_attr``'s value, else one (``attr_or_default``). None
    where the attr that says is missing and has no default."""
    counted = arg.type_list_attr or arg.number_attr
    if not counted:
        return 1
    value = attr_or_default(node_def, op_def, counted)
    if value is None:
        return None
    return len(value.list.type) if arg.type_list_attr else value.i


class WorkingGraph:
    """The pass's working copy of one item: a copy of its GraphDef, the NodeDef of each node
    in it by name (graph order), each node's inputs parsed, and each node's data readers. Only
    ``insert_node`` changes edges, keeping a NodeDef's input list and both indexes in step;
    nodes are only added (by it), never removed."""

    __slots__ = ("graph_def", "node_defs", "inputs", "readers")

    def __init__(self, graph_def: graph_pb2.GraphDef, node_defs: dict[str, node_def_pb2.NodeDef],
                 inputs: dict[str, list[TensorRef]], readers: dict[str, list[tuple[str, int]]]) -> None:
        self.graph_def = graph_def  # the copy; take_graph_def hands it back
        self.node_defs = node_defs
        self.inputs = inputs    # node -> its inputs, data ones first, as NodeDef.input reads
        self.readers = readers  # node -> (consumer, input position) of every data input naming it, in graph order

    def data_readers(self, node: str, port: int) -> list[tuple[str, int]]:
        """(consumer, input position) of every data input reading ``node:port``."""
        inputs = self.inputs
        return [(dst, position) for dst, position in self.readers[node] if inputs[dst][position].port == port]


def working_copy(graph_def: graph_pb2.GraphDef) -> WorkingGraph:
    """Copies and indexes ``graph_def`` (the caller's stays untouched); raises ``GraphError``
    on duplicate names, dangling inputs, or a data input after a control one."""
    working = copy_graph_def(graph_def)  # one copy of everything
    node_defs: dict[str, node_def_pb2.NodeDef] = {}
    readers: dict[str, list[tuple[str, int]]] = {}
    for node_def in working.node:
        name = node_def.name
        node_defs[name] = node_def
        readers[name] = []
    if len(node_defs) != len(working.node):
        seen: set[str] = set()
        duplicate = next(name for name in (node_def.name for node_def in working.node) if name in seen or seen.add(name))
        raise GraphError(f"duplicate node name '{duplicate}'; node names must be unique")
    inputs: dict[str, list[TensorRef]] = {}
    new_ref = _new_tuple
    for name, node_def in node_defs.items():
        refs = inputs[name] = []
        seen_control = False
        for position, tensor in enumerate(node_def.input[:]):  # a slice (a list) iterates faster than the field
            # Most inputs are "name", "name:port" or "^name": only the others go through the parser.
            if ":" not in tensor and tensor[:1] not in ("^", ""):
                producer, port = tensor, 0
            elif tensor[:1] == "^" and tensor[1:2] not in ("^", ""):
                producer, port = tensor[1:], CONTROL
            else:
                producer, _, port_text = tensor.rpartition(":")
                if port_text.isdigit() and producer and tensor[0] != "^":
                    port = int(port_text)
                else:
                    producer, port = parse_tensor_name(tensor, consumer=name)
            producer_readers = readers.get(producer)
            if producer_readers is None:
                raise GraphError(
                    f"node '{name}': input '{tensor}' names a node that is not in the graph; fix or remove that input"
                )
            if port == CONTROL:
                seen_control = True
            elif seen_control:
                raise GraphError(
                    f"node '{name}': data input '{tensor}' follows a control input; put control inputs ('^name') last"
                )
            else:
                producer_readers.append((name, position))
            refs.append(new_ref(TensorRef, (producer, port)))
    return WorkingGraph(working, node_defs, inputs, readers)


def take_graph_def(graph: WorkingGraph) -> graph_pb2.GraphDef:
    """The working GraphDef itself, with the nodes ``insert_node`` added appended, without
    copying a node. The working graph must not be used afterwards."""
    return graph.graph_def


def insert_node(
    graph: WorkingGraph, template: node_def_pb2.NodeDef, name: str, producer: str, port: int,
    consumers: Sequence[tuple[str, int]], *, device: str = "",
) -> node_def_pb2.NodeDef:
    """Adds a node ``name`` on ``device``, a copy of ``template`` (op and attrs, from
    ``make_node_def``), fed by ``producer:port``, and moves each (consumer, input position)
    in ``consumers``, data inputs that read ``producer:port``, onto its output 0: how a Cast
    goes between a tensor and readers. Made inside the working GraphDef, so that
    ``take_graph_def`` hands it back without a copy; NodeDef inputs and indexes stay in step."""
    node_defs, inputs, readers = graph.node_defs, graph.inputs, graph.readers
    assert name not in node_defs, f"node '{name}' is already in the graph"
    node_def = graph.graph_def.node.add()
    node_def.CopyFrom(template)  # one copy instead of an attr map entry each
    node_def.name = name
    if device:
        node_def.device = device
    node_def.input.append(tensor_name(producer, port))
    node_defs[name] = node_def
    inputs[name] = [_new_tuple(TensorRef, (producer, port))]
    readers[name] = list(consumers)
    producer_readers = readers[producer]
    moved = consumers if len(consumers) < 8 else set(consumers)  # a short list is searched faster than hashed
    producer_readers[:] = [reader for reader in producer_readers if reader not in moved]
    producer_readers.append((name, 0))
    output = _new_tuple(TensorRef, (name, 0))
    for consumer, position in consumers:
        inputs[consumer][position] = output
        node_defs[consumer].input[position] = name
    return node_def


def to_networkx(graph_def: graph_pb2.GraphDef) -> nx.MultiDiGraph:
    """``graph_def`` as a networkx ``MultiDiGraph`` keyed by node name, in GraphDef order,
    for analyses that want networkx (the command's deny paths): nodes carry their
    ``node_def`` (a copy), edges ``src_port``, ``dst_port`` and ``tensor`` (module doc).
    Checked as ``working_copy`` checks."""
    working = working_copy(graph_def)
    copy = working.graph_def
    graph = nx.MultiDiGraph(versions=copy.versions if copy.HasField("versions") else None,
                            library=copy.library if copy.HasField("library") else None)
    for name, node_def in working.node_defs.items():
        graph.add_node(name, node_def=node_def)
    for name, refs in working.inputs.items():
        written = working.node_defs[name].input
        for position, (producer, port) in enumerate(refs):
            graph.add_edge(producer, name, key=position, src_port=port, dst_port=position, tensor=written[position])
    return graph


def to_graph_def(graph: nx.MultiDiGraph) -> graph_pb2.GraphDef:
    """Inverse of ``to_networkx``: nodes in graph order, each with its inputs."""
    graph_def = graph_pb2.GraphDef()
    for field in ("versions", "library"):
        if graph.graph[field] is not None:
            getattr(graph_def, field).CopyFrom(graph.graph[field])
    graph_def.node.extend(data["node_def"] for _, data in graph.nodes(data=True))
    return graph_def


# --------------------------------------------------------------------------------------
# Building nodes


def make_node_def(
    op: str, name: str, inputs: Iterable[str] = (), *, device: str = "",
    into: Any = None, functions: Mapping[str, op_def_pb2.OpDef] | None = None, **attrs: object,
) -> node_def_pb2.NodeDef:
    """The one way to build a NodeDef: ``name`` running ``op`` on ``inputs``, its attrs typed
    by the op's definition, so that an ``int`` attr (``N``, ``axis``) and a ``type`` attr
    (``T``, ``dtype``) cannot be confused, and an attr the definition lacks, or a value of
    the wrong kind, is a ``GraphError`` naming the node, op and attr.

    A value is what the attr's type takes: a ``DataType`` enum value (or ``tf.DType``) for
    ``type``, int, float, bool, str or bytes, a shape (dims, ``tf.TensorShape`` or the
    proto), a tensor (an array or ``TensorProto``), a function name, a sequence of those
    for ``list(...)``, or an ``AttrValue`` of that kind. Attrs named ``_...`` (TensorFlow's
    own, in no definition) take an ``AttrValue``, a bool or a string. ``into``: the
    repeated NodeDef field to create the node in (``graph_def.node``, a FunctionDef's
    ``node_def``), without a copy; None makes it alone. ``functions``: library signatures,
    for a node that calls one (``Program.op_defs``).
    """
    typed: dict[str, attr_value_pb2.AttrValue] = {}
    if attrs:
        op_def = support.resolve_op_def(node_def_pb2.NodeDef(name=name, op=op), functions or {})
        attr_defs = {attr.name: attr for attr in op_def.attr}
        for key, value in attrs.items():
            attr_def = attr_defs.get(key)
            where = f"node '{name}' ({op}): attribute '{key}'"
            if attr_def is None and not key.startswith("_"):
                raise GraphError(f"{where} is not in the op's definition (it has {', '.join(attr_defs) or 'none'})")
            typed[key] = _attr_value(attr_def.type if attr_def is not None else "", value, where)
    # Checked first, then made: a bad attr leaves ``into`` as it was.
    return (into.add if into is not None else node_def_pb2.NodeDef)(name=name, op=op, input=list(inputs),
                                                                  device=device, attr=typed)


# attr type -> (AttrValue field, what a Python value of it is, its name in errors)
_KINDS: dict[str, tuple[str, Any, str]] = {
    "type": ("type", lambda v: _datatype(v) is not None, "a DataType (e.g. types_pb2.DT_FLOAT) or tf.DType"),
    "int": ("i", lambda v: isinstance(v, numbers.Integral) and not isinstance(v, bool), "an int"),
    "float": ("f", lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), "a float"),
    "bool": ("b", lambda v: isinstance(v, bool), "a bool"),
    "string": ("s", lambda v: isinstance(v, (str, bytes)), "a str or bytes"),
    "shape": ("shape", lambda v: _shape(v) is not None, "a shape (dims, tf.TensorShape or TensorShapeProto)"),
    "tensor": ("tensor", lambda v: not isinstance(v, (str, bytes, Message)) or isinstance(v, tensor_pb2.TensorProto),
               "a tensor (an array or TensorProto)"),
    "func": ("func", lambda v: isinstance(v, (str, attr_value_pb2.NameAttrList)), "a function name or NameAttrList"),
}


def _attr_value(attr_type: str, given: object, where: str) -> attr_value_pb2.AttrValue:
    """``given`` as an AttrValue of ``attr_type`` ("" for an attr in no definition)."""
    value = attr_value_pb2.AttrValue()
    listed = attr_type.startswith("list(")
    kind = _KINDS.get(attr_type[len("list("):-1] if listed else attr_type)
    if isinstance(given, attr_value_pb2.AttrValue):
        field = given.WhichOneof("value")
        expected = "list" if listed else kind[0] if kind else field
        if field != expected:
            raise GraphError(f"{where} is of type {attr_type}, but the AttrValue given holds {field or 'nothing'}")
        value.CopyFrom(given)
    elif not attr_type:
        if not isinstance(given, (bool, str, bytes)):
            raise GraphError(f"{where} is in no op definition: give an AttrValue, a bool or a string")
        _put(value, "b" if isinstance(given, bool) else "s", given)
    elif kind is None:
        raise GraphError(f"{where} is of type {attr_type}: give an AttrValue")
    elif listed:
        field, fits, what = kind
        if isinstance(given, (str, bytes)) or not isinstance(given, Sequence) or not all(map(fits, given)):
            raise GraphError(f"{where} is of type {attr_type}: give a sequence of {what.removeprefix('a ')},"
                             f" not {given!r}")
        value.list.SetInParent()
        for item in given:
            _put(value.list, field, item)
    else:
        field, fits, what = kind
        if not fits(given):
            raise GraphError(f"{where} is of type {attr_type}: give {what}, not {given!r}")
        _put(value, field, given)
    return value


def _put(holder: Message, field: str, given: Any) -> None:
    """``given`` into ``field`` of an AttrValue, or appended to that field of its ``list``."""
    repeated = isinstance(holder, attr_value_pb2.AttrValue.ListValue)
    if field in ("shape", "tensor", "func"):
        proto = (_shape(given) if field == "shape" else _tensor(given) if field == "tensor"
                 else given if isinstance(given, attr_value_pb2.NameAttrList) else attr_value_pb2.NameAttrList(name=given))
        (getattr(holder, field).add() if repeated else getattr(holder, field)).CopyFrom(proto)
        return
    given = _datatype(given) if field == "type" else given.encode() if isinstance(given, str) else given
    if repeated:
        getattr(holder, field).append(given)
    else:
        setattr(holder, field, given)


def _datatype(given: object) -> int | None:
    """A valid DataType enum value from ``given`` (an int or anything with ``as_datatype_enum``), or None."""
    enum = getattr(given, "as_datatype_enum", given)
    if isinstance(enum, bool) or not isinstance(enum, numbers.Integral) or enum == types_pb2.DT_INVALID:
        return None
    return int(enum) if int(enum) in types_pb2.DataType.values() else None


def _shape(given: object) -> tensor_shape_pb2.TensorShapeProto | None:
    if isinstance(given, tensor_shape_pb2.TensorShapeProto):
        return given
    if hasattr(given, "as_proto"):  # tf.TensorShape
        return given.as_proto()
    if isinstance(given, Sequence) and not isinstance(given, (str, bytes)) and all(
            d is None or isinstance(d, numbers.Integral) and not isinstance(d, bool) for d in given):
        return tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=-1 if d is None else int(d)) for d in given])
    return None


def _tensor(given: object) -> tensor_pb2.TensorProto:
    if isinstance(given, tensor_pb2.TensorProto):
        return given
    import tensorflow as tf  # only to turn an array into a TensorProto, its public converter

    return tf.make_tensor_proto(given)
