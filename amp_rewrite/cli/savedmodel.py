"""Models on disk: read a SavedModel or GraphDef file, rewrite it, write the result safely.

A SavedModel keeps its signatures, variables and assets: only the graph's function
bodies change (their signatures never do, so ``tf.saved_model.load`` and serving keep
working). The source is never written to; the destination is built in a temporary
directory beside it and renamed into place, so a failure leaves nothing half written.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

from google.protobuf import message, text_format
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import meta_graph_pb2, saved_model_pb2

from amp_rewrite.core.errors import AmpRewriteError
from amp_rewrite.core.graph_io import parse_tensor_name
from amp_rewrite.core.lists import OpLists, load_lists
from amp_rewrite.core.rewrite import RewriteResult, rewrite_graph_def

SAVED_MODEL_FILES = ("saved_model.pb", "saved_model.pbtxt")
FINGERPRINT = "fingerprint.pb"


class ModelError(AmpRewriteError):
    """A model file or directory cannot be read or written."""


@dataclass(frozen=True)
class Model:
    """A model read from disk: a SavedModel (one meta graph rewritten) or a GraphDef file."""

    path: Path
    kind: str  # "savedmodel" | "graphdef"
    graph_def: graph_pb2.GraphDef
    fetches: tuple[str, ...]            # tensors ("node" or "node:port") whose nodes keep their dtypes
    entry_functions: tuple[str, ...]    # functions a loader or server calls by name
    saved_model: saved_model_pb2.SavedModel | None = None
    text: bool = False                  # read from text format (.pbtxt)


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
        detail = str(error).splitlines()[0] if str(error) else "not a valid protocol buffer"
        raise ModelError(f"{path}: not a valid {type(proto).__name__} ({detail}); is the file truncated?") from None
    return proto


def read_model(path: str | os.PathLike, fetches: Iterable[str] = ()) -> Model:
    """A SavedModel directory, or a GraphDef ``.pb``/``.pbtxt`` file with ``fetches``."""
    path = Path(path)
    if not path.exists():
        raise ModelError(f"{path}: no such file or directory; pass a SavedModel directory or a .pb/.pbtxt GraphDef")
    if path.is_dir():
        return _read_saved_model(path)
    if path.suffix not in (".pb", ".pbtxt"):
        raise ModelError(f"{path}: expected a SavedModel directory or a GraphDef file ending in .pb or .pbtxt")
    graph_def = _parse(path, graph_pb2.GraphDef())
    names = {node.name for node in graph_def.node}
    fetches = tuple(dict.fromkeys(fetches))
    missing = [f for f in fetches if parse_tensor_name(f).node not in names]
    if missing:
        raise ModelError(f"{path}: --fetch {', '.join(missing)}: no such node in the graph")
    return Model(path, "graphdef", graph_def, fetches, (), text=path.suffix == ".pbtxt")


def _read_saved_model(path: Path) -> Model:
    found = [path / name for name in SAVED_MODEL_FILES if (path / name).exists()]
    if not found:
        raise ModelError(f"{path}: not a SavedModel (no saved_model.pb); pass the directory tf.saved_model.save wrote")
    saved_model = _parse(found[0], saved_model_pb2.SavedModel())
    if not saved_model.meta_graphs:
        raise ModelError(f"{found[0]}: the SavedModel holds no meta graph; re-export it")
    meta = saved_model.meta_graphs[0]
    if _has_variables(meta) and not (path / "variables" / "variables.index").exists():
        raise ModelError(f"{path}: the variables/ folder is missing or incomplete; copy it from the original export")
    return Model(found[0].parent, "savedmodel", meta.graph_def, _preserved(meta), _entry_functions(meta),
                 saved_model, text=found[0].suffix == ".pbtxt")


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


def _entry_functions(meta: meta_graph_pb2.MetaGraphDef) -> tuple[str, ...]:
    """Functions called by name from outside the library: by the graph, or by a loader."""
    names = {f.signature.name for f in meta.graph_def.library.function}
    called = {node.op for node in meta.graph_def.node} | {
        value.func.name for node in meta.graph_def.node for value in node.attr.values() if value.HasField("func")
    }
    called |= set(meta.object_graph_def.concrete_functions)
    return tuple(sorted(called & names))


def rewrite_model(model: Model, *, target: str, lists: OpLists, cross_function: bool = False) -> RewriteResult:
    """The rewritten graph of ``model``: its outputs and entry functions keep their dtypes."""
    return rewrite_graph_def(model.graph_def, target=target, fetches=model.fetches, lists=lists,
                             cross_function=cross_function, entry_functions=model.entry_functions)


def effective_lists(target: str, overlay: str | os.PathLike | None = None, keep: Iterable[str] = ()) -> OpLists:
    """The lists for ``target`` with an overlay file and extra ``keep`` node regexes."""
    op_lists = load_lists(target, overlay)
    keep = tuple(keep)
    return dataclasses.replace(op_lists, keep_nodes=op_lists.keep_nodes + keep) if keep else op_lists


def check_destination(source: Path, destination: Path, force: bool) -> None:
    """Refuse to write into the source, or over an existing destination without ``force``."""
    source, destination = source.resolve(), destination.resolve()
    if destination == source or source in destination.parents:
        raise ModelError(f"{destination}: is (inside) the source {source}; choose a destination outside it")
    if destination in source.parents:
        raise ModelError(f"{destination}: contains the source {source}; choose a destination outside it")
    if destination.exists() and not force:
        raise ModelError(f"{destination}: already exists; choose another destination or pass --force to replace it")
    if not destination.parent.is_dir():
        what = "is not a directory" if destination.parent.exists() else "no such directory; create it first"
        raise ModelError(f"{destination.parent}: {what}")


@contextlib.contextmanager
def _staging(destination: Path) -> Iterator[Path]:
    """A temporary path beside ``destination``; renamed into place only if the block succeeds."""
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}.", dir=destination.parent))
    except OSError as error:
        raise ModelError(f"{destination.parent}: cannot write here ({error.strerror}); check permissions") from None
    target, old = staging / destination.name, staging / "replaced"
    try:
        yield target
        if destination.exists():  # --force: swap the old one out, then remove it
            os.replace(destination, old)
        os.replace(target, destination)
    except OSError as error:
        if old.exists() and not destination.exists():
            os.replace(old, destination)  # put the replaced destination back
        raise ModelError(f"{destination}: writing failed ({error.strerror}); nothing was changed") from None
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_model(model: Model, graph_def: graph_pb2.GraphDef, destination: str | os.PathLike, force: bool = False) -> Path:
    """Write ``graph_def`` as ``model`` was written (SavedModel or GraphDef file), atomically."""
    destination = Path(destination)
    check_destination(model.path, destination, force)
    if model.kind == "graphdef" and destination.suffix not in (".pb", ".pbtxt"):
        raise ModelError(f"{destination}: a GraphDef is written as .pb (binary) or .pbtxt (text); name it so")
    with _staging(destination) as target:
        if model.kind == "graphdef":
            _write_proto(target, graph_def, text=destination.suffix == ".pbtxt")
            return destination
        shutil.copytree(model.path, target, ignore=shutil.ignore_patterns(*SAVED_MODEL_FILES, FINGERPRINT))
        saved_model = saved_model_pb2.SavedModel()
        saved_model.CopyFrom(model.saved_model)
        saved_model.meta_graphs[0].graph_def.CopyFrom(graph_def)
        _write_proto(target / ("saved_model.pbtxt" if model.text else "saved_model.pb"), saved_model, text=model.text)
        _write_fingerprint(target)
    return destination


def _write_proto(path: Path, proto: message.Message, text: bool) -> None:
    if text:
        path.write_text(text_format.MessageToString(proto), encoding="utf-8")
    else:
        path.write_bytes(proto.SerializeToString(deterministic=True))


def _write_fingerprint(directory: Path) -> None:
    """A fresh fingerprint.pb: the old one hashes the old graph."""
    from tensorflow.python.saved_model import fingerprinting_utils

    if (directory / "saved_model.pb").exists():
        fingerprinting_utils.write_fingerprint(str(directory))

