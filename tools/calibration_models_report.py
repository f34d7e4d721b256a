"""Tensor magnitudes in float32, node by node: the numbers behind calibration's defaults.

Calibration (issue 18) keeps a node float32 when its float32 values exceed a "safe
magnitude" or mostly fall below the target's smallest normal number. This tool measures,
in one float32 run per model, every node's largest finite |value|, the share of its
non-zero values below float16's smallest normal (2**-14 ≈ 6.1e-5) and the share of its
L1 mass those values carry, for

* the four models of ``tests/calibration_models.py`` (calibration inputs, seed 0, and
  held-out inputs, seed 1), with their plain float16 and bfloat16 rewrites' errors
  (the CLI's measure: max |new − old| / max |old|) and the first nodes that turn
  non-finite in the float16 rewrite, and the float16 rewrite with the nodes the chosen
  defaults (SAFE_MAGNITUDE, SMALL_MASS_SHARE) flag on calibration inputs kept float32,
  validated on held-out inputs;
* ResNet50 (``keras.applications.ResNet50(weights=None)``, inputs ~ N(0, 1), batch 2,
  224×224×3) and the BERT-base-shaped encoder of ``tools/bench.py`` (12 layers, width
  768, sequence 128, batch 2, random token ids), both with random weights, and that
  BERT with its query kernels ×4 (``bert-sharp``): attention logits ×4, so most softmax
  probabilities fall below 6.1e-5, as in peaked attention heads.

The last table counts, per model, the converted nodes each candidate threshold flags.

Function bodies are measured by inlining them: a SavedModel signature is frozen with
``convert_variables_to_constants_v2``, a Keras model traced inline; node names are the
body's names under the caller's prefix. Only nodes the plain rewrite converts count
towards the thresholds (a node that stays float32 cannot overflow float16); the tables
list every node of the named op types. Grappler is off in the measuring session, so
every node runs as written::

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/calibration_models_report.py
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/calibration_models_report.py --models overflow_mlp resnet50
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/calibration_models_report.py --smoke   # one model, 2 inputs
"""
from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import numpy as np
import tensorflow as tf
from tensorflow.core.framework.graph_pb2 import GraphDef

import amp_rewrite
from amp_rewrite import _tf
from amp_rewrite import cli
from amp_rewrite.core.target import NAME_TO_TARGET
from amp_rewrite.testing.models import captured_variables

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tools"))
import calibration_models  # noqa: E402  tests/ and tools/ are not packages

FLOAT16_SMALLEST_NORMAL = 2.0 ** -14  # 6.1035e-05
FLOAT16_MAX = 65504.0
REFERENCE_MODELS = ("resnet50", "bert", "bert-sharp")
SHARPEN = 4.0  # bert-sharp's query kernels are the random ones ×SHARPEN
ALL_MODELS = (*calibration_models.MODEL_NAMES, *REFERENCE_MODELS)
SMOKE_MODEL = calibration_models.MODEL_NAMES[0]
SAFE_MAGNITUDES = (4096.0, 8192.0, 16384.0, 32768.0, FLOAT16_MAX)
SMALL_SHARES = (0.25, 0.5, 0.75, 0.9)
# The defaults this tool's numbers support for float16: a converted node whose float32
# values exceed SAFE_MAGNITUDE, or whose values below 6.1e-5 carry more than
# SMALL_MASS_SHARE of its L1 mass, stays float32.
SAFE_MAGNITUDE = 16384.0
SMALL_MASS_SHARE = 0.5
TABLE_OPS = ("MatMul", "BatchMatMulV2", "Einsum", "Conv2D", "BiasAdd", "Add", "AddV2", "Relu",
             "FusedBatchNormV3", "Sub", "Mul", "SquaredDifference", "Rsqrt", "Softmax", "Tanh", "Erf")
TOP = 5
_SKIPPED_OPS = frozenset({"Const", "Placeholder", "Identity", "IdentityN", "ReadVariableOp", "NoOp"})


@dataclass(frozen=True)
class NodeStats:
    """One node's float outputs, pooled: largest finite |value|, non-zero and small counts."""

    node: str
    op: str
    max_abs: float
    nonzero: int
    small: int      # non-zero values with |value| < FLOAT16_SMALLEST_NORMAL
    nonfinite: int
    mass: float     # sum of finite |value|
    small_mass: float  # the part of ``mass`` carried by the small values

    @property
    def small_share(self) -> float:
        """Share of the non-zero values that are below float16's normal range."""
        return self.small / self.nonzero if self.nonzero else 0.0

    @property
    def small_mass_share(self) -> float:
        """Share of the tensor's L1 mass those values carry: near 0 when they are a long
        tail under large values (a softmax), near 1 when the whole tensor is tiny."""
        return self.small_mass / self.mass if self.mass else 0.0


@dataclass(frozen=True)
class Flat:
    """A model as one inline GraphDef: what to feed and fetch, and the variables to bind."""

    graph_def: GraphDef
    outputs: tuple[str, ...]  # tensor names
    variables: Mapping[str, np.ndarray] = field(default_factory=dict)  # resource placeholder tensor → value


# --- measuring ------------------------------------------------------------------------------


def measure(flat: Flat, feeds: Mapping[str, np.ndarray]) -> dict[str, NodeStats]:
    """Every node's statistics from one run of ``flat`` on ``feeds`` (tensor name → array)."""
    graph = tf.Graph()
    with graph.as_default(), tf.device("/device:CPU:0"):
        bound = {tensor: tf.Variable(flat.variables[tensor], name=f"bound_{i}")
                 for i, tensor in enumerate(sorted(flat.variables))}
        tf.graph_util.import_graph_def(flat.graph_def, name="",
                                       input_map={t: v.handle for t, v in bound.items()})
        node_to_fetch = {}
        for op in graph.get_operations():
            if op.type in _SKIPPED_OPS or op.name.startswith("bound_"):
                continue
            outputs = op.outputs[:1] if op.type.startswith("FusedBatchNorm") else op.outputs
            floats = [t for t in outputs if t.dtype in (tf.float32, tf.float16, tf.bfloat16)]
            if floats:
                node_to_fetch[op.name] = _statistics(floats)
        init = tf.compat.v1.global_variables_initializer()
    config = tf.compat.v1.ConfigProto(device_count={"GPU": 0})
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        values = session.run(node_to_fetch, feed_dict={graph.get_tensor_by_name(t): a for t, a in feeds.items()})
    return {name: NodeStats(name, graph.get_operation_by_name(name).type, float(v[0]), int(v[1]), int(v[2]),
                            int(v[3]), float(v[4]), float(v[5]))
            for name, v in values.items()}


def _statistics(tensors: Sequence[tf.Tensor]) -> tf.Tensor:
    """[max finite |v|, non-zero count, small non-zero count, non-finite count, L1 mass,
    small values' L1 mass] over ``tensors`` (float64 sums: counts stay exact)."""
    rows = []
    for tensor in tensors:
        a = tf.reshape(tf.abs(tf.cast(tensor, tf.float64)), [-1])
        finite = tf.math.is_finite(a)
        a = tf.where(finite, a, tf.zeros_like(a))
        is_small = (a > 0) & (a < FLOAT16_SMALLEST_NORMAL)
        rows.append(tf.stack([
            tf.reduce_max(tf.concat([a, tf.zeros([1], tf.float64)], 0)),
            tf.reduce_sum(tf.cast(a > 0, tf.float64)),
            tf.reduce_sum(tf.cast(is_small, tf.float64)),
            tf.reduce_sum(tf.cast(tf.logical_not(finite), tf.float64)),
            tf.reduce_sum(a),
            tf.reduce_sum(tf.where(is_small, a, tf.zeros_like(a))),
        ]))
    stacked = tf.stack(rows)
    return tf.concat([tf.reduce_max(stacked[:, :1], 0), tf.reduce_sum(stacked[:, 1:], 0)], 0)


def converted_nodes(flat: Flat, target: str) -> frozenset[str]:
    """Nodes of which the plain rewrite (built-in lists) converts at least one type attribute."""
    nodes = tuple(t.split(":")[0] for t in flat.outputs)
    result = amp_rewrite.rewrite_graph_def(flat.graph_def, target=target, fetches=nodes)
    return frozenset(d.node for d in result.report.decisions if d.converted)


# --- the models as flat graphs --------------------------------------------------------------


def frozen_signature(path: Path, signature: str = "serving_default") -> tuple[Flat, tuple[str, ...]]:
    """A SavedModel signature with its functions inlined and variables frozen, and the
    signature input names in the order of the frozen graph's placeholders."""
    loaded = tf.saved_model.load(str(path))  # holds the variables while freezing
    function = loaded.signatures[signature]
    _tf.require(_tf.TOOLS)
    frozen = _tf.CONVERT_VARIABLES_TO_CONSTANTS.get()(function)
    names = tuple(spec.name for spec in function.structured_input_signature[1].values())
    placeholders = tuple(t.name for t in frozen.inputs)
    if len(names) != len(placeholders):
        raise RuntimeError(f"{path}: {len(names)} signature inputs but {len(placeholders)} placeholders")
    graph_def = frozen.graph.as_graph_def()
    return Flat(graph_def, tuple(t.name for t in frozen.outputs)), placeholders


def traced_keras(model: object, spec: tf.TensorSpec) -> Flat:
    """``model(x, training=False)`` traced inline; variables become resource placeholders."""
    concrete = tf.function(lambda x: model(x, training=False)).get_concrete_function(spec)
    graph_def = concrete.graph.as_graph_def()
    if graph_def.library.function:
        raise RuntimeError(f"{model.name} traced with library functions; expected one inline graph")
    variables = {t: v.numpy() for t, v in captured_variables(concrete, list(model.variables)).items()}
    return Flat(graph_def, tuple(t.name for t in concrete.graph.outputs), MappingProxyType(variables))


def reference_model(name: str) -> tuple[Flat, dict[str, np.ndarray]]:
    """ResNet50 or the BERT-base encoder of tools/bench.py with random weights, and a batch of 2."""
    import keras
    import bench

    keras.backend.clear_session()
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    if name == "resnet50":
        model = keras.applications.ResNet50(weights=None, input_shape=(224, 224, 3), classes=1000)
        x = rng.standard_normal((2, 224, 224, 3), dtype=np.float32)
        flat = traced_keras(model, tf.TensorSpec(x.shape, tf.float32, name="x"))
    else:
        sizes = bench.FULL
        model = bench._build_bert(sizes)
        if name == "bert-sharp":
            for layer in model.layers:
                if isinstance(layer, keras.layers.MultiHeadAttention):
                    kernel = layer.query_dense.kernel
                    kernel.assign(kernel * SHARPEN)
        x = rng.integers(0, sizes.bert_vocab, size=(2, sizes.bert_seq), dtype=np.int32)
        flat = traced_keras(model, tf.TensorSpec(x.shape, tf.int32, name="x"))
    return flat, {"x:0": x}


# --- the plain rewrites of the calibration models --------------------------------------------


def run_cli(*args: object) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = cli.main([str(a) for a in args])
    return code, out.getvalue()


def output_errors(source: Path, rewritten: Path, feed: Mapping[str, np.ndarray]) -> dict[str, tuple[float, float]]:
    """Output name → (max |float32 output|, max |new − old| / max |old|), serving_default."""
    old = tf.saved_model.load(str(source)).signatures["serving_default"]
    new = tf.saved_model.load(str(rewritten)).signatures["serving_default"]
    tensors = {k: tf.constant(v) for k, v in feed.items()}
    old_out, new_out = old(**tensors), new(**tensors)
    errors = {}
    for name in sorted(old_out):
        a, b = old_out[name].numpy().astype(np.float64), new_out[name].numpy().astype(np.float64)
        scale = float(np.max(np.abs(a)))
        errors[name] = (scale, float(np.max(np.abs(b - a))) / scale)
    return errors


def report_calibration_model(
    name: str, workdir: Path, count: int
) -> tuple[dict[str, dict[str, NodeStats]], frozenset[str]]:
    """Build ``name``, print its plain rewrites' errors, the first nodes that turn
    non-finite in float16 and how far held-out magnitudes move from calibration's; return
    its float32 statistics by seed ("calibration", "held-out") and the converted nodes."""
    source = workdir / name
    start = time.perf_counter()
    calibration_models.save_model(name, source)
    built_s = time.perf_counter() - start
    feeds = {seed: calibration_models.inputs(name, count, seed)
             for seed in (calibration_models.CALIBRATION_SEED, calibration_models.HELD_OUT_SEED)}
    npz = calibration_models.save_inputs(name, count, calibration_models.CALIBRATION_SEED, workdir / f"{name}-0.npz")
    print(f"\n## {name} (built in {built_s:.1f} s; {count} inputs per seed)\n")
    flat, placeholders = frozen_signature(source)
    input_names = list(feeds[0])
    stats = {label: measure(flat, {p: feeds[seed][n] for p, n in zip(placeholders, input_names)})
             for label, seed in (("calibration", 0), ("held-out", 1))}
    for target in ("float16", "bfloat16"):
        rewritten = workdir / f"{name}-{target}"
        code, text = run_cli("convert", source, rewritten, "--target", target, "--inputs", npz, "--validate", 1,
                             "--keep-failed", "--quiet")
        for seed, feed in feeds.items():
            for output, (scale, error) in output_errors(source, rewritten, feed).items():
                verdict = "ok" if np.isfinite(error) and error <= NAME_TO_TARGET[target].tolerance else "FAIL"
                print(f"- {target} seed {seed}: {verdict} {output}: float32 max |out| {scale:.3g}, "
                      f"max rel error {error:.3g} (CLI exit on seed 0: {code})")
        if target == "float16":
            rewritten_flat, rewritten_placeholders = frozen_signature(rewritten)
            after = measure(rewritten_flat, {p: feeds[1][n] for p, n in zip(rewritten_placeholders, input_names)})
            order = [n.name for n in rewritten_flat.graph_def.node]
            first = [after[n] for n in order if n in after and after[n].nonfinite][:4]
            print("- float16 rewrite, held-out inputs, first non-finite nodes: "
                  + (", ".join(f"{_short(s.node)} ({s.op})" for s in first) or "none"))
    converted = converted_nodes(flat, "float16")
    calibration, held_out = stats["calibration"], stats["held-out"]
    moved = [(held_out[n].max_abs / calibration[n].max_abs, n) for n in sorted(converted)
             if n in calibration and calibration[n].max_abs > 0]
    ratio, node = max(moved)
    print(f"- converted nodes, largest |value| held-out / calibration: {min(moved)[0]:.2f} to {ratio:.2f} "
          f"(largest: {_short(node)}, {calibration[node].max_abs:.4g} → {held_out[node].max_abs:.4g})")
    report_kept(name, source, workdir, stats["calibration"], converted,
                calibration_models.save_inputs(name, count, calibration_models.HELD_OUT_SEED,
                                               workdir / f"{name}-1.npz"), feeds[1])
    return stats, converted


def report_kept(name: str, source: Path, workdir: Path, calibration: Mapping[str, NodeStats],
                converted: frozenset[str], held_out_npz: Path, held_out: Mapping[str, np.ndarray]) -> None:
    """The float16 rewrite with the nodes SAFE_MAGNITUDE and SMALL_MASS_SHARE flag on the
    calibration inputs kept float32 (``keep_nodes``: not painted, no deny propagation),
    validated on held-out inputs."""
    flagged = sorted(n for n in converted if n in calibration and (
        calibration[n].max_abs > SAFE_MAGNITUDE or calibration[n].small_mass_share > SMALL_MASS_SHARE))
    overlay = workdir / f"{name}-keep.yaml"
    overlay.write_text("keep_nodes:\n" + "".join(f"  - '{re.escape(_short(n))}'\n" for n in flagged),
                       encoding="utf-8")
    rewritten = workdir / f"{name}-float16-kept"
    run_cli("convert", source, rewritten, "--target", "float16", "--lists", overlay, "--inputs", held_out_npz,
            "--validate", 1, "--keep-failed", "--quiet")
    kernels = [n for n in converted if n in calibration and calibration[n].op in ("MatMul", "Conv2D")]
    print(f"- float16 with the {len(flagged)} flagged nodes kept float32 (max abs > {SAFE_MAGNITUDE:g} or small "
          f"mass share > {SMALL_MASS_SHARE:g} on calibration inputs: "
          f"{', '.join(sorted({calibration[n].op for n in flagged}))}); MatMul/Conv2D still converted: "
          f"{sum(n not in flagged for n in kernels)} of {len(kernels)}")
    for output, (scale, error) in output_errors(source, rewritten, held_out).items():
        verdict = "ok" if np.isfinite(error) and error <= NAME_TO_TARGET["float16"].tolerance else "FAIL"
        print(f"  - held-out: {verdict} {output}: max rel error {error:.3g}")


# --- tables ---------------------------------------------------------------------------------


def print_tables(name: str, stats: Mapping[str, NodeStats], converted: frozenset[str]) -> None:
    """Top nodes by largest |value| per op type, and by small share (converted nodes only)."""
    print(f"\n### {name}: largest |value| per op type (top {TOP}; * = converted by the plain float16 rewrite)\n")
    print("| op | nodes | node | max abs | small share | small mass share |")
    print("|---|---:|---|---:|---:|---:|")
    by_op: dict[str, list[NodeStats]] = {}
    for s in stats.values():
        by_op.setdefault(s.op, []).append(s)
    for op in [op for op in TABLE_OPS if op in by_op] + sorted(set(by_op) - set(TABLE_OPS)):
        if op not in TABLE_OPS and not any(s.node in converted for s in by_op[op]):
            continue
        ranked = sorted(by_op[op], key=lambda s: -s.max_abs)
        for rank, s in enumerate(ranked[:TOP]):
            mark = "*" if s.node in converted else ""
            print(f"| {op if rank == 0 else ''} | {len(ranked) if rank == 0 else ''} | {_short(s.node)}{mark} "
                  f"| {s.max_abs:.4g} | {s.small_share:.3f} | {s.small_mass_share:.2g} |")
    small = sorted((s for s in stats.values() if s.node in converted), key=lambda s: -s.small_share)[:TOP]
    print("\nconverted nodes with the largest share of non-zero values below 6.1e-5 (share, mass share): "
          + ", ".join(f"{_short(s.node)} ({s.op}) {s.small_share:.3f}, {s.small_mass_share:.2g}" for s in small))


def print_sweep(rows: Sequence[tuple[str, Mapping[str, NodeStats], frozenset[str]]]) -> None:
    """How many converted nodes each candidate threshold flags, per model."""
    print("\n## Converted nodes flagged by each candidate threshold (plain float16 rewrite)\n")
    head = ([f"max abs > {s:g}" for s in SAFE_MAGNITUDES] + [f"small share > {p:g}" for p in SMALL_SHARES]
            + [f"small mass share > {p:g}" for p in SMALL_SHARES])
    print("| model | converted | " + " | ".join(head) + " |")
    print("|---|---:|" + "---:|" * len(head))
    for label, stats, converted in rows:
        judged = [s for s in stats.values() if s.node in converted]
        counts = [sum(s.max_abs > m for s in judged) for m in SAFE_MAGNITUDES]
        counts += [sum(s.small_share > p for s in judged) for p in SMALL_SHARES]
        counts += [sum(s.small_mass_share > p for s in judged) for p in SMALL_SHARES]
        print(f"| {label} | {len(judged)} | " + " | ".join(map(str, counts)) + " |")


def _short(node: str) -> str:
    return node.removeprefix("StatefulPartitionedCall/")


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=ALL_MODELS, default=list(ALL_MODELS))
    parser.add_argument("--count", type=int, default=8, help="inputs per seed for the calibration models")
    parser.add_argument("--smoke", action="store_true",
                        help=f"checks this script: {SMOKE_MODEL} on 2 inputs per seed (overrides the two above)")
    args = parser.parse_args(None if argv is None else list(argv))
    if args.smoke:
        args.models, args.count = [SMOKE_MODEL], 2
    rows = []
    with tempfile.TemporaryDirectory(prefix="calibration-models-") as tmp:
        for name in args.models:
            if name in REFERENCE_MODELS:
                start = time.perf_counter()
                flat, feeds = reference_model(name)
                stats = measure(flat, feeds)
                converted = converted_nodes(flat, "float16")
                print(f"\n## {name} ({time.perf_counter() - start:.0f} s to build, rewrite and measure)")
                print_tables(name, stats, converted)
                rows.append((name, stats, converted))
                continue
            by_seed, converted = report_calibration_model(name, Path(tmp), args.count)
            print_tables(f"{name}, calibration inputs", by_seed["calibration"], converted)
            rows += [(f"{name} ({label})", stats, converted) for label, stats in by_seed.items()]
    print_sweep(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
