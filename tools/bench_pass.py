"""Time our pass against grappler's (``make bench``): training steps, and unrolled chains up to 200k nodes.

Graphs: the ResNet50 training step at 224x224 (~7,000 nodes) and the small
transformer's training step, each for float16 and bfloat16; then, for bfloat16, an
unrolled chain of MatMul blocks (``matmul_chain``: what ``tf.function`` traces for
``x = relu(x @ w + b)`` with variables, 7 nodes a block) at 5k, 20k, 50k, 100k and 200k
nodes, where the pass's cost per node shows. Each pass runs once to warm up, then the
two run in turn, the first of each round alternating; the table shows the medians and the
ratio ours/grappler as markdown, ready for BENCHMARKS.md, under a line naming the CPU and
its flags. Both passes are timed as a caller sees them: GraphDef in, rewritten GraphDef
out (for grappler that includes building its virtual cluster and MetaGraphDef, see
``amp_rewrite.testing.reference``). On the chains both must insert the same casts
(``compare_rewrites``), or the tool exits 1.

The goal is a ratio of at most 1.0x; above 3.0x the tool exits 1.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_pass.py [--sizes 5000,200000] [--smoke]
"""
from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, graph_pb2, tensor_shape_pb2, types_pb2

import amp_rewrite
from amp_rewrite.core import support
from amp_rewrite.testing.models import build_model_graph
from amp_rewrite.testing.reference import GrapplerUnavailable, compare_rewrites, count_amp_casts, run_grappler

WARMUP_RUNS = 1
TIMED_RUNS = 9
RATIO_LIMIT = 3.0
TARGETS = amp_rewrite.TARGETS
# (label, model, build arguments): training steps, the graphs where the pass costs most.
GRAPHS = (
    ("ResNet50 training step, 224x224", "resnet50", {"image_size": 224}),
    ("transformer training step", "transformer", {}),
)
CHAIN_SIZES = (5_000, 20_000, 50_000, 100_000, 200_000)
CHAIN_TARGET = "bfloat16"
SMOKE_SIZE = 300
# A 200k-node pass takes seconds: fewer rounds there keep the tool within minutes.
LARGE_CHAIN, LARGE_CHAIN_RUNS = 50_000, 5
# CPU features that decide whether bfloat16/float16 run fast on this CPU.
LOW_PRECISION_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16")


def median_seconds(
    *runs: Callable[[], object], timed: int = TIMED_RUNS, warmup: int = WARMUP_RUNS
) -> tuple[float, ...]:
    """Median wall time of each of ``runs``: ``warmup`` untimed calls of each, then
    ``timed`` rounds that call each once, in turn, the order reversed every other round,
    so a change in the machine's load, or a run that warms the caches for the next, falls
    on all of them alike."""
    for run in runs:
        for _ in range(warmup):
            run()
    times: list[list[float]] = [[] for _ in runs]
    for round_ in range(timed):
        order = list(zip(runs, times))
        for run, run_times in order if round_ % 2 == 0 else reversed(order):
            start = time.perf_counter()
            run()
            run_times.append(time.perf_counter() - start)
    return tuple(statistics.median(run_times) for run_times in times)


def matmul_chain(nodes: int) -> graph_pb2.GraphDef:
    """An unrolled chain of MatMul blocks of about ``nodes`` nodes, as ``tf.function`` traces
    ``x = tf.nn.relu(tf.matmul(x, w) + b)`` over variables ``w``, ``b`` (the same nodes, names,
    inputs and attrs, but ``_user_specified_name``), built as protos: tracing 200k nodes would
    take minutes. Fetch ``Identity``."""
    graph_def = graph_pb2.GraphDef()

    def add(name: str, op: str, inputs: Sequence[str] = (), **attrs: attr_value_pb2.AttrValue) -> None:
        node = graph_def.node.add(name=name, op=op, input=inputs)
        for key, value in attrs.items():
            node.attr[key].CopyFrom(value)

    float32 = attr_value_pb2.AttrValue(type=types_pb2.DT_FLOAT)
    resource = attr_value_pb2.AttrValue(type=types_pb2.DT_RESOURCE)
    scalar = attr_value_pb2.AttrValue(shape=tensor_shape_pb2.TensorShapeProto())
    false = attr_value_pb2.AttrValue(b=False)
    # grad_a/grad_b: TensorFlow 2.18+ (what this release's MatMul has, as a trace would)
    matmul_flags = {attr.name: false for attr in support.registered_op_def("MatMul").attr if attr.type == "bool"}
    batch = tensor_shape_pb2.TensorShapeProto(dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=size) for size in (8, 16)])
    add("x", "Placeholder", dtype=float32, shape=attr_value_pb2.AttrValue(shape=batch))
    previous, reads = "x", {"MatMul": [], "AddV2": []}
    while len(graph_def.node) + 9 <= nodes:
        suffix = f"_{len(reads['AddV2'])}" if reads["AddV2"] else ""
        for op, scope in (("MatMul", f"MatMul{suffix}"), ("AddV2", f"add{suffix}")):
            add(f"{scope}/ReadVariableOp/resource", "Placeholder", dtype=resource, shape=scalar)
            add(f"{scope}/ReadVariableOp", "ReadVariableOp", [f"{scope}/ReadVariableOp/resource"], dtype=float32)
            add(scope, op, [previous, f"{scope}/ReadVariableOp"], T=float32, **(matmul_flags if op == "MatMul" else {}))
            reads[op].append(f"^{scope}/ReadVariableOp")
            previous = scope
        add(f"Relu{suffix}", "Relu", [previous], T=float32)
        previous = f"Relu{suffix}"
    add("Identity", "Identity", [previous, "^NoOp"], T=float32)
    add("NoOp", "NoOp", reads["MatMul"] + reads["AddV2"])  # the trace's: every read before the output
    return graph_def


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


Row = tuple[str, int, str, float, float]


def model_rows(timed: int) -> list[Row]:
    """The training steps, each target: (label, nodes, target, ours, grappler)."""
    rows = []
    for label, name, build_args in GRAPHS:
        model = build_model_graph(name, training=True, **build_args)
        for target in TARGETS:
            arguments = {"target": target, "fetches": model.fetches}
            ours, grappler = median_seconds(
                functools.partial(amp_rewrite.rewrite_graph_def, model.graph_def, **arguments),
                functools.partial(run_grappler, model.graph_def, our_lists=False, **arguments),
                timed=timed,
            )
            rows.append((label, len(model.graph_def.node), target, ours, grappler))
    return rows


def chain_row(nodes: int, timed: int) -> Row:
    """One chain size: both passes once to check they insert the same casts, then timed."""
    graph_def = matmul_chain(nodes)
    arguments = {"target": CHAIN_TARGET, "fetches": ["Identity"]}
    ours = functools.partial(amp_rewrite.rewrite_graph_def, graph_def, **arguments)
    grappler = functools.partial(run_grappler, graph_def, our_lists=False, **arguments)
    ours_graph, grappler_graph = ours().graph_def, grappler()
    agreement = compare_rewrites(graph_def, ours_graph, grappler_graph)
    if not agreement.ok:
        raise SystemExit(f"MatMul chain, {len(graph_def.node):,} nodes: our casts differ from grappler's"
                         f" ({count_amp_casts(ours_graph)} vs {count_amp_casts(grappler_graph)}):\n{agreement.explain()}")
    seconds = median_seconds(ours, grappler, timed=timed if nodes < LARGE_CHAIN else min(timed, LARGE_CHAIN_RUNS),
                             warmup=0)  # the check above warmed both up
    return (f"MatMul chain ({count_amp_casts(ours_graph):,} casts, as grappler)", len(graph_def.node), CHAIN_TARGET,
            *seconds)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default=",".join(map(str, CHAIN_SIZES)),
                        help="node counts of the MatMul chains, comma-separated ('' for none)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"a {SMOKE_SIZE}-node chain, one round, no training steps: checks this tool only")
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    except ValueError:
        parser.error(f"--sizes takes node counts such as 5000,200000, not {args.sizes!r}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    timed = 1 if args.smoke else TIMED_RUNS
    print(machine_line())
    print(f"Median of {timed} rounds ({LARGE_CHAIN_RUNS} from {LARGE_CHAIN:,} nodes) after a warm-up, ours and"
          " grappler's in turn, the first alternating; seconds per pass.\n")
    print("| graph | nodes | target | ours (s) | grappler (s) | ours/grappler |")
    print("|---|---:|---|---:|---:|---:|")
    try:
        rows = [] if args.smoke else model_rows(timed)
        for label, nodes, target, ours, grappler in rows:
            print(f"| {label} | {nodes:,} | {target} | {ours:.3f} | {grappler:.3f} | {ours / grappler:.2f}x |")
        for size in [SMOKE_SIZE] if args.smoke else args.sizes:
            rows.append(row := chain_row(size, timed))
            label, nodes, target, ours, grappler = row
            print(f"| {label} | {nodes:,} | {target} | {ours:.3f} | {grappler:.3f} | {ours / grappler:.2f}x |",
                  flush=True)
    except GrapplerUnavailable as error:
        print(f"grappler cannot run here, nothing to compare with: {error}", file=sys.stderr)
        return 0 if args.smoke else 1
    worst = max((ours / grappler for *_, ours, grappler in rows), default=0.0)
    if worst > RATIO_LIMIT:
        print(
            f"\nour pass takes {worst:.2f}x grappler's time on at least one graph; the limit is {RATIO_LIMIT:.1f}x",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
