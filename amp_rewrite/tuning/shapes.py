"""The static dtype, shape and (for small non-float tensors) value of every tensor of a
graph and the functions it calls, at given input shapes, from TensorFlow's own shape inference.

An op's speed depends on the shapes it runs with, and on a few non-float inputs (a Pad's
paddings, a Reshape's shape, a reduction's axes). Each item is imported into a ``tf.Graph``
of its own, which runs TensorFlow's shape inference: the main graph with its placeholders
set to the feed shapes, then each function a call reaches, its arguments set to the call's
input shapes (a variable handle becomes a ``VarHandleOp`` of the variable's shape, so the
reads inside know it), a ``While``'s body and condition at the shapes of the values that
enter the loop. A function called with several shapes is seen with the first.
"""
from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

from amp_rewrite.core import functions
from amp_rewrite.core.graph_io import copy_graph_def, parse_tensor_name
from amp_rewrite.core.program import MAIN_GRAPH, Program

CALL_OPS = frozenset({"PartitionedCall", "StatefulPartitionedCall"})
# A loop's body and condition see the loop-carried values as they enter the loop: the
# shapes of every iteration where the body keeps them (a KV cache preallocated to the full
# length); a body that changes one is seen at its first iteration.
LOOP_OPS = {"While": ("body", "cond"), "StatelessWhile": ("body", "cond")}
# Non-float inputs whose value is kept (they change what an op computes, hence its speed);
# larger ones are data, and an op reading one is not timed.
MAX_VALUE_ELEMENTS = 64
_VALUE_DTYPES = frozenset({types_pb2.DT_INT32, types_pb2.DT_INT64, types_pb2.DT_BOOL})


@dataclass(frozen=True, eq=False)
class TensorInfo:
    """A tensor as shape inference knows it: ``shape`` None unless every dim is known;
    ``value`` for a small int or bool tensor whose value is static, else None."""

    dtype: int
    shape: tuple[int, ...] | None
    value: np.ndarray | None = None


@dataclass(frozen=True)
class _Arg:
    dtype: int
    shape: tf.TensorShape
    variable: tuple[int, tuple[int, ...] | None] | None = None  # a resource: its variable's (dtype, shape)


@dataclass
class Shapes:
    """The imported items (item -> its graph); ``info`` answers for any tensor of them."""

    graphs: dict[str, tf.Graph] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # item -> why TensorFlow could not import it
    looped: set[str] = field(default_factory=set)  # the items a loop runs: a body, a condition, what they call

    def info(self, item: str, tensor: str) -> TensorInfo | None:
        """``tensor`` ("node:port") of ``item``, or None where it was not seen."""
        graph = self.graphs.get(item)
        if graph is None:
            return None
        ref = parse_tensor_name(tensor)
        try:
            value = graph.get_operation_by_name(ref.node).outputs[ref.port]
        except (KeyError, IndexError, ValueError):
            return None
        shape = tuple(value.shape.as_list()) if value.shape.is_fully_defined() else None
        dtype = value.dtype.as_datatype_enum
        static = None
        if dtype in _VALUE_DTYPES and shape is not None and int(np.prod(shape)) <= MAX_VALUE_ELEMENTS:
            static = tf.get_static_value(value)
        return TensorInfo(dtype, shape, None if static is None else np.asarray(static))


def infer_shapes(program: Program, feed_shapes: Mapping[str, tuple[int, ...]],
                 skip: Collection[str] = (), handles: Mapping[str, tuple[int, tuple[int, ...]]] | None = None
                 ) -> Shapes:
    """Shapes of ``program``'s main graph with placeholder ``name`` of shape
    ``feed_shapes[name]``, and of every function its calls reach (breadth first) but those
    in ``skip`` (a SavedModel's save and restore functions: no op there is timed).
    ``handles``: resource placeholders that hold a variable -> its (dtype, shape) (a
    ``tf.function``'s captured variables), so the reads know their shapes."""
    shapes = Shapes()
    pending: list[tuple[str, list[_Arg], bool]] = [(MAIN_GRAPH, [], False)]
    seen = {MAIN_GRAPH, *skip}
    while pending:
        item, args, looped = pending.pop(0)
        if looped:
            shapes.looped.add(item)
        if item == MAIN_GRAPH:
            body = _main_graph(program, feed_shapes, skip, handles or {})
        else:
            body = _function_graph(program, item, args)
        graph = tf.Graph()
        try:
            with graph.as_default():
                tf.graph_util.import_graph_def(body, name="")
        except (ValueError, TypeError, tf.errors.OpError) as error:
            shapes.failed[item] = str(error).splitlines()[0] if str(error) else type(error).__name__
            continue
        shapes.graphs[item] = graph
        for callee, callee_args, in_loop in _calls(graph, program):
            if callee not in seen:
                seen.add(callee)
                pending.append((callee, callee_args, looped or in_loop))
    return shapes


def _without_colocation(body: graph_pb2.GraphDef) -> None:
    for node_def in body.node:
        node_def.attr.pop("_class", None)


def _add_library(body: graph_pb2.GraphDef, program: Program) -> None:
    """The functions ``body`` calls, directly or not: the import needs them, and only them
    (a SavedModel's save and restore functions are large)."""
    needed: set[str] = set()
    stack = [name for node_def in body.node for name in functions.called_functions(node_def)]
    while stack:
        name = stack.pop()
        if name in program.library and name not in needed:
            needed.add(name)
            stack.extend(n for node_def in program.library[name].node_def for n in functions.called_functions(node_def))
    body.library.function.extend(program.library[name] for name in program.library if name in needed)
    body.library.gradient.extend(g for g in program.graph_def.library.gradient if g.function_name in needed)


def _main_graph(program: Program, feed_shapes: Mapping[str, tuple[int, ...]], skip: Collection[str],
                handles: Mapping[str, tuple[int, tuple[int, ...]]]) -> graph_pb2.GraphDef:
    """The main graph without the nodes that call ``skip`` functions, its placeholders of
    the feed shapes, its variable placeholders (``handles``) variable handles."""
    body = graph_pb2.GraphDef()
    body.versions.CopyFrom(program.graph_def.versions)
    dropped = {n.name for n in program.graph_def.node if set(functions.called_functions(n)) & set(skip)}
    while grown := {n.name for n in program.graph_def.node  # and what reads a dropped node
                    if n.name not in dropped and any(parse_tensor_name(t).node in dropped for t in n.input)}:
        dropped |= grown
    body.node.extend(n for n in program.graph_def.node if n.name not in dropped)
    _add_library(body, program)
    for node_def in body.node:
        if node_def.name in feed_shapes and node_def.op.startswith("Placeholder"):
            node_def.attr["shape"].shape.CopyFrom(tf.TensorShape(feed_shapes[node_def.name]).as_proto())
        elif node_def.name in handles and node_def.op == "Placeholder":
            _as_handle(node_def, *handles[node_def.name])
    _without_colocation(body)
    return body


def _as_handle(node_def, dtype: int, shape: tuple[int, ...] | None) -> None:
    """Make ``node_def`` a ``VarHandleOp`` of a variable of ``dtype`` and ``shape``."""
    node_def.op = "VarHandleOp"
    node_def.ClearField("attr")
    node_def.attr["dtype"].type = dtype
    node_def.attr["shape"].shape.CopyFrom(tf.TensorShape(shape).as_proto())
    node_def.attr["shared_name"].s = node_def.name.encode()


def _function_graph(program: Program, name: str, args: list[_Arg]) -> graph_pb2.GraphDef:
    """The body of function ``name`` as an importable graph: each ``_Arg`` a placeholder (or
    a variable handle) of the call's shape, each ``_Retval`` an Identity."""
    body = copy_graph_def(program.item(name))
    _add_library(body, program)
    body.versions.CopyFrom(program.graph_def.versions)
    for node_def in body.node:
        if node_def.op == "_Arg":
            index = node_def.attr["index"].i
            arg = args[index] if index < len(args) else None
            dtype = node_def.attr["T"].type
            node_def.ClearField("attr")
            if arg is not None and arg.variable is not None:
                _as_handle(node_def, *arg.variable)
            else:
                node_def.op = "Placeholder"
                node_def.attr["dtype"].type = dtype
                node_def.attr["shape"].shape.CopyFrom((arg.shape if arg is not None else tf.TensorShape(None))
                                                      .as_proto())
        elif node_def.op == "_Retval":
            node_def.op = "Identity"
            node_def.attr.pop("index", None)
    _without_colocation(body)
    return body


def traced_inputs(func_graph: Any) -> tuple[dict[int, tuple[int, ...]], dict[int, tuple[int, tuple[int, ...]]]]:
    """A traced function's inputs by position: each data input's shape where every dim is known,
    and each captured variable's (dtype, shape), the shape its handle placeholder does not say."""
    by_handle = {id(variable.handle): variable for variable in func_graph.variables}
    captured = {id(internal): by_handle.get(id(external)) for external, internal in func_graph.captures}
    feeds, handles = {}, {}
    for index, tensor in enumerate(func_graph.inputs):
        variable = captured.get(id(tensor))
        if variable is not None:
            handles[index] = (variable.dtype.as_datatype_enum, tuple(variable.shape))
        elif tensor.dtype != tf.resource and tensor.shape.is_fully_defined():
            feeds[index] = tuple(tensor.shape.as_list())
    return feeds, handles


def _variable(tensor: tf.Tensor) -> tuple[int, tuple[int, ...] | None] | None:
    """The (dtype, shape) of the variable a resource tensor is the handle of, where known."""
    op = tensor.op
    while op.type == "Identity":
        op = op.inputs[0].op
    if op.type != "VarHandleOp":
        return None
    shape = tf.TensorShape(op.get_attr("shape"))
    return op.get_attr("dtype").as_datatype_enum, tuple(shape.as_list()) if shape.is_fully_defined() else None


def _calls(graph: tf.Graph, program: Program) -> list[tuple[str, list[_Arg], bool]]:
    """Each function ``graph`` calls (PartitionedCall, a call by the function's name, a
    ``While``'s body and condition), with the shapes of the call's inputs and whether a loop calls it."""
    found = []
    for op in graph.get_operations():
        if op.type in LOOP_OPS:
            callees = [op.get_attr(attr).name for attr in LOOP_OPS[op.type]]
        else:
            callees = [op.get_attr("f").name if op.type in CALL_OPS else op.type]
        args = [_Arg(t.dtype.as_datatype_enum, t.shape, _variable(t) if t.dtype == tf.resource else None)
                for t in op.inputs]
        found.extend((callee, args, op.type in LOOP_OPS) for callee in callees if callee in program.library)
    return found
