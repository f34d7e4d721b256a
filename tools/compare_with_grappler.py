"""Run TensorFlow's grappler AMP pass and ours on one graph and show where they differ.

For each target it prints one table row — vertices judged, agreement, converted
vertices and casts in grappler's words and ours, and the median wall time of each
pass — followed by both "Converted ..." lines and the first mismatches. Exits 1 when
any target is short of 100% agreement, 2 on bad input::

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/compare_with_grappler.py --model resnet50 --training
    .venv/bin/python tools/compare_with_grappler.py --graph frozen.pb --fetch logits --target bfloat16

grappler's own "Converted ..." line is an INFO log of its C++ code; this tool turns
C++ INFO logging on before TensorFlow loads, reads the line from stderr while grappler
runs, and passes every other non-INFO line through.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import TypeVar

# grappler logs its summary at INFO; the level is read once, when TensorFlow loads.
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"

T = TypeVar("T")
TARGETS = ("float16", "bfloat16")
RUNS = 3
MAX_MISMATCHES_SHOWN = 20
_CONVERTED = re.compile(r"Converted (\d+)/(\d+) nodes to \w+ precision using (\d+) cast\(s\)")
_LOG_LINE = re.compile(r"^(?P<level>[IWEF])\d{4} ")
_ABSL_PREAMBLE = "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR"


@contextlib.contextmanager
def _stderr_lines() -> Iterator[list[str]]:
    """Collect what anything (C++ included) writes to file descriptor 2 during the block.

    INFO records (with their continuation lines) are kept in the yielded list; every
    other line is written back to stderr when the block ends, so no warning or error is
    lost.
    """
    captured: list[str] = []
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            in_info = False
            for line in sink.read().decode(errors="replace").splitlines():
                record = _LOG_LINE.match(line)
                if record:
                    in_info = record["level"] == "I"
                if in_info or line == _ABSL_PREAMBLE:
                    captured.append(line)
                else:
                    print(line, file=sys.stderr)


with _stderr_lines():  # TensorFlow's import-time INFO chatter, now that level 0 shows it
    import amp_rewrite
    from amp_rewrite.models import MODEL_NAMES, build_model_graph
    from amp_rewrite.reference import compare_rewrites, run_grappler
    from google.protobuf import text_format
    from google.protobuf.message import DecodeError
    from tensorflow.core.framework.graph_pb2 import GraphDef


def _median_seconds(run: Callable[[], T], runs: int) -> tuple[T, float]:
    """The last result of ``runs`` calls and the median wall time of one call."""
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
    return result, statistics.median(times)


def _load_graph_def(path: Path) -> GraphDef:
    """A GraphDef from ``.pb`` (binary) or ``.pbtxt`` (text format); ValueError if neither."""
    if not path.is_file():
        raise ValueError(f"--graph {path}: no such file")
    graph_def = GraphDef()
    try:
        if path.suffix == ".pbtxt":
            text_format.Parse(path.read_text(encoding="utf-8"), graph_def)
        else:
            graph_def.ParseFromString(path.read_bytes())
    except (text_format.ParseError, DecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--graph {path}: not a GraphDef ({error}); pass a binary .pb or a text .pbtxt") from error
    return graph_def


def _grappler_with_log(graph_def: GraphDef, target: str, fetches: Sequence[str]) -> tuple[GraphDef, list[str]]:
    """grappler's rewrite and its "Converted ..." line(s): one per graph item it rewrote."""
    with _stderr_lines() as lines:
        output = run_grappler(graph_def, target=target, fetches=fetches)
    return output, [line.split("] ", 1)[-1] for line in lines if "Converted " in line]


def _counts(summary: str) -> str:
    """``Converted 546/6991 nodes ... using 157 cast(s)`` -> ``546/6991, 157 casts``."""
    match = _CONVERTED.search(summary)
    if not match:
        return "n/a"
    return f"{match[1]}/{match[2]}, {match[3]} cast{'' if match[3] == '1' else 's'}"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def compare(graph_def: GraphDef, fetches: Sequence[str], targets: Sequence[str]) -> bool:
    """Print the comparison for each target; True when all agree fully."""
    rows, details, all_ok = [], [], True
    for target in targets:
        (grappler, grappler_lines), grappler_seconds = _median_seconds(
            lambda: _grappler_with_log(graph_def, target, fetches), RUNS
        )
        ours, ours_seconds = _median_seconds(
            lambda: amp_rewrite.rewrite_graph_def(graph_def, target=target, fetches=fetches), RUNS
        )
        agreement = compare_rewrites(graph_def, ours.graph_def, grappler)
        all_ok &= agreement.ok
        grappler_summary = grappler_lines[0] if grappler_lines else "(grappler logged no summary)"
        percent = 100.0 * agreement.agreed / agreement.judged if agreement.judged else 100.0
        rows.append([
            target,
            f"{agreement.judged:,}",
            f"{agreement.agreed:,}",
            f"{percent:.2f}%" + ("" if agreement.ok else " FAIL"),
            _counts(grappler_summary),
            _counts(ours.report.summary()),
            f"{agreement.grappler_casts}/{agreement.ours_casts}",
            f"{grappler_seconds:.3f}",
            f"{ours_seconds:.3f}",
        ])
        details.append(f"{target}:")
        details += [f"  grappler: {line}" for line in grappler_lines or [grappler_summary]]
        details.append(f"  ours:     {ours.report.summary()}")
        problems = [f"vertex {m}" for m in agreement.mismatches] + [f"cast {m}" for m in agreement.cast_mismatches]
        details += [f"  mismatch: {problem}" for problem in problems[:MAX_MISMATCHES_SHOWN]]
        if len(problems) > MAX_MISMATCHES_SHOWN:
            details.append(f"  ... and {len(problems) - MAX_MISMATCHES_SHOWN} more mismatches")
        if not problems and not agreement.ok:
            details.append(f"  mismatch: {agreement.explain()}")
    header = ["target", "judged", "agreed", "agreement", "grappler converted", "ours converted",
              "AMP casts g/o", "grappler s", "ours s"]
    print(_table(header, rows))
    print(f"(times: median of {RUNS} runs)\n")
    print("\n".join(details))
    return all_ok


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", choices=MODEL_NAMES, help="a built-in model (amp_rewrite.models)")
    source.add_argument("--graph", type=Path, help="a GraphDef file: binary .pb or text .pbtxt")
    parser.add_argument("--training", action="store_true", help="with --model: the training step, not inference")
    parser.add_argument("--image-size", type=int, help="with --model cnn/resnet50: square input size")
    parser.add_argument("--batch", type=int, default=2, help="with --model: batch size (default 2)")
    parser.add_argument("--fetch", nargs="+", default=[], metavar="NAME",
                        help="with --graph: node names whose outputs are fetched (required)")
    parser.add_argument("--target", choices=[*TARGETS, "both"], default="both")
    args = parser.parse_args(argv)
    if args.graph is not None and not args.fetch:
        parser.error("--graph needs --fetch NAME...: the nodes whose outputs the graph's user reads")
    if args.model is not None and args.fetch:
        parser.error("--fetch goes with --graph; a --model knows its own fetches")
    if args.graph is not None and (args.training or args.image_size is not None):
        parser.error("--training and --image-size go with --model")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        if args.model is not None:
            model = build_model_graph(args.model, training=args.training, batch=args.batch, image_size=args.image_size)
            graph_def, fetches = model.graph_def, model.fetches
            title = f"{args.model} {'training step' if args.training else 'inference'}"
        else:
            graph_def, fetches, title = _load_graph_def(args.graph), tuple(args.fetch), str(args.graph)
            missing = sorted(set(fetches) - {node.name for node in graph_def.node})
            if missing:
                raise ValueError(
                    f"--fetch {' '.join(missing)}: no such node in {args.graph}; pass node names, not tensors"
                )
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"{title}: {len(graph_def.node):,} nodes, fetches {', '.join(fetches)}\n")
    targets = TARGETS if args.target == "both" else (args.target,)
    try:
        ok = compare(graph_def, fetches, targets)
    except (amp_rewrite.AmpRewriteError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
