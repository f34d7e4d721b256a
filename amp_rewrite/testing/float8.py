"""Helpers for the float8 target's tests and GPU check, until calibration is in the package.

``tensor_amax`` runs a float32 GraphDef and takes each float32 tensor's largest finite |x|,
keyed ``(function, node, port)`` as calibration will hand them over (main graph only).
``xla_function`` turns a GraphDef into one ``tf.function(jit_compile=True)``: a plain
GraphDef's main graph is no function, so this is how its float8 matmuls reach XLA.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any

import numpy as np
import tensorflow as tf
from tensorflow.core.framework.graph_pb2 import GraphDef

NO_VARIABLES: Mapping[str, np.ndarray] = MappingProxyType({})


def tensor_amax(graph_def: GraphDef, batches: Sequence[Mapping[str, np.ndarray]],
                variables: Mapping[str, np.ndarray] = NO_VARIABLES) -> dict[tuple[str, str, int], float]:
    """Largest finite |x| of every float32 tensor of ``graph_def``'s main graph over ``batches``
    (``{"x:0": array}`` feeds); ``variables`` binds resource placeholders as ``run_graph`` does."""
    graph = tf.Graph()
    with graph.as_default():
        handles = {tensor: tf.Variable(value).handle for tensor, value in variables.items()}
        tf.graph_util.import_graph_def(graph_def, input_map=handles, name="m")
        init = tf.compat.v1.global_variables_initializer()
    tensors = {("", op.name[2:], port): out for op in graph.get_operations() if op.name.startswith("m/")
               for port, out in enumerate(op.outputs) if out.dtype == tf.float32}
    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    amax: dict[tuple[str, str, int], float] = {}
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        for batch in batches:
            values = session.run(tensors, {graph.get_tensor_by_name(f"m/{k}"): v for k, v in batch.items()})
            for key, value in values.items():
                finite = np.abs(value[np.isfinite(value)])
                amax[key] = max(amax.get(key, 0.0), float(finite.max()) if finite.size else 0.0)
    return amax


def xla_function(graph_def: GraphDef, inputs: Sequence[str], fetches: Sequence[str],
                 variables: Mapping[str, np.ndarray] = NO_VARIABLES) -> Callable[..., Any]:
    """``graph_def`` as a ``tf.function(jit_compile=True)`` taking ``inputs`` (placeholder
    tensors, in order) and returning the port-0 outputs of the ``fetches`` nodes; each
    resource placeholder in ``variables`` is bound to a fresh variable with that value."""
    bound = {tensor: tf.Variable(value) for tensor, value in variables.items()}

    def imported() -> Any:
        graph = tf.compat.v1.get_default_graph()
        return tf.graph_util.import_graph_def(
            graph_def, input_map={t: graph.capture(v.handle) for t, v in bound.items()},
            return_elements=[f"{f}:0" for f in fetches], name="")

    pruned = tf.compat.v1.wrap_function(imported, []).prune(list(inputs), [f"{f}:0" for f in fetches])
    function = tf.function(lambda *xs: pruned(*xs), jit_compile=True)
    function.keep_alive = bound  # the variables live as long as the function
    return function
