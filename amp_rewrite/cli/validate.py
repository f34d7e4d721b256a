"""Run the original and the rewritten model on the same inputs and measure the difference.

Inputs are random (seeded) or come from an ``.npz`` file; shapes and dtypes come from the
SavedModel's signatures or the GraphDef's placeholders (unknown dimensions become 2).
The error of an output is its largest absolute difference divided by the largest
magnitude of the float32 output, so it reads as a fraction of the output's scale.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from amp_rewrite.cli.savedmodel import Model, ModelError
from amp_rewrite.core.graph_io import parse_tensor_name, tensor_name
from amp_rewrite.core.target import Target
UNKNOWN_DIM = 2


@dataclass(frozen=True)
class OutputError:
    signature: str
    output: str
    max_abs: float
    max_rel: float  # max |new - old| / max |old|

    def ok(self, target: Target) -> bool:
        """Finite, and within the target's tolerance: a fraction of the output's largest float32 magnitude."""
        return np.isfinite(self.max_rel) and self.max_rel <= target.tolerance


def _sample(spec_shape: list[int | None], dtype: tf.DType, rng: np.random.Generator) -> np.ndarray:
    shape = [UNKNOWN_DIM if d is None else d for d in spec_shape]
    if dtype.is_floating:
        return rng.standard_normal(shape).astype(dtype.as_numpy_dtype)
    if dtype.is_integer:
        return rng.integers(0, 10, size=shape).astype(dtype.as_numpy_dtype)
    if dtype == tf.bool:
        return rng.integers(0, 2, size=shape).astype(bool)
    raise ModelError(f"cannot make random inputs of dtype {dtype.name}; pass real data with --inputs FILE.npz")


def load_inputs(path: Path) -> Mapping[str, np.ndarray]:
    try:
        with np.load(path) as data:
            return {key: data[key] for key in data.files}
    except (OSError, ValueError) as error:
        raise ModelError(f"{path}: cannot read inputs ({error}); pass an .npz file saved with numpy.savez") from None


def check_inputs(model: Model, path: Path) -> Mapping[str, np.ndarray]:
    """Before anything is written: ``path`` loads and has an array for every input.
    Returns the arrays, for ``validate_saved_models`` / ``validate_graph_defs``."""
    given = load_inputs(path)
    if model.kind == "savedmodel":
        for key, signature in sorted(model.saved_model.meta_graphs[0].signature_def.items()):
            missing = sorted(set(signature.inputs) - set(given))
            if signature.inputs and missing:
                raise ModelError(f"{path}: no array for input(s) {', '.join(missing)} of signature '{key}'")
    else:
        missing = sorted({n.name for n in model.graph_def.node if n.op == "Placeholder"} - set(given))
        if missing:
            raise ModelError(f"{path}: no array for placeholder(s) {', '.join(missing)}")
    return given


def _error(signature: str, output: str, old: np.ndarray, new: np.ndarray) -> OutputError:
    old, new = np.asarray(old, np.float64), np.asarray(new, np.float64)
    diff = float(np.max(np.abs(new - old))) if old.size else 0.0
    scale = float(np.max(np.abs(old))) if old.size else 0.0
    return OutputError(signature, output, diff, diff / scale if scale > 0 else (0.0 if diff == 0 else np.inf))


def validate_saved_models(
    source: Path, destination: Path, runs: int, given: Mapping[str, np.ndarray] | None = None
) -> list[OutputError]:
    """Worst error per (signature, output) over ``runs`` random batches, or one run on
    ``given`` (``check_inputs``' arrays)."""
    old_model, new_model = tf.saved_model.load(str(source)), tf.saved_model.load(str(destination))
    rng = np.random.default_rng(0)
    worst: dict[tuple[str, str], OutputError] = {}
    for key in sorted(old_model.signatures):
        old_fn, new_fn = old_model.signatures[key], new_model.signatures[key]
        specs = old_fn.structured_input_signature[1]
        for _ in range(1 if given is not None else runs):
            if given is not None:
                feed = {name: tf.constant(given[name]) for name in specs}
            else:
                feed = {name: tf.constant(_sample(spec.shape.as_list(), spec.dtype, rng)) for name, spec in specs.items()}
            old_out, new_out = old_fn(**feed), new_fn(**feed)
            for name in sorted(old_out):
                error = _error(key, name, old_out[name].numpy(), new_out[name].numpy())
                current = worst.get((key, name))
                if current is None or not error.max_rel <= current.max_rel:
                    worst[(key, name)] = error
    return list(worst.values())


def validate_graph_defs(
    model: Model, rewritten: graph_pb2.GraphDef, runs: int, given: Mapping[str, np.ndarray] | None = None
) -> list[OutputError]:
    """The same for a GraphDef file: placeholders fed, ``model.fetches`` compared."""
    if not model.fetches:
        raise ModelError(f"{model.path}: --validate needs the outputs to compare; name them with --fetch")
    placeholders = [n for n in model.graph_def.node if n.op == "Placeholder"]
    rng = np.random.default_rng(0)
    worst: dict[str, OutputError] = {}
    for _ in range(1 if given is not None else runs):
        feed = {}
        for node in placeholders:
            if given is not None:
                feed[f"{node.name}:0"] = given[node.name]
            else:
                shape = [None if d.size < 0 else d.size for d in node.attr["shape"].shape.dim]
                feed[f"{node.name}:0"] = _sample(shape, tf.as_dtype(node.attr["dtype"].type), rng)
        old, new = _run(model.graph_def, model.fetches, feed), _run(rewritten, model.fetches, feed)
        for name, a, b in zip(model.fetches, old, new):
            error = _error("graph", name, a, b)
            if name not in worst or not error.max_rel <= worst[name].max_rel:
                worst[name] = error
    return list(worst.values())


def _run(graph_def: graph_pb2.GraphDef, fetches: tuple[str, ...], feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        return session.run([tensor_name(*parse_tensor_name(name)) for name in fetches], feed_dict=feed)
