"""Library functions and control flow, checked against live grappler in every function body.

grappler's meta-optimizer runs AMP on the main graph and, separately, on every reachable
library function body (spec §1.2, §2.7): While/If bodies and conds, PartitionedCall
callees, gradient functions. ``check_against_grappler`` compares each of those bodies
vertex by vertex and cast by cast (``Agreement.functions``) and checks that our library
keeps every signature, so a test here passes only at 100% agreement everywhere.

Covered: spec §5.1 #17 (a TensorList crossing a function call), the §5.2 Python cases
built on v1 control flow (Enter/Merge/Switch/Exit/NextIteration in plain graphs),
Keras 3 LSTM/GRU training steps (functional While loops and their gradients), control
flow v2 and nested calls in ``tf.function`` (with numerics on CPU), bfloat16's clear
While/StatelessWhile, and calls that cannot be rewritten (GraphError).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import pytest
import tensorflow as tf
import deviations
from conftest import (
    TARGETS,
    TARGET_TO_DTYPE,
    Rewrites,
    assert_colours,
    assert_model_close_to_float32,
    assert_numerics_match,
    check_against_grappler,
    graph_def_of,
    rewrite_both,
    run_on_cpu,
)
from tensorflow.core.framework import function_pb2, node_def_pb2, types_pb2
from tensorflow.core.framework.graph_pb2 import GraphDef
from tensorflow.python.framework import function as tf1_function

import amp_rewrite
import recorded_grappler
from amp_rewrite.core.functions import reachable_functions
from amp_rewrite.core.target import lookup_target
from amp_rewrite.testing.loops import build_loop_graph
from amp_rewrite.testing.models import run_model_graph
from amp_rewrite.testing.reference import compare_rewrites, function_body, vertex_dtypes

raw = tf.raw_ops
FLOAT = tf.float32


@pytest.fixture
def control_flow_v1() -> Iterator[None]:
    """Build v1 loops (Enter/Merge/Switch/Exit/NextIteration) as TF1 did; v2 is restored after."""
    was_v2 = tf.compat.v1.control_flow_v2_enabled()
    tf.compat.v1.disable_control_flow_v2()
    try:
        yield
    finally:
        if was_v2:
            tf.compat.v1.enable_control_flow_v2()


def _function_named(graph_def: GraphDef, prefix: str) -> str:
    """The one library function whose (generated) name starts with ``prefix``."""
    names = [f.signature.name for f in graph_def.library.function if f.signature.name.startswith(prefix)]
    assert len(names) == 1, f"expected one function named {prefix}*, library has {names}"
    return names[0]


def _assert_functions_compared(rewrites: Rewrites, *prefixes: str) -> None:
    """Each named function was judged (so the 100% agreement covers it) and agrees."""
    if rewrites.agreement is None:
        return  # no grappler answer on this release: our own assertions stand alone
    compared = {f.name: f for f in rewrites.agreement.functions}
    for prefix in prefixes:
        name = _function_named(rewrites.original, prefix)
        assert name in compared, f"{name} was not compared with grappler; compared: {sorted(compared)}"
        assert compared[name].judged > 0 and compared[name].ok, compared[name].explain()


def _assert_signatures_kept(rewrites: Rewrites) -> None:
    """Every function keeps its signature and output names: every caller stays valid."""
    before = {f.signature.name: f for f in rewrites.original.library.function}
    after = {f.signature.name: f for f in rewrites.ours.library.function}
    assert set(after) == set(before)
    for name, function in before.items():
        assert after[name].signature == function.signature, name
        assert set(after[name].ret) == set(function.ret), name
    assert rewrites.agreement is None or rewrites.agreement.library_mismatches == ()


# --------------------------------------------------------------------------------------
# §5.1 #17: a TensorList cluster that crosses a function call


def _func1() -> function_pb2.FunctionDef:
    """Func1(ihandle: variant, x: float) -> (ohandle: variant, y: float): push x, pop it back."""
    func = function_pb2.FunctionDef()
    func.signature.name = "Func1"
    func.signature.input_arg.add(name="ihandle", type=types_pb2.DT_VARIANT)
    func.signature.input_arg.add(name="x", type=types_pb2.DT_FLOAT)
    func.signature.output_arg.add(name="ohandle", type=types_pb2.DT_VARIANT)
    func.signature.output_arg.add(name="y", type=types_pb2.DT_FLOAT)
    shape = func.node_def.add(name="shape", op="Const")
    shape.attr["dtype"].type = types_pb2.DT_INT32
    shape.attr["value"].tensor.CopyFrom(tf.make_tensor_proto([32, 32], dtype=tf.int32))
    push = func.node_def.add(name="tl1w3", op="TensorListPushBack", input=["ihandle", "x"])
    push.attr["element_dtype"].type = types_pb2.DT_FLOAT
    pop = func.node_def.add(
        name="tl1r1", op="TensorListPopBack", input=["tl1w3:output_handle:0", "shape:output:0"]
    )
    pop.attr["element_dtype"].type = types_pb2.DT_FLOAT
    for name, source, dtype in (("ohandle", "tl1r1:output_handle:0", types_pb2.DT_VARIANT),
                                ("y", "tl1r1:tensor:0", types_pb2.DT_FLOAT)):
        identity = func.node_def.add(name=f"{name}_identity", op="Identity", input=[source])
        identity.attr["T"].type = dtype
        func.ret[name] = f"{name}_identity:output:0"
    return func


def _build_tensor_list_through_function() -> GraphDef:
    """allow1→Tanh infer1; tl1 = EmptyTensorList→PushBack tl1w1(infer1)→Func1(tl1w1, infer1)
    →PopBack tl1r1; tl2 = EmptyTensorList→PushBack tl2w1(infer1)→PopBack tl2r1;
    MatMul allow2(tl1r1, tl2r1)→fetch1."""
    shape = [32, 32]

    def build() -> None:
        inp = tf.constant(1.0 / 32, FLOAT, shape, name="input")
        infer1 = raw.Tanh(x=raw.MatMul(a=inp, b=inp, name="allow1"), name="infer1")
        tl1 = raw.EmptyTensorList(element_shape=shape, max_num_elements=8, element_dtype=FLOAT, name="tl1")
        tl1w1 = raw.TensorListPushBack(input_handle=tl1, tensor=infer1, name="tl1w1")
        # Stands in for the Func1 call until the library exists: same inputs, same output types.
        func1 = raw.IdentityN(input=[tl1w1, infer1], name="func1")
        tl1r1 = raw.TensorListPopBack(input_handle=func1[0], element_shape=shape, element_dtype=FLOAT, name="tl1r1")
        tl2 = raw.EmptyTensorList(element_shape=shape, max_num_elements=8, element_dtype=FLOAT, name="tl2")
        tl2w1 = raw.TensorListPushBack(input_handle=tl2, tensor=infer1, name="tl2w1")
        tl2r1 = raw.TensorListPopBack(input_handle=tl2w1, element_shape=shape, element_dtype=FLOAT, name="tl2r1")
        raw.Identity(input=raw.MatMul(a=tl1r1.tensor, b=tl2r1.tensor, name="allow2"), name="fetch1")

    graph_def = graph_def_of(build)
    graph_def.library.function.append(_func1())
    call = next(node for node in graph_def.node if node.name == "func1")
    call.op = "Func1"
    del call.attr["T"]
    return graph_def


def test_tensor_list_through_function() -> None:
    """§5.1 #17 TensorListThroughFunction: a TensorList cluster whose handle reaches a
    library function call (an op the library defines) is unsafe, so tl1, tl1w1 and tl1r1
    stay float32; the separate tl2 cluster follows the allow ops into float16. The call's
    op def comes from the library; inside Func1 the handle comes from an ``_Arg``, so the
    body's cluster is denied too and Func1 is unchanged."""
    rewrites = check_against_grappler(_build_tensor_list_through_function(), "float16", ["fetch1"])
    tl1 = [f"{node}:element_dtype" for node in ("tl1", "tl1w1", "tl1r1")]
    tl2 = [f"{node}:element_dtype" for node in ("tl2", "tl2w1", "tl2r1")]
    assert_colours(rewrites, lowered=["allow1", "infer1", "allow2", *tl2], kept=tl1)
    assert_colours(rewrites, kept=["tl1w3:element_dtype", "tl1r1:element_dtype"], casts=0, function="Func1")
    _assert_functions_compared(rewrites, "Func1")
    _assert_signatures_kept(rewrites)


# --------------------------------------------------------------------------------------
# §5.2 Python cases on v1 control flow (TF1-style graphs)


class _Variables:
    """Seeded initial values; variables take a callable so they may be created in a loop body."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def input(self, shape: list[int]) -> tf.Variable:
        value = self.rng.standard_normal(shape).clip(-2, 2).astype(np.float32)
        return tf.Variable(lambda: value)

    def weight(self, shape: list[int]) -> tf.Variable:
        limit = np.sqrt(6.0 / (int(np.prod(shape[:-1])) + shape[-1]))
        value = self.rng.uniform(-limit, limit, shape).astype(np.float32)
        return tf.Variable(lambda: value)

    def matmul_act(self, x: tf.Tensor) -> tf.Tensor:
        return tf.nn.relu(tf.matmul(x, self.weight([8, 8])))


def _simple_loop(x: tf.Tensor, functor: Callable[[tf.Tensor], tf.Tensor], iterations: int = 4) -> list[tf.Tensor]:
    return tf.compat.v1.while_loop(lambda i, _: i < iterations, lambda i, x: (i + 1, functor(x)), [0, x])


def _gradients(y: tf.Tensor, xs: list[tf.Tensor]) -> list[tf.Tensor]:
    """As ``Optimizer.compute_gradients`` makes them (gated)."""
    return tf.compat.v1.gradients(y, xs, gate_gradients=True)


def _v1_case(build: Callable[[], list[tf.Tensor]]) -> tuple[GraphDef, list[str]]:
    """A TF1 graph and its fetched tensor names; fails if a v2 loop sneaked in."""
    fetched: list[str] = []
    graph_def = graph_def_of(lambda: fetched.extend(t.name for t in build()))
    ops = {node.op for node in graph_def.node}
    assert "NextIteration" in ops and not ops & {"While", "StatelessWhile"}, "expected a v1 loop"
    return graph_def, fetched


def _nodes(tensors: list[str]) -> list[str]:
    return sorted({tensor.split(":")[0] for tensor in tensors})


@pytest.mark.parametrize("target", TARGETS)
def test_simple_loop(target: str, control_flow_v1: None) -> None:
    """§5.2 test_simple_loop [cuda, mkl]: a v1 while loop whose body is MatMul→Relu, with
    its gradient: the body's MatMul and Relu convert (Enter/Merge/Switch/NextIteration
    are clear, recurrent edges keep one colour); numerics match float32."""

    def build() -> list[tf.Tensor]:
        variables = _Variables()
        x = variables.input([8, 8])
        y = _simple_loop(x, variables.matmul_act)[1]
        return [y, *_gradients(y, [x])]

    graph_def, fetches = _v1_case(build)
    rewrites = check_against_grappler(graph_def, target, _nodes(fetches))
    assert_colours(rewrites, lowered=["while/MatMul", "while/Relu"])
    assert_numerics_match(rewrites, fetches)


@pytest.mark.parametrize("target", TARGETS)
def test_loop_with_vars_intertwined(target: str, control_flow_v1: None) -> None:
    """§5.2 test_loop_with_vars_intertwined [cuda, mkl]: two loop variables swapped each
    iteration through MatMul→Relu: all four body ops convert."""

    def build() -> list[tf.Tensor]:
        variables = _Variables()
        x = variables.input([8, 8])

        def body(i: tf.Tensor, a: tf.Tensor, b: tf.Tensor) -> tuple[tf.Tensor, ...]:
            return i + 1, variables.matmul_act(b), variables.matmul_act(a)

        _, k, l = tf.compat.v1.while_loop(lambda i, a, b: i < 4, body, [0, tf.ones_like(x), x])
        return [k, l, *_gradients(k, [x])]

    graph_def, fetches = _v1_case(build)
    rewrites = check_against_grappler(graph_def, target, _nodes(fetches))
    assert_colours(rewrites, lowered=["while/MatMul", "while/Relu", "while/MatMul_1", "while/Relu_1"])
    assert_numerics_match(rewrites, fetches)


def _lstm_cell(
    variables: _Variables, prev_c: tf.Tensor, prev_h: tf.Tensor, x: tf.Tensor
) -> tuple[tf.Tensor, tf.Tensor]:
    """The Python test's LSTM cell: one MatMul for four gates, split, sigmoid/tanh."""
    bias, w = variables.weight([4]), variables.weight([8, 16])
    ifoc = tf.matmul(tf.concat([x, prev_h], axis=1), w)
    i, f, o, c = tf.split(ifoc, 4, axis=1)
    i = tf.sigmoid(tf.nn.bias_add(i, bias))
    f = tf.sigmoid(tf.nn.bias_add(f, bias))
    o = tf.sigmoid(tf.nn.bias_add(o, bias))
    c = tf.tanh(tf.nn.bias_add(c, bias))
    next_c = f * prev_c + i * c
    return next_c, o * tf.tanh(next_c)


def test_recurrent_lstm(control_flow_v1: None) -> None:
    """§5.2 test_recurrent_lstm [cuda]: an LSTM cell in a v1 loop reading its inputs from a
    TensorArray (in no list: casts at its boundary): concat, MatMul, split and the gate
    activations convert; numerics match float32."""

    def build() -> list[tf.Tensor]:
        variables = _Variables()
        init_c, init_h = variables.input([8, 4]), variables.input([8, 4])
        inputs = tf.TensorArray(FLOAT, size=4)
        for i in range(4):
            inputs = inputs.write(i, tf.constant(0.1, FLOAT, [8, 4]))

        def body(i: tf.Tensor, c: tf.Tensor, h: tf.Tensor, ta: tf.TensorArray) -> tuple:
            return (i + 1, *_lstm_cell(variables, c, h, ta.read(i)), ta)

        _, _, h, _ = tf.compat.v1.while_loop(lambda i, c, h, ta: i < 4, body, [0, init_c, init_h, inputs])
        return [h, *_gradients(h, [init_c, init_h])]

    graph_def, fetches = _v1_case(build)
    rewrites = check_against_grappler(graph_def, "float16", _nodes(fetches))
    lowered = ["while/concat", "while/MatMul", "while/split", "while/Sigmoid", "while/Sigmoid_1",
               "while/Sigmoid_2", "while/Tanh", "while/Tanh_1"]
    assert_colours(rewrites, lowered=lowered)
    assert_numerics_match(rewrites, fetches)


def _make_node(variables: _Variables, x: tf.Tensor, index: int, colour: str, prefix: str) -> tf.Tensor:
    """One node of the Python test's colour strings: w allow, g infer, c clear, b deny."""
    name = f"{prefix}_{index}"
    kind = colour.lower()
    if kind == "w":
        return tf.matmul(x, variables.weight([8, 8]), name=name)
    if kind == "g":
        return tf.add(x, 0.1, name=name)
    if kind == "c":
        return tf.nn.relu(x, name=name)
    assert kind == "b", colour
    return tf.pow(tf.pow(x, 2.0), 0.5, name=name)


# (inp, body, out) colour strings of test_propagation_through_simple_loop_1…8; capital =
# expected in the target dtype (spec §5.2).
PROPAGATION_CASES = {
    1: ("W", "C", "C"),
    2: ("C", "C", "W"),
    3: ("W", "G", "W"),
    4: ("W", "gbg", "W"),
    5: ("b", "gWC", "c"),
    6: ("b", "CWCG", "C"),
    7: ("C", "GWCG", "C"),
    8: ("C", "CgbgWC", "g"),
}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("case", sorted(PROPAGATION_CASES))
def test_propagation_through_simple_loop(case: int, target: str, control_flow_v1: None) -> None:
    """§5.2 test_propagation_through_simple_loop_1…8 [cuda, mkl]: inp → v1 loop body → out,
    nodes named input_i, while/body_i, output_i with colours from the spec's letter table
    (w allow, g infer, c clear, b deny; capital = converts). Colour crosses the loop's
    Enter/Merge/Switch/NextIteration/Exit both ways, and deny in the body blocks it."""
    inp, body, out = PROPAGATION_CASES[case]
    variables = _Variables()

    def build() -> list[tf.Tensor]:
        a = variables.input([8, 8])
        for i, colour in enumerate(inp):
            a = _make_node(variables, a, i, colour, "input")

        def functor(x: tf.Tensor) -> tf.Tensor:
            for i, colour in enumerate(body):
                x = _make_node(variables, x, i, colour, "body")
            return x

        a = _simple_loop(a, functor)[1]
        for i, colour in enumerate(out):
            a = _make_node(variables, a, i, colour, "output")
        return [tf.identity(a, name="fetch")]

    graph_def, fetches = _v1_case(build)
    rewrites = check_against_grappler(graph_def, target, _nodes(fetches))
    names = [(f"{section}_{i}", colour) for section, colours in (("input", inp), ("while/body", body), ("output", out))
             for i, colour in enumerate(colours)]
    assert_colours(
        rewrites,
        lowered=[name for name, colour in names if colour.isupper()],
        kept=[name for name, colour in names if colour.islower()],
    )
    assert_numerics_match(rewrites, fetches)


@tf1_function.Defun(
    shape_func=lambda op: [op.inputs[0].get_shape()], func_name="example_noninlined_funcdef_grad", noinline=True
)
def _swish_grad(features: tf.Tensor, grad: tf.Tensor) -> tf.Tensor:
    sigmoid = tf.sigmoid(features)
    return grad * (sigmoid * (1.0 + features * (1.0 - sigmoid)))


@tf1_function.Defun(
    grad_func=_swish_grad,
    shape_func=lambda op: [op.inputs[0].get_shape()],
    func_name="example_noninlined_funcdef",
    noinline=True,
)
def _swish(features: tf.Tensor) -> tf.Tensor:
    return features * tf.sigmoid(features)


@pytest.mark.parametrize("target", TARGETS)
def test_noninlined_funcdef(target: str) -> None:
    """§5.2 test_noninlined_funcdef [cuda, mkl]: MatMul→Relu→a non-inlined Defun (Swish,
    with a Defun gradient) and the gradient: the call's op def exists only in the library
    and must be resolved from it (PR #30140); MatMul converts, the calls keep float32
    boundaries, the Swish bodies are their own items (no allow op: unchanged)."""

    def build() -> list[tf.Tensor]:
        variables = _Variables()
        x = variables.input([8, 8])
        y = _swish(variables.matmul_act(x))
        return [*_gradients(y, [x]), y]

    fetched: list[str] = []
    graph_def = graph_def_of(lambda: fetched.extend(t.name for t in build()))
    # Defun specialises by input type: the call's op is "example_noninlined_funcdef_f32",
    # and the gradient a SymbolicGradient of it (the library maps it to the _grad Defun).
    assert {"example_noninlined_funcdef_f32", "SymbolicGradient"} <= {n.op for n in graph_def.node}
    rewrites = check_against_grappler(graph_def, target, _nodes(fetched))
    assert_colours(rewrites, lowered=["MatMul"])
    _assert_functions_compared(rewrites, "example_noninlined_funcdef_f32", "example_noninlined_funcdef_grad")
    assert_numerics_match(rewrites, fetched)


_REF_VARIABLE_OPS = ("VariableV2", "Variable")


@pytest.mark.parametrize("target", TARGETS)
def test_ingraph_train_loop(target: str, control_flow_v1: None) -> None:
    """§5.2 test_ingraph_train_loop [cuda, mkl]: a v1 loop around a dense layer trained
    with Adam on ref variables (``use_resource=False``), fed by a one-shot iterator. The
    forward and weight-gradient MatMuls convert; the Enter that reads a ref variable's
    value is an implicit variable read and never converts, so no cast sits between a ref
    variable and the loop (PR #31178); the loss after 10 steps matches float32."""
    rng = np.random.default_rng(1234)
    iterations, batch, channels, classes = 10, 16, 32, 10

    def build() -> list[tf.Tensor]:
        data = rng.normal(size=(batch * iterations, channels)).astype(np.float32)
        labels = rng.integers(classes, size=(batch * iterations,))
        dataset = tf.data.Dataset.from_tensor_slices((data, labels)).batch(batch)
        batches = tf.compat.v1.data.make_one_shot_iterator(dataset)
        kernel_value = rng.uniform(-0.3, 0.3, (channels, classes)).astype(np.float32)

        def body(_: tf.Tensor, i: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            x, labels = batches.get_next()
            with tf.compat.v1.variable_scope("dense"):
                kernel = tf.compat.v1.get_variable("kernel", initializer=lambda: kernel_value, use_resource=False)
                bias = tf.compat.v1.get_variable("bias", initializer=lambda: np.zeros(classes, np.float32),
                                                 use_resource=False)
                logits = tf.nn.bias_add(tf.matmul(x, kernel), bias)
            loss = tf.compat.v1.losses.sparse_softmax_cross_entropy(labels, logits)
            train_op = tf.compat.v1.train.AdamOptimizer().minimize(loss, var_list=[kernel, bias])
            with tf.control_dependencies([train_op]):
                return tf.identity(loss), i + 1

        loss, _ = tf.compat.v1.while_loop(lambda _, i: i < iterations, body, [0.0, tf.constant(0)])
        return [tf.identity(loss, name="loss")]

    graph_def, fetches = _v1_case(build)
    assert {"VariableV2", "ApplyAdam", "RefEnter"} <= {node.op for node in graph_def.node}
    rewrites = check_against_grappler(graph_def, target, _nodes(fetches))
    assert_colours(
        rewrites,
        lowered=["while/dense/MatMul", "while/gradients/while/dense/MatMul_grad/MatMul_1"],
        kept=["dense/kernel/read", "while/dense/MatMul/Enter"],
    )
    name_to_op = {node.name: node.op for node in graph_def.node}
    for node in rewrites.ours.node:
        if node.name.endswith("-AutoMixedPrecision"):
            source = node.input[0].split(":")[0]
            assert name_to_op.get(source) not in (*_REF_VARIABLE_OPS, "RefEnter"), node.name
            assert source != "dense/kernel/read", node.name
    assert_numerics_match(rewrites, fetches)


# --------------------------------------------------------------------------------------
# Keras 3 recurrent layers: functional While loops and their gradients in the library


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("layer", ["lstm", "gru"])
def test_keras_recurrent_training_step(layer: str, target: str) -> None:
    """Keras 3 LSTM/GRU training steps keep their recurrence in library functions: the
    forward While body/cond and the gradient While's body/cond. Each body is its own item
    (``_Arg``/``_Retval`` fp32, stateful ops preserved) and agrees with grappler 100%, and
    the cell's MatMuls convert inside the bodies.

    One intended difference, in the main graph: grappler paints the TensorLists that feed
    the loop (TensorListFromTensor, the output list) in low precision while the bodies read
    and write them as float32 — its graph fails at run time ("op elements float but list
    elements half"). We treat a loop as a TensorList boundary, keep those lists float32
    and the step runs and matches float32. The comparison, both ways, finds exactly that:
    ``deviations.KERAS_LOOP_STEP``."""
    model = build_loop_graph(layer)
    rewrites = rewrite_both(model.graph_def, target, list(model.fetches))
    low = TARGET_TO_DTYPE[target]
    bodies = [name for name in reachable_functions(model.graph_def) if "_while_body_" in name]
    assert any(name.endswith("_rewritten") for name in bodies) and any("_grad_" in name for name in bodies), bodies
    for name in bodies:
        body = function_body(rewrites.ours, name)
        matmuls = [node.name for node in body.node if node.op == "MatMul"]
        assert matmuls and all(vertex_dtypes(body)[(m, "T")] == low for m in matmuls), (name, matmuls)
    _assert_signatures_kept(rewrites)
    if rewrites.grappler is not None:
        assert set(bodies) <= {f.name for f in rewrites.agreement.functions}, "a loop body was not compared"
        deviations.assert_agrees_but_for(rewrites.agreement, model.graph_def, target, deviations.KERAS_LOOP_STEP)
        with pytest.raises(tf.errors.InvalidArgumentError, match="list elements"):
            run_model_graph(model, rewrites.grappler)
    assert_model_close_to_float32(model, run_model_graph(model), rewrites.ours, target)


# --------------------------------------------------------------------------------------
# tf.function: control flow v2 and nested calls, with numerics


def _feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.uniform(-1, 1, (8, 8)).astype(np.float32), "w": rng.uniform(-0.5, 0.5, (8, 8)).astype(np.float32)}


def _traced(function: Callable[..., tf.Tensor]) -> tuple[GraphDef, list[str]]:
    specs = tf.TensorSpec([8, 8], name="x"), tf.TensorSpec([8, 8], name="w")
    concrete = tf.function(function).get_concrete_function(*specs)
    return concrete.graph.as_graph_def(), [t.name for t in concrete.outputs]


def _loop_and_branch(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    """A StatelessWhile whose body is MatMul→Relu, then a StatelessIf whose true branch
    is a MatMul; the main graph holds no allowlist op."""

    def body(i: tf.Tensor, h: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return i + 1, tf.nn.relu(tf.matmul(h, w, name="allow1"), name="clr1")

    _, h = tf.while_loop(lambda i, h: i < 3, body, [0, x], name="loop")
    return tf.cond(
        tf.reduce_sum(h, name="deny1") > 0.0,
        lambda: tf.matmul(h, w, name="allow2"),
        lambda: tf.identity(h, name="clr2"),
        name="branch",
    )


@pytest.mark.parametrize("target", TARGETS)
def test_while_and_cond_bodies(target: str) -> None:
    """Control flow v2 (spec §2.7): the main graph has no allowlist op and is unchanged;
    the loop body and the true branch are items of their own, converted with casts right
    after ``_Arg`` and right before ``_Retval`` (whose dtypes never change); the cond
    function and the false branch have nothing to convert. Numerics match float32."""
    graph_def, fetches = _traced(_loop_and_branch)
    assert {"StatelessWhile", "StatelessIf"} <= {node.op for node in graph_def.node}
    rewrites = check_against_grappler(graph_def, target, _nodes(fetches))
    assert_colours(rewrites, casts=0)
    body, true_branch = _function_named(graph_def, "loop_body"), _function_named(graph_def, "branch_true")
    assert_colours(rewrites, lowered=["loop/allow1", "loop/clr1"], casts=3, function=body)
    assert_colours(rewrites, lowered=["branch/allow2"], casts=3, function=true_branch)
    for prefix in ("loop_cond", "branch_false"):
        assert_colours(rewrites, casts=0, function=_function_named(graph_def, prefix))
    _assert_functions_compared(rewrites, "loop_body", "loop_cond", "branch_true", "branch_false")
    _assert_signatures_kept(rewrites)
    assert_numerics_match(rewrites, fetches, _feeds())


@tf.function
def _inner(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    return tf.nn.relu(tf.matmul(x, w, name="allow1"), name="clr1")


@tf.function
def _noisy(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    """Stateful (a seeded RandomUniform), so it is called through StatefulPartitionedCall."""
    noise = raw.RandomUniform(shape=[8, 8], dtype=FLOAT, seed=1, seed2=2, name="noise")
    return tf.matmul(x + 0.01 * noise, w, name="allow3")


@tf.function
def _middle(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    return _inner(tf.matmul(x, w, name="allow2"), w) * 0.5


def _nested(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    return _middle(x, w) + _inner(x, w) + _noisy(x, w)


@pytest.mark.parametrize("target", TARGETS)
def test_nested_function_calls(target: str) -> None:
    """PartitionedCall/StatefulPartitionedCall are in no list, so call arguments and
    results stay float32 on both sides (spec §2.7): each callee is rewritten once as its
    own item, even when called from the main graph and from another function; a nested
    call inside a function body gets a cast back to float32 before it. Signatures are
    unchanged and the numbers match float32."""
    graph_def, fetches = _traced(_nested)
    assert {"PartitionedCall", "StatefulPartitionedCall"} <= {node.op for node in graph_def.node}
    rewrites = check_against_grappler(graph_def, target, _nodes(fetches))
    assert_colours(rewrites, casts=0)
    inner, middle = _function_named(graph_def, "__inference__inner"), _function_named(graph_def, "__inference__middle")
    noisy = _function_named(graph_def, "__inference__noisy")
    assert_colours(rewrites, lowered=["allow1", "clr1"], casts=3, function=inner)
    # allow2 reads x and w (2 casts) and feeds only the nested call (1 cast back).
    assert_colours(rewrites, lowered=["allow2"], casts=3, function=middle)
    assert_colours(rewrites, lowered=["allow3"], kept=["noise:dtype"], function=noisy)
    _assert_functions_compared(rewrites, "__inference__inner", "__inference__middle", "__inference__noisy")
    _assert_signatures_kept(rewrites)
    assert_numerics_match(rewrites, fetches, _feeds())


# --------------------------------------------------------------------------------------
# bfloat16: While and StatelessWhile are clear ops


def _loop_between_matmuls(stateful: bool) -> Callable[[tf.Tensor, tf.Tensor], tf.Tensor]:
    """A function calling ``inner``: MatMul allow1 → a loop whose float loop variable goes
    through Relu → MatMul allow2. ``stateful`` reads a variable in the loop body, which
    makes the loop a ``While`` (and the call a StatefulPartitionedCall)."""
    offset = tf.Variable(np.full([8, 8], 0.5, np.float32), name="offset") if stateful else None

    def body(i: tf.Tensor, h: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        return i + 1, tf.nn.relu(h + offset if stateful else h, name="clr_body")

    @tf.function
    def inner(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
        _, h = tf.while_loop(lambda i, h: i < 3, body, [0, tf.matmul(x, w, name="allow1")], name="loop")
        return tf.matmul(h, w, name="allow2")

    return inner


def _runs(graph_def: GraphDef, fetches: list[str]) -> bool:
    try:
        run_on_cpu(graph_def, fetches, _feeds())
    except (tf.errors.OpError, ValueError):
        return False
    return True


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("stateful", [False, True], ids=["StatelessWhile", "While"])
def test_functional_while_between_allow_ops(stateful: bool, target: str) -> None:
    """Spec §2.7: the bfloat16 lists put While and StatelessWhile in the clear list. Grappler
    then paints a StatelessWhile's loop value T[3] between two allow ops while the body and
    cond keep float32 signatures, which is not a valid graph (a While in a function item is
    stateful, hence preserved). We deliberately keep every loop value float32 unless
    ``cross_function`` changes the bodies too: the one intended difference from grappler,
    and the comparison, both ways, finds exactly it (one loop value, a cast on each side)."""
    graph_def, fetches = _traced(_loop_between_matmuls(stateful))
    rewrites = rewrite_both(graph_def, target, _nodes(fetches))
    function = _function_named(graph_def, "__inference_inner")
    loop_op = {node.name: node.op for node in function_body(graph_def, function).node}["loop"]
    assert loop_op == ("While" if stateful else "StatelessWhile")
    assert_colours(rewrites, lowered=["allow1", "allow2"], kept=["loop:T[3]"], function=function, grappler=False)
    _assert_signatures_kept(rewrites)
    if rewrites.grappler is not None:
        grappler_paints = target == "bfloat16" and not stateful
        expected = {deviations.LOOP_VALUE: 1, deviations.CASTS: 2} if grappler_paints else {}
        deviations.assert_agrees_but_for(rewrites.agreement, graph_def, target, expected)
        grappler_loop = vertex_dtypes(function_body(rewrites.grappler, function))[("loop", "T[3]")]
        assert (grappler_loop != types_pb2.DT_FLOAT) == grappler_paints
        if grappler_paints:
            assert not _runs(rewrites.grappler, fetches), "grappler's painted loop was expected to be invalid"
    if not stateful:  # the stateful loop reads a captured variable this harness cannot feed
        assert_numerics_match(rewrites, fetches, _feeds())


@pytest.mark.parametrize("target", TARGETS)
def test_functional_while_in_main_graph(target: str) -> None:
    """In the main graph too, a StatelessWhile between two MatMuls keeps its float32 loop
    value (grappler paints T[3] in bfloat16 and breaks the graph); everything else agrees,
    both ways."""

    def main(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
        _, h = tf.while_loop(
            lambda i, h: i < 3, lambda i, h: (i + 1, tf.nn.relu(h, name="clr_body")),
            [0, tf.matmul(x, w, name="allow1")], name="loop",
        )
        return tf.matmul(h, w, name="allow2")

    graph_def, fetches = _traced(main)
    rewrites = rewrite_both(graph_def, target, _nodes(fetches))
    assert_colours(rewrites, lowered=["allow1", "allow2"], kept=["loop:T[3]"], grappler=False)
    _assert_signatures_kept(rewrites)
    if rewrites.grappler is not None:
        expected = {deviations.LOOP_VALUE: 1, deviations.CASTS: 2} if target == "bfloat16" else {}
        deviations.assert_agrees_but_for(rewrites.agreement, graph_def, target, expected)
        if target == "bfloat16":
            assert vertex_dtypes(rewrites.grappler)[("loop", "T[3]")] == types_pb2.DT_BFLOAT16
            assert not _runs(rewrites.grappler, fetches)
    assert_numerics_match(rewrites, fetches, _feeds())


# --------------------------------------------------------------------------------------
# Calls that cannot be rewritten: GraphError naming the function, input untouched


def _assert_graph_error(graph_def: GraphDef, pattern: str) -> None:
    before = graph_def.SerializeToString(deterministic=True)
    with pytest.raises(amp_rewrite.GraphError, match=pattern):
        amp_rewrite.rewrite_graph_def(graph_def, target="float16", fetches=("Identity",))
    assert graph_def.SerializeToString(deterministic=True) == before, "the input GraphDef was modified"


def test_call_to_missing_function_is_refused() -> None:
    """A PartitionedCall whose ``f`` names no library function cannot be rewritten (its
    body is unknown): GraphError naming the function."""
    graph_def, _ = _traced(lambda x, w: _inner(x, w))
    call = next(node for node in graph_def.node if node.op == "PartitionedCall")
    call.attr["f"].func.name = "missing_fn"
    _assert_graph_error(graph_def, r"function 'missing_fn'")


def test_call_to_missing_function_inside_a_function_is_refused() -> None:
    """The same inside a library function: the error names the caller's function too."""
    graph_def, _ = _traced(lambda x, w: _inner(x, w))
    function = graph_def.library.function[0]
    _call_node(function, "stray_call", "missing_fn")
    _assert_graph_error(
        graph_def, rf"function 'missing_fn' called by node 'stray_call' in function '{function.signature.name}'"
    )


def test_while_body_signature_mismatch_is_refused() -> None:
    """A While whose body takes other types than the loop's ``T`` is malformed: GraphError
    naming the body function."""
    graph_def, _ = _traced(_loop_and_branch)
    body = next(f for f in graph_def.library.function if f.signature.name.startswith("loop_body"))
    body.signature.input_arg[3].type = types_pb2.DT_HALF
    _assert_graph_error(graph_def, rf"function '{body.signature.name}'")


def _call_node(function: function_pb2.FunctionDef, name: str, callee: str) -> None:
    node = function.node_def.add(name=name, op="PartitionedCall", input=["x"])
    node.attr["f"].func.name = callee
    node.attr["Tin"].list.type.append(types_pb2.DT_FLOAT)
    node.attr["Tout"].list.type.append(types_pb2.DT_FLOAT)
    function.ret["y"] = f"{name}:output:0"


def test_recursive_functions_are_refused() -> None:
    """ping calls pong and pong calls ping: a recursive body cannot be an item of its own
    (and could never finish). GraphError naming the functions."""

    graph_def = GraphDef()
    x = graph_def.node.add(name="x", op="Const")
    x.attr["dtype"].type = types_pb2.DT_FLOAT
    x.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(np.ones([8, 8], np.float32)))
    call = graph_def.node.add(name="call", op="PartitionedCall", input=["x"])
    call.attr["f"].func.name = "ping"
    call.attr["Tin"].list.type.append(types_pb2.DT_FLOAT)
    call.attr["Tout"].list.type.append(types_pb2.DT_FLOAT)
    identity = graph_def.node.add(name="Identity", op="Identity", input=["call"])
    identity.attr["T"].type = types_pb2.DT_FLOAT
    for name, callee in (("ping", "pong"), ("pong", "ping")):
        function = graph_def.library.function.add()
        function.signature.name = name
        function.signature.input_arg.add(name="x", type=types_pb2.DT_FLOAT)
        function.signature.output_arg.add(name="y", type=types_pb2.DT_FLOAT)
        _call_node(function, f"call_{callee}", callee)
    _assert_graph_error(graph_def, r"function '(ping|pong)'")


# --------------------------------------------------------------------------------------
# The oracle's per-function comparison sees differences inside bodies


def test_compare_rewrites_reports_a_function_body_difference() -> None:
    """A vertex changed inside one function body, or a changed signature, makes the
    agreement fail and is reported under that function's name."""
    graph_def, fetches = _traced(_loop_and_branch)
    grappler = recorded_grappler.rewrite(graph_def, target="float16", fetches=_nodes(fetches))
    if grappler is None:
        recorded_grappler.skip_comparison()
    body = _function_named(graph_def, "loop_body")
    ours = GraphDef()
    ours.CopyFrom(grappler)
    function = next(f for f in ours.library.function if f.signature.name == body)
    relu = next(node for node in function.node_def if node.name == "loop/clr1")
    relu.attr["T"].type = types_pb2.DT_FLOAT
    agreement = compare_rewrites(graph_def, ours, grappler)
    assert not agreement.ok
    assert agreement.function(body).mismatches == ("loop/clr1 attr T: ours=DT_FLOAT grappler=DT_HALF",)
    assert all(f.ok for f in agreement.functions if f.name != body)
    assert f"function '{body}'" in agreement.explain()

    ours.CopyFrom(grappler)
    next(f for f in ours.library.function if f.signature.name == body).signature.output_arg[0].name = "renamed"
    agreement = compare_rewrites(graph_def, ours, grappler)
    assert not agreement.ok
    assert agreement.library_mismatches == (f"function '{body}': our signature differs from the original's",)


@tf.function
def _gaussian(x: tf.Tensor, w: tf.Tensor) -> tf.Tensor:
    """exp(-h^2) between two matmuls: a deny op whose argument is never positive."""
    h = tf.matmul(x, w, name="allow1")
    return tf.matmul(tf.exp(-tf.square(h, name="square"), name="bump") * h, w, name="allow2")


@pytest.mark.parametrize("target", TARGETS)
def test_bounded_exp_in_a_function_body(target: str) -> None:
    """A function body's Exp(-Square) acts as an infer op as in the main graph, and the
    oracle tells grappler so inside the body too: they agree. On float16 Square is in no
    list, so the path from allow1 breaks and the bump stays float32 there."""
    graph_def, fetches = _traced(lambda x, w: _gaussian(x, w) + 1.0)
    rewrites = check_against_grappler(graph_def, target, _nodes(fetches))
    body = _function_named(graph_def, "__inference__gaussian")
    if target == "bfloat16":
        assert_colours(rewrites, lowered=["allow1", "square", "bump", "mul", "allow2"], function=body)
    else:
        assert_colours(rewrites, lowered=["allow1", "allow2"], kept=["square", "bump"], function=body)
    _assert_functions_compared(rewrites, "__inference__gaussian")
    assert_numerics_match(rewrites, fetches, _feeds())


# --------------------------------------------------------------------------------------
# Which functions a node calls: one rule (``functions.called_functions``), TensorFlow's


@pytest.mark.parametrize("target", TARGETS)
def test_a_root_nothing_in_the_graph_calls_is_rewritten_with_what_it_calls(target: str) -> None:
    """Rule: ``roots`` (a SavedModel's restored functions, which a loader calls by name) are
    reached as the main graph's calls are, with the functions they call; each keeps its
    signature, and what the main graph reaches is rewritten byte for byte as without roots
    (grappler's items). Without roots, ``restored`` and ``helper`` stay as they were."""
    graph_def = GraphDef()
    x = graph_def.node.add(name="x", op="Placeholder")
    x.attr["dtype"].type = types_pb2.DT_FLOAT
    call = graph_def.node.add(name="call", op="PartitionedCall", input=["x"])
    call.attr["f"].func.name = "outer"
    call.attr["Tin"].list.type.append(types_pb2.DT_FLOAT)
    call.attr["Tout"].list.type.append(types_pb2.DT_FLOAT)
    graph_def.node.add(name="fetch", op="Identity", input=["call"]).attr["T"].type = types_pb2.DT_FLOAT
    restored = function_pb2.FunctionDef()
    restored.signature.name = "restored"
    restored.signature.input_arg.add(name="x", type=types_pb2.DT_FLOAT)
    restored.signature.output_arg.add(name="y", type=types_pb2.DT_FLOAT)
    _call_node(restored, "call_helper", "helper")
    graph_def.library.function.extend([_matmul_function("outer"), restored, _matmul_function("helper")])
    assert reachable_functions(graph_def) == ["outer"]
    assert reachable_functions(graph_def, roots=["restored"]) == ["outer", "restored", "helper"]

    alone = amp_rewrite.rewrite_graph_def(graph_def, target=target, fetches=["fetch"]).graph_def
    rooted = amp_rewrite.rewrite_graph_def(graph_def, target=target, fetches=["fetch"], roots=["restored"]).graph_def
    by_name = {f.signature.name: f for f in rooted.library.function}
    assert {f.signature.name: f for f in alone.library.function}["helper"] == _matmul_function("helper")
    low = lookup_target(target).dtype
    assert next(n for n in by_name["helper"].node_def if n.name == "allow1").attr["T"].type == low
    assert by_name["restored"].signature == restored.signature and by_name["helper"].signature.output_arg[0].type \
        == types_pb2.DT_FLOAT
    assert list(rooted.node) == list(alone.node) and by_name["outer"] == alone.library.function[0]


def _matmul_function(name: str) -> function_pb2.FunctionDef:
    """name(x: float) -> (y: float): y = MatMul allow1(x, x)."""
    function = function_pb2.FunctionDef()
    function.signature.name = name
    function.signature.input_arg.add(name="x", type=types_pb2.DT_FLOAT)
    function.signature.output_arg.add(name="y", type=types_pb2.DT_FLOAT)
    matmul = function.node_def.add(name="allow1", op="MatMul", input=["x", "x"])
    matmul.attr["T"].type = types_pb2.DT_FLOAT
    function.ret["y"] = "allow1:product:0"
    return function


def test_a_node_calls_its_op_and_its_func_attrs_but_not_names_bound_inside_them() -> None:
    """A node calls its op, when a library defines it, and the functions its ``func`` and
    ``list(func)`` attrs name; a name inside a func value's own attrs binds the callee's
    attr and is no call. ``rename_calls`` renames exactly those names. A registered op
    without a func attr calls nothing but itself."""
    from amp_rewrite.core.functions import called_functions, rename_calls

    node = node_def_pb2.NodeDef(name="call", op="Outer")
    node.attr["f"].func.name = "body"
    node.attr["f"].func.attr["inner"].func.name = "bound"
    node.attr["branches"].list.func.add(name="then")
    node.attr["branches"].list.func.add(name="else")
    node.attr["T"].type = types_pb2.DT_FLOAT
    assert sorted(called_functions(node)) == ["Outer", "body", "else", "then"]
    rename_calls(node, {name: name.upper() for name in ("Outer", "body", "bound", "then", "else")})
    assert sorted(called_functions(node)) == ["BODY", "ELSE", "OUTER", "THEN"]
    assert node.attr["f"].func.attr["inner"].func.name == "bound"
    matmul = node_def_pb2.NodeDef(name="m", op="MatMul")
    matmul.attr["_stray"].func.name = "body"  # a private attr of an op that takes no function
    assert list(called_functions(matmul)) == ["MatMul"]


@pytest.mark.parametrize("target", TARGETS)
def test_a_function_named_only_inside_a_func_attr_is_not_reached(target: str) -> None:
    """The rule is TensorFlow's (grappler reaches functions through ops and func attrs only):
    ``outer`` is called with its attr ``inner`` bound to ``nested``, which nothing calls.
    Grappler rewrites ``outer`` and drops ``nested`` from its library as unreachable; we
    rewrite ``outer`` the same and leave ``nested`` as it was."""
    graph_def = GraphDef()
    x = graph_def.node.add(name="x", op="Placeholder")
    x.attr["dtype"].type = types_pb2.DT_FLOAT
    x.attr["shape"].shape.dim.add(size=4)
    x.attr["shape"].shape.dim.add(size=4)
    call = graph_def.node.add(name="call", op="PartitionedCall", input=["x"])
    call.attr["f"].func.name = "outer"
    call.attr["f"].func.attr["inner"].func.name = "nested"
    call.attr["Tin"].list.type.append(types_pb2.DT_FLOAT)
    call.attr["Tout"].list.type.append(types_pb2.DT_FLOAT)
    graph_def.node.add(name="fetch", op="Identity", input=["call"]).attr["T"].type = types_pb2.DT_FLOAT
    graph_def.library.function.extend([_matmul_function("outer"), _matmul_function("nested")])
    rewrites = check_against_grappler(graph_def, target, ["fetch"])
    if rewrites.grappler is not None:
        assert "nested" not in {f.signature.name for f in rewrites.grappler.library.function}
        assert [f.name for f in rewrites.agreement.functions] == ["outer"]
    assert_colours(rewrites, lowered=["allow1"], casts=2, function="outer")
    nested = next(f for f in rewrites.ours.library.function if f.signature.name == "nested")
    assert nested == _matmul_function("nested")
