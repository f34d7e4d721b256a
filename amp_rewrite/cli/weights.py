"""Weights stored in the target precision, on disk (``convert``'s default; ``--float32-weights``
keeps them float32).

``core/weights.py`` decides from the graph which weights every reader reads in the target
dtype, and changes the graph. What the graph cannot say is read here: which object of a
SavedModel's object graph holds which checkpoint key (the checkpoint's own object graph),
and which keys another MetaGraphDef sharing ``variables/`` restores. Then the SavedModel's
``SavedVariable.dtype`` entries and the checkpoint change to match: the checkpoint is
written again with TensorFlow's own writer (``SaveV2``, run eagerly), every key read back
from the source, the low ones rounded once as the per-call cast rounded them
(``core.weights.round_to``), every other tensor (the object graph's key included) as it was.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tensorflow.core.protobuf import saved_model_pb2, trackable_object_graph_pb2

from amp_rewrite.calibration.savedmodel import Model, tag_set_text
from amp_rewrite.core.errors import GraphError, ModelError, tensorflow_cause
from amp_rewrite.core.graph_io import parse_tensor_name
from amp_rewrite.core.program import MAIN_GRAPH
from amp_rewrite.core.rewrite import RewriteResult
from amp_rewrite.core.weights import FLOAT32, ObjectGraph, StoredWeights, restored_keys, round_to, store_weights

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"  # the checkpoint's object graph (tf.train.Checkpoint)
VARIABLE_VALUE = "VARIABLE_VALUE"                 # the attribute a variable's value is saved as


def checkpoint_prefix(model: Model) -> Path:
    return model.path / "variables" / "variables"


def _reader(model: Model):
    import tensorflow as tf

    try:
        return tf.train.load_checkpoint(str(checkpoint_prefix(model)))
    except (tf.errors.OpError, ValueError) as error:
        raise _unreadable(model, error) from None


def _unreadable(model: Model, error: Exception) -> ModelError:
    return ModelError(f"{checkpoint_prefix(model)}: cannot read the checkpoint ({tensorflow_cause(error)}); copy"
                      " variables/ from the original export")


def stored_weights(model: Model, result: RewriteResult, target: str) -> StoredWeights:
    """``result``'s graph with its weights in ``target``'s dtype, and each weight's fate: a
    SavedModel's variables (its checkpoint is read for its object graph only), a GraphDef
    file's float32 ``Const`` weights."""
    kept = {(MAIN_GRAPH, parse_tensor_name(fetch).node): "an output of the model" for fetch in model.fetches}
    kept.update(model.preserved)
    if model.kind == "graphdef":
        return store_weights(result.graph_def, target, kept=kept, variables=False, constants=True)
    if not (model.path / "variables" / "variables.index").exists():
        return store_weights(result.graph_def, target, kept=kept, variables=False)
    reader = _reader(model)
    objects, blocked = _object_graph(model, reader)
    for index, meta in enumerate(model.saved_model.meta_graphs):
        if index != model.meta_graph_index:
            why = (f"is also restored by the MetaGraphDef tagged {tag_set_text(meta.meta_info_def.tags)!r}, which"
                   " this run does not convert (it reads float32)")
            blocked.update(dict.fromkeys(restored_keys(meta.graph_def), why))
    try:
        stored = store_weights(result.graph_def, target, kept=kept, objects=objects, blocked_keys=blocked)
    except GraphError as error:
        raise ModelError(f"{model.path}: {error}") from None
    _check_dtypes(model, stored, reader.get_variable_to_dtype_map())
    return stored


def _check_dtypes(model: Model, stored: StoredWeights, key_to_dtype: Mapping[str, Any]) -> None:
    """The checkpoint holds each float32 variable of the graph as float32: else ``variables/``
    and ``saved_model.pb`` come from different exports, and rounding it again would be wrong."""
    for weight in stored.weights:
        for key in weight.keys:
            found = key_to_dtype.get(key)
            if found is not None and found.as_datatype_enum != FLOAT32:
                raise ModelError(f"{checkpoint_prefix(model)}: key '{key}' holds {found.name} but the graph reads"
                                 f" variable '{weight.name}' as float32; variables/ and saved_model.pb disagree:"
                                 " copy both from one export")


def _object_graph(model: Model, reader: Any) -> tuple[ObjectGraph | None, dict[str, str]]:
    """The object graph with each SavedVariable's checkpoint key; keys held by objects that
    are no SavedVariable must stay float32 (their loader restores them as it knows)."""
    proto = model.meta_graph.object_graph_def
    if not proto.nodes or not reader.has_tensor(OBJECT_GRAPH_KEY):
        return None, {}  # a TF1 SavedModel: its graph's savers are all there is
    try:
        trackable = trackable_object_graph_pb2.TrackableObjectGraph.FromString(reader.get_tensor(OBJECT_GRAPH_KEY))
    except Exception as error:  # noqa: BLE001 - a corrupt tensor or proto: one line, whatever raised
        raise _unreadable(model, error) from None
    object_to_key, blocked = {}, {}
    for node_id, node in enumerate(trackable.nodes):
        for attribute in node.attributes:
            if attribute.name != VARIABLE_VALUE:
                continue
            kind = proto.nodes[node_id].WhichOneof("kind") if node_id < len(proto.nodes) else None
            if kind == "variable":
                object_to_key[node_id] = attribute.checkpoint_key
            else:
                blocked[attribute.checkpoint_key] = f"belongs to a {kind or 'missing'} object, not a variable"
    return ObjectGraph(proto, object_to_key), blocked


def with_weights(model: Model, stored: StoredWeights) -> Model:
    """``model`` whose object graph says the dtype each variable is now stored in."""
    if model.kind != "savedmodel" or not stored.low_objects:
        return model
    saved_model = saved_model_pb2.SavedModel()
    saved_model.CopyFrom(model.saved_model)
    nodes = saved_model.meta_graphs[model.meta_graph_index].object_graph_def.nodes
    dtype = next(weight.dtype for weight in stored.weights if weight.low)
    for node_id in stored.low_objects:
        nodes[node_id].variable.dtype = dtype
    return dataclasses.replace(model, saved_model=saved_model)


def write_checkpoint(model: Model, stored: StoredWeights, variables: Path) -> None:
    """``variables/`` of the staged copy: the source's checkpoint with ``stored``'s low keys
    in the target dtype. The copy of the source's files there is replaced."""
    import tensorflow as tf

    low = stored.low_keys
    if not low:
        return  # nothing changes: the copied checkpoint stays byte for byte
    dtype = next(weight.dtype for weight in stored.weights if weight.low)
    reader = _reader(model)
    keys = sorted(reader.get_variable_to_dtype_map())
    values = []
    for key in keys:
        try:
            value = reader.get_tensor(key)
        except (tf.errors.OpError, ValueError) as error:
            raise _unreadable(model, error) from None
        values.append(round_to(value, dtype) if key in low else value)  # bytes as read: numpy drops trailing NULs
    for old in variables.glob("variables.*"):
        old.unlink()
    try:
        with tf.device("CPU:0"):
            tf.raw_ops.SaveV2(prefix=str(variables / "variables"), tensor_names=keys,
                              shape_and_slices=[""] * len(keys), tensors=values)
    except tf.errors.OpError as error:
        raise ModelError(f"{variables}: cannot write the checkpoint ({tensorflow_cause(error)}); nothing was"
                         " written; check the free space and permissions there") from None
