"""Serving speed of converted SavedModels: weights stored in the target precision or not.

A converted SavedModel is served: loaded once, then called with small batches. This tool
exports ResNet50, a BERT-base-shaped encoder (``tools/bench.py``'s shapes, random
weights, ``model.export``; BERT takes any sequence length) and MobileNetV2
(``keras.applications``, weights=None), and compares four SavedModels:

* the float32 export;
* ``amp-rewrite convert --target T`` (weights stored in T, the default);
* ``amp-rewrite convert --target T --float32-weights`` (float32 weights, cast on every call);
* ``amp-rewrite convert --target T --tune speed --batch-sizes 1,8`` (ops timed on this
  machine, those that do not pay kept float32; BERT's shapes from ``--inputs`` of the batch-8
  regime), with what the timing moved and cost, and convert's own check of the result;
* the same once per regime, ``--batch-sizes 1`` for the batch-1 column and ``8`` for the
  other (BERT: ``--inputs`` of that regime), each timed at its own batch.

Measured, per model: the size of ``variables/`` and of the whole SavedModel; load time
(``tf.saved_model.load``) and peak RSS, each variant loaded in its own fresh process (median
of 3, in turn); and the time of one call of the ``serve`` signature at batch 1 (BERT: 16
tokens) and batch 8 (BERT: 128 tokens), the three variants loaded in one process and
called in turn, one call each per round, in an order rotated per round, so a change in the
machine's load falls on all three alike; speed-up = the median over rounds of float32's
time / the variant's. Where a goal is missed, a per-op profile of one call (a TF1 Session
with full tracing: the time of every op the call ran) says where the time goes: casts,
float32 ops, low-precision matmuls and convolutions, other low-precision ops.

Goals (issue 29, a CPU with AVX512-BF16): batch 1 ≥ 1.1×, batch 8 ≥ 1.7× float32; variables/
≤ 0.55× the source's. Issue 37: ``--tune speed`` never slower than float32 (≥ 1.0× at both).

    TF_CPP_MIN_LOG_LEVEL=2 nice -n 10 .venv/bin/python tools/bench_serving.py          # ~25 min on 2 cores
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_serving.py --smoke            # tiny BERT: checks the script
    tools/bench_gpu.sh                                                                  # float16 on a GPU

The markdown goes to stdout and replaces this device's serving section of BENCHMARKS.md
(``--smoke``: of a copy of it in a temporary directory).
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import datetime
import functools
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402  (tools/bench.py: the models and BENCHMARKS.md's sections)
from bench_pass import machine_line  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
VARIANTS = ("float32", "low", "float32-weights", "tuned", "tuned-each")
PER_REGIME = ("tuned-each",)               # variants converted once per regime, each timed at its own
PROFILED = ("float32", "low", "float32-weights", "tuned-each")  # traced where a goal is missed
DEVICE_TARGETS = {"cpu": "bfloat16", "gpu": "float16"}
GOALS = {"batch 1": 1.1, "batch 8": 1.7}  # speed-up of "low" over float32, per regime
TUNED_GOAL = 1.0                           # speed-up of "tuned" over float32, every regime (issue 37)
TUNE_ARGS = ("--tune", "speed")
REGIME_BATCH = {"batch 1": 1, "batch 8": 8}
VARIABLES_GOAL = 0.55                     # variables/ of "low" over the source's
LOW_DTYPES = {"bfloat16": 14, "float16": 19}
DT_FLOAT = 1


@dataclass(frozen=True)
class Sizes:
    image_size: int
    bert_layers: int
    bert_hidden: int
    bert_heads: int
    bert_ffn: int
    bert_vocab: int
    short_seq: int   # BERT tokens at batch 1
    long_seq: int    # BERT tokens at batch 8
    rounds: int
    warmup: int
    load_rounds: int  # fresh-process loads of each variant
    profiled: tuple[tuple[str, str], ...]  # (regime, variant) profiled where that regime's goal is missed
    tune_budget: float = 30.0  # --tune-budget of the tuned variants (convert's default)


REGIMES = ("batch 1", "batch 8")
FULL = Sizes(image_size=224, bert_layers=12, bert_hidden=768, bert_heads=12, bert_ffn=3072, bert_vocab=30522,
             short_seq=16, long_seq=128, rounds=15, warmup=3, load_rounds=3,
             profiled=tuple((regime, variant) for regime in REGIMES for variant in VARIANTS))
# --smoke: each kind of child once, in this process, on a tiny BERT; checks the script, measures nothing.
SMOKE = Sizes(image_size=32, bert_layers=1, bert_hidden=32, bert_heads=2, bert_ffn=64, bert_vocab=100,
              short_seq=4, long_seq=8, rounds=1, warmup=0, load_rounds=1, profiled=(("batch 1", "low"),),
              tune_budget=3.0)
SMOKE_MODELS = "bert"


def variant_label(variant: str, target: str) -> str:
    return {
        "float32": "float32 SavedModel (`model.export`)",
        "low": f"`amp-rewrite convert --target {target}` (weights stored {target})",
        "float32-weights": f"`amp-rewrite convert --target {target} --float32-weights`",
        "tuned": f"`amp-rewrite convert --target {target} --tune speed --batch-sizes 1,8`",
        "tuned-each": f"`amp-rewrite convert --target {target} --tune speed --batch-sizes N`, N each column's batch"
                      " (one conversion per column)",
    }[variant]


# --- models ---------------------------------------------------------------------------


def _build(model: str, sizes: Sizes) -> Any:
    """tools/bench.py's models, its BERT encoder taking any sequence length up to
    ``long_seq``; MobileNetV2 from keras.applications."""
    import keras

    keras.utils.set_random_seed(0)
    if model == "mobilenetv2":
        return keras.applications.MobileNetV2(weights=None, input_shape=(sizes.image_size, sizes.image_size, 3))
    shapes = dataclasses.replace(bench.FULL, image_size=sizes.image_size, bert_layers=sizes.bert_layers,
                                 bert_hidden=sizes.bert_hidden, bert_heads=sizes.bert_heads, bert_ffn=sizes.bert_ffn,
                                 bert_vocab=sizes.bert_vocab, bert_seq=sizes.long_seq)
    return bench._build_resnet50(shapes) if model == "resnet50" else bench._build_bert(shapes, any_length=True)


def _batch(model: str, regime: str, sizes: Sizes) -> Any:
    import numpy as np

    rng = np.random.default_rng(0)
    batch = 1 if regime == "batch 1" else 8
    if model in IMAGE_MODELS:
        return rng.standard_normal((batch, sizes.image_size, sizes.image_size, 3), dtype=np.float32)
    seq = sizes.short_seq if regime == "batch 1" else sizes.long_seq
    return rng.integers(0, sizes.bert_vocab, size=(batch, seq), dtype=np.int32)


IMAGE_MODELS = ("resnet50", "mobilenetv2")


def _regime_text(model: str, regime: str, sizes: Sizes) -> str:
    if model in IMAGE_MODELS:
        return regime
    return f"{regime} × {sizes.short_seq if regime == 'batch 1' else sizes.long_seq} tokens"


# --- children: each measurement in a fresh process -------------------------------------


def _serve(directory: str, device: str) -> Any:
    import tensorflow as tf

    with tf.device(f"/{device.upper()}:0"):
        function = tf.saved_model.load(directory).signatures["serve"]
    (name,) = function.structured_input_signature[1]

    def call(x: Any) -> None:
        with tf.device(f"/{device.upper()}:0"):
            for tensor in tf.nest.flatten(function(**{name: tf.constant(x)})):
                tensor.numpy()
    return call


def child_export(spec: dict[str, Any]) -> dict[str, Any]:
    """The float32 export, and for BERT the batch-8 regime's inputs (``--tune``'s shapes)."""
    import numpy as np
    import tensorflow as tf

    sizes = Sizes(**spec["sizes"])
    _build(spec["model"], sizes).export(spec["dir"], verbose=False)
    if spec["model"] not in IMAGE_MODELS:
        (name,) = tf.saved_model.load(spec["dir"]).signatures["serve"].structured_input_signature[1]
        for regime, path in spec["inputs"].items():
            np.savez(path, **{name: _batch(spec["model"], regime, sizes)})
    return {}


def child_load(spec: dict[str, Any]) -> dict[str, Any]:
    """Load time, first call and the process's peak RSS (TensorFlow, the model, one call)."""
    import tensorflow as tf

    sizes = Sizes(**spec["sizes"])
    x = _batch(spec["model"], "batch 1", sizes)
    tf.constant(0.0).numpy()  # TensorFlow's runtime up before the clock starts
    start = time.perf_counter()
    call = _serve(spec["dir"], spec["device"])
    load_s = time.perf_counter() - start
    start = time.perf_counter()
    call(x)
    first_call_s = time.perf_counter() - start
    result = {"load_s": load_s, "first_call_s": first_call_s,
              "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if spec["device"] == "gpu":
        result["peak_gpu_mb"] = tf.config.experimental.get_memory_info("GPU:0")["peak"] / 2**20
    return result


def child_time(spec: dict[str, Any]) -> dict[str, Any]:
    """The variants in one process, timed in turn: seconds per call, per regime and variant
    (a PER_REGIME variant's conversion for that regime)."""
    sizes = Sizes(**spec["sizes"])
    calls = {variant: _serve(directory, spec["device"]) for variant, directory in spec["dirs"].items()
             if variant not in spec["per_regime"]}
    seconds: dict[str, dict[str, list[float]]] = {}
    for regime in REGIMES:
        calls.update({variant: _serve(dirs[regime], spec["device"]) for variant, dirs in spec["per_regime"].items()})
        x = _batch(spec["model"], regime, sizes)
        seconds[regime] = bench.time_rotated({variant: functools.partial(call, x) for variant, call in calls.items()},
                                             sizes.rounds, 1 + sizes.warmup)
    return {"seconds": seconds}


def child_profile(spec: dict[str, Any]) -> dict[str, Any]:
    """Where one call's time goes: every op the call ran, from a TF1 Session's full trace
    (function bodies included), summed by category; median over a few traced calls."""
    import numpy as np
    import tensorflow as tf

    sizes = Sizes(**spec["sizes"])
    low = LOW_DTYPES[spec["target"]]
    x = _batch(spec["model"], spec["regime"], sizes)
    graph = tf.Graph()
    totals: dict[str, list[float]] = collections.defaultdict(list)
    with tf.compat.v1.Session(graph=graph) as session:
        meta = tf.compat.v1.saved_model.loader.load(session, ["serve"], spec["dir"])
        signature = meta.signature_def["serve"]
        (feed,) = [tensor.name for tensor in signature.inputs.values()]
        fetches = [tensor.name for tensor in signature.outputs.values()]
        for _ in range(1 + sizes.warmup):
            session.run(fetches, {feed: x})
        for _ in range(5):
            options = tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
            metadata = tf.compat.v1.RunMetadata()
            session.run(fetches, {feed: x}, options=options, run_metadata=metadata)
            sums: dict[str, float] = collections.defaultdict(float)
            for device in metadata.step_stats.dev_stats:
                for node in device.node_stats:
                    op = node.timeline_label.split("(")[0].split(" = ")[-1].strip() if node.timeline_label else ""
                    dtype = node.output[0].tensor_description.dtype if node.output else 0
                    kind = _kind(op, dtype, low)
                    sums[kind] += (node.op_end_rel_micros - node.op_start_rel_micros) / 1e6
            for kind, value in sums.items():
                totals[kind].append(value)
    return {"profile": {kind: float(np.median(values)) for kind, values in totals.items()}}


HEAVY = re.compile(r"Conv|MatMul|Einsum")


def _kind(op: str, dtype: int, low: int) -> str:
    """What an op is for the profile: a cast, or arithmetic in float32 or low precision."""
    if op == "Cast":
        return "casts"
    if op in ("_Arg", "_Retval", "NoOp", "Const", "Identity", "_Recv", "_Send") or not op:
        return "other (no arithmetic)"
    if dtype == low:
        return "low-precision matmul/conv" if HEAVY.search(op) else "low-precision other ops"
    if dtype == DT_FLOAT:
        return "float32 matmul/conv" if HEAVY.search(op) else "float32 other ops"
    return "other (no arithmetic)"


CHILDREN = {"export": child_export, "load": child_load, "time": child_time, "profile": child_profile}


def run_child(kind: str, spec: dict[str, Any], timeout: int, in_process: bool = False) -> dict[str, Any]:
    """One child process: this script with ``--child``; its JSON answer, or {"error": ...}.
    ``in_process`` (--smoke): the same child code in this process, its numbers meaningless."""
    if in_process:
        return json.loads(json.dumps(CHILDREN[kind](dict(spec))))
    with tempfile.NamedTemporaryFile("r", suffix=".json") as out:
        command = [sys.executable, __file__, "--child", json.dumps({"kind": kind, "out": out.name, **spec})]
        try:
            child = subprocess.run(command, capture_output=True, text=True, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout} s"}
        if child.returncode != 0:
            return {"error": (child.stderr.strip().splitlines() or ["failed"])[-1]}
        return json.loads(Path(out.name).read_text(encoding="utf-8"))


def convert(source: Path, destination: Path, target: str, *extra: str, in_process: bool = False) -> tuple[float, str]:
    """``amp-rewrite convert`` as a user runs it (``in_process``, --smoke: ``amp_rewrite.cli.main``);
    (seconds, "ok: " and its Weights block, or the error line)."""
    start = time.perf_counter()
    child = bench.amp_rewrite_cli(["convert", str(source), str(destination), "--target", target, *extra], in_process)
    if child.returncode != 0:
        return time.perf_counter() - start, (child.stderr.strip().splitlines() or ["failed"])[-1]
    lines = child.stdout.splitlines()
    first = next((index for index, line in enumerate(lines) if line.startswith("Weights:")), None)
    if first is None:
        return time.perf_counter() - start, ""
    block = [lines[first]] + [line for line in lines[first + 1:] if line.startswith("  ")]
    said = [line for line in lines if line.startswith(("Timing:", "Speed against"))]  # --tune speed
    said += [line.removeprefix("amp-rewrite: warning: ") for line in child.stderr.splitlines() if "Speed:" in line]
    return time.perf_counter() - start, "ok: " + "\n".join(block + said)


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- the run --------------------------------------------------------------------------


@dataclass
class ModelResult:
    model: str
    sizes_bytes: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)  # variant -> (variables, all)
    loads: dict[str, list[dict[str, float]]] = dataclasses.field(default_factory=dict)
    seconds: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)  # regime -> variant -> s
    profiles: dict[tuple[str, str], dict[str, float]] = dataclasses.field(default_factory=dict)
    convert_lines: dict[str, str] = dataclasses.field(default_factory=dict)
    errors: list[str] = dataclasses.field(default_factory=list)

    def median(self, regime: str, variant: str) -> float:
        return statistics.median(self.seconds[regime][variant])

    def speed_up(self, regime: str, variant: str, base: str = "float32") -> float:
        """Median over rounds of ``base``'s time / the variant's (both from the same round)."""
        pairs = zip(self.seconds[regime][base], self.seconds[regime][variant])
        return statistics.median(theirs / mine for theirs, mine in pairs)


def convert_jobs(model: str, sizes: Sizes, workdir: Path, dirs: dict[str, Path],
                 per_regime: dict[str, dict[str, Path]], inputs: dict[str, Path]) -> list[tuple[str, Path, tuple]]:
    """(variant, destination, convert's extra arguments) of each converted variant; each
    tuned one with a fresh cache, so its Timing line says what timing costs."""
    def tuned(cache: str, batches: str, regime: str) -> tuple[str, ...]:
        given = ("--inputs", str(inputs[regime])) if model not in IMAGE_MODELS else ()
        return (*TUNE_ARGS, "--tune-budget", f"{sizes.tune_budget:g}", "--batch-sizes", batches,
                "--tune-cache", str(workdir / cache), *given)
    jobs = [("low", dirs["low"], ()), ("float32-weights", dirs["float32-weights"], ("--float32-weights",)),
            ("tuned", dirs["tuned"], tuned(f"{model}-timings.json", "1,8", "batch 8"))]
    return jobs + [(variant, path, tuned(f"{model}-{variant}.json", str(REGIME_BATCH[regime]), regime))
                   for variant, regime_dirs in per_regime.items() for regime, path in regime_dirs.items()]


def measure(model: str, sizes: Sizes, device: str, target: str, workdir: Path, timeout: int,
            in_process: bool = False) -> ModelResult:
    """One model's variants: exported, converted, sized, loaded, timed (``in_process``: --smoke)."""
    result = ModelResult(model)

    def run(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
        return run_child(kind, spec, timeout, in_process)

    dirs = {variant: workdir / f"{model}-{variant}" for variant in VARIANTS}
    common = {"model": model, "sizes": dataclasses.asdict(sizes), "device": device, "target": target}
    per_regime = {v: {r: workdir / f"{model}-{v}-b{REGIME_BATCH[r]}" for r in REGIMES} for v in PER_REGIME}
    for variant, regime_dirs in per_regime.items():
        dirs[variant] = regime_dirs["batch 8"]  # its sizes and load times
    inputs = {regime: workdir / f"{model}-inputs-b{REGIME_BATCH[regime]}.npz" for regime in REGIMES}
    exported = run("export", {**common, "dir": str(dirs["float32"]), "inputs": {r: str(p) for r, p in inputs.items()}})
    if "error" in exported:
        result.errors.append(f"export: {exported['error']}")
        return result

    jobs = convert_jobs(model, sizes, workdir, dirs, per_regime, inputs)
    for variant, destination, extra in jobs:
        seconds, line = convert(dirs["float32"], destination, target, *extra, in_process=in_process)
        if not line.startswith("ok") and line:
            result.errors.append(f"convert {variant}: {line}")
            return result
        said = line.removeprefix("ok: ")
        result.convert_lines[variant] = "\n".join(filter(None, (result.convert_lines.get(variant), said)))
        print(f"{model}: converted {variant} in {seconds:.1f} s", file=sys.stderr, flush=True)
    for variant, directory in dirs.items():
        result.sizes_bytes[variant] = (folder_bytes(directory / "variables"), folder_bytes(directory))
    order = list(dirs)
    for round_index in range(sizes.load_rounds):  # each variant loaded in its own process, in turn, the order rotated
        for variant in order[round_index:] + order[:round_index]:
            directory = dirs[variant]
            answer = run("load", {**common, "dir": str(directory)})
            if "error" in answer:
                result.errors.append(f"load {variant}: {answer['error']}")
                return result
            result.loads.setdefault(variant, []).append(answer)
    print(f"{model}: loads measured", file=sys.stderr, flush=True)
    timed = run("time", {**common, "dirs": {v: str(d) for v, d in dirs.items()},
                         "per_regime": {v: {r: str(d) for r, d in rd.items()} for v, rd in per_regime.items()}})
    if "error" in timed:
        result.errors.append(f"timing: {timed['error']}")
        return result
    result.seconds = timed["seconds"]
    for regime, variant in sizes.profiled:  # where a goal is missed, or low weights run slower than float32 ones
        slower = result.speed_up(regime, "low", base="float32-weights") < 0.95
        if variant in PROFILED and (result.speed_up(regime, "low") < GOALS[regime] or slower):
            directory = per_regime[variant][regime] if variant in per_regime else dirs[variant]
            answer = run("profile", {**common, "dir": str(directory), "regime": regime})
            if "error" not in answer:
                result.profiles[(regime, variant)] = answer["profile"]
            else:
                result.errors.append(f"profile {variant} {regime}: {answer['error']}")
    print(f"{model}: timed", file=sys.stderr, flush=True)
    return result


# --- markdown -------------------------------------------------------------------------

LABELS = {"resnet50": "ResNet50", "bert": "BERT-base-shaped encoder", "mobilenetv2": "MobileNetV2"}


def _mb(count: float) -> str:
    return f"{count / 1e6:,.1f}"


def tuned_lines(result: ModelResult) -> list[str]:
    """The tuned variants' speed against the goal, and what convert said about their timing."""
    lines = []
    for variant, what in (("tuned", "`--tune speed --batch-sizes 1,8`"),
                          ("tuned-each", "`--tune speed`, one conversion per batch size")):
        ratios = {regime: result.speed_up(regime, variant) for regime in REGIMES}
        lines.append(f"  {what}: " + ", ".join(
            f"{regime} {ratio:.2f}x ({'met' if ratio >= TUNED_GOAL else '**missed**'})"
            for regime, ratio in ratios.items()) + f" (goal ≥ {TUNED_GOAL}x float32). `convert` said:")
        lines += [f"  - {line}" for line in result.convert_lines.get(variant, "").splitlines()
                  if line.startswith(("Timing:", "Speed"))]
    return lines


def render(results: Sequence[ModelResult], sizes: Sizes, device: str, target: str, machine: str, elapsed_s: float,
           smoke: bool) -> str:
    title = {"cpu": f"CPU, {target}: serving converted SavedModels",
             "gpu": f"NVIDIA GPU, {target}: serving converted SavedModels"}[device]
    lines = [f"## {title}", ""]
    if smoke:
        lines += [bench.SMOKE_NOTE, ""]
    lines += [
        f"{machine}. Run {datetime.date.today().isoformat()}, {elapsed_s / 60:.1f} min in all, load average"
        f" {os.getloadavg()[0]:.2f} at the end: the speed-ups are ratios of calls timed in turn in one process,"
        " so a change in load falls on every variant alike; the absolute times move more.", "",
        f"`tools/bench_serving.py`: ResNet50 {sizes.image_size}x{sizes.image_size}; BERT-base-shaped encoder"
        f" {sizes.bert_layers} layers, hidden {sizes.bert_hidden}, FFN {sizes.bert_ffn}, vocab {sizes.bert_vocab};"
        f" MobileNetV2 {sizes.image_size}x{sizes.image_size} (`keras.applications`, weights=None);"
        f" random weights, written with `model.export`. Time per call of the `serve` signature: median of"
        f" {sizes.rounds} rounds after {sizes.warmup} warm-up calls; speed-up = median over rounds of float32's"
        " time / the variant's. Load = `tf.saved_model.load` in a fresh process (TensorFlow already imported),"
        f" median of {sizes.load_rounds}; peak RSS = that process after one batch-1 call.", "",
    ]
    if device == "cpu":
        lines += [bench.cpu_note(machine), ""]
    gpu = device == "gpu"
    lines += ["| model | variant | variables/ (MB) | SavedModel (MB) | load (s) | peak RSS (MB) |"
              f"{' peak GPU (MB) |' if gpu else ''} batch 1 (ms) | speed-up | batch 8 (ms) | speed-up |",
              f"|---|---|---:|---:|---:|---:|{'---:|' if gpu else ''}---:|---:|---:|---:|"]
    for result in results:
        if result.errors and not result.seconds:
            lines.append(f"| {LABELS[result.model]} | failed: {'; '.join(result.errors).replace('|', '/')} |"
                         " | | | | | | | |")
            continue
        for variant in VARIANTS:
            variables, whole = result.sizes_bytes[variant]
            load = statistics.median(answer["load_s"] for answer in result.loads[variant])
            rss = statistics.median(answer["peak_rss_mb"] for answer in result.loads[variant])
            if gpu:
                rss_cell = f"{rss:,.0f} | {statistics.median(a['peak_gpu_mb'] for a in result.loads[variant]):,.0f}"
            else:
                rss_cell = f"{rss:,.0f}"
            cells = []
            for regime in REGIMES:
                cells += [f"{result.median(regime, variant) * 1e3:,.1f}",
                          f"{result.speed_up(regime, variant):.2f}x" if variant != "float32" else "1.00x"]
            lines.append(f"| {LABELS[result.model]} | {variant_label(variant, target)} | {_mb(variables)} |"
                         f" {_mb(whole)} | {load:.2f} | {rss_cell} | " + " | ".join(cells) + " |")
    lines += ["", "Regimes: " + "; ".join(f"{LABELS[m]}: {', '.join(_regime_text(m, r, sizes) for r in REGIMES)}"
                                          for m in LABELS) + ".", ""]
    lines += ["Goals (weights stored low against float32): " + ", ".join(
        f"{regime} ≥ {goal}x" for regime, goal in GOALS.items()) + f", variables/ ≤ {VARIABLES_GOAL}x the source's.", ""]
    for result in results:
        if not result.seconds:
            continue
        parts = []
        for regime in REGIMES:
            ratio = result.speed_up(regime, "low")
            versus = result.speed_up(regime, "low", base="float32-weights")
            parts.append(f"{regime} {ratio:.2f}x ({'met' if ratio >= GOALS[regime] else '**missed**'}; against"
                         f" float32 weights {versus:.2f}x)")
        share = result.sizes_bytes["low"][0] / result.sizes_bytes["float32"][0]
        parts.append(f"variables/ {share:.2f}x ({'met' if share <= VARIABLES_GOAL else '**missed**'})")
        lines.append(f"- **{LABELS[result.model]}:** " + "; ".join(parts) + ".")
        lines += tuned_lines(result)
        said = result.convert_lines.get("low", "").splitlines()
        listed = share > VARIABLES_GOAL  # where the float32 bytes are: the variables that stay, and why
        if said:
            lines.append(f"  `convert` said: {said[0] if listed else said[0].removesuffix(':')}")
        if listed:
            lines += [f"  - {line.strip()}" for line in said[1:]]
    profiled = [(result, regime) for result in results for regime in REGIMES
                if (regime, "low") in result.profiles]
    if profiled:
        lines += ["", "Where the time goes where a goal was missed or weights stored low ran slower than float32"
                  " weights (one call, TF1 Session full trace: every op's"
                  " kernel time summed by kind, median of 5 traced calls; the sum exceeds the wall time when ops"
                  " run in parallel):", "",
                  "| model | regime | variant | casts (ms) | float32 matmul/conv | float32 other | low matmul/conv"
                  " | low other | no arithmetic | sum (ms) |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
        kinds = ("casts", "float32 matmul/conv", "float32 other ops", "low-precision matmul/conv",
                 "low-precision other ops", "other (no arithmetic)")
        for result, regime in profiled:
            for variant in PROFILED:
                profile = result.profiles.get((regime, variant), {})
                cells = [f"{profile.get(kind, 0.0) * 1e3:,.1f}" for kind in kinds]
                lines.append(f"| {LABELS[result.model]} | {_regime_text(result.model, regime, sizes)} |"
                             f" {variant_label(variant, target)} | " + " | ".join(cells) +
                             f" | {sum(profile.values()) * 1e3:,.1f} |")
    errors = [f"{LABELS[r.model]}: {e}" for r in results for e in r.errors]
    if errors:
        lines += ["", "Failures: " + "; ".join(errors)]
    return "\n".join(lines) + "\n"


def benchmark_parser(description: str, *, smoke: str, models: str, rounds: str) -> argparse.ArgumentParser:
    """The options the serving benchmarks share (this one's and bench_retarget.py's)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--smoke", action="store_true", help=smoke)
    parser.add_argument("--models", help=models)
    parser.add_argument("--rounds", type=int, help=rounds)
    parser.add_argument("--output", type=Path, default=bench.BENCHMARKS_MD)
    parser.add_argument("--no-write", action="store_true", help="print the section only")
    parser.add_argument("--child-timeout", type=int, default=1800, metavar="S")
    return parser


def chosen(args: argparse.Namespace, parser: argparse.ArgumentParser, *, allowed: Sequence[str], smoke_models: str,
           full: Any, smoke: Any) -> tuple[list[str], Any]:
    """The models --models names (checked against ``allowed``) and the sizes (--smoke's, --rounds)."""
    names = args.models or (smoke_models if args.smoke else ",".join(allowed))
    models = [name.strip() for name in names.split(",") if name.strip()]
    if not models or any(name not in allowed for name in models):
        parser.error(f"--models {names!r}: choose from {','.join(allowed)}")
    sizes = smoke if args.smoke else full
    return models, sizes if args.rounds is None else dataclasses.replace(sizes, rounds=args.rounds)


def main(argv: Sequence[str] | None = None) -> int:
    parser = benchmark_parser(
        __doc__.split("\n\n")[0], smoke="checks this script: a tiny BERT (default), each kind of child once; writes a"
        " copy of BENCHMARKS.md in a temporary directory; not a measurement",
        models="comma-separated: resnet50, bert, mobilenetv2 (default all three; --smoke: bert)",
        rounds=f"timed rounds (default {FULL.rounds}, smoke {SMOKE.rounds})")
    parser.add_argument("--device", choices=sorted(DEVICE_TARGETS), default="cpu")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        spec = json.loads(args.child)
        out = Path(spec.pop("out"))
        os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # TensorFlow's and Keras' prints
        out.write_text(json.dumps(CHILDREN[spec.pop("kind")](spec)), encoding="utf-8")
        return 0
    models, sizes = chosen(args, parser, allowed=tuple(LABELS), smoke_models=SMOKE_MODELS, full=FULL, smoke=SMOKE)
    target = DEVICE_TARGETS[args.device]
    machine = machine_line()
    if args.device == "gpu":
        gpus = bench.gpu_line()
        if gpus is None:
            print("bench_serving.py: --device gpu, but TensorFlow sees no GPU", file=sys.stderr)
            return 2
        machine = f"{gpus}. {machine}"
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-serving-") as workdir:
        results = [measure(model, sizes, args.device, target, Path(workdir), args.child_timeout, args.smoke)
                   for model in models]
        section = render(results, sizes, args.device, target, machine, time.perf_counter() - started, args.smoke)
        print(section)
        bench.write_section(None if args.no_write else args.output, f"{args.device}-{target}-serving", section,
                            Path(workdir) if args.smoke else None)
    return 1 if any(r.errors for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
