"""Built-in graphs whose work runs inside library functions, and where their loop casts are.

:mod:`amp_rewrite.testing.models` traces its models inline; these keep the functions
``tf.function`` makes, so function boundaries matter (spec §2.7, §6):

* ``lstm``, ``gru``: a Keras 3 ``LSTM``/``GRU`` layer (sequence 8, features 16, units 32)
  and a ``Dense`` softmax head, as one training step — forward, loss, ``tf.GradientTape``
  gradients, SGD update. The recurrence is a ``While`` whose body and cond are library
  functions; its gradient is a second loop (``StatelessWhile``) over gradient functions.
* ``while_loop``: ``tf.while_loop`` whose body applies MatMul → Relu to the loop-carried
  value, then a ``tf.cond`` (an ``If`` with two branch functions), followed by a call of
  a nested ``tf.function`` (a ``StatefulPartitionedCall``).

Each builds a :class:`~amp_rewrite.testing.models.ModelGraph` (its GraphDef *has* a library) that
:func:`~amp_rewrite.testing.models.run_model_graph` runs on CPU. Function names carry
process-wide counters, so find functions by the nodes that call them, not by name.
:func:`item_cast_counts` and :func:`casts_per_iteration` measure what a rewrite costs.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework.graph_pb2 import GraphDef
from tensorflow.core.framework.node_def_pb2 import NodeDef

from amp_rewrite.core.casts import is_amp_cast
from amp_rewrite.core.functions import LOOP_OPS
from amp_rewrite.core.graph_io import parse_tensor_name
from amp_rewrite.core.program import Program, program_of
from amp_rewrite.testing.models import (
    NUM_CLASSES,
    ModelGraph,
    captured_variables,
    number_custom_gradients,
    trace_training_step,
)

LOOP_GRAPH_NAMES: tuple[str, ...] = ("lstm", "gru", "while_loop")

_RECURRENT = {"seq_len": 8, "features": 16, "units": 32}
_WHILE_LOOP = {"width": 16, "iterations": 6}


def build_loop_graph(name: str, *, batch: int = 2, seed: int = 0) -> ModelGraph:
    """Build graph ``name`` (one of :data:`LOOP_GRAPH_NAMES`) with random weights and trace it."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown loop graph {name!r}; choose one of {', '.join(LOOP_GRAPH_NAMES)}")
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")
    keras.backend.clear_session()
    keras.utils.set_random_seed(seed)
    concrete, variables, trainable, feeds = _BUILDERS[name](batch, np.random.default_rng(seed))
    graph_def = concrete.graph.as_graph_def()
    if not any(node.op in LOOP_OPS for node in graph_def.node):
        raise RuntimeError(f"loop graph {name!r} traced without a functional While; its loop was unrolled or inlined")
    number_custom_gradients(graph_def)
    placeholder_to_variable = captured_variables(concrete, variables)
    trainable_ids = {id(variable) for variable in trainable}
    return ModelGraph(
        name=name,
        graph_def=graph_def,
        fetches=tuple(tensor.op.name for tensor in concrete.graph.outputs),
        feeds=MappingProxyType(feeds),
        variables=MappingProxyType({tensor: v.numpy() for tensor, v in placeholder_to_variable.items()}),
        trainable=frozenset(tensor for tensor, v in placeholder_to_variable.items() if id(v) in trainable_ids),
        training=bool(trainable),
    )


@dataclass(frozen=True)
class CastCount:
    """AMP casts (spec §2.6) in one item: all of them, and those that run.

    A cast whose input is a ``Const`` does not run: grappler's constant folding, which
    follows AMP in the pipeline, turns ``Const → Cast`` into a low-precision ``Const``
    (spec §2.7); grappler's own "cast(s)" count leaves them out for the same reason.
    """

    total: int
    run_time: int


def item_cast_counts(graph_def: GraphDef | Program) -> dict[str, CastCount]:
    """Casts per item: the main graph (``MAIN_GRAPH``), then each library function."""
    program = graph_def if isinstance(graph_def, Program) else program_of(graph_def)
    return {item: _cast_count(program.item(item)) for item in program.names}


def _cast_count(graph_def: GraphDef) -> CastCount:
    node_to_op = {node.name: node.op for node in graph_def.node}
    casts = [node for node in graph_def.node if is_amp_cast(node)]
    folded = sum(node_to_op.get(parse_tensor_name(node.input[0]).node) == "Const" for node in casts)
    return CastCount(len(casts), len(casts) - folded)


def casts_per_iteration(graph_def: GraphDef) -> dict[str, int]:
    """Per functional loop (keyed by its body function): run-time casts one iteration executes.

    That is the casts in the body and the cond and in what they call, transitively: a
    call counts its callee, an ``If``/``Case`` its costliest branch (only one runs), a
    nested loop one iteration of its own.
    """
    program = program_of(graph_def)
    library = program.library
    function_to_casts = {name: count.run_time for name, count in item_cast_counts(program).items()}
    executed: dict[str, int] = {}

    def cost(name: str) -> int:
        if name not in executed:
            calls = sum(_call_cost(node, library, cost) for node in library[name].node_def)
            executed[name] = function_to_casts[name] + calls
        return executed[name]

    nodes = [*graph_def.node, *(node for f in library.values() for node in f.node_def)]
    loops = [node for node in nodes if node.op in LOOP_OPS]
    return {
        node.attr["body"].func.name: cost(node.attr["body"].func.name) + cost(node.attr["cond"].func.name)
        for node in sorted(loops, key=lambda node: node.attr["body"].func.name)
    }


def _call_cost(node: NodeDef, library: Mapping[str, Any], cost: Callable[[str], int]) -> int:
    """Casts one execution of ``node`` runs inside the functions it calls."""
    if node.op in library:
        return cost(node.op)
    if node.op in ("PartitionedCall", "StatefulPartitionedCall"):
        return cost(node.attr["f"].func.name)
    if node.op in LOOP_OPS:
        return cost(node.attr["body"].func.name) + cost(node.attr["cond"].func.name)
    if node.op in ("If", "StatelessIf"):
        return max(cost(node.attr["then_branch"].func.name), cost(node.attr["else_branch"].func.name))
    if node.op in ("Case", "StatelessCase"):
        return max((cost(f.name) for f in node.attr["branches"].list.func), default=0)
    return 0


# --- the graphs ----------------------------------------------------------------------
# Each builder takes (batch, rng) and returns the ConcreteFunction, every variable it may
# capture, the trainable ones, and feeds for its inputs ("x:0", "y:0").
_Built = tuple[Any, list[Any], list[Any], Mapping[str, np.ndarray]]


def _recurrent_training_step(layer: Callable[[int], keras.layers.Layer], name: str) -> Callable[..., _Built]:
    def build(batch: int, rng: np.random.Generator) -> _Built:
        spec = _RECURRENT
        model = keras.Sequential(
            [
                keras.Input((spec["seq_len"], spec["features"])),
                layer(spec["units"]),
                keras.layers.Dense(NUM_CLASSES, activation="softmax"),
            ],
            name=name,
        )
        x = rng.standard_normal((batch, spec["seq_len"], spec["features"]), dtype=np.float32)
        y = rng.integers(0, NUM_CLASSES, size=batch, dtype=np.int32)
        x_spec = tf.TensorSpec(x.shape, tf.float32, name="x")
        concrete, variables = trace_training_step(model, x_spec, tf.TensorSpec([batch], tf.int32, name="y"))
        return concrete, variables, list(model.trainable_variables), {"x:0": x, "y:0": y}

    return build


def _build_while_loop(batch: int, rng: np.random.Generator) -> _Built:
    """x → while i < N: h = Relu(h @ w); h = cond(i even, h * 0.5, h + 0.1) → project(h) = h @ v.

    The ``tf.cond`` predicate depends only on the counter, so rounding cannot change
    which branch runs; the weights are scaled so the values stay of order one.
    """
    width, iterations = _WHILE_LOOP["width"], _WHILE_LOOP["iterations"]
    scale = np.float32(1.5 / np.sqrt(width))
    w = keras.Variable(rng.standard_normal((width, width), dtype=np.float32) * scale, name="w")
    v = keras.Variable(rng.standard_normal((width, width), dtype=np.float32) * scale, name="v")

    @tf.function
    def project(h: Any) -> Any:
        return tf.matmul(h, v)

    def step(x: Any) -> Any:
        def body(i: Any, h: Any) -> tuple[Any, Any]:
            h = tf.nn.relu(tf.matmul(h, w))
            h = tf.cond(tf.equal(i % 2, 0), lambda: h * 0.5, lambda: h + 0.1)
            return i + 1, h

        _, h = tf.while_loop(lambda i, h: i < iterations, body, (tf.constant(0), x))
        return project(h)

    x = rng.standard_normal((batch, width), dtype=np.float32)
    concrete = tf.function(step).get_concrete_function(tf.TensorSpec(x.shape, tf.float32, name="x"))
    return concrete, [w, v], [], {"x:0": x}


_BUILDERS: dict[str, Callable[[int, np.random.Generator], _Built]] = {
    "lstm": _recurrent_training_step(keras.layers.LSTM, "lstm"),
    "gru": _recurrent_training_step(keras.layers.GRU, "gru"),
    "while_loop": _build_while_loop,
}
