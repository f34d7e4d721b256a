"""Time our pass against grappler's on two training-step graphs (``make bench``).

Graphs: the ResNet50 training step at 224x224 (~7,000 nodes) and the small
transformer's training step, each for float16 and bfloat16. Each pass runs once to
warm up, then the two run in turn 9 times; the table shows the medians and the ratio ours/grappler as
markdown, ready for the README, under a line naming the machine. Both passes are
timed as a caller sees them: GraphDef in, rewritten GraphDef out (for grappler that
includes building its virtual cluster and MetaGraphDef, see ``amp_rewrite.testing.reference``).

The goal is a ratio of at most 1.0x; above 3.0x the tool exits 1.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_pass.py
"""
from __future__ import annotations

import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import tensorflow as tf

import amp_rewrite
from amp_rewrite.testing.models import build_model_graph
from amp_rewrite.testing.reference import run_grappler

WARMUP_RUNS = 1
TIMED_RUNS = 9
RATIO_LIMIT = 3.0
TARGETS = amp_rewrite.TARGETS
# (label, model, build arguments): training steps, the graphs where the pass costs most.
GRAPHS = (
    ("ResNet50 training step, 224x224", "resnet50", {"image_size": 224}),
    ("transformer training step", "transformer", {}),
)
# CPU features that decide whether bfloat16/float16 run fast on this CPU.
LOW_PRECISION_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


def median_seconds(
    *runs: Callable[[], object], timed: int = TIMED_RUNS, warmup: int = WARMUP_RUNS
) -> tuple[float, ...]:
    """Median wall time of each of ``runs``: ``warmup`` untimed calls of each, then
    ``timed`` rounds that call each once, in turn, so a change in the machine's load
    falls on all of them alike."""
    for run in runs:
        for _ in range(warmup):
            run()
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(timed):
        for run, run_times in zip(runs, times):
            start = time.perf_counter()
            run()
            run_times.append(time.perf_counter() - start)
    return tuple(statistics.median(run_times) for run_times in times)


def machine_line() -> str:
    """CPU model, low-precision flags, cores, TensorFlow and Python versions."""
    model, flags = platform.processor() or platform.machine(), set()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(encoding="utf-8", errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
    shown = ", ".join(f"{flag} {'yes' if flag in flags else 'no'}" for flag in LOW_PRECISION_FLAGS)
    return (
        f"CPU: {model} ({os.cpu_count()} cores; {shown}); "
        f"TensorFlow {tf.__version__}, Python {platform.python_version()}"
    )


def main() -> int:
    print(machine_line())
    print(f"Median of {TIMED_RUNS} runs after {WARMUP_RUNS} warm-up, ours and grappler's in turn, seconds per pass.\n")
    print("| graph | nodes | target | ours (s) | grappler (s) | ours/grappler |")
    print("|---|---:|---|---:|---:|---:|")
    worst = 0.0
    for label, name, build_args in GRAPHS:
        model = build_model_graph(name, training=True, **build_args)
        for target in TARGETS:
            arguments = {"target": target, "fetches": model.fetches}
            ours, grappler = median_seconds(
                functools.partial(amp_rewrite.rewrite_graph_def, model.graph_def, **arguments),
                functools.partial(run_grappler, model.graph_def, our_lists=False, **arguments),
            )
            ratio = ours / grappler
            worst = max(worst, ratio)
            print(
                f"| {label} | {len(model.graph_def.node):,} | {target} | {ours:.3f} | {grappler:.3f} | {ratio:.2f}x |",
                flush=True,
            )
    if worst > RATIO_LIMIT:
        print(
            f"\nour pass takes {worst:.2f}x grappler's time on at least one graph; the limit is {RATIO_LIMIT:.1f}x",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
