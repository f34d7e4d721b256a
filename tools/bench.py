"""End-to-end speed of mixed precision: ResNet50 and a BERT-base-shaped encoder (``make bench``).

A rewrite is only worth having if the graph it writes runs at least as fast as grappler's
or the Keras policy's, so this tool times what a user runs: an inference batch and one
training step (forward, backward, SGD update) of two real-sized models, in each
mixed-precision variant, as a ratio to float32 measured in the same run (speed-up =
float32 time / variant time; medians of ``--runs`` calls after the first call and
``--warmup`` untimed ones).

Each (model, step, variant) runs in a fresh subprocess of this script, so rewrites,
grappler options and Keras policies never leak from one variant into another, and the
child's own peak RSS (``ru_maxrss``) is that variant's. A (model, step)'s variants are
timed in turn: each child builds and warms up alone, then every round times one step of
each variant, in an order rotated per round, so a change in the machine's load during the
run (another process, clock speed) falls on every variant alike instead of on whichever
ran at that moment. The child also records what
actually ran after TensorFlow's runtime optimizations (the partition graphs of the step's
first call, from run metadata): the precision casts per step, how many convolutions and
matmuls run in low precision, and the oneDNN/cuDNN fusions kept. Where ours is slower,
those counts are the first suspects, and the table below the timings lists them.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench.py --smoke         # tiny BERT, float32 and ours: seconds
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench.py                 # full run, quiet machine, ~20 min on 2 cores
    tools/bench_gpu.sh                                                      # float16 on one NVIDIA GPU

The markdown goes to stdout and replaces this device and target's section of
``BENCHMARKS.md`` (other sections are kept; ``--no-write`` leaves the file alone; ``--smoke``
writes a copy of it in a temporary directory).
The exit status is 1 when a variant failed to run, else 0: slower is reported, not failed.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import keras
import numpy as np
import tensorflow as tf

import amp_rewrite
from amp_rewrite import _tf
from amp_rewrite.testing.models import PositionEmbedding
from amp_rewrite.testing.reference import run_grappler

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_pass  # tools/ is not a package

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO / "BENCHMARKS.md"

MODELS = ("resnet50", "bert")
MODEL_LABELS = {"resnet50": "ResNet50", "bert": "BERT-base-shaped encoder"}
MODES = ("inference", "training")
# Variant keys, in table order. SavedModel variants serve inference only.
VARIANTS = ("float32", "ours", "ours-cli", "float32-savedmodel", "grappler", "keras")
SAVEDMODEL_VARIANTS = ("ours-cli", "float32-savedmodel")
DEFAULT_VARIANTS = {
    "cpu": VARIANTS,
    # The GPU script must finish in minutes: the SavedModel round trip is CPU-bound
    # export and conversion work that tells nothing new about the GPU.
    "gpu": ("float32", "ours", "grappler", "keras"),
}
DEVICE_TARGETS = {"cpu": "bfloat16", "gpu": "float16"}  # the pairs grappler has a pass for
GRAPPLER_OPTIONS = {"bfloat16": "auto_mixed_precision_onednn_bfloat16", "float16": "auto_mixed_precision"}
KERAS_POLICIES = {"bfloat16": "mixed_bfloat16", "float16": "mixed_float16"}
LOW_PRECISION_DTYPES = {"bfloat16": 14, "float16": 19}  # types_pb2.DT_BFLOAT16, DT_HALF
DT_FLOAT = 1
NUM_CLASSES = {"resnet50": 1000, "bert": 2}


def variant_label(variant: str, target: str) -> str:
    """How the table names a variant: what a user would type to get it."""
    return {
        "float32": "float32",
        "ours": f'ours: `amp_rewrite.mixed_precision(target="{target}")`',
        "ours-cli": f"ours: `amp-rewrite convert --target {target}` SavedModel",
        "float32-savedmodel": "float32 SavedModel, unconverted (reference for the row above)",
        "grappler": f"grappler `{GRAPPLER_OPTIONS[target]}`",
        "keras": f"Keras `{KERAS_POLICIES[target]}` policy",
    }[variant]


# --- settings -------------------------------------------------------------------------


@dataclass(frozen=True)
class Sizes:
    """Model shapes, batches and run counts: FULL and SMOKE presets, each field overridable by a flag."""

    image_size: int
    resnet_batch: int
    resnet_train_batch: int
    bert_layers: int
    bert_seq: int
    bert_hidden: int
    bert_heads: int
    bert_ffn: int
    bert_vocab: int
    bert_batch: int
    bert_train_batch: int
    runs: int
    warmup: int
    pass_runs: int
    child_timeout: int


FULL = Sizes(image_size=224, resnet_batch=32, resnet_train_batch=16, bert_layers=12, bert_seq=128,
             bert_hidden=768, bert_heads=12, bert_ffn=3072, bert_vocab=30522, bert_batch=8, bert_train_batch=8,
             runs=5, warmup=2, pass_runs=9, child_timeout=1800)
SMOKE = Sizes(image_size=32, resnet_batch=1, resnet_train_batch=1, bert_layers=1, bert_seq=8,
              bert_hidden=32, bert_heads=2, bert_ffn=64, bert_vocab=100, bert_batch=1, bert_train_batch=1,
              runs=1, warmup=0, pass_runs=1, child_timeout=300)
# --smoke's defaults where no flag says otherwise: the least that runs a child per variant kind.
SMOKE_MODELS, SMOKE_MODES, SMOKE_VARIANTS = ("bert",), ("inference",), ("float32", "ours")


@dataclass(frozen=True)
class Settings:
    device: str
    target: str
    models: tuple[str, ...]
    modes: tuple[str, ...]
    variants: tuple[str, ...]
    sizes: Sizes
    smoke: bool
    output: Path | None
    time_passes: bool

    @property
    def section(self) -> str:
        return f"{self.device}-{self.target}"

    def batch(self, model: str, mode: str) -> int:
        prefix = "resnet" if model == "resnet50" else "bert"
        return getattr(self.sizes, f"{prefix}_train_batch" if mode == "training" else f"{prefix}_batch")


def _names(allowed: Sequence[str], what: str) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        unknown = [n for n in names if n not in allowed]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(map(repr, unknown)) or '(none given)'}; choose from {','.join(allowed)}")
        return names
    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true",
                        help="checks this script in seconds: tiny sizes, 1 run, by default BERT inference, float32 and"
                             " ours; writes a copy of BENCHMARKS.md in a temporary directory; not a measurement")
    parser.add_argument("--device", choices=sorted(DEVICE_TARGETS), default="cpu", help="where to run (default cpu)")
    parser.add_argument("--target", choices=sorted(GRAPPLER_OPTIONS),
                        help="low-precision type (default: bfloat16 on cpu, float16 on gpu)")
    parser.add_argument("--models", type=_names(MODELS, "model"), help=f"comma-separated (default {','.join(MODELS)})")
    parser.add_argument("--modes", type=_names(MODES, "mode"), help=f"comma-separated (default {','.join(MODES)})")
    parser.add_argument("--variants", type=_names(VARIANTS, "variant"),
                        help="comma-separated; float32 always runs (default: all on cpu; float32,ours,grappler,keras on gpu)")
    sizes = parser.add_argument_group("sizes and runs (default: the full preset; --smoke shrinks them)")
    for field in dataclasses.fields(Sizes):
        sizes.add_argument(f"--{field.name.replace('_', '-')}", type=int, metavar="N",
                           help=f"full {getattr(FULL, field.name)}, smoke {getattr(SMOKE, field.name)}")
    parser.add_argument("--output", type=Path, default=BENCHMARKS_MD,
                        help="markdown file whose section for this device and target is replaced (default BENCHMARKS.md)")
    parser.add_argument("--no-write", action="store_true", help="print the table only")
    parser.add_argument("--no-pass-time", action="store_true",
                        help="skip timing our pass against grappler's on the traced float32 graphs")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # internal: one measurement, as JSON
    return parser


def parse_settings(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Settings:
    target = args.target or DEVICE_TARGETS[args.device]
    if target != DEVICE_TARGETS[args.device]:
        parser.error(f"--device {args.device} --target {target}: grappler has no {target} pass for a {args.device};"
                     f" use --target {DEVICE_TARGETS[args.device]}")
    preset = SMOKE if args.smoke else FULL
    overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(Sizes) if getattr(args, f.name) is not None}
    sizes = dataclasses.replace(preset, **overrides)
    bad = [f"--{name.replace('_', '-')} {value}" for name, value in dataclasses.asdict(sizes).items()
           if value < (0 if name == "warmup" else 1)]
    if bad:
        parser.error(f"{', '.join(bad)}: must be at least 1 (--warmup at least 0)")
    if sizes.image_size < 32:
        parser.error(f"--image-size {sizes.image_size}: ResNet50 needs at least 32")
    if sizes.bert_hidden % sizes.bert_heads:
        parser.error(f"--bert-hidden {sizes.bert_hidden} is not a multiple of --bert-heads {sizes.bert_heads}")
    variants = args.variants or (SMOKE_VARIANTS if args.smoke else DEFAULT_VARIANTS[args.device])
    chosen = set(variants) | {"float32"}  # the baseline of every ratio
    return Settings(device=args.device, target=target, models=args.models or (SMOKE_MODELS if args.smoke else MODELS),
                    modes=args.modes or (SMOKE_MODES if args.smoke else MODES),
                    variants=tuple(v for v in VARIANTS if v in chosen), sizes=sizes, smoke=args.smoke,
                    output=None if args.no_write else args.output,
                    time_passes=not (args.no_pass_time or args.smoke))


# --- jobs and results -----------------------------------------------------------------


@dataclass(frozen=True)
class Job:
    """One child run. ``kind``: "step" (time a variant) or "export" (write the float32
    SavedModel). The float32 step's child also times the passes on its traced graph,
    after its peak RSS is read, which saves a process start per graph."""

    kind: str
    model: str
    mode: str
    variant: str
    device: str
    target: str
    batch: int
    sizes: Sizes
    savedmodel: str = ""  # directory to export to (export) or load from (SavedModel variants)
    time_passes: bool = False

    @property
    def name(self) -> str:
        return " ".join(p for p in (self.kind, self.model, self.mode, self.variant) if p)


@dataclass(frozen=True)
class StepOps:
    """What ran in one step, counted in the partition graphs after runtime optimization."""

    nodes: int
    casts_to_low: int       # Cast float32 -> low precision
    casts_to_float32: int   # Cast low precision -> float32
    heavy_low: int          # convolutions, matmuls, einsums running in low precision
    heavy_total: int
    float_ops_low: int      # every op with a floating-point T attr, in low precision
    float_ops_total: int
    fused: int              # remapper/oneDNN/cuDNN fusions (_FusedConv2D, _MklNativeFusedMatMul, ...)


@dataclass(frozen=True)
class Outcome:
    """A child's answer; ``error`` is set instead of the numbers when it failed."""

    job: Job
    error: str = ""
    seconds: tuple[float, ...] = ()
    first_call_s: float = 0.0
    peak_rss_mb: float = 0.0
    peak_gpu_mb: float = 0.0
    ops: StepOps | None = None
    pass_nodes: int = 0
    pass_ours_s: float = 0.0
    pass_grappler_s: float = 0.0
    convert_s: float = 0.0

    @property
    def median_s(self) -> float:
        return statistics.median(self.seconds)


def plan_jobs(settings: Settings, workdir: Path) -> list[Job]:
    jobs = []
    for model in settings.models:
        common = {"model": model, "device": settings.device, "target": settings.target, "sizes": settings.sizes}
        needs_export = "inference" in settings.modes and any(v in SAVEDMODEL_VARIANTS for v in settings.variants)
        if needs_export:
            jobs.append(Job("export", mode="", variant="", batch=settings.batch(model, "inference"),
                            savedmodel=str(workdir / f"{model}-float32"), **common))
        for mode in settings.modes:
            for variant in settings.variants:
                if variant in SAVEDMODEL_VARIANTS and mode != "inference":
                    continue
                directory = {"ours-cli": f"{model}-{settings.target}", "float32-savedmodel": f"{model}-float32"}
                jobs.append(Job("step", mode=mode, variant=variant, batch=settings.batch(model, mode),
                                savedmodel=str(workdir / directory[variant]) if variant in directory else "",
                                time_passes=variant == "float32" and settings.time_passes, **common))
    return jobs


# --- the child: one measurement -------------------------------------------------------




def _build_resnet50(sizes: Sizes) -> Any:
    size = sizes.image_size
    return keras.applications.ResNet50(weights=None, input_shape=(size, size, 3), classes=NUM_CLASSES["resnet50"])


class _AnyLengthPositionEmbedding(PositionEmbedding):
    """The position table sliced to the input's length: one model serves short and long requests."""

    def call(self, inputs: Any) -> Any:
        return inputs + self.table[: keras.ops.shape(inputs)[1]]


def _build_bert(sizes: Sizes, any_length: bool = False) -> Any:
    """BERT-base's shape from Keras layers: embeddings + LayerNorm, post-norm encoder
    blocks (MultiHeadAttention, GELU FFN), a tanh pooler on the first token. Dropout is
    left out so every variant runs the same deterministic ops. ``any_length``: token
    sequences of any length up to ``bert_seq`` (tools/bench_serving.py)."""
    layers = keras.layers
    tokens = keras.Input((None if any_length else sizes.bert_seq,), dtype="int32", name="tokens")
    hidden = layers.Embedding(sizes.bert_vocab, sizes.bert_hidden, name="word_embeddings")(tokens)
    positions = _AnyLengthPositionEmbedding if any_length else PositionEmbedding
    hidden = positions(sizes.bert_seq, sizes.bert_hidden, name="position_embeddings")(hidden)
    hidden = layers.LayerNormalization(epsilon=1e-12, name="embeddings_norm")(hidden)
    for index in range(sizes.bert_layers):
        attention = layers.MultiHeadAttention(sizes.bert_heads, key_dim=sizes.bert_hidden // sizes.bert_heads,
                                              name=f"layer{index}_attention")(hidden, hidden)
        hidden = layers.LayerNormalization(epsilon=1e-12, name=f"layer{index}_attention_norm")(hidden + attention)
        feed_forward = layers.Dense(sizes.bert_ffn, activation="gelu", name=f"layer{index}_ffn_in")(hidden)
        feed_forward = layers.Dense(sizes.bert_hidden, name=f"layer{index}_ffn_out")(feed_forward)
        hidden = layers.LayerNormalization(epsilon=1e-12, name=f"layer{index}_ffn_norm")(hidden + feed_forward)
    pooled = layers.Dense(sizes.bert_hidden, activation="tanh", name="pooler")(hidden[:, 0, :])
    probabilities = layers.Dense(NUM_CLASSES["bert"], activation="softmax", name="classifier")(pooled)
    return keras.Model(tokens, probabilities, name="bert")


def _inputs(job: Job) -> tuple[Any, Any]:
    """A fixed random batch and its labels, placed on the measured device once."""
    rng = np.random.default_rng(0)
    if job.model == "resnet50":
        x = rng.standard_normal((job.batch, job.sizes.image_size, job.sizes.image_size, 3), dtype=np.float32)
    else:
        x = rng.integers(0, job.sizes.bert_vocab, size=(job.batch, job.sizes.bert_seq), dtype=np.int32)
    y = rng.integers(0, NUM_CLASSES[job.model], size=(job.batch,), dtype=np.int32)
    with tf.device("/GPU:0" if job.device == "gpu" else "/CPU:0"):
        return tf.identity(x), tf.identity(y)


def _build_model(job: Job) -> Any:
    keras.utils.set_random_seed(0)
    return _build_resnet50(job.sizes) if job.model == "resnet50" else _build_bert(job.sizes)


def _step_function(job: Job, model: Any) -> Callable[[Any, Any], Any]:
    """The tf.function a user would run: ``model(x)``, or forward + loss + gradients + SGD.

    For float16 the mixed variants train through Keras' LossScaleOptimizer (all the same
    one, so the optimizer's extra work is equal); bfloat16 needs no loss scaling.
    """
    if job.mode == "inference":
        return tf.function(lambda x, y: model(x, training=False))
    optimizer = keras.optimizers.SGD(learning_rate=0.01)
    if job.target == "float16" and job.variant in ("ours", "grappler", "keras"):
        optimizer = keras.mixed_precision.LossScaleOptimizer(optimizer)
    optimizer.build(model.trainable_variables)  # variables exist before tracing
    loss_fn = keras.losses.SparseCategoricalCrossentropy()

    @tf.function
    def train_step(x: Any, y: Any) -> Any:
        with tf.GradientTape() as tape:
            loss = loss_fn(y, tf.cast(model(x, training=True), tf.float32))
            scaled = optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    return train_step


def _savedmodel_function(job: Job) -> Callable[[Any, Any], Any]:
    """The ``serve`` signature of the SavedModel, called as TF Serving would."""
    serve = tf.saved_model.load(job.savedmodel).signatures["serve"]
    (input_name,) = serve.structured_input_signature[1]
    return lambda x, y: serve(**{input_name: x})


def _sync(result: Any) -> None:
    """Wait for the step: fetch every output to the host."""
    for tensor in tf.nest.flatten(result):
        tensor.numpy()


def _graph_ops(run_metadata: Any, target: str) -> StepOps:
    """Count what ran: every partition graph of every function the step instantiated."""
    low = LOW_PRECISION_DTYPES[target]
    counts = {field.name: 0 for field in dataclasses.fields(StepOps)}
    for function_graph in run_metadata.function_graphs:
        for graph in function_graph.partition_graphs:
            for node in graph.node:
                counts["nodes"] += 1
                if node.op == "Cast":
                    source, destination = node.attr["SrcT"].type, node.attr["DstT"].type
                    counts["casts_to_low"] += source == DT_FLOAT and destination == low
                    counts["casts_to_float32"] += source == low and destination == DT_FLOAT
                    continue
                dtype = next((node.attr[a].type for a in ("T", "Ta") if a in node.attr), None)
                if dtype not in (DT_FLOAT, low) or node.op in ("_Arg", "_Retval", "Const", "Identity"):
                    continue
                is_low = dtype == low
                counts["float_ops_total"] += 1
                counts["float_ops_low"] += is_low
                if re.search(r"Conv|MatMul|Einsum", node.op):
                    counts["heavy_total"] += 1
                    counts["heavy_low"] += is_low
                # Remapper and oneDNN fusions; plain FusedBatchNorm* is an ordinary kernel.
                if node.op.startswith("_") and ("Fused" in node.op or node.op == "_MklLayerNorm") and not re.search(
                        r"FusedBatchNorm(Grad)?(V[23])?$", node.op):
                    counts["fused"] += 1
    return StepOps(**counts)


@contextlib.contextmanager
def _variant_scope(job: Job) -> Iterator[None]:
    """Whatever makes the variant: set before the model is built and the step traced."""
    if job.variant == "grappler":
        tf.config.optimizer.set_experimental_options({GRAPPLER_OPTIONS[job.target]: True})
    if job.variant == "keras":
        keras.config.set_dtype_policy(KERAS_POLICIES[job.target])
    if job.variant == "ours":
        with amp_rewrite.mixed_precision(target=job.target):
            yield
    else:
        yield


def gpu_line() -> str | None:
    """The GPUs TensorFlow sees, with compute capability; None when it sees none."""
    gpus = tf.config.list_physical_devices("GPU")
    if not gpus:
        return None
    details = [tf.config.experimental.get_device_details(gpu) for gpu in gpus]
    named = [f"{d.get('device_name', 'GPU')} (compute capability {'.'.join(map(str, d.get('compute_capability', '?')))})"
             for d in details]
    return f"GPU: {', '.join(named)}; measured on the first"


def serve_step(job: Job, commands: Any, reply: Callable[[str], None]) -> dict[str, Any]:
    """Build, trace (first call, inside the variant's scope) and warm up; say "ready"; then
    time one step per "step" command until "done"; then count ops (and time the passes)."""
    x, y = _inputs(job)
    eager = _tf.EAGER_CONTEXT.get()()
    with _variant_scope(job):
        if job.savedmodel:
            step = _savedmodel_function(job)
        else:
            step = _step_function(job, _build_model(job))
        eager.enable_run_metadata()  # the first call instantiates the graphs it records
        start = time.perf_counter()
        _sync(step(x, y))
        first_call_s = time.perf_counter() - start
        run_metadata = eager.export_run_metadata()
        eager.disable_run_metadata()
    for _ in range(job.sizes.warmup):
        _sync(step(x, y))
    reply("ready")
    seconds = []
    for command in commands:
        if command.strip() != "step":
            break
        start = time.perf_counter()
        _sync(step(x, y))
        seconds.append(time.perf_counter() - start)
        reply(repr(seconds[-1]))
    result = {
        "seconds": seconds, "first_call_s": first_call_s, "peak_rss_mb": _peak_rss_mb(),
        "peak_gpu_mb": tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20 if job.device == "gpu" else 0.0,
        "ops": dataclasses.asdict(_graph_ops(run_metadata, job.target)),
    }
    if job.time_passes:  # after the peak RSS is read: the passes' memory is not the variant's
        result.update(time_passes(job, step.get_concrete_function(x, y)))
    return result


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def time_passes(job: Job, concrete: Any) -> dict[str, Any]:
    """Time our pass and grappler's on the float32 step's GraphDef, with bench_pass's timer."""
    graph_def = concrete.graph.as_graph_def()
    fetches = [tensor.op.name for tensor in concrete.graph.outputs]
    ours, grappler = bench_pass.median_seconds(
        lambda: amp_rewrite.rewrite_graph_def(graph_def, target=job.target, fetches=fetches),
        lambda: run_grappler(graph_def, target=job.target, fetches=fetches, our_lists=False), timed=job.sizes.pass_runs)
    nodes = len(graph_def.node) + sum(len(f.node_def) for f in graph_def.library.function)
    return {"pass_nodes": nodes, "pass_ours_s": ours, "pass_grappler_s": grappler}


def export_float32(job: Job) -> dict[str, Any]:
    _build_model(job).export(job.savedmodel, verbose=False)
    return {}


def run_child(spec: str) -> int:
    """The child's side: stdout is the line protocol with the parent; anything else that
    writes to stdout (TensorFlow, Keras) is sent to stderr."""
    protocol = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1, encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    fields = json.loads(spec)
    out = Path(fields.pop("out"))
    job = Job(**{**fields, "sizes": Sizes(**fields["sizes"])})
    if job.kind == "export":
        result = export_float32(job)
    else:
        result = serve_step(job, sys.stdin, lambda line: print(line, file=protocol))
    out.write_text(json.dumps(result), encoding="utf-8")
    return 0


# --- the parent: run the children, write the tables -----------------------------------


class Child:
    """One job's process. Step children hold their model between the parent's "step"
    commands, so a group's variants can be timed in turn (see ``run_group``)."""

    def __init__(self, job: Job, workdir: Path, index: int) -> None:
        self.job, self.error = job, ""
        self.out, self.log = workdir / f"result-{index}.json", workdir / f"stderr-{index}.txt"
        spec = json.dumps({**dataclasses.asdict(job), "out": str(self.out)})
        environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": os.environ.get("TF_CPP_MIN_LOG_LEVEL", "2")}
        if job.device == "cpu":
            environment["CUDA_VISIBLE_DEVICES"] = "-1"  # a GPU host still measures the CPU
        else:  # a group's children share the GPU: none may take all of its memory up front
            environment["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
        with self.log.open("w", encoding="utf-8") as log:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "--child", spec], env=environment, cwd=REPO,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, bufsize=1)
        # A hung child is killed; its next read then fails like any other death.
        self.watchdog = threading.Timer(job.sizes.child_timeout, self._time_out)
        self.watchdog.start()

    def _time_out(self) -> None:
        self.error = f"timed out after {self.job.sizes.child_timeout} s (raise --child-timeout)"
        self.process.kill()

    def ask(self, command: str | None) -> str | None:
        """Send a command (None: just listen) and read the one-line answer; None (and
        ``error`` set) if the child died."""
        if self.error:
            return None
        if command is not None:
            with contextlib.suppress(OSError):  # a dead child is found by the read below
                self.process.stdin.write(command + "\n")
                self.process.stdin.flush()
        answer = self.process.stdout.readline()
        if not answer:
            self._failed()
            return None
        return answer.strip()

    def _failed(self) -> None:
        self.process.wait()
        lines = [line for line in self.log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
        print(f"--- {self.job.name} failed (exit {self.process.returncode}); last lines of its stderr:", *lines[-15:],
              sep="\n", file=sys.stderr)
        self.error = self.error or (lines[-1] if lines else f"exit status {self.process.returncode}")[:200]

    def finish(self) -> Outcome:
        """Say "done", wait for the result file, and read it."""
        if not self.error:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
            if self.process.wait() != 0 or not self.out.exists():
                self._failed()
        self.watchdog.cancel()
        if self.error:
            return Outcome(self.job, error=self.error)
        values = json.loads(self.out.read_text(encoding="utf-8"))
        if "ops" in values:
            values["ops"] = StepOps(**values["ops"])
        if "seconds" in values:
            values["seconds"] = tuple(values["seconds"])
        return Outcome(self.job, **values)


def run_group(jobs: Sequence[Job], workdir: Path, first_index: int) -> list[Outcome]:
    """Time one (model, step)'s variants in turn: each is built and warmed up alone, then
    every round times one step of each, in an order rotated per round, so drift in the
    machine's load (another process, thermal state) falls on all variants alike."""
    children = []
    for index, job in enumerate(jobs, first_index):
        child = Child(job, workdir, index)
        if child.ask(None) not in ("ready", None):
            child.error = "did not say it was ready"
        children.append(child)
    for round_index in range(jobs[0].sizes.runs):
        shift = round_index % len(children)
        for child in children[shift:] + children[:shift]:
            child.ask("step")
    return [child.finish() for child in children]


def amp_rewrite_cli(args: Sequence[str], in_process: bool = False) -> subprocess.CompletedProcess:
    """``amp-rewrite ARGS`` as a user runs it, a Python of its own from this checkout; or
    (``in_process``, for a --smoke run) ``amp_rewrite.cli.main`` in this process, its output
    captured, which saves a TensorFlow import."""
    if not in_process:
        return subprocess.run([sys.executable, "-m", "amp_rewrite", *args], capture_output=True, text=True, cwd=REPO,
                              env={**os.environ, "PYTHONPATH": str(REPO)}, check=False)
    import io

    from amp_rewrite import cli

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


def convert_savedmodel(source: str, destination: str, target: str) -> tuple[float, str]:
    """``amp-rewrite convert``, exactly as a user runs it; returns (seconds, error or "")."""
    start = time.perf_counter()
    child = amp_rewrite_cli(["convert", source, destination, "--target", target, "--quiet"])
    error = "" if child.returncode == 0 else (child.stderr.strip().splitlines() or ["failed"])[-1]
    return time.perf_counter() - start, error


def run_all(settings: Settings, workdir: Path) -> list[Outcome]:
    outcomes: list[Outcome] = []
    jobs = plan_jobs(settings, workdir)
    started = time.perf_counter()
    groups: dict[tuple[str, str], list[Job]] = {}
    for job in jobs:
        groups.setdefault((job.model, job.mode), []).append(job)
    for (model, mode), group in groups.items():
        group_start = time.perf_counter()
        if group[0].kind == "export":
            outcome = Child(group[0], workdir, len(outcomes)).finish()
            if not outcome.error and "ours-cli" in settings.variants:
                seconds, error = convert_savedmodel(group[0].savedmodel, str(workdir / f"{model}-{settings.target}"),
                                                    settings.target)
                outcome = dataclasses.replace(outcome, convert_s=seconds,
                                              error=error and f"amp-rewrite convert: {error}")
            outcomes.append(outcome)
            done = "failed" if outcome.error else "done"
            print(f"export {model}: {done}", file=sys.stderr, flush=True)
            continue
        export_failed = any(o.job.kind == "export" and o.error for o in outcomes if o.job.model == model)
        runnable = [job for job in group if not (job.variant == "ours-cli" and export_failed)]
        outcomes += [Outcome(job, error="the float32 export failed") for job in group if job not in runnable]
        outcomes += run_group(runnable, workdir, len(outcomes))
        summary = ", ".join(f"{o.job.variant} {o.median_s:.3f} s" if o.seconds else f"{o.job.variant} failed"
                            for o in outcomes[-len(runnable):])
        print(f"{model} {mode}: {summary} ({time.perf_counter() - group_start:.0f} s,"
              f" {time.perf_counter() - started:.0f} s in all)", file=sys.stderr, flush=True)
    return outcomes


def _ratio(numerator: float, denominator: float) -> str:
    return f"{numerator / denominator:.2f}x"


def _step_rows(outcomes: Sequence[Outcome], model: str, mode: str) -> list[Outcome]:
    return [o for o in outcomes if o.job.kind == "step" and o.job.model == model and o.job.mode == mode]


def _find(rows: Sequence[Outcome], variant: str) -> Outcome | None:
    return next((o for o in rows if o.job.variant == variant and not o.error), None)


def render_sizes(settings: Settings) -> str:
    s = settings.sizes
    return (
        f"ResNet50 {s.image_size}x{s.image_size}, inference batch {s.resnet_batch}, training batch"
        f" {s.resnet_train_batch}; BERT-base-shaped encoder: {s.bert_layers} layers, hidden {s.bert_hidden},"
        f" {s.bert_heads} heads, FFN {s.bert_ffn}, seq {s.bert_seq}, vocab {s.bert_vocab}, inference batch"
        f" {s.bert_batch}, training batch {s.bert_train_batch}. Median of {s.runs} runs after the first call and"
        f" {s.warmup} warm-up run(s); training = one step of forward, backward and SGD update. Random weights."
    )


def render_timings(settings: Settings, outcomes: Sequence[Outcome]) -> list[str]:
    gpu = settings.device == "gpu"
    lines = [
        f"| model | step | variant | median (s) | speed-up vs float32 | peak RSS (MB) |{' peak GPU (MB) |' if gpu else ''}",
        f"|---|---|---|---:|---:|---:|{'---:|' if gpu else ''}",
    ]
    for model in settings.models:
        for mode in settings.modes:
            rows = _step_rows(outcomes, model, mode)
            base = _find(rows, "float32")
            for o in rows:
                label = variant_label(o.job.variant, settings.target)
                head = f"| {MODEL_LABELS[model]} | {mode} (batch {o.job.batch}) | {label} |"
                if o.error:
                    lines.append(f"{head} failed: {o.error.replace('|', '/')} | | |{' |' if gpu else ''}")
                    continue
                speed_up = _ratio(base.median_s, o.median_s) if base else "n/a (float32 failed)"
                gpu_cell = f" {o.peak_gpu_mb:,.0f} |" if gpu else ""
                lines.append(f"{head} {o.median_s:.3f} | {speed_up} | {o.peak_rss_mb:,.0f} |{gpu_cell}")
    return lines


def render_ops(settings: Settings, outcomes: Sequence[Outcome]) -> list[str]:
    low = settings.target
    header = (f"| model | step | variant | nodes run | casts to {low} / to float32 | conv+matmul in {low} |"
              f" all float ops in {low} | fused ops | first call (s) |")
    lines = [header, "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for model in settings.models:
        for mode in settings.modes:
            for o in _step_rows(outcomes, model, mode):
                if o.error or o.ops is None:
                    continue
                ops = o.ops
                not_low = ops.heavy_low == 0 and o.job.variant not in ("float32", "float32-savedmodel")
                warning = f" **(none: not {low})**" if not_low else ""
                lines.append(
                    f"| {MODEL_LABELS[model]} | {mode} | {variant_label(o.job.variant, low)} | {ops.nodes:,} |"
                    f" {ops.casts_to_low} / {ops.casts_to_float32} | {ops.heavy_low}/{ops.heavy_total}{warning} |"
                    f" {ops.float_ops_low}/{ops.float_ops_total} | {ops.fused} | {o.first_call_s:.1f} |"
                )
    return lines


def _compare(ours: Outcome, other: Outcome, other_name: str) -> str:
    """"ours ≥ X: yes/no", by how much (median of the per-round ratios: both ran in the
    same rounds), and in how many rounds ours was faster; a slower median is only noise
    when ours still won some rounds. Where ours is slower, what the op counts suggest."""
    ratios = [theirs / mine for mine, theirs in zip(ours.seconds, other.seconds)]
    gain = statistics.median(ratios) - 1  # > 0: ours is faster
    rounds = f"faster in {sum(r > 1 for r in ratios)} of {len(ratios)} rounds"
    if gain >= 0:
        return f"ours ≥ {other_name}: yes ({gain:+.1%}, {rounds})"
    if any(r > 1 for r in ratios):
        verdict = f"ours ≥ {other_name}: no, but within the run-to-run noise ({gain:+.1%}, {rounds})"
    else:
        verdict = f"ours ≥ {other_name}: **no** ({gain:+.1%}, {rounds})"
    return f"{verdict} — {_suspects(ours, other, other_name)}"


def _suspects(ours: Outcome, other: Outcome, other_name: str) -> str:
    """What the op counts say about why ours is slower than ``other``."""
    a, b = ours.ops, other.ops
    if a is None or b is None:
        return "no op counts"
    if a == b:
        return (f"ours and {other_name} ran the same graph (nodes, casts, dtypes and fusions all equal),"
                " so look at kernel time and noise, not the rewrite")
    notes = []
    if a.casts_to_low + a.casts_to_float32 > b.casts_to_low + b.casts_to_float32:
        notes.append(f"ours runs {a.casts_to_low + a.casts_to_float32} precision casts per step,"
                     f" {other_name} {b.casts_to_low + b.casts_to_float32}")
    if a.heavy_low < b.heavy_low:
        notes.append(f"{a.heavy_total - a.heavy_low} of our {a.heavy_total} conv/matmul ops stay float32,"
                     f" {b.heavy_total - b.heavy_low} of {other_name}'s {b.heavy_total}")
    if a.float_ops_low < b.float_ops_low:
        notes.append(f"{a.float_ops_low} of our float ops run in low precision, {b.float_ops_low} of {other_name}'s")
    if a.fused < b.fused:
        notes.append(f"ours keeps {a.fused} fused ops, {other_name} {b.fused} (fusions lost)")
    if a.nodes > b.nodes:
        notes.append(f"ours runs {a.nodes:,} nodes, {other_name} {b.nodes:,}")
    return "; ".join(notes) or f"the op counts are no worse than {other_name}'s: look at kernel time"


def render_verdicts(settings: Settings, outcomes: Sequence[Outcome]) -> list[str]:
    lines = []
    for model in settings.models:
        for mode in settings.modes:
            rows = _step_rows(outcomes, model, mode)
            ours = _find(rows, "ours")
            if ours is None:
                if any(o.job.variant == "ours" for o in rows):
                    lines.append(f"- **{MODEL_LABELS[model]}, {mode}:** ours failed to run; see the table.")
                continue
            parts = []
            for variant, name in (("grappler", "grappler"), ("keras", "Keras policy")):
                other = _find(rows, variant)
                if other is None:
                    parts.append(f"ours ≥ {name}: not measured")
                    continue
                parts.append(_compare(ours, other, name))
            cli, reference = _find(rows, "ours-cli"), _find(rows, "float32-savedmodel")
            if cli and reference:
                parts.append(f"CLI SavedModel vs float32 SavedModel: {_ratio(reference.median_s, cli.median_s)}")
            lines.append(f"- **{MODEL_LABELS[model]}, {mode}:** " + "; ".join(parts) + ".")
    return lines


def render_passes(settings: Settings, outcomes: Sequence[Outcome]) -> list[str]:
    rows = [o for o in outcomes if o.job.time_passes and not o.error]
    if not rows:
        return []
    heading = (f"Pass time on the float32 step's traced graph (GraphDef in, rewritten GraphDef out; median of"
               f" {settings.sizes.pass_runs} after a warm-up, `tools/bench_pass.py`'s timer):")
    lines = [
        heading,
        "",
        "| graph | nodes | ours (s) | grappler (s) | ours/grappler |",
        "|---|---:|---:|---:|---:|",
    ]
    for o in rows:
        graph = f"{MODEL_LABELS[o.job.model]} {o.job.mode} (batch {o.job.batch})"
        lines.append(f"| {graph} | {o.pass_nodes:,} | {o.pass_ours_s:.3f} | {o.pass_grappler_s:.3f} |"
                     f" {_ratio(o.pass_ours_s, o.pass_grappler_s)} |")
    converts = [o for o in outcomes if o.job.kind == "export" and o.convert_s]
    if converts:
        lines += ["", "`amp-rewrite convert` wall time (process start to finish): " + ", ".join(
            f"{MODEL_LABELS[o.job.model]} {o.convert_s:.1f} s" for o in converts) + "."]
    return lines


def cpu_note(machine: str) -> str:
    """Where the CPU stands for bfloat16: spec/tf_facts.md's numbers come from an AMX CPU."""
    has = {flag: f"{flag} yes" in machine for flag in ("avx512_bf16", "amx_bf16", "amx_tile")}
    if has["amx_bf16"] and has["amx_tile"]:
        return "This CPU has AMX: bfloat16 matmuls and convolutions can run on AMX tiles."
    if has["avx512_bf16"]:
        return ("This CPU has AVX512-BF16 but no AMX: oneDNN runs bfloat16 convolutions and matmuls with"
                " AVX512-BF16 dot products, not AMX tiles, so gains can be far smaller than the ~1.8x for"
                " ResNet50 inference in `spec/tf_facts.md`, which was measured on an AMX CPU.")
    return "This CPU has neither AVX512-BF16 nor AMX: bfloat16 is emulated and expected to be slower than float32."


SMOKE_NOTE = (
    "**Smoke run (`--smoke`), not a measurement:** tiny sizes and 1 run; it shows that the variants run and"
    " the table renders. Replace it with a full run on a quiet machine."
)
METHOD_NOTE = (
    "Each variant runs in its own process; a model and step's variants are timed in turn, one step each per"
    " round, in an order rotated per round; speed-up = float32 time / variant time, both from this run;"
    " peak RSS is the variant's whole process (TensorFlow, model build, tracing, runs)."
)
VERDICTS_HEADING = (
    "Ours against the others (median of the per-round time ratios; a slower median is noise when ours still won"
    " some rounds):"
)
OPS_HEADING = (
    "What ran per step (partition graphs of the first call, after TensorFlow's runtime optimizations;"
    " fused ops = remapper/oneDNN/cuDNN fusions; first call = trace, rewrite and graph optimization):"
)


def render_section(settings: Settings, outcomes: Sequence[Outcome], machine: str, elapsed_s: float) -> str:
    title = {"cpu": "CPU, bfloat16", "gpu": "NVIDIA GPU, float16"}[settings.device]
    lines = [f"## {title}", ""]
    if settings.smoke:
        lines += [SMOKE_NOTE, ""]
    lines += [f"{machine}. Run {datetime.date.today().isoformat()}, {elapsed_s / 60:.1f} min in all.", "",
              render_sizes(settings), "", METHOD_NOTE, ""]
    if settings.device == "cpu":
        lines += [cpu_note(machine), ""]
    lines += render_timings(settings, outcomes)
    verdicts = render_verdicts(settings, outcomes)
    if verdicts:
        lines += ["", VERDICTS_HEADING, "", *verdicts]
    lines += ["", OPS_HEADING, "", *render_ops(settings, outcomes)]
    passes = render_passes(settings, outcomes)
    if passes:
        lines += ["", *passes]
    return "\n".join(lines) + "\n"


# --- BENCHMARKS.md: one section per device and target ---------------------------------

MARKDOWN_HEAD = """# Benchmarks

End-to-end time of mixed precision on ResNet50 and a BERT-base-shaped encoder, inference and
one training step, against float32 and the other ways to get mixed precision, and serving
converted SavedModels (weights stored in the target precision or not). Written by
`tools/bench.py` and `tools/bench_serving.py` (`make bench`; `tools/bench_gpu.sh` on a GPU
machine): each run replaces its own section below and keeps the others. How the numbers are
taken: the docstrings of the two tools.
"""
PLACEHOLDERS = {
    "cpu-bfloat16": "## CPU, bfloat16\n\nNot yet measured. Run `make bench` on a quiet machine.\n",
    "gpu-float16": ("## NVIDIA GPU, float16\n\nNot yet measured: no GPU was available. Run `tools/bench_gpu.sh`"
                    " on a machine with one NVIDIA GPU (compute capability 7.0+); it prints this section for"
                    " float32, ours (`target=\"float16\"`), grappler's `auto_mixed_precision` and Keras'"
                    " `mixed_float16`.\n"),
}


def _markers(section: str) -> tuple[str, str]:
    return f"<!-- bench.py section {section} -->", f"<!-- end of bench.py section {section} -->"


def update_markdown(text: str | None, section: str, body: str) -> str:
    """``text`` with ``section`` replaced by ``body`` (created from the skeleton when absent)."""
    if text is None:
        text = MARKDOWN_HEAD + "".join(f"\n{_markers(s)[0]}\n{p}{_markers(s)[1]}\n" for s, p in PLACEHOLDERS.items())
    begin, end = _markers(section)
    block = f"{begin}\n{body}{end}"
    pattern = re.compile(re.escape(begin) + r".*?" + re.escape(end), re.DOTALL)
    if pattern.search(text):
        return pattern.sub(lambda _: block, text, count=1)
    return text.rstrip("\n") + "\n\n" + block + "\n"


def time_rotated(calls: dict[str, Callable[[], object]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each variant: ``warmup`` untimed calls each, then ``rounds`` rounds
    of one call each, in an order rotated per round, so a change in the machine's load
    falls on every variant alike instead of on whichever ran at that moment."""
    for call in calls.values():
        for _ in range(warmup):
            call()
    times: dict[str, list[float]] = {variant: [] for variant in calls}
    order = list(calls)
    for round_index in range(rounds):
        shift = round_index % len(order)
        for variant in order[shift:] + order[:shift]:
            start = time.perf_counter()
            calls[variant]()
            times[variant].append(time.perf_counter() - start)
    return times


def write_section(output: Path | None, name: str, section: str, smoke_dir: Path | None) -> None:
    """Replace section ``name`` of ``output`` (None: write nothing) with ``section``; a smoke
    run (``smoke_dir``) writes a copy of ``output`` there instead, leaving the file alone."""
    if output is None:
        return
    if smoke_dir is not None:
        if output.exists():
            shutil.copy(output, smoke_dir / output.name)
        output = smoke_dir / output.name
    old = output.read_text(encoding="utf-8") if output.exists() else None
    output.write_text(update_markdown(old, name, section), encoding="utf-8")
    print(f"wrote section {name} of {output}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.child:
        return run_child(args.child)
    settings = parse_settings(args, parser)
    machine = bench_pass.machine_line()
    if settings.device == "gpu":
        gpus = gpu_line()
        if gpus is None:
            print("bench.py: --device gpu, but TensorFlow sees no GPU; check nvidia-smi and that tensorflow[and-cuda]"
                  " is installed (tools/bench_gpu.sh does both), or measure the CPU with --device cpu",
                  file=sys.stderr)
            return 2
        machine = f"{gpus}. {machine}"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-bench-") as workdir:
        outcomes = run_all(settings, Path(workdir))
        section = render_section(settings, outcomes, machine, time.perf_counter() - started)
        print(section)
        write_section(settings.output, settings.section, section, Path(workdir) if settings.smoke else None)
    failed = [o.job.name for o in outcomes if o.error]
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
