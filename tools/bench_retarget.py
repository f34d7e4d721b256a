"""Serving a model trained under Keras' ``mixed_float16`` on this CPU: as exported, retargeted.

The case of issue 49 (tensorflow/tensorflow#45441): a model trained with the
``mixed_float16`` policy and exported is served on a CPU, where float16 is slow. This tool
trains two such models for a few steps on random data — MobileNetV2 (``keras.applications``,
weights=None, small images) and a BERT-style encoder (``tools/bench.py``'s, 2 layers) —
exports each as trained (float16 compute, float32 variables), and compares four SavedModels:

* as exported: float16 inside;
* ``amp-rewrite convert --target bfloat16`` of that export (retargeted);
* ``amp-rewrite convert --target float32`` of that export (mixed precision undone);
* the float32 twin: the same model built under the float32 policy, given the trained
  weights (Keras keeps float32 masters), exported. The baseline.

Each is called through its ``serve`` signature at batch 1 (BERT: 16 tokens) and batch 8
(BERT: 64 tokens), all four loaded in one process and called in turn, the order rotated per
round (``tools/bench_serving.py``'s timing child); speed = median over rounds of the twin's
time / the variant's. The largest difference of each variant's outputs from the twin's on one
batch-8 input is shown beside it. A retargeting the installed amp-rewrite refuses is shown
with the line it said.

    TF_CPP_MIN_LOG_LEVEL=2 nice -n 5 .venv/bin/python tools/bench_retarget.py    # ~10 min on 2 cores
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_retarget.py --smoke     # tiny BERT: checks the script

The markdown goes to stdout and replaces the ``cpu-retarget`` section of BENCHMARKS.md
(``--smoke``: of a copy in a temporary directory).
"""
from __future__ import annotations

import dataclasses
import datetime
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402  (tools/bench.py: BENCHMARKS.md's sections)
import bench_serving  # noqa: E402  (its models, inputs and timing child)
from bench_pass import machine_line  # noqa: E402

SECTION = "cpu-retarget"
MODELS = ("mobilenetv2", "bert")
LABELS = {"mobilenetv2": "MobileNetV2", "bert": "BERT-style encoder"}
# (variant, what it is); "twin" is the baseline every ratio divides.
VARIANTS = (("exported", "as exported (`mixed_float16`: float16 inside)"),
            ("bfloat16", "`amp-rewrite convert --target bfloat16` of the export"),
            ("float32", "`amp-rewrite convert --target float32` of the export"),
            ("twin", "float32 twin (same weights, float32 policy): the baseline"))
RETARGETS = ("bfloat16", "float32")
FLAGS = ("avx512f", "avx512_bf16", "amx_bf16")
TRAIN_STEPS, TRAIN_BATCH = 5, 8

FULL = dataclasses.replace(bench_serving.FULL, image_size=96, bert_layers=2, bert_hidden=256, bert_heads=4,
                           bert_ffn=1024, bert_vocab=8000, short_seq=16, long_seq=64, rounds=15, warmup=3,
                           load_rounds=0, profiled=())
SMOKE = dataclasses.replace(bench_serving.SMOKE, load_rounds=0, profiled=())


@dataclass
class Result:
    """One model's measurements: seconds per call by regime and variant, the outputs'
    largest difference from the twin's, and why a variant is missing."""

    model: str
    seconds: dict[str, dict[str, list[float]]] = dataclasses.field(default_factory=dict)
    difference: dict[str, float] = dataclasses.field(default_factory=dict)
    missing: dict[str, str] = dataclasses.field(default_factory=dict)

    def speed(self, regime: str, variant: str) -> float:
        """Median over rounds of the twin's time / the variant's, both of the same round."""
        pairs = zip(self.seconds[regime]["twin"], self.seconds[regime][variant])
        return statistics.median(twin / mine for twin, mine in pairs)


def flags_line() -> str:
    """The CPU flags that decide float16 and bfloat16 speed here."""
    cpuinfo = Path("/proc/cpuinfo")
    flags: set[str] = set()
    if cpuinfo.exists():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            if line.startswith("flags"):
                flags = set(line.partition(":")[2].split())
                break
    return "CPU flags: " + ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in FLAGS)


def train_and_export(model: str, sizes: Any, workdir: Path) -> dict[str, Path]:
    """The model trained a few steps under ``mixed_float16`` and exported, and its float32 twin
    (the same weights under the float32 policy) exported beside it."""
    import keras
    import numpy as np

    dirs = {"exported": workdir / f"{model}-exported", "twin": workdir / f"{model}-twin"}
    keras.config.set_dtype_policy("mixed_float16")
    try:
        trained = bench_serving._build(model, sizes)
        trained.compile(optimizer=keras.optimizers.Adam(1e-4), loss="sparse_categorical_crossentropy")
        x = np.concatenate([bench_serving._batch(model, "batch 8", sizes)] * (TRAIN_STEPS * TRAIN_BATCH // 8))
        classes = trained.output_shape[-1]
        y = np.random.default_rng(0).integers(0, classes, size=len(x))
        trained.fit(x, y, batch_size=TRAIN_BATCH, epochs=1, verbose=0)
        trained.export(str(dirs["exported"]), verbose=False)
    finally:
        keras.config.set_dtype_policy("float32")
    twin = bench_serving._build(model, sizes)
    twin.set_weights(trained.get_weights())
    twin.export(str(dirs["twin"]), verbose=False)
    return dirs


def retarget(model: str, dirs: dict[str, Path], workdir: Path, result: Result, in_process: bool) -> None:
    """Each RETARGETS conversion of the export, as a user runs it; a refusal is noted, not fatal."""
    for target in RETARGETS:
        destination = workdir / f"{model}-{target}"
        try:
            seconds, said = bench_serving.convert(dirs["exported"], destination, target, in_process=in_process)
        except SystemExit as exit_:  # in process (--smoke): argparse refusing the option, its line on the captured stderr
            seconds, said = 0.0, f"amp-rewrite exited {exit_.code}: no --target {target} in this amp-rewrite"
        if said.startswith("ok") or (not said and destination.is_dir()):
            dirs[target] = destination
            print(f"{model}: retargeted to {target} in {seconds:.1f} s", file=sys.stderr, flush=True)
        else:
            result.missing[target] = said or "convert wrote nothing"


def differences(model: str, dirs: dict[str, Path], sizes: Any) -> dict[str, float]:
    """Each variant's largest absolute output difference from the twin's, on one batch-8 input."""
    import numpy as np
    import tensorflow as tf

    x = bench_serving._batch(model, "batch 8", sizes)
    outputs = {}
    for variant, directory in dirs.items():
        function = tf.saved_model.load(str(directory)).signatures["serve"]
        (name,) = function.structured_input_signature[1]
        flat = tf.nest.flatten(function(**{name: tf.constant(x)}))
        outputs[variant] = [np.asarray(tensor, dtype=np.float64) for tensor in flat]
    return {variant: max(float(np.max(np.abs(mine - twin))) for mine, twin in zip(found, outputs["twin"]))
            for variant, found in outputs.items()}


def measure(model: str, sizes: Any, workdir: Path, timeout: int, in_process: bool) -> Result:
    """One model: trained and exported, retargeted, compared with its twin, timed."""
    result = Result(model)
    dirs = train_and_export(model, sizes, workdir)
    retarget(model, dirs, workdir, result, in_process)
    result.difference = differences(model, dirs, sizes)
    spec = {"model": model, "sizes": dataclasses.asdict(sizes), "device": "cpu", "per_regime": {},
            "dirs": {variant: str(directory) for variant, directory in dirs.items()}}
    answer = bench_serving.run_child("time", spec, timeout, in_process)
    if "error" in answer:
        result.missing.update({variant: f"timing: {answer['error']}" for variant in dirs})
    else:
        result.seconds = answer["seconds"]
    return result


def render_rows(result: Result) -> list[str]:
    """A row per variant: time and speed against the twin per regime, and the outputs' difference."""
    rows = []
    for variant, label in VARIANTS:
        if variant in result.missing:
            rows.append(f"| {LABELS[result.model]} | {label} | not measured: {result.missing[variant]} | | | | |")
            continue
        cells = []
        for regime in bench_serving.REGIMES:
            seconds = statistics.median(result.seconds[regime][variant])
            cells += [f"{seconds * 1e3:.2f}", f"{result.speed(regime, variant):.2f}x"]
        rows.append(f"| {LABELS[result.model]} | {label} | " + " | ".join(cells)
                    + f" | {result.difference[variant]:.2g} |")
    return rows


def render(results: Sequence[Result], sizes: Any, elapsed_s: float, smoke: bool) -> str:
    lines = ["## CPU: serving a model trained under `mixed_float16`, retargeted (issue 49)", ""]
    if smoke:
        lines += [bench.SMOKE_NOTE, ""]
    lines += [
        f"{machine_line()}. {flags_line()}. Run {datetime.date.today().isoformat()}, {elapsed_s / 60:.1f} min in"
        f" all, load average {os.getloadavg()[0]:.2f} at the end.", "",
        "    TF_CPP_MIN_LOG_LEVEL=2 nice -n 5 .venv/bin/python tools/bench_retarget.py", "",
        f"`tools/bench_retarget.py`: MobileNetV2 {sizes.image_size}x{sizes.image_size} (`keras.applications`,"
        f" weights=None) and a BERT-style encoder ({sizes.bert_layers} layers, hidden {sizes.bert_hidden}, FFN"
        f" {sizes.bert_ffn}, vocab {sizes.bert_vocab}), each trained {TRAIN_STEPS} steps under `mixed_float16` on"
        " random data and exported with `model.export`. Time per call of the `serve` signature (batch 1; batch 8;"
        f" BERT: {sizes.short_seq} and {sizes.long_seq} tokens): median of {sizes.rounds} rounds after"
        f" {sizes.warmup} warm-up calls, the four loaded in one process and called in turn, the order rotated per"
        " round; speed = median over rounds of the twin's time / the variant's (above 1: faster than float32)."
        " |Δ| = the largest output difference from the twin on one batch-8 input. Both models' last layers"
        " follow the policy, so their `serve` outputs are float16, and retargeting keeps a signature's dtypes:"
        " float32's |Δ| is that last rounding to float16 (half a float16 step of the largest output).", "",
        bench.cpu_note(machine_line()), "",
        "| model | variant | batch 1 (ms) | vs twin | batch 8 (ms) | vs twin | max \\|Δ\\| vs twin |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        lines += render_rows(result)
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = bench_serving.benchmark_parser(
        __doc__.split("\n\n")[0], smoke="checks this script: a tiny BERT, one round, in this process; writes a copy"
        " of BENCHMARKS.md in a temporary directory; not a measurement",
        models=f"comma-separated: {', '.join(MODELS)} (default both; --smoke: bert)",
        rounds=f"timed rounds (default {FULL.rounds})")
    args = parser.parse_args(argv)
    models, sizes = bench_serving.chosen(args, parser, allowed=MODELS, smoke_models="bert", full=FULL, smoke=SMOKE)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-retarget-") as workdir:
        results = [measure(model, sizes, Path(workdir), args.child_timeout, args.smoke) for model in models]
        section = render(results, sizes, time.perf_counter() - started, args.smoke)
        print(section)
        bench.write_section(None if args.no_write else args.output, SECTION, section,
                            Path(workdir) if args.smoke else None)
    return 1 if any("timing" in why for result in results for why in result.missing.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
