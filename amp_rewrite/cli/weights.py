"""Weights stored in the target precision, on disk (``convert``'s default; ``--float32-weights``
keeps them float32).

``core/weights.py`` decides from the graph which weights every reader reads in the target
dtype, and changes the graph. What the graph cannot say is read here: which object of a
SavedModel's object graph holds which checkpoint key (the checkpoint's own object graph),
and which keys another MetaGraphDef sharing ``variables/`` restores. Then the SavedModel's
``SavedVariable.dtype`` entries and the checkpoint change to match. The checkpoint is
written in bounded memory, whatever its size (``LowCheckpoint``): a chunk of low keys at a
time, read back from the source and rounded once as the per-call cast rounded them
(``core.weights.round_to``), written by TensorFlow's own ``SaveV2``; every other tensor (the
object graph's key included) copied byte for byte; the source's shards kept.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import tempfile
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import tensorflow as tf
from google.protobuf import message
from tensorflow.core.framework import variable_pb2
from tensorflow.core.protobuf import saved_model_pb2, tensor_bundle_pb2, trackable_object_graph_pb2

from amp_rewrite.calibration.savedmodel import Model, tag_set_text
from amp_rewrite.calibration import bundle
from amp_rewrite.core.functions import split_scope
from amp_rewrite.core.graph_io import parse_tensor_name
from amp_rewrite.core.program import MAIN_GRAPH
from amp_rewrite.core.rewrite import RewriteResult, gc_paused
from amp_rewrite.core.canonical import LOW_DTYPES
from amp_rewrite.core.report import dtype_name
from amp_rewrite.core.target import FLOAT_DTYPES
from amp_rewrite.core.weights import FLOAT32, ObjectGraph, StoredWeights, restored_keys, round_to, store_weights
from amp_rewrite.errors import GraphError, ModelError, tensorflow_cause

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"  # the checkpoint's object graph (tf.train.Checkpoint)
VARIABLE_VALUE = "VARIABLE_VALUE"                 # the attribute a variable's value is saved as
TRAINABLE_COLLECTION = "trainable_variables"    # a TF1 MetaGraphDef's (tf.compat.v1.GraphKeys.TRAINABLE_VARIABLES)
# What ``with_weights`` saved non-trainable, so that widening them back to float32 (``--target
# float32``, retargeting) makes them trainable again: MetaGraphDef collections, which loaders
# keep as they are. The object ids of the variables that were trainable; a Keras export's
# trainable_variables list as it was; TF1: the VariableDefs taken out of trainable_variables.
UNTRAINED = "amp_rewrite_untrained"
TRAINABLE_ORDER = "amp_rewrite_trainable_order"
UNTRAINED_TF1 = "amp_rewrite_untrained_variables"
CHUNK_BYTES = 16 << 20  # float32 bytes of low keys read, rounded and written at once (tests pass less)
COPY_BLOCK = 8 << 20    # bytes copied at once from a source shard


def checkpoint_prefix(model: Model) -> Path:
    return model.path / "variables" / "variables"


def _reader(model: Model) -> Any:
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
    file's float32 ``Const`` weights. No GC runs meanwhile: the walks hold a few small
    objects per variable op until they return."""
    with gc_paused():
        return _stored_weights(model, result, target)


def _stored_weights(model: Model, result: RewriteResult, target: str) -> StoredWeights:
    kept = {(MAIN_GRAPH, parse_tensor_name(fetch).node): "an output of the model" for fetch in model.fetches}
    kept.update(model.preserved)
    if model.kind == "graphdef":
        return store_weights(result.graph_def, target, kept=kept, variables=False, constants=True)
    if not (model.path / "variables" / "variables.index").exists():
        return store_weights(result.graph_def, target, kept=kept, variables=False)
    check_checkpoint(model)
    reader = _reader(model)
    objects, blocked = _object_graph(model, reader)
    if model.is_tf_keras:
        why = ("is restored into float32 layers by tf_keras.models.load_model (keras_metadata.pb describes them);"
               " tf.saved_model.load runs the converted functions all the same")
        blocked.update(dict.fromkeys(reader.get_variable_to_dtype_map(), why))
    for index, meta in enumerate(model.saved_model.meta_graphs):
        if index != model.meta_graph_index:
            why = (f"is also restored by the MetaGraphDef tagged {tag_set_text(meta.meta_info_def.tags)!r}, which"
                   " this run does not convert (it reads float32)")
            blocked.update(dict.fromkeys(restored_keys(meta.graph_def), why))
    try:
        stored = store_weights(result.graph_def, target, kept=kept, objects=objects, blocked_keys=blocked,
                               roots=model.entry_functions)
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
            if found is not None and found.as_datatype_enum != FLOAT32 and key not in model.widened_keys:
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
    except (tf.errors.OpError, ValueError, IndexError, message.DecodeError) as error:  # IndexError: bytes missing
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


def widen_weights(model: Model) -> Model:
    """A retargeted SavedModel whose graph now reads as float32 the variables the source
    stored low (``canonical_model(variables=True)``): its object graph says float32 for
    them too, those an earlier conversion saved non-trainable are trainable again
    (``_retrain``), and ``widened_keys`` names their checkpoint keys, which ``LowCheckpoint``
    widens as it writes. Other models are returned as they are."""
    if model.kind != "savedmodel" or model.canonical is None or not model.canonical.variables_widened:
        return model
    reader = _reader(model)
    low = {key: dtype.as_datatype_enum for key, dtype in reader.get_variable_to_dtype_map().items()
           if dtype.as_datatype_enum in LOW_DTYPES}
    objects, _ = _object_graph(model, reader)
    saved_model = saved_model_pb2.SavedModel()
    saved_model.CopyFrom(model.saved_model)
    meta = saved_model.meta_graphs[model.meta_graph_index]
    widened = {node_id for node_id, key in (objects.object_to_key.items() if objects else ()) if key in low}
    for node_id in widened:
        meta.object_graph_def.nodes[node_id].variable.dtype = FLOAT32
    _retrain(meta, widened, set(low))
    return dataclasses.replace(model, saved_model=saved_model, widened_keys=low)


@dataclass(frozen=True)
class _Change:
    """What storing one weight in another low dtype does to its values."""

    name: str
    dtype: int          # the dtype it is stored in now
    elements: int
    changed: int        # elements whose value changes
    largest: float      # the largest |change| of a finite value
    overflow: float     # the largest finite |value| that becomes inf (0: none)


@dataclass(frozen=True)
class _StoredLow:
    """The weights a retargeted model's source stored low: a SavedModel's checkpoint keys, or
    a GraphDef's constants (by ``[FUNCTION::]node``), each with its dtype and its values."""

    kind: str                              # "key(s)" or "constant(s)", as the lines count them
    source: Mapping[str, int]              # key or constant -> the dtype the source stored it in
    values: Callable[[str], np.ndarray]    # its values, widened to float32

    def names(self, weight: Any) -> tuple[str, ...]:
        """A weight's keys (a variable's) or its own name (a constant's) that the source stored low."""
        found = weight.keys if weight.kind == "variable" else (weight.name,)
        return tuple(name for name in found if name in self.source)


def _stored_low(model: Model) -> _StoredLow | None:
    if model.widened_keys:
        reader = _reader(model)
        return _StoredLow("key(s)", model.widened_keys, lambda key: np.asarray(reader.get_tensor(key), np.float32))
    constants = model.canonical.low_constants if model.canonical is not None and model.kind == "graphdef" else {}
    if constants:
        return _StoredLow("constant(s)", constants, lambda name: _constant_values(model.graph_def, name))
    return None


def _constant_values(graph_def: Any, name: str) -> np.ndarray:
    """A Const's values in ``graph_def`` (float32 once canonical), by ``[FUNCTION::]node``."""
    function, node = split_scope(name)
    nodes = graph_def.node if function is None else next(
        f.node_def for f in graph_def.library.function if f.signature.name == function)
    found = next(n for n in nodes if n.name == node)
    return np.asarray(tf.make_ndarray(found.attr["value"].tensor), np.float32)


def retargeted_weights_lines(model: Model, stored: StoredWeights | None, *, force: bool) -> list[str]:
    """What retargeting did to the weights the source stored low: widened to float32 exactly,
    or stored in the other low dtype, measured per weight (one line each). A value beyond the
    new dtype's range is refused (``ModelError``), unless ``force``."""
    canonical = model.canonical
    if canonical is not None and canonical.low_variables and not canonical.variables_widened:
        return [f"Weights: {len(canonical.low_variables)} variable(s) stay stored low as the source has them (e.g."
                f" {canonical.low_variables[0]!r}), read through a cast: --calibrate and --tune run the model as it"
                " is on disk; convert it with --target float32 first to retarget them too"]
    low = _stored_low(model)
    if low is None:
        return []
    moved = [weight for weight in (stored.weights if stored else ()) if weight.low and low.names(weight)]
    changes = [_change(low, weight) for weight in moved
               if any(low.source[name] != weight.dtype for name in low.names(weight))]
    over = [change for change in changes if change.overflow]
    if over and not force:
        raise ModelError(f"{model.path}: weight '{over[0].name}' holds {over[0].overflow:g}, beyond"
                         f" {dtype_name(over[0].dtype)}'s range: stored so it would be inf; pass --force to store it"
                         " anyway, or --float32-weights to keep it float32")
    relowered = {name for weight in moved for name in low.names(weight)}
    widened = [name for name in low.source if name not in relowered]
    lines = []
    if widened:
        lines.append(f"Weights: {len(widened)} {low.kind} stored in {_dtypes(low, widened)} widened to float32,"
                     " exactly: the precision they lost earlier is not recovered")
    if changes:
        lines.append(f"Weights retargeted from {_dtypes(low, relowered)} to {dtype_name(changes[0].dtype)}, per weight:")
    for change in changes:
        line = (f"  {change.name}: {change.changed} of {change.elements} element(s) change, largest change"
                f" {change.largest:.3g}")
        lines.append(line + (f"; {change.overflow:g} becomes inf (--force)" if change.overflow else ""))
    return lines


def _dtypes(low: _StoredLow, names: Any) -> str:
    return " and ".join(sorted({dtype_name(low.source[name]) for name in names}))


def _change(low: _StoredLow, weight: Any) -> _Change:
    """One weight's values, as the source stored them, against them in ``weight.dtype``."""
    elements = changed = 0
    largest = overflow = 0.0
    for name in low.names(weight):
        values = low.values(name).ravel()
        stored = round_to(values, weight.dtype).astype(np.float32)
        finite = np.isfinite(values)
        lost = finite & ~np.isfinite(stored)
        difference = np.abs(np.where(finite & ~lost, stored - values, 0))
        elements += values.size
        changed += int(np.count_nonzero((stored != values) & finite))
        largest = max(largest, float(difference.max(initial=0)))
        overflow = max(overflow, float(np.abs(values[lost]).max(initial=0)))
    return _Change(weight.name, weight.dtype, elements, changed, largest, overflow)


def with_weights(model: Model, stored: StoredWeights) -> Model:
    """``model`` whose object graph says the dtype each variable is now stored in, and that
    the low ones are not trainable (TF1: out of the trainable_variables collection): updates
    smaller than their precision would round away, so fine-tuning code must not see them as
    float32 master weights (``--float32-weights`` keeps those)."""
    if model.kind != "savedmodel" or not stored.low_keys:
        return model
    saved_model = saved_model_pb2.SavedModel()
    saved_model.CopyFrom(model.saved_model)
    meta = saved_model.meta_graphs[model.meta_graph_index]
    dtype = next(weight.dtype for weight in stored.weights if weight.low)
    nodes = meta.object_graph_def.nodes
    _mark(meta, UNTRAINED, [node_id for node_id in sorted(stored.low_objects) if nodes[node_id].variable.trainable])
    for node_id in stored.low_objects:
        nodes[node_id].variable.dtype = dtype
        nodes[node_id].variable.trainable = False
    _untrain_lists(meta, stored.low_objects)
    if TRAINABLE_COLLECTION in meta.collection_def:
        low = {weight.name for weight in stored.weights if weight.low}
        values = meta.collection_def[TRAINABLE_COLLECTION].bytes_list.value
        moved = [value for value in values if _variable_node(value) in low]
        kept = [value for value in values if _variable_node(value) not in low]
        del values[:]
        values.extend(kept)
        meta.collection_def[UNTRAINED_TF1].bytes_list.value.extend(moved)
    return dataclasses.replace(model, saved_model=saved_model)


def _variable_node(value: bytes) -> str:
    """The variable op a TF1 collection's serialized VariableDef names."""
    return parse_tensor_name(variable_pb2.VariableDef.FromString(value).variable_name).node


def _mark(meta: Any, key: str, node_ids: list[int]) -> None:
    """Object ids added to the collection ``key`` (``UNTRAINED``, ``TRAINABLE_ORDER``), once each."""
    if node_ids:
        values = meta.collection_def[key].int64_list.value
        values.extend(node_id for node_id in node_ids if node_id not in set(values))


def _variable_lists(proto: Any) -> tuple[Any, Any] | None:
    """A Keras export's ``trainable_variables`` and ``non_trainable_variables`` lists (saved on
    the root object by ``model.export``), or None."""
    lists = {child.local_name: proto.nodes[child.node_id] for child in proto.nodes[0].children} if proto.nodes else {}
    trainable, frozen = lists.get("trainable_variables"), lists.get("non_trainable_variables")
    return None if trainable is None or frozen is None else (trainable, frozen)


def _set_children(found: Any, node_ids: list[int]) -> None:
    del found.children[:]
    for position, node_id in enumerate(node_ids):
        found.children.add(node_id=node_id, local_name=str(position))


def _untrain_lists(meta: Any, low: frozenset[int]) -> None:
    """A Keras export's ``trainable_variables`` list without the low variables, which join its
    ``non_trainable_variables``; the list as it was is kept (``TRAINABLE_ORDER``) for ``_retrain``."""
    lists = _variable_lists(meta.object_graph_def)
    if lists is None:
        return
    trainable, frozen = lists
    before = [child.node_id for child in trainable.children]
    if any(node_id in low for node_id in before) and TRAINABLE_ORDER not in meta.collection_def:
        _mark(meta, TRAINABLE_ORDER, before)
    _set_children(trainable, [node_id for node_id in before if node_id not in low])
    _set_children(frozen, [c.node_id for c in frozen.children] + [node_id for node_id in before if node_id in low])


def _retrain(meta: Any, widened: set[int], widened_names: set[str]) -> None:
    """The variables ``with_weights`` saved non-trainable (``UNTRAINED``; TF1: taken out of
    the trainable_variables collection), now widened to float32: trainable again, in a Keras
    export's ``trainable_variables`` list at their places before; the marks of those go."""
    marked = list(meta.collection_def[UNTRAINED].int64_list.value) if UNTRAINED in meta.collection_def else []
    back = [node_id for node_id in marked if node_id in widened]
    for node_id in back:
        meta.object_graph_def.nodes[node_id].variable.trainable = True
    lists = _variable_lists(meta.object_graph_def)
    if back and lists is not None and TRAINABLE_ORDER in meta.collection_def:
        (trainable, frozen), order = lists, list(meta.collection_def[TRAINABLE_ORDER].int64_list.value)
        current = [child.node_id for child in trainable.children]
        returning = {node_id for node_id in back if node_id in order}  # those _untrain_lists moved
        _set_children(trainable, [node_id for node_id in order if node_id in returning or node_id in current]
                      + [node_id for node_id in current if node_id not in order])
        _set_children(frozen, [child.node_id for child in frozen.children if child.node_id not in returning])
    _unmark(meta, UNTRAINED, [node_id for node_id in marked if node_id not in back], TRAINABLE_ORDER)
    if UNTRAINED_TF1 in meta.collection_def:
        moved = meta.collection_def[UNTRAINED_TF1].bytes_list.value
        meta.collection_def[TRAINABLE_COLLECTION].bytes_list.value.extend(
            value for value in moved if _variable_node(value) in widened_names)
        _unmark(meta, UNTRAINED_TF1, [value for value in moved if _variable_node(value) not in widened_names])


def _unmark(meta: Any, key: str, left: list, *also: str) -> None:
    """Collection ``key`` holding ``left`` only; gone, with the collections ``also``, where nothing is left."""
    if left:
        field = meta.collection_def[key].WhichOneof("kind")
        values = getattr(meta.collection_def[key], field).value
        del values[:]
        values.extend(left)
        return
    for name in (key, *also):
        if name in meta.collection_def:
            del meta.collection_def[name]


class LowCheckpoint:
    """``variables/`` of the staged copy, written a chunk at a time: the source's checkpoint
    with ``stored``'s low keys in the target dtype, each part of them in its source shard,
    and a retargeted model's keys stored low (``Model.widened_keys``) read from their dtype:
    widened to float32, exactly, where the result reads them so.

    Every other key's bytes are copied as they are (their crc32c with them). The low keys
    are read (TensorFlow's reader, which checks each crc32c; a part larger than a chunk is
    read in slices straight from its shard), rounded, and written by TensorFlow's ``SaveV2``
    a chunk at a time, each chunk's shard appended to the source part's shard; one index over
    them all. At most ``chunk_bytes`` of float32 values (and their rounded copy) are held."""

    def __init__(self, model: Model, stored: StoredWeights | None, chunk_bytes: int | None = None) -> None:
        self.model, self.chunk_bytes = model, chunk_bytes or CHUNK_BYTES
        dtype = next((weight.dtype for weight in stored.weights if weight.low), FLOAT32) if stored else FLOAT32
        # key -> the dtype written: the target's where stored low, float32 where only widened
        self.key_to_dtype = {**dict.fromkeys(model.widened_keys, FLOAT32),
                             **dict.fromkeys(stored.low_keys if stored else (), dtype)}
        self.low = frozenset(self.key_to_dtype)
        try:
            with gc_paused():  # an entry or two per key, freed with the checkpoint
                self.source = checked_index(model)
                self.parts = {key: bundle.parts(self.source, key) for key in sorted(self.low)}
        except bundle.BundleError as error:
            raise ModelError(f"{bundle.index_path(checkpoint_prefix(model))}: {error}; copy variables/ from the"
                             " original export") from None
        # entry -> (bytes per value written, read): what each rewritten entry's size becomes
        self.entry_bytes = {name: (FLOAT_DTYPES[self.key_to_dtype[key]].item_bytes, self.source_bytes(key))
                            for key, found in self.parts.items() for name, _, _ in found}
        self.low_entries = set(self.entry_bytes)
        self.progress: Callable[[int], None] = lambda written: None

    @property
    def size(self) -> int:
        """The bytes it writes: the rewritten keys' at their new size, the others' as they are."""
        return sum(entry.size * self.entry_bytes[key][0] // self.entry_bytes[key][1] if key in self.entry_bytes
                   else entry.size for key, entry in self.source.entries.items())

    def source_dtype(self, key: str) -> int:
        """The dtype ``key`` is stored in in the source: float32, or the low one it was retargeted from."""
        return self.model.widened_keys.get(key, FLOAT32)

    def source_bytes(self, key: str) -> int:
        return FLOAT_DTYPES[self.source_dtype(key)].item_bytes

    def write(self, variables: Path) -> None:
        """No GC meanwhile: a few small objects per key (its entry, its piece, its rounded values)
        live until the index is written, and GC runs would only rescan them."""
        with gc_paused():
            self._write(variables)

    def _write(self, variables: Path) -> None:
        prefix, shards = variables / "variables", self.source.header.num_shards
        entries = {key: entry for key, entry in self.source.entries.items() if entry.slices and key not in self.low}
        with tempfile.TemporaryDirectory(prefix=".chunks.", dir=variables) as scratch:
            reader = _reader(self.model)
            for shard in range(shards):
                with open(bundle.data_path(prefix, shard, shards), "wb") as out:
                    self._copy_shard(shard, out, entries)
                    _Chunks(self, reader, shard, out, Path(scratch), entries).write()
        bundle.index_path(prefix).write_bytes(bundle.index_bytes(bundle.Index(self.source.header, entries)))

    def shard_path(self, shard: int) -> Path:
        return bundle.data_path(checkpoint_prefix(self.model), shard, self.source.header.num_shards)

    def _copy_shard(self, shard: int, out: BinaryIO, entries: dict[str, Any]) -> None:
        """The keys that do not change, their bytes as they are, in the source's order."""
        kept = sorted((entry.offset, key) for key, entry in self.source.entries.items()
                      if entry.shard_id == shard and not entry.slices and key not in self.low_entries)
        with open(self.shard_path(shard), "rb") as source:
            for _, key in kept:
                entry = self.source.entries[key]
                entries[key] = _moved(entry, shard, out.tell())
                _copy_bytes(source, out, entry.offset, entry.size)
                self.progress(entry.size)


def _moved(entry: Any, shard: int, offset: int) -> Any:
    moved = tensor_bundle_pb2.BundleEntryProto()
    moved.CopyFrom(entry)
    moved.shard_id, moved.offset = shard, offset
    return moved


def _copy_bytes(source: BinaryIO, out: BinaryIO, offset: int, size: int) -> None:
    """``size`` bytes of ``source`` from ``offset`` appended to ``out``, a block at a time."""
    source.seek(offset)
    while size:
        block = source.read(min(size, COPY_BLOCK))
        if not block:
            raise ModelError(f"{source.name}: ends before byte {offset + size}; the shard is truncated: copy"
                             " variables/ from the original export")
        out.write(block)
        size -= len(block)


@dataclass(frozen=True)
class _Piece:
    """Values read, rounded and written at once: all of a stored part, or a slice of one."""

    key: str
    dims: tuple[int, ...]       # the whole tensor's
    extents: bundle.Extents     # what this piece holds of it
    part: Any                   # the stored entry holding it
    first: int                  # its first element's place in the part
    whole_part: bool

    @property
    def elements(self) -> int:
        return math.prod(length for _, length in self.extents)

    @property
    def spec(self) -> str:
        """SaveV2's and RestoreV2's shape-and-slice: "" for the whole tensor."""
        if all(start == 0 and length == size for (start, length), size in zip(self.extents, self.dims)):
            return ""
        return " ".join(map(str, self.dims)) + " " + ":".join(f"{start},{length}" for start, length in self.extents)


def _pieces(key: str, dims: tuple[int, ...], part: Any, extents: bundle.Extents, chunk_bytes: int
            ) -> Iterator[_Piece]:
    """A stored part of a float32 key whole when it fits a chunk, else in slices contiguous in
    its shard: along the first axis whose trailing block fits, one index on each axis before."""
    lengths = [length for _, length in extents]
    if math.prod(lengths) * 4 <= chunk_bytes:
        yield _Piece(key, dims, extents, part, 0, True)
        return
    axis = next(axis for axis in range(len(lengths)) if math.prod(lengths[axis + 1:]) * 4 <= chunk_bytes)
    block = math.prod(lengths[axis + 1:])
    step = max(1, chunk_bytes // (block * 4))
    for leading in itertools.product(*(range(size) for size in lengths[:axis])):
        row = 0
        for index, size in zip(leading, lengths[:axis]):
            row = row * size + index
        for start in range(0, lengths[axis], step):
            length = min(step, lengths[axis] - start)
            local = [*((index, 1) for index in leading), (start, length), *((0, size) for size in lengths[axis + 1:])]
            yield _Piece(key, dims, tuple((origin + begin, size) for (origin, _), (begin, size) in zip(extents, local)),
                         part, (row * lengths[axis] + start) * block, False)


class _Chunks:
    """One shard's low parts, read, rounded and written a chunk at a time (``LowCheckpoint``)."""

    def __init__(self, checkpoint: LowCheckpoint, reader: Any, shard: int, out: BinaryIO, scratch: Path,
                 entries: dict[str, Any]) -> None:
        self.checkpoint, self.reader, self.shard, self.out = checkpoint, reader, shard, out
        self.scratch, self.entries = scratch, entries
        self.pieces: list[_Piece] = []
        self.values: list[np.ndarray] = []
        self.held = 0  # the elements of the pieces held

    def write(self) -> None:
        checkpoint = self.checkpoint
        for key, found in checkpoint.parts.items():
            dims = tuple(dim.size for dim in checkpoint.source.entries[key].shape.dim)
            for _, part, extents in sorted(found, key=lambda found: found[1].offset):
                if part.shard_id != self.shard:
                    continue
                for piece in _pieces(key, dims, part, extents, checkpoint.chunk_bytes):
                    elements = piece.elements
                    if self.pieces and (self.held + elements) * 4 > checkpoint.chunk_bytes:
                        self._flush()
                    self.values.append(round_to(self._read(piece), checkpoint.key_to_dtype[key]))
                    self.pieces.append(piece)
                    self.held += elements
        self._flush()

    def _read(self, piece: _Piece) -> np.ndarray:
        """A whole part through TensorFlow's reader (its crc32c checked), a slice of one from the shard."""
        if piece.whole_part:
            try:
                if not piece.spec:
                    return self.reader.get_tensor(piece.key)
                prefix = str(checkpoint_prefix(self.checkpoint.model))
                with tf.device("CPU:0"):
                    return tf.raw_ops.RestoreV2(prefix=prefix, tensor_names=[piece.key], shape_and_slices=[piece.spec],
                                                dtypes=[tf.as_dtype(self.checkpoint.source_dtype(piece.key))])[0].numpy()
            except (tf.errors.OpError, ValueError, IndexError) as error:
                raise _unreadable(self.checkpoint.model, error) from None
        path = self.checkpoint.shard_path(self.shard)
        dtype = np.dtype(tf.as_dtype(self.checkpoint.source_dtype(piece.key)).as_numpy_dtype).newbyteorder("<")
        values = np.fromfile(path, dtype=dtype, count=piece.elements, offset=piece.part.offset + piece.first * dtype.itemsize)
        if values.size != piece.elements:
            raise ModelError(f"{path}: ends inside key '{piece.key}'; the shard is truncated: copy variables/ from the"
                             " original export")
        return values.reshape([length for _, length in piece.extents])

    def _flush(self) -> None:
        """The chunk held: written by ``SaveV2``, its shard appended to ours, its entries moved there."""
        if not self.pieces:
            return
        prefix = self.scratch / "chunk"
        try:
            with tf.device("CPU:0"):
                tf.raw_ops.SaveV2(prefix=str(prefix), tensor_names=[piece.key for piece in self.pieces],
                                  shape_and_slices=[piece.spec for piece in self.pieces], tensors=self.values)
        except tf.errors.OpError as error:
            raise ModelError(f"{self.scratch.parent}: cannot write the checkpoint ({tensorflow_cause(error)});"
                             " nothing was written; check the free space and permissions there") from None
        written = bundle.read_index(prefix)
        base = self.out.tell()
        for key, entry in written.entries.items():
            if not entry.slices:
                self.entries[key] = _moved(entry, self.shard, base + entry.offset)
            elif key in self.entries:  # a key written in slices: its whole-tensor entry lists them all
                self.entries[key].slices.extend(entry.slices)
            else:
                self.entries[key] = entry
        data = bundle.data_path(prefix, 0, 1)
        with open(data, "rb") as chunk:
            _copy_bytes(chunk, self.out, 0, data.stat().st_size)
        self.checkpoint.progress(data.stat().st_size)
        data.unlink()
        bundle.index_path(prefix).unlink()
        self.pieces, self.values, self.held = [], [], 0


def check_checkpoint(model: Model) -> None:
    """A SavedModel's checkpoint, if it has one, has every shard, each long enough (``checked_index``)."""
    if model.kind == "savedmodel" and bundle.index_path(checkpoint_prefix(model)).exists():
        checked_index(model)


def checked_index(model: Model) -> bundle.Index:
    """The source checkpoint's index, with every shard there and long enough for the keys it
    holds: a missing or cut shard is one line before anything is written."""
    prefix = checkpoint_prefix(model)
    try:
        index = bundle.read_index(prefix)
    except OSError as error:
        raise ModelError(f"{bundle.index_path(prefix)}: cannot read ({error.strerror}); copy variables/ from the"
                         " original export") from None
    except (bundle.BundleError, message.DecodeError) as error:
        raise ModelError(f"{bundle.index_path(prefix)}: not a checkpoint index TensorFlow wrote ({error}); copy"
                         " variables/ from the original export") from None
    shards = index.header.num_shards
    ends = [0] * shards
    for entry in index.entries.values():
        if not entry.slices and entry.shard_id < shards:
            ends[entry.shard_id] = max(ends[entry.shard_id], entry.offset + entry.size)
    for shard, end in enumerate(ends):
        path = bundle.data_path(prefix, shard, shards)
        if not path.exists():
            raise ModelError(f"{path}: missing (the index names {shards} shard(s)); copy variables/ from the"
                             " original export")
        if path.stat().st_size < end:
            raise ModelError(f"{path}: {path.stat().st_size} bytes, but the index places keys up to byte {end};"
                             " the shard is truncated: copy variables/ from the original export")
    return index
