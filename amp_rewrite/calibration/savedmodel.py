"""Models on disk: read a SavedModel or GraphDef file, rewrite it, write the result safely.

A SavedModel keeps its signatures, variables and assets: only the graph's function
bodies of the chosen MetaGraphDef (``--tag-set``, default ``serve``) change, the others
are copied as they were. The source is never written to; the destination is staged
beside it (``staging``: contents only, so its modes are the user's, whatever the
source's) and moved into place whole, or not at all.
"""
from __future__ import annotations

import functools
import os
import re
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Protocol

from google.protobuf import message, text_format
from tensorflow.core.framework import graph_pb2, types_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2, struct_pb2

from amp_rewrite import _tf
from amp_rewrite.calibration import frozen
from amp_rewrite.calibration.staging import check_destination, check_room, staged, step
from amp_rewrite.core import colouring, functions, graph_io, instrument, support
from amp_rewrite.core.canonical import Canonical, function_called, to_float32, widen_outputs
from amp_rewrite.core.graph_io import arg_port_count, parse_tensor_name, tensor_name
from amp_rewrite.core.report import dtype_name
from amp_rewrite.core.target import LOW_DTYPES
from amp_rewrite.core.lists import OpLists, load_lists
from amp_rewrite.core.precision import SourcePrecision
from amp_rewrite.core.program import Program, program_of
from amp_rewrite.core.rewrite import RewriteResult, rewrite_graph_def
from amp_rewrite.errors import GraphError, ModelError, did_you_mean

SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")
FINGERPRINT = "fingerprint.pb"
PROTOBUF_LIMIT = 2**31 - 1   # the largest message protobuf parses
DEFAULT_TAG_SET = "serve"
KERAS_FILES = (".keras", ".h5", ".hdf5")
TF_KERAS_METADATA = "keras_metadata.pb"   # written by tf_keras' model.save(dir), read by tf_keras.models.load_model
GRAPH = "graph"  # the "signature" of a GraphDef file's placeholders and outputs

Signature = tuple[dict[str, str], dict[str, str]]  # a signature's inputs and outputs, name -> tensor


@dataclass(frozen=True)
class Model:
    """A model read from disk: a SavedModel (one meta graph rewritten) or a GraphDef file.
    What calibration, validation and tuning read of it (``program``, ``signatures``,
    ``compared_outputs``) is read once, on first use, and shared by all their steps."""

    path: Path
    kind: str  # "savedmodel" | "graphdef"
    graph_def: graph_pb2.GraphDef
    fetches: tuple[str, ...]            # tensors ("node" or "node:port") whose nodes keep their dtypes
    entry_functions: tuple[str, ...]    # functions a loader or server calls by name
    saved_model: saved_model_pb2.SavedModel | None = None
    text: bool = False                  # read from text format (.pbtxt)
    meta_graph_index: int = 0           # SavedModel: the MetaGraphDef rewritten (the one --tag-set names)
    fetches_are_sinks: bool = False     # GraphDef without --fetch: the outputs are the nodes nobody reads
    preserved: Mapping[tuple[str, str], str] = field(default_factory=dict)  # (function, node) -> why: custom gradients
    left_in_file: frozen.LeftInFile | None = None  # GraphDef: the large Consts whose values stayed in the file
    canonical: Canonical | None = None  # retargeted: graph_def is the source's float32 form, and what that changed
    widened_keys: Mapping[str, int] = field(default_factory=dict)  # checkpoint key stored low -> its dtype, read
    # as float32 by the canonical graph (cli/weights.py widens it on writing)
    source: SourcePrecision | None = None  # what the file computes in and stores, read before any retargeting
    float32_outputs: tuple[str, ...] = ()  # "signature/output" made float32 (--outputs float32)

    @property
    def meta_graph(self) -> meta_graph_pb2.MetaGraphDef:
        return self.saved_model.meta_graphs[self.meta_graph_index]

    @functools.cached_property
    def program(self) -> Program:
        """The graph's items (the main graph, each library function's body built on first
        use) and the library's op definitions."""
        return program_of(self.graph_def)

    @functools.cached_property
    def compared_outputs(self) -> tuple[str, ...]:
        """A GraphDef's tensors to compare: the ``--fetch`` tensors, or every output of its sinks."""
        if not self.fetches_are_sinks:
            return self.fetches
        nodes = {node.name: node for node in self.graph_def.node}
        return tuple(tensor_name(name, port) for name in self.fetches
                     for port in range(output_count(self.graph_def, nodes[name])))

    @functools.cached_property
    def placeholders(self) -> tuple[Any, ...]:
        """A GraphDef file's placeholders a run of its compared outputs reads (a frozen loop's
        ``unused_control_flow_input`` ones, which nothing reads, need no array); all of them
        where no output is known."""
        found = [n for n in self.graph_def.node if n.op == "Placeholder"]
        if not self.compared_outputs:
            return tuple(found)
        needed = instrument.ancestors(self.graph_def, self.compared_outputs)
        return tuple(n for n in found if n.name in needed)

    @functools.cached_property
    def signatures(self) -> Mapping[str, Signature]:
        """Per signature (a GraphDef file's is ``GRAPH``: its placeholders and
        ``compared_outputs``), its inputs and outputs, name -> tensor."""
        if self.kind == "graphdef":
            placeholders = [n.name for n in self.placeholders]
            return {GRAPH: ({name: f"{name}:0" for name in placeholders},
                            {name: tensor_name(*parse_tensor_name(name)) for name in self.compared_outputs})}
        return {key: ({name: info.name for name, info in signature.inputs.items()},
                      {name: info.name for name, info in signature.outputs.items()})
                for key, signature in sorted(self.meta_graph.signature_def.items()) if not key.startswith("__")}

    @functools.cached_property
    def unsigned_functions(self) -> tuple[str, ...]:
        """The functions the rewrite reaches through the object graph alone (a module's
        ``@tf.function`` attribute, a restored ``serve``): converted like the rest, but no
        signature runs them, so validation, calibration and timing never see them."""
        library = self.program.library
        signed = set(functions.reachable_functions(self.graph_def, library))
        return tuple(name for name in functions.reachable_functions(self.graph_def, library, roots=self.entry_functions)
                     if name not in signed)

    @property
    def tags(self) -> tuple[str, ...]:
        """The rewritten MetaGraphDef's tags (SavedModel only)."""
        return tuple(self.meta_graph.meta_info_def.tags) if self.saved_model is not None else ()

    @property
    def other_tag_sets(self) -> tuple[tuple[str, ...], ...]:
        """Tags of the MetaGraphDefs copied unchanged."""
        if self.saved_model is None:
            return ()
        return tuple(tuple(meta.meta_info_def.tags) for index, meta in enumerate(self.saved_model.meta_graphs)
                     if index != self.meta_graph_index)

    @property
    def is_tf_keras(self) -> bool:
        """Saved by tf_keras: ``tf_keras.models.load_model`` rebuilds its layers from this metadata."""
        return self.kind == "savedmodel" and (self.path / TF_KERAS_METADATA).exists()


def _read_graph_def(path: Path, constants_in_file: bool) -> tuple[graph_pb2.GraphDef, frozen.LeftInFile | None]:
    """A GraphDef file; a binary one a node at a time (``frozen.read_graph_def``), with
    ``constants_in_file`` its large Consts' values left in the file (but those colouring reads)."""
    if path.suffix == ".pbtxt":
        return _parse(path, graph_pb2.GraphDef()), None
    try:
        if path.stat().st_size > PROTOBUF_LIMIT:
            raise ModelError(f"{path}: {path.stat().st_size / 1e9:.1f} GB, and protobuf cannot read a GraphDef"
                             " over 2 GB (it can write one); save the model as a SavedModel, whose variables live"
                             " outside the graph (tf.saved_model.save, or model.export), and convert that")
        graph_def, left = frozen.read_graph_def(path, frozen.LARGE_BYTES if constants_in_file else None)
        left = frozen.hold(graph_def, left, colouring.constants_read(graph_def))
    except OSError as error:
        raise ModelError(f"{path}: cannot read ({error.strerror}); check the path and permissions") from None
    except message.DecodeError as error:
        raise _invalid(path, graph_pb2.GraphDef(), error) from None
    return graph_def, left if left.contents else None


def _parse(path: Path, proto: message.Message) -> message.Message:
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ModelError(f"{path}: cannot read ({error.strerror}); check the path and permissions") from None
    try:
        if path.suffix == ".pbtxt":
            text_format.Parse(data.decode("utf-8"), proto)
        else:
            proto.ParseFromString(data)
    except (message.DecodeError, text_format.ParseError, UnicodeDecodeError) as error:
        raise _invalid(path, proto, error) from None
    return proto


def _invalid(path: Path, proto: message.Message, error: Exception) -> ModelError:
    detail = str(error).splitlines()[0] if str(error) else "not a valid protocol buffer"
    return ModelError(f"{path}: not a valid {type(proto).__name__} ({detail}); is the file truncated?")


def read_model(path: str | os.PathLike, fetches: Iterable[str] = (), tag_set: str | None = None, *,
               constants_in_file: bool = False) -> Model:
    """A SavedModel directory (the MetaGraphDef ``tag_set`` names, default ``serve``), or a
    GraphDef ``.pb``/``.pbtxt`` file whose outputs are ``fetches`` (default: its sinks).
    ``constants_in_file``: a ``.pb``'s large Const values stay in the file (``frozen``), for
    a run that rewrites and writes the graph but neither runs nor prints it."""
    path = Path(path)
    if path.suffix in KERAS_FILES:
        raise ModelError(f"{path}: a Keras model file, not a SavedModel; export it with model.export(dir)"
                         " and convert that directory")
    if not path.exists():
        raise ModelError(f"{path}: no such file or directory; pass a SavedModel directory or a .pb/.pbtxt GraphDef")
    if path.name in SAVED_MODEL_FILES and path.is_file():
        raise ModelError(f"{path}: the graph file of a SavedModel; pass the directory {path.parent}")
    if path.is_dir():
        if fetches:
            raise ModelError(f"{path}: --fetch applies to GraphDef files; a SavedModel's outputs come from its signatures")
        return _read_saved_model(path, tag_set or DEFAULT_TAG_SET)
    if tag_set is not None:
        raise ModelError(f"{path}: --tag-set applies to SavedModel directories; a GraphDef file has one graph")
    if path.suffix not in (".pb", ".pbtxt"):
        raise ModelError(f"{path}: expected a SavedModel directory or a GraphDef file ending in .pb or .pbtxt")
    graph_def, left = _read_graph_def(path, constants_in_file)
    fetches = tuple(dict.fromkeys(fetches))
    for fetch in fetches:
        _check_fetch(path, graph_def, fetch)
    if fetches:
        return Model(path, "graphdef", graph_def, fetches, (), text=path.suffix == ".pbtxt", left_in_file=left)
    return Model(path, "graphdef", graph_def, graph_sinks(graph_def), (), text=path.suffix == ".pbtxt",
                 fetches_are_sinks=True, left_in_file=left)


def graph_sinks(graph_def: graph_pb2.GraphDef) -> tuple[str, ...]:
    """Nodes no other node reads (by data or control edge) and that read something, in graph
    order: a GraphDef's outputs when the user names none, so they keep their dtypes. A node
    with neither inputs nor readers (a tf.function's unused shape constant) is dead, not an output."""
    read = {parse_tensor_name(tensor).node for node in graph_def.node for tensor in node.input}
    return tuple(node.name for node in graph_def.node if node.name not in read and node.input)


def output_count(graph_def: graph_pb2.GraphDef, node_def) -> int:
    """How many output ports ``node_def`` has, from its op definition (or library function);
    an arg whose count attr is missing adds none."""
    op_def = support.resolve_op_def(node_def, support.library_op_defs(graph_def.library))
    return sum(arg_port_count(node_def, op_def, arg) or 0 for arg in op_def.output_arg)


def _check_fetch(path: Path, graph_def: graph_pb2.GraphDef, fetch: str) -> None:
    """``fetch`` is ``NAME`` or ``NAME:PORT`` of a node in the graph that has that output port."""
    try:
        ref = parse_tensor_name(fetch)
    except GraphError:
        ref = None
    if ref is None or ref.is_control:
        raise ModelError(f"{path}: --fetch {fetch!r}: expected NAME or NAME:PORT (an output, not a control input)")
    node_def = next((node for node in graph_def.node if node.name == ref.node), None)
    if node_def is None:
        close = did_you_mean(ref.node, (node.name for node in graph_def.node))
        raise ModelError(f"{path}: --fetch {fetch}: no such node in the graph; {close}list the node names with"
                         " `amp-rewrite dump` (before.pbtxt)")
    try:
        count = output_count(graph_def, node_def)
    except GraphError as error:
        raise ModelError(f"{path}: {error}") from None
    if ref.port >= count:
        have = f"outputs 0..{count - 1}" if count else "no outputs"
        raise ModelError(f"{path}: --fetch {fetch}: node '{ref.node}' ({node_def.op}) has {have}; pick one of those")


def tag_set_text(tags: Iterable[str]) -> str:
    """Tags as ``saved_model_cli --tag_set`` takes them: comma-separated."""
    return ",".join(tags)


def _read_saved_model(path: Path, tag_set: str) -> Model:
    found = [path / name for name in SAVED_MODEL_FILES if (path / name).exists()]
    if not found:
        raise ModelError(f"{path}: not a SavedModel (no saved_model.pb); pass the directory tf.saved_model.save wrote")
    saved_model = _parse(found[0], saved_model_pb2.SavedModel())
    if not saved_model.meta_graphs:
        raise ModelError(f"{found[0]}: the SavedModel holds no meta graph; re-export it")
    wanted = {tag.strip() for tag in tag_set.split(",") if tag.strip()}
    matching = [index for index, meta in enumerate(saved_model.meta_graphs) if set(meta.meta_info_def.tags) == wanted]
    if not matching:
        have = "; ".join(repr(tag_set_text(meta.meta_info_def.tags)) for meta in saved_model.meta_graphs)
        raise ModelError(f"{path}: no MetaGraphDef with tag set {tag_set_text(sorted(wanted))!r}; it has {have};"
                         " choose one with --tag-set")
    meta = saved_model.meta_graphs[matching[0]]
    if _has_variables(meta) and not (path / "variables" / "variables.index").exists():
        raise ModelError(f"{path}: the variables/ folder is missing or incomplete; copy it from the original export")
    return Model(found[0].parent, "savedmodel", meta.graph_def, _preserved(meta), _entry_functions(meta),
                 saved_model, text=found[0].suffix == ".pbtxt", meta_graph_index=matching[0],
                 preserved=custom_gradient_nodes(meta))


def _has_variables(meta: meta_graph_pb2.MetaGraphDef) -> bool:
    return bool(meta.saver_def.filename_tensor_name) and any(
        node.op in ("VarHandleOp", "VariableV2") for node in meta.graph_def.node
    )


def _preserved(meta: meta_graph_pb2.MetaGraphDef) -> tuple[str, ...]:
    """Signature inputs/outputs and the saver's nodes keep their dtypes."""
    tensors = [t.name for s in meta.signature_def.values() for t in [*s.inputs.values(), *s.outputs.values()]]
    saver = meta.saver_def
    tensors += [saver.filename_tensor_name, saver.save_tensor_name, saver.restore_op_name]
    names = {node.name for node in meta.graph_def.node}
    return tuple(sorted({parse_tensor_name(t).node for t in tensors if t} & names))


def custom_gradient_nodes(meta: meta_graph_pb2.MetaGraphDef) -> dict[tuple[str, str], str]:
    """(function, node) -> why, for the nodes whose dtypes a SavedModel's custom gradients
    (``tf.custom_gradient``, ``tf.RegisterGradient``) depend on. The loader registers each
    saved gradient function for the ops whose ``_gradient_op_type`` it was saved for; the
    function was traced for those ops' dtypes, and reads tensors of the forward function by
    name (``captured_tensor`` in the object graph). Rewritten to another dtype they fail
    under ``tf.GradientTape`` ("Input 'b' of 'MatMul' Op has type float16 that does not
    match type float32"), so they keep the dtypes the source had."""
    library = {function.signature.name: function for function in meta.graph_def.library.function}
    gradients = {g.registered_op_type: g.gradient_func for g in meta.graph_def.library.registered_gradients}
    found = {}
    for name, function in library.items():
        for node in function.node_def:
            op_type = node.attr["_gradient_op_type"].s.decode() if "_gradient_op_type" in node.attr else ""
            if op_type in gradients:
                found[(name, node.name)] = (f"has a custom gradient ({gradients[op_type]}), traced for the dtypes"
                                            " the source had")
    for saved in meta.object_graph_def.nodes:
        if saved.WhichOneof("kind") != "captured_tensor":
            continue
        function, node = saved.captured_tensor.concrete_function, parse_tensor_name(saved.captured_tensor.name).node
        if function in library and (any(n.name == node for n in library[function].node_def)
                                    or any(a.name == node for a in library[function].signature.input_arg)):
            found[(function, node)] = "read by a custom gradient function, traced for the dtype the source had"
    return found


def _entry_functions(meta: meta_graph_pb2.MetaGraphDef) -> tuple[str, ...]:
    """Functions called by name from outside the library: by the graph, or by a loader."""
    names = {f.signature.name for f in meta.graph_def.library.function}
    called = {name for node in meta.graph_def.node for name in functions.called_functions(node)}
    called |= set(meta.object_graph_def.concrete_functions)
    return tuple(sorted(called & names))


# Functions tf.saved_model.save writes around the model's own: they read and write variables
# or adapt a signature's arguments, and are the same for every model.
PLUMBING_FUNCTIONS = (
    ("save/restore", re.compile(r"^__inference__traced_(save|restore)_\d+$")),
    ("signature wrapper", re.compile(r"^__inference_signature_wrapper_")),
)


def plumbing_kinds(model: Model) -> dict[str, str]:
    """Items that are TensorFlow's plumbing rather than the model, with their kind: a TF2
    SavedModel's save/restore functions and signature wrappers, and its main graph (the
    loader's variables and calls). A TF1 SavedModel's or a GraphDef file's main graph is the model."""
    if model.kind != "savedmodel":
        return {}
    kinds = {function.signature.name: kind for function in model.graph_def.library.function
             for kind, pattern in PLUMBING_FUNCTIONS if pattern.search(function.signature.name)}
    if model.meta_graph.object_graph_def.nodes:
        kinds[""] = "loader graph"  # the main graph (program.MAIN_GRAPH)
    return kinds


def rewrite_model(model: Model, *, target: str, lists: OpLists, cross_function: bool | str = False,
                  amax: Mapping[tuple[str, str, int], float] | None = None,
                  lossy: Mapping[tuple[str, str], str] | None = None) -> RewriteResult:
    """The rewritten graph of ``model``: its outputs and entry functions keep their dtypes.
    Every function a loader restores is rewritten, not only what the signatures call: the
    object graph's functions (``loaded.serve``, a module's ``@tf.function`` attributes) run
    converted too, and a weight they read can be stored low. ``amax`` and ``lossy``: target
    float8's calibration (``rewrite_graph_def``)."""
    return rewrite_graph_def(model.graph_def, target=target, fetches=model.fetches, lists=lists,
                             cross_function=cross_function, entry_functions=model.entry_functions,
                             roots=model.entry_functions, amax=amax, lossy=lossy, preserved=model.preserved)


def canonical_model(model: Model, *, variables: bool = False) -> Model:
    """``model`` with its graph back in float32 (``core/canonical.py``): its outputs and
    custom gradients keep their dtypes; ``canonical`` says what changed. ``variables``: the
    variables stored low too (the caller widens the checkpoint: ``cli/weights.py``)."""
    canonical = to_float32(model.graph_def, fetches=model.fetches, preserved=model.preserved, variables=variables)
    return replace(model, graph_def=canonical.graph_def, canonical=canonical)


def float32_outputs(model: Model) -> Model:
    """``--outputs float32``: ``model`` whose signatures' float16/bfloat16 outputs are float32,
    all that says so changed together: the graph (``canonical.widen_outputs``: the signature
    functions, the functions they return from, their calls), each signature's dtypes, and the
    object graph's output specs of the functions that changed, so ``tf.saved_model.load``
    and a server both see float32. A TF1 signature's output gets a Cast in the main graph. A
    GraphDef file has no signature to change: one with a low output is refused."""
    if model.kind != "savedmodel":
        low = [fetch for fetch in model.compared_outputs if _output_dtype(model, fetch) in LOW_DTYPES]
        if low:
            raise ModelError(f"{model.path}: --outputs float32 changes a SavedModel's signatures, and a GraphDef file"
                             f" has none (output {low[0]!r} is {dtype_name(_output_dtype(model, low[0]))}); convert"
                             " its SavedModel, or drop --outputs float32")
        return model
    saved_model = saved_model_pb2.SavedModel()
    saved_model.CopyFrom(model.saved_model)
    meta = saved_model.meta_graphs[model.meta_graph_index]
    graph_def, nodes = graph_pb2.GraphDef(), {node.name: node for node in model.graph_def.node}
    graph_def.CopyFrom(model.graph_def)
    library = {function.signature.name: function for function in graph_def.library.function}
    requested: dict[str, set[int]] = {}
    changed, tf1_outputs = [], {}  # TF1: a main-graph tensor the signature named -> its float32 output
    for key, signature in sorted(meta.signature_def.items()):
        for output, info in sorted(signature.outputs.items()) if not key.startswith("__") else ():
            if info.dtype not in LOW_DTYPES:
                continue
            ref = parse_tensor_name(info.name)
            callee = function_called(nodes[ref.node], library)
            if callee is not None:
                requested.setdefault(callee, set()).add(ref.port)
            else:
                if info.name not in tf1_outputs:
                    tf1_outputs[info.name] = _float32_output(graph_def, ref, info.dtype)
                info.name = tf1_outputs[info.name]
            info.dtype = types_pb2.DT_FLOAT
            changed.append(f"{key}/{output}")
    named = {parse_tensor_name(info.name).node for signature in meta.signature_def.values()
             for info in [*signature.inputs.values(), *signature.outputs.values()]}
    replaced = {parse_tensor_name(tensor).node for tensor in tf1_outputs} - named  # no longer an output
    fetches = (*(fetch for fetch in model.fetches if fetch not in replaced),
               *(parse_tensor_name(tensor).node for tensor in tf1_outputs.values()))
    specs = {name: _tensor_specs(function.output_signature)
             for name, function in meta.object_graph_def.concrete_functions.items()}
    fixed = {name for name, found in specs.items() if name in library
             and len(found) != len(library[name].signature.output_arg)}
    graph_def, widened = widen_outputs(graph_def, requested, fixed=fixed)
    for name, ports in widened.items():
        for port in ports if name in specs and name not in fixed else ():
            specs[name][port].dtype = types_pb2.DT_FLOAT
    return replace(model, graph_def=graph_def, saved_model=saved_model, fetches=fetches,
                   float32_outputs=tuple(changed))


def _output_dtype(model: Model, tensor: str) -> int:
    """The dtype of a GraphDef file's output ``tensor``."""
    ref = parse_tensor_name(tensor)
    node = next(node for node in model.graph_def.node if node.name == ref.node)
    op_def = support.resolve_op_def(node, support.library_op_defs(model.graph_def.library))
    outputs = [graph_io.attr_or_default(node, op_def, arg.type_attr).type if arg.type_attr else arg.type
               for arg in op_def.output_arg]
    return outputs[ref.port] if ref.port < len(outputs) else types_pb2.DT_INVALID


def _float32_output(graph_def: graph_pb2.GraphDef, ref: Any, dtype: int) -> str:
    """A TF1 signature's low main-graph tensor ``ref`` as float32, added to ``graph_def``: a Cast,
    then an Identity the signature names (an output keeps its node: where retargeting widens
    ``ref``'s node the Cast becomes float32 -> float32 and goes, the Identity stays)."""
    cast, name = f"{ref.node}-{ref.port}-CastToFp32-Outputs", f"{ref.node}-{ref.port}-Float32-Outputs"
    graph_io.make_node_def("Cast", cast, [tensor_name(ref.node, ref.port)], into=graph_def.node, SrcT=dtype,
                           DstT=types_pb2.DT_FLOAT, Truncate=False)
    graph_io.make_node_def("Identity", name, [cast], into=graph_def.node, T=types_pb2.DT_FLOAT)
    return f"{name}:0"


def _tensor_specs(value: struct_pb2.StructuredValue) -> list[Any]:
    """The tensor specs of a saved function's outputs, in the order its outputs flatten
    (``tf.nest``: a dict's values by sorted key); a composite or unknown kind gives none."""
    kind = value.WhichOneof("kind")
    if kind in ("tensor_spec_value", "bounded_tensor_spec_value"):
        return [getattr(value, kind)]
    if kind in ("list_value", "tuple_value"):
        return [spec for item in getattr(value, kind).values for spec in _tensor_specs(item)]
    if kind == "dict_value":
        return [spec for key in sorted(value.dict_value.fields) for spec in _tensor_specs(value.dict_value.fields[key])]
    if kind == "named_tuple_value":
        return [spec for pair in value.named_tuple_value.values for spec in _tensor_specs(pair.value)]
    return [None] if kind == "type_spec_value" else []  # a composite: the count no longer matches


def effective_lists(target: str, overlay: str | os.PathLike | None = None, keep: Iterable[str] = ()) -> OpLists:
    """The lists for ``target`` with an overlay file and extra ``keep`` entries (``--keep``:
    node regexes, ``FUNCTION::REGEX`` for one function), given no reason."""
    op_lists = load_lists(target, overlay)
    keep = tuple(keep)
    return op_lists.keeping(dict.fromkeys(keep, "")) if keep else op_lists


class Checkpoint(Protocol):
    """A ``variables/`` checkpoint written in place of the source's (``cli.weights.LowCheckpoint``)."""

    @property
    def size(self) -> int: ...

    def write(self, variables: Path) -> None: ...


def write_model(
    model: Model, graph_def: graph_pb2.GraphDef, destination: str | os.PathLike, force: bool = False,
    accept: Callable[[Path], bool] | None = None, variables: Checkpoint | None = None,
) -> bool:
    """Write ``graph_def`` as ``model`` was written (SavedModel or GraphDef file), atomically.

    ``variables`` writes the copy's checkpoint (weights stored low) in place of the source's,
    which is then not copied, before the fingerprint hashes it. The free space the result
    needs is checked before anything is written. ``accept`` sees the finished copy before it
    is moved into place (validation); when it returns False nothing is written. Returns
    whether ``destination`` was written."""
    destination = Path(destination)
    check_destination(model.path, destination, force)
    _tf.require(_tf.SAVED_MODEL_WRITING)
    if model.kind == "graphdef" and destination.suffix not in (".pb", ".pbtxt"):
        raise ModelError(f"{destination}: a GraphDef is written as .pb (binary) or .pbtxt (text); name it so")
    skip = {model.path / name for name in (*SAVED_MODEL_FILES, FINGERPRINT)}
    if variables is not None:
        skip.update((model.path / "variables").glob("variables.*"))
    check_room(destination, _size_of(model, graph_def, skip) + (variables.size if variables is not None else 0))
    with staged(destination, force) as target:
        if model.kind == "graphdef":
            with step("writing the graph"):
                _write_proto(target, graph_def, text=destination.suffix == ".pbtxt", left=model.left_in_file)
        else:
            with step("copying the SavedModel's files"):
                _copy_contents(model.path, target, skip)
            if variables is not None:
                with step("writing the checkpoint"):
                    variables.write(target / "variables")
            with step("writing saved_model.pb"):
                _write_proto(target / ("saved_model.pbtxt" if model.text else "saved_model.pb"),
                             _rewritten_saved_model(model, graph_def), text=model.text)
                _write_fingerprint(target)
        if accept is not None and not accept(target):
            shutil.rmtree(target) if target.is_dir() else target.unlink()
            return False
    return True


def _size_of(model: Model, graph_def: graph_pb2.GraphDef, skip: set[Path]) -> int:
    """About the bytes ``write_model`` writes besides a new checkpoint: the graph, and the files it copies."""
    if model.kind == "graphdef":
        return graph_def.ByteSize() + (model.left_in_file.size if model.left_in_file is not None else 0)
    copied = sum(path.stat().st_size for path in model.path.rglob("*") if path.is_file() and path not in skip)
    return copied + model.saved_model.ByteSize() + graph_def.ByteSize() - model.graph_def.ByteSize()


def _rewritten_saved_model(model: Model, graph_def: graph_pb2.GraphDef) -> saved_model_pb2.SavedModel:
    """The source's SavedModel with the chosen MetaGraphDef's graph replaced. The rewrite
    spells out default-valued attrs; where the file promises ``stripped_default_attrs``
    they are stripped again, so the promise stays true (older consumers rely on it)."""
    saved_model = saved_model_pb2.SavedModel()
    saved_model.CopyFrom(model.saved_model)
    meta = saved_model.meta_graphs[model.meta_graph_index]
    meta.graph_def.CopyFrom(graph_def)
    if meta.meta_info_def.stripped_default_attrs:
        _tf.STRIP_DEFAULT_ATTRS.get()(meta)
    return saved_model


def _copy_contents(source: Path, target: Path, skip: set[Path] = frozenset()) -> None:
    """Copy files' contents only (but those in ``skip``): directories and files get the user's
    default modes (umask), so the copy is writable and removable whatever the source's modes."""
    target.mkdir()
    for entry in sorted(source.iterdir()):
        if entry in skip:
            continue
        if entry.is_dir():
            _copy_contents(entry, target / entry.name, skip)
        else:
            shutil.copyfile(entry, target / entry.name)


def _write_proto(path: Path, proto: message.Message, text: bool, left: frozen.LeftInFile | None = None) -> None:
    """``proto`` in text or binary; a binary GraphDef a node at a time, the values ``left``
    holds copied from their file (``frozen.write_graph_def``)."""
    if text:
        if isinstance(proto, graph_pb2.GraphDef):
            proto = frozen.loaded(proto, left)
        path.write_text(text_format.MessageToString(proto), encoding="utf-8")
    elif isinstance(proto, graph_pb2.GraphDef):
        frozen.write_graph_def(path, proto, left)
    else:
        path.write_bytes(proto.SerializeToString(deterministic=True))


def _write_fingerprint(directory: Path) -> None:
    """A fresh fingerprint.pb: the old one hashes the old graph."""
    if (directory / "saved_model.pb").exists():
        _tf.WRITE_FINGERPRINT.get()(str(directory))

