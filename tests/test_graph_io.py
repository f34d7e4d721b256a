"""GraphDef ⇄ networkx and FunctionDef ⇄ body round trips, and the tensor-name grammar (graph_io is the only parser)."""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2, node_def_pb2, types_pb2

from amp_rewrite import GraphError
from amp_rewrite.core import functions
from amp_rewrite.core.program import MAIN_GRAPH, program_of
from amp_rewrite.core.graph_io import (
    CONTROL,
    TensorRef,
    insert_node,
    make_node_def,
    parse_tensor_name,
    take_graph_def,
    to_graph_def,
    to_networkx,
    working_copy,
)


def _graph_with_control_edges() -> graph_pb2.GraphDef:
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 3], name="x")
        a, b = tf.split(x, [1, 2], axis=1, name="split")
        gate = tf.constant(0.0, name="gate")
        with tf.control_dependencies([gate.op]):
            y = tf.identity(b, name="y")
        tf.concat([a, y, a], axis=1, name="cat")
    graph_def = graph.as_graph_def()
    graph_def.node[-1].input[0] = "split:0"  # an explicit ':0' must survive
    return graph_def


def test_round_trip_is_byte_identical():
    """to_graph_def(to_networkx(g)) == g: node order, input spelling, control inputs, versions."""
    graph_def = _graph_with_control_edges()
    round_tripped = to_graph_def(to_networkx(graph_def))
    assert round_tripped == graph_def
    assert round_tripped.SerializeToString(deterministic=True) == graph_def.SerializeToString(deterministic=True)


def _fresh(graph_def: graph_pb2.GraphDef) -> dict[str, tuple]:
    """Each node's parsed inputs and readers, as ``working_copy`` indexes ``graph_def`` anew."""
    fresh = working_copy(graph_def)
    return {name: (fresh.inputs[name], fresh.readers[name]) for name in fresh.node_defs}


_IDENTITY = node_def_pb2.NodeDef(op="Identity")


def test_take_graph_def_hands_back_the_working_copy_with_added_nodes_appended():
    """take_graph_def returns the working GraphDef itself (no node copied), the inserted nodes
    last, each on its device, each reader reading them; the caller's graph is untouched."""
    graph_def = _graph_with_control_edges()
    graph = working_copy(graph_def)
    first = insert_node(graph, _IDENTITY, "a2", "split", 0, [("cat", 0), ("cat", 2)], device="/device:CPU:0")
    insert_node(graph, _IDENTITY, "b2", "split", 1, [("y", 0)])
    taken = take_graph_def(graph)
    assert taken is graph.graph_def and taken.node[-2] == first and first.device == "/device:CPU:0"
    assert [n.name for n in taken.node][-2:] == ["a2", "b2"] and list(taken.node[-2].input) == ["split:0"]
    assert [n.op for n in taken.node][-2:] == ["Identity", "Identity"] and _IDENTITY.name == ""
    assert list(next(n for n in taken.node if n.name == "cat").input) == ["a2", "y", "a2", "cat/axis"]
    assert graph_def == _graph_with_control_edges()  # the caller's graph is untouched


def test_insert_node_moves_inputs_and_indexes_together():
    """After an insert, the working copy's indexes read as those of a fresh working copy of
    its GraphDef: same inputs, same ports, same readers in the same order."""
    graph = working_copy(_graph_with_control_edges())
    insert_node(graph, _IDENTITY, "s1", "split", 1, [("y", 0)])
    assert graph.data_readers("split", 1) == [("s1", 0)] and graph.data_readers("s1", 0) == [("y", 0)]
    assert list(graph.node_defs["s1"].input) == ["split:1"] and list(graph.node_defs["y"].input) == ["s1", "^gate"]
    assert {name: (graph.inputs[name], graph.readers[name]) for name in graph.node_defs} == _fresh(graph.graph_def)
    insert_node(graph, _IDENTITY, "s0", "split", 0, [("cat", 2)])  # one of two readers of split:0
    assert graph.data_readers("split", 0) == [("cat", 0), ("s0", 0)]
    assert {name: (graph.inputs[name], graph.readers[name]) for name in graph.node_defs} == _fresh(graph.graph_def)


def test_inputs_and_readers_carry_ports_and_control_inputs():
    graph = working_copy(_graph_with_control_edges())
    assert graph.inputs["cat"] == [("split", 0), ("y", 0), ("split", 0), ("cat/axis", 0)]
    assert graph.inputs["y"] == [("split", 1), ("gate", CONTROL)]
    assert graph.readers["split"] == [("y", 0), ("cat", 0), ("cat", 2)]
    assert graph.readers["gate"] == []  # a control input reads no tensor
    assert graph.data_readers("split", 0) == [("cat", 0), ("cat", 2)]


def test_edges_carry_ports_and_control_flag():
    graph = to_networkx(_graph_with_control_edges())
    cat_inputs = sorted((d["dst_port"], u, d["src_port"]) for u, _, d in graph.in_edges("cat", data=True))
    assert cat_inputs == [(0, "split", 0), (1, "y", 0), (2, "split", 0), (3, "cat/axis", 0)]
    y_inputs = {(u, d["src_port"]) for u, _, d in graph.in_edges("y", data=True)}
    assert y_inputs == {("split", 1), ("gate", CONTROL)}


@pytest.mark.parametrize(
    "text, expected",
    [("a", TensorRef("a", 0)), ("a:3", TensorRef("a", 3)), ("^a", TensorRef("a", CONTROL)),
     ("scope/a:b:1", TensorRef("scope/a:b", 1))],
)
def test_parse_tensor_name(text, expected):
    assert parse_tensor_name(text) == expected


@pytest.mark.parametrize("text", ["", "a:", "a:x", ":0", "^", "^^a", "a:-1"])
def test_malformed_tensor_names_are_rejected(text):
    with pytest.raises(GraphError, match="malformed input"):
        parse_tensor_name(text, consumer="n")


def test_dangling_input_names_the_node():
    graph_def = _graph_with_control_edges()
    graph_def.node[-1].input[1] = "ghost:0"
    with pytest.raises(GraphError, match="node 'cat': input 'ghost:0' names a node that is not in the graph"):
        working_copy(graph_def)


def test_duplicate_node_name_is_rejected():
    graph_def = _graph_with_control_edges()
    graph_def.node.add().CopyFrom(graph_def.node[0])
    with pytest.raises(GraphError, match="duplicate node name 'x'"):
        working_copy(graph_def)


def _library_graph_def() -> graph_pb2.GraphDef:
    """A main graph calling ``outer``, which calls ``inner`` (tf.function, so the bodies use
    FunctionDef's ``node:output_arg:index`` names): list outputs (Unpack, Split), a control
    dependency, two outputs, and an argument read directly by a return value."""

    @tf.function(autograph=False)
    def inner(v):
        parts = tf.unstack(v, num=2, axis=1)
        return parts[1] * 2.0, parts[0]

    @tf.function(autograph=False)
    def outer(x, w):
        a, b = tf.split(x, [1, 1], axis=1)
        with tf.control_dependencies([a]):
            c = tf.identity(b)
        d, e = inner(tf.concat([c, a], axis=1))
        return tf.matmul(d[:, None], w[:1]), e, w

    @tf.function(autograph=False)
    def main(x, w):
        return outer(x, w)

    spec = (tf.TensorSpec([3, 2], tf.float32), tf.TensorSpec([2, 4], tf.float32))
    return main.get_concrete_function(*spec).graph.as_graph_def()


def test_function_body_round_trip_is_exact():
    """to_function_def(body_graph_def(f)) == f for every library function: output-arg names,
    control inputs, ``ret`` and node order survive the body's ``node:port`` spelling."""
    graph_def = _library_graph_def()
    program = program_of(graph_def)
    assert len(program.library) >= 2  # outer and inner
    for name, function in program.library.items():
        body = program.item(name)
        assert [n.op for n in body.node].count("_Arg") == len(function.signature.input_arg)
        assert all(":" not in t or t.count(":") == 1 for n in body.node for t in n.input)  # node:port only
        round_tripped = functions.to_function_def(body, function, program.op_defs)
        assert round_tripped == function, name
        assert program.item(name) is body  # built once
    assert program.item(MAIN_GRAPH) is graph_def
    assert [graph_def.library.function[program.positions[name]].signature.name for name in program.library] == list(
        program.library
    )


# --- make_node_def: the one NodeDef builder ------------------------------------------------


def test_make_node_def_types_each_attr_from_the_op_definition():
    """``N`` is an int attr and ``T``/``Tidx`` type attrs: the same Python int lands in the
    field its definition names, and the node TensorFlow builds from the same call agrees."""
    graph_def = graph_pb2.GraphDef()
    node = make_node_def("ConcatV2", "concat", ["a", "b", "axis"], device="/device:CPU:0", into=graph_def.node,
                         N=2, T=types_pb2.DT_HALF, Tidx=tf.int32)
    assert graph_def.node[0] == node
    assert (node.attr["N"].WhichOneof("value"), node.attr["N"].i) == ("i", 2)
    assert (node.attr["T"].WhichOneof("value"), node.attr["T"].type) == ("type", types_pb2.DT_HALF)
    assert node.attr["Tidx"].type == types_pb2.DT_INT32
    assert list(node.input) == ["a", "b", "axis"] and node.device == "/device:CPU:0"
    listed = make_node_def("IdentityN", "n", ["a", "b"], T=[types_pb2.DT_FLOAT, tf.bfloat16])
    assert list(listed.attr["T"].list.type) == [types_pb2.DT_FLOAT, types_pb2.DT_BFLOAT16]
    const = make_node_def("Const", "c", dtype=types_pb2.DT_FLOAT, value=np.arange(3, dtype=np.float32))
    assert tf.make_ndarray(const.attr["value"].tensor).tolist() == [0.0, 1.0, 2.0]
    placeholder = make_node_def("Placeholder", "p", dtype=types_pb2.DT_FLOAT, shape=[None, 3], _note=b"kept")
    assert [d.size for d in placeholder.attr["shape"].shape.dim] == [-1, 3]
    assert placeholder.attr["_note"].s == b"kept"


@pytest.mark.parametrize(
    "attrs, message",
    [
        ({"N": 2, "T": 2.5}, "node 'bad' \\(AddN\\): attribute 'T' is of type type: give a DataType"),
        ({"N": types_pb2.DT_FLOAT * 1.0, "T": types_pb2.DT_FLOAT}, "attribute 'N' is of type int: give an int"),
        ({"N": True, "T": types_pb2.DT_FLOAT}, "attribute 'N' is of type int: give an int, not True"),
        ({"N": 2, "T": 5000}, "attribute 'T' is of type type: give a DataType"),
        ({"N": 2, "T": types_pb2.DT_FLOAT, "axis": 0}, "attribute 'axis' is not in the op's definition \\(it has N, T\\)"),
        ({"N": 2, "T": attr_value_pb2.AttrValue(i=1)}, "attribute 'T' is of type type, but the AttrValue given holds i"),
        ({"N": 2, "T": types_pb2.DT_FLOAT, "_x": 3}, "attribute '_x' is in no op definition"),
    ],
)
def test_make_node_def_refuses_a_mistyped_or_unknown_attr_and_adds_nothing(attrs, message):
    """The builder the float8 step, the casts and calibration share types attrs by the op's
    definition: a value of the wrong kind, or an attr the op lacks, is one GraphError naming
    node, op and attr, and the graph it was to go into is unchanged."""
    graph_def = graph_pb2.GraphDef()
    with pytest.raises(GraphError, match=message):
        make_node_def("AddN", "bad", ["a", "b"], into=graph_def.node, **attrs)
    assert len(graph_def.node) == 0


def test_make_node_def_names_an_op_tensorflow_does_not_know():
    with pytest.raises(GraphError, match="node 'n': op 'NoSuchOp' is neither registered"):
        make_node_def("NoSuchOp", "n", T=types_pb2.DT_FLOAT)
