"""Small built-in Keras models traced to GraphDefs, for tests, tools, the demo and benchmarks.

Each model has random weights (nothing is downloaded) and comes in two flavours:

* inference: ``model(x, training=False)``;
* training: one full step — forward, sparse categorical cross-entropy, ``tf.GradientTape``
  gradients and a Keras ``SGD`` update — so the graph holds the real variable updates
  (``ReadVariableOp``, ``AssignSubVariableOp``, ``AssignVariableOp``, ...).

Both are traced with ``tf.function(...).get_concrete_function`` and emitted with
``graph.as_graph_def()``; the GraphDef has no function library. Model variables are
*not* frozen: each captured variable is a ``Placeholder`` of dtype ``resource`` (named
like ``mlp_1/dense_1/Cast/ReadVariableOp/resource``) read by ``ReadVariableOp`` and
updated by ``AssignSubVariableOp``. ``ModelGraph.variables`` maps those placeholders to
the variables' initial values, and :func:`run_graph` runs any GraphDef with that
interface — the original or a rewritten one — on CPU by creating fresh variables and
binding their handles to the placeholders.

Building the same model twice in one process gives a byte-identical GraphDef: Keras'
name counters are reset and every random source is seeded.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework.graph_pb2 import GraphDef

MODEL_NAMES: tuple[str, ...] = ("mlp", "cnn", "resnet50", "transformer")

NUM_CLASSES = 10
LEARNING_RATE = 0.01
# Image sizes when ``image_size`` is not given: ResNet50 at its real size (the benchmark
# graph), the small CNN at CIFAR size. ResNet50 accepts anything from 32 up.
_DEFAULT_IMAGE_SIZE = {"cnn": 32, "resnet50": 224}
_MLP_FEATURES = 64
_TRANSFORMER = {"vocab": 100, "seq_len": 16, "width": 32, "heads": 4, "ff_width": 64, "layers": 2}


@dataclass(frozen=True)
class ModelGraph:
    """A traced model: its GraphDef and everything needed to run it.

    ``feeds`` maps input placeholder tensors (``"x:0"``, and ``"y:0"`` for the labels of a
    training step) to a deterministic sample batch. ``variables`` maps each resource
    placeholder tensor (a captured Keras or optimizer variable) to the variable's initial
    value; pass both to :func:`run_graph`. ``trainable`` names the placeholders of the
    trainable weights: a training step moves each by ``-LEARNING_RATE * gradient``; the
    other variables are Keras state (BatchNormalization moving statistics) and the
    optimizer's ``iteration`` and ``learning_rate``.
    """

    name: str
    graph_def: GraphDef  # no function library: everything inline
    fetches: tuple[str, ...]
    feeds: Mapping[str, np.ndarray]
    variables: Mapping[str, np.ndarray]
    trainable: frozenset[str]
    training: bool


@dataclass(frozen=True)
class GraphRun:
    """What :func:`run_graph` computed.

    ``outputs`` maps each fetch node name to its port-0 value; ``variables`` maps each
    resource placeholder tensor to the variable's value *after* the run (for a training
    step: the updated weights).
    """

    outputs: Mapping[str, np.ndarray]
    variables: Mapping[str, np.ndarray]


def build_model_graph(
    name: str, *, training: bool, batch: int = 2, seed: int = 0, image_size: int | None = None
) -> ModelGraph:
    """Build model ``name`` (one of :data:`MODEL_NAMES`) with random weights and trace it.

    ``image_size`` sets the square input of the image models (``cnn``: 32, ``resnet50``:
    224 by default; ResNet50 needs at least 32). It changes tensor shapes only, never
    the graph's structure.
    """
    if name not in _BUILDERS:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_NAMES)}")
    if image_size is not None and name not in _DEFAULT_IMAGE_SIZE:
        raise ValueError(
            f"image_size applies to the image models ({', '.join(_DEFAULT_IMAGE_SIZE)}), "
            f"not to {name!r}; leave it out"
        )
    if batch < 1:
        raise ValueError(f"batch must be at least 1, got {batch}")

    keras.backend.clear_session()  # resets Keras' name counters: same names every build
    keras.utils.set_random_seed(seed)
    size = image_size if image_size is not None else _DEFAULT_IMAGE_SIZE.get(name)
    model, x_spec, x_sample = _BUILDERS[name](size, batch, np.random.default_rng(seed))
    y_spec = tf.TensorSpec([batch], tf.int32, name="y")
    y_sample = np.random.default_rng(seed + 1).integers(0, NUM_CLASSES, size=batch, dtype=np.int32)

    if training:
        concrete, variables = trace_training_step(model, x_spec, y_spec)
        feeds = {"x:0": x_sample, "y:0": y_sample}
    else:
        concrete = tf.function(lambda x: model(x, training=False)).get_concrete_function(x_spec)
        variables = list(model.variables)
        feeds = {"x:0": x_sample}

    graph_def = concrete.graph.as_graph_def()
    if graph_def.library.function:
        names = ", ".join(f.signature.name for f in graph_def.library.function)
        raise RuntimeError(f"model {name!r} traced with library functions ({names}); models must be inline")
    number_custom_gradients(graph_def)
    fetches = tuple(tensor.op.name for tensor in concrete.graph.outputs)
    placeholder_to_variable = captured_variables(concrete, variables)
    trainable_ids = {id(variable) for variable in model.trainable_variables}
    return ModelGraph(
        name=name,
        graph_def=graph_def,
        fetches=fetches,
        feeds=MappingProxyType(feeds),
        variables=MappingProxyType({tensor: v.numpy() for tensor, v in placeholder_to_variable.items()}),
        trainable=frozenset(tensor for tensor, v in placeholder_to_variable.items() if id(v) in trainable_ids),
        training=training,
    )


def run_graph(
    graph_def: GraphDef,
    *,
    fetches: Sequence[str],
    feeds: Mapping[str, np.ndarray],
    variables: Mapping[str, np.ndarray] = MappingProxyType({}),
) -> GraphRun:
    """Run ``graph_def`` once on CPU, exactly as given, and return fetches and variables.

    Each resource placeholder named in ``variables`` is bound to a fresh variable holding
    the given value, so runs are independent. Grappler is switched off for the session:
    the graph runs node for node as written (no fusing, folding or casts removed).
    """
    graph = tf.Graph()
    with graph.as_default(), tf.device("/device:CPU:0"):
        placeholder_to_variable = {
            tensor: tf.Variable(variables[tensor], name=f"run_graph_variable_{index}")
            for index, tensor in enumerate(sorted(variables))
        }
        imported = tf.graph_util.import_graph_def(
            graph_def,
            input_map={tensor: variable.handle for tensor, variable in placeholder_to_variable.items()},
            return_elements=[f"{node}:0" for node in fetches],
            name="model",
        )
        # Reads run after the step: they depend on every fetch, which depends on the updates.
        with tf.control_dependencies(imported):
            reads = {tensor: variable.read_value() for tensor, variable in placeholder_to_variable.items()}
        init = tf.compat.v1.global_variables_initializer()

    config = tf.compat.v1.ConfigProto(device_count={"GPU": 0}, allow_soft_placement=True)
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    feed_dict = {graph.get_tensor_by_name(f"model/{tensor}"): value for tensor, value in feeds.items()}
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        outputs, after = session.run((list(imported), reads), feed_dict=feed_dict)
    return GraphRun(
        outputs=MappingProxyType(dict(zip(fetches, outputs))),
        variables=MappingProxyType(after),
    )


def run_model_graph(model: ModelGraph, graph_def: GraphDef | None = None) -> GraphRun:
    """Run ``model``'s graph — or ``graph_def``, a rewrite of it — with the model's inputs."""
    return run_graph(
        model.graph_def if graph_def is None else graph_def,
        fetches=model.fetches,
        feeds=model.feeds,
        variables=model.variables,
    )


# --- tracing ------------------------------------------------------------------------------


def trace_training_step(
    model: keras.Model, x_spec: tf.TensorSpec, y_spec: tf.TensorSpec
) -> tuple[Any, list[keras.Variable]]:
    """Trace forward + loss + gradients + SGD update; return the ConcreteFunction and all
    variables it may capture (the model's and the optimizer's).

    The step returns the loss. tf.function's automatic control dependencies make that
    output wait for every variable update, so fetching the loss keeps the updates.
    """
    optimizer = keras.optimizers.SGD(learning_rate=LEARNING_RATE)
    optimizer.build(model.trainable_variables)  # optimizer variables exist before tracing
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    def step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    concrete = tf.function(step).get_concrete_function(x_spec, y_spec)
    return concrete, [*model.variables, *optimizer.variables]


def number_custom_gradients(graph_def: GraphDef) -> None:
    """Renumber ``_gradient_op_type`` attrs (``CustomGradient-<process-wide uid>``) from 0.

    ``tf.custom_gradient`` (the Keras optimizer uses one) tags its ``IdentityN`` with a uid
    that grows with every trace, so without this two builds would differ. The attr only
    names a Python gradient function; nothing reads it from an emitted GraphDef.
    """
    old_to_new: dict[bytes, bytes] = {}
    for node in graph_def.node:
        if "_gradient_op_type" in node.attr:
            value = node.attr["_gradient_op_type"]
            value.s = old_to_new.setdefault(value.s, b"CustomGradient-%d" % len(old_to_new))


def captured_variables(concrete: Any, variables: Sequence[keras.Variable]) -> dict[str, keras.Variable]:
    """Resource placeholder tensor name -> the variable (one of ``variables``) it captures."""
    handle_to_variable = {id(variable.value.handle): variable for variable in variables}
    placeholder_to_variable = {}
    for external, internal in concrete.graph.captures:
        variable = handle_to_variable.get(id(external))
        if variable is None:
            raise RuntimeError(
                f"captured tensor {internal.name} is not a variable; models must capture variables only"
            )
        placeholder_to_variable[internal.name] = variable
    return placeholder_to_variable


# --- the models ---------------------------------------------------------------------------
# Each builder takes (image size or None, batch, rng) and returns the model, its input
# TensorSpec (named "x") and a deterministic sample input.
_Built = tuple[keras.Model, tf.TensorSpec, np.ndarray]


def _build_mlp(size: int | None, batch: int, rng: np.random.Generator) -> _Built:
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((_MLP_FEATURES,)),
            layers.Dense(128, activation="relu"),
            layers.Dense(64, activation="relu"),
            layers.Dense(NUM_CLASSES, activation="softmax"),
        ],
        name="mlp",
    )
    x = rng.standard_normal((batch, _MLP_FEATURES), dtype=np.float32)
    return model, tf.TensorSpec(x.shape, tf.float32, name="x"), x


def _build_cnn(size: int | None, batch: int, rng: np.random.Generator) -> _Built:
    layers = keras.layers
    model = keras.Sequential(
        [
            keras.Input((size, size, 3)),
            layers.Conv2D(16, 3, padding="same", use_bias=False),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.MaxPooling2D(),
            layers.Conv2D(32, 3, padding="same", use_bias=False),
            layers.BatchNormalization(),
            layers.ReLU(),
            layers.GlobalAveragePooling2D(),
            layers.Dense(NUM_CLASSES, activation="softmax"),
        ],
        name="cnn",
    )
    x = rng.standard_normal((batch, size, size, 3), dtype=np.float32)
    return model, tf.TensorSpec(x.shape, tf.float32, name="x"), x


def _build_resnet50(size: int | None, batch: int, rng: np.random.Generator) -> _Built:
    model = keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=NUM_CLASSES)
    x = rng.standard_normal((batch, size, size, 3), dtype=np.float32)
    return model, tf.TensorSpec(x.shape, tf.float32, name="x"), x


def _build_transformer(size: int | None, batch: int, rng: np.random.Generator) -> _Built:
    """A small encoder classifier over token ids: embeddings, N post-norm blocks, pooling."""
    layers = keras.layers
    spec = _TRANSFORMER
    tokens = keras.Input((spec["seq_len"],), dtype="int32")
    hidden = layers.Embedding(spec["vocab"], spec["width"])(tokens)
    hidden = PositionEmbedding(spec["seq_len"], spec["width"])(hidden)
    for _ in range(spec["layers"]):
        attention = layers.MultiHeadAttention(spec["heads"], key_dim=spec["width"] // spec["heads"])(hidden, hidden)
        hidden = layers.LayerNormalization()(hidden + attention)
        feed_forward = layers.Dense(spec["ff_width"], activation="gelu")(hidden)
        feed_forward = layers.Dense(spec["width"])(feed_forward)
        hidden = layers.LayerNormalization()(hidden + feed_forward)
    pooled = layers.GlobalAveragePooling1D()(hidden)
    probabilities = layers.Dense(NUM_CLASSES, activation="softmax")(pooled)
    model = keras.Model(tokens, probabilities, name="transformer")
    x = rng.integers(0, spec["vocab"], size=(batch, spec["seq_len"]), dtype=np.int32)
    return model, tf.TensorSpec(x.shape, tf.int32, name="x"), x


class PositionEmbedding(keras.layers.Layer):
    """Adds a learned embedding per sequence position."""

    def __init__(self, length: int, width: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.table = self.add_weight(shape=(length, width), initializer="glorot_uniform", name="table")

    def call(self, inputs: Any) -> Any:
        return inputs + self.table


_BUILDERS: dict[str, Callable[[int | None, int, np.random.Generator], _Built]] = {
    "mlp": _build_mlp,
    "cnn": _build_cnn,
    "resnet50": _build_resnet50,
    "transformer": _build_transformer,
}
