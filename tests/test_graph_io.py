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
    new_node_def,
    parse_tensor_name,
    take_graph_def,
    to_graph_def,
    to_networkx,
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


def test_take_graph_def_equals_to_graph_def_after_edits():
    """take_graph_def hands back the working copy with added nodes appended: same as to_graph_def."""
    graph_def = _graph_with_control_edges()
    graph = to_networkx(graph_def)
    insert_node(graph, node_def_pb2.NodeDef(name="a2", op="Identity"), "split", 0, [("cat", 0), ("cat", 2)])
    made_inside = new_node_def(graph)
    made_inside.MergeFrom(node_def_pb2.NodeDef(name="b2", op="Identity"))
    insert_node(graph, made_inside, "split", 1, [("y", 0)])
    expected = to_graph_def(graph)
    taken = take_graph_def(graph)
    assert taken.SerializeToString(deterministic=True) == expected.SerializeToString(deterministic=True)
    assert [n.name for n in taken.node][-2:] == ["a2", "b2"] and list(taken.node[-2].input) == ["split:0"]
    assert list(next(n for n in taken.node if n.name == "cat").input) == ["a2", "y", "a2", "cat/axis"]
    assert graph_def == _graph_with_control_edges()  # the caller's graph is untouched


def test_take_graph_def_leaves_out_a_made_node_never_inserted():
    graph = to_networkx(_graph_with_control_edges())
    new_node_def(graph).name = "stray"
    taken = take_graph_def(graph)
    assert "stray" not in [n.name for n in taken.node]
    assert taken.SerializeToString(deterministic=True) == to_graph_def(graph).SerializeToString(deterministic=True)


def test_insert_node_moves_inputs_and_edges_together():
    """The inserted node's edges and its readers' inputs agree, and the graph reads as a
    freshly built one: same edges, same ports, same spellings."""
    graph = to_networkx(_graph_with_control_edges())
    insert_node(graph, node_def_pb2.NodeDef(name="s1", op="Identity"), "split", 1, [("y", 0)])
    assert not graph.has_edge("split", "y") and graph.has_edge("split", "s1") and graph.has_edge("s1", "y")
    rebuilt = to_networkx(to_graph_def(graph))
    def edges(g):
        return sorted((u, v, k, d["src_port"], d["tensor"]) for u, v, k, d in g.edges(keys=True, data=True))
    assert edges(graph) == edges(rebuilt)
    assert list(graph.pred["cat"]) == list(rebuilt.pred["cat"])  # still split, y, cat/axis; "split" loses no key
    assert graph.nodes["s1"]["node_def"].input == ["split:1"] and graph.nodes["y"]["node_def"].input == ["s1", "^gate"]


def test_take_graph_def_copies_when_a_node_was_replaced():
    graph_def = _graph_with_control_edges()
    graph = to_networkx(graph_def)
    replacement = node_def_pb2.NodeDef()
    replacement.CopyFrom(graph.nodes["gate"]["node_def"])
    replacement.device = "/device:CPU:0"
    graph.nodes["gate"]["node_def"] = replacement
    taken = take_graph_def(graph)
    assert taken.SerializeToString(deterministic=True) == to_graph_def(graph).SerializeToString(deterministic=True)
    assert next(n for n in taken.node if n.name == "gate").device == "/device:CPU:0"


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
        to_networkx(graph_def)


def test_duplicate_node_name_is_rejected():
    graph_def = _graph_with_control_edges()
    graph_def.node.add().CopyFrom(graph_def.node[0])
    with pytest.raises(GraphError, match="duplicate node name 'x'"):
        to_networkx(graph_def)


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
