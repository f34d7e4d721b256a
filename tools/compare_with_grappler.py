"""Run TensorFlow's grappler AMP pass and ours on one graph and show where they differ.

For each target it prints one table row — vertices judged, agreement, converted
vertices and casts in grappler's words and ours, and the median wall time of each
pass — then, for a graph with a function library, the same agreement per item (the
main graph and each function body grappler rewrites), followed by both "Converted ..."
lines and the first mismatches. Exits 1 when any target is short of 100% agreement
(main graph, any function body or any signature), 2 on bad input::

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/compare_with_grappler.py --model resnet50 --training
    .venv/bin/python tools/compare_with_grappler.py --model lstm --cross-function
    .venv/bin/python tools/compare_with_grappler.py --graph frozen.pb --fetch logits --target bfloat16

``--cross-function`` adds our ``cross_function=True`` rewrite next to grappler's: AMP
casts in all, those that run (a cast of a ``Const`` is folded away, spec §2.7), run-time
casts executed per iteration of each functional loop (``amp_rewrite.loops``), converted
counts and, for a built-in ``--model``, how far each result is from float32 when run on
this CPU. These numbers do not change the exit status.

grappler's own "Converted ..." line is an INFO log of its C++ code; this tool turns
C++ INFO logging on before TensorFlow loads, reads the line from stderr while grappler
runs, and passes every other non-INFO line through.
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

# grappler logs its summary at INFO; the level is read once, when TensorFlow loads.
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"

T = TypeVar("T")
TARGETS = ("float16", "bfloat16")
RUNS = 3
MAX_MISMATCHES_SHOWN = 20
MAIN_GRAPH_LABEL = "(main graph)"
SMOKE_MODEL = "while_loop"  # small, with a function library: every comparison's path runs
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
    import numpy as np
    import tensorflow as tf
    from google.protobuf import text_format
    from google.protobuf.message import DecodeError
    from tensorflow.core.framework.graph_pb2 import GraphDef

    import amp_rewrite
    from amp_rewrite.testing.loops import LOOP_GRAPH_NAMES, build_loop_graph, casts_per_iteration, item_cast_counts
    from amp_rewrite.testing.models import MODEL_NAMES, GraphRun, ModelGraph, build_model_graph, run_model_graph
    from amp_rewrite.testing.reference import Agreement, compare_rewrites, run_grappler


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


def _converted(vertices: int, casts: int) -> str:
    return f"{vertices:,} vertices, {casts} cast{'' if casts == 1 else 's'}"


def _grappler_converted(lines: Sequence[str]) -> str:
    """grappler's "Converted ..." lines, one per item, summed as :func:`_converted` shows ours."""
    matches = [match for line in lines if (match := _CONVERTED.search(line))]
    if not matches:
        return "n/a"
    return _converted(sum(int(match[1]) for match in matches), sum(int(match[3]) for match in matches))


def _percent(agreed: int, judged: int, ok: bool) -> str:
    return f"{100.0 * agreed / judged if judged else 100.0:.2f}%" + ("" if ok else " FAIL")


def _total_casts(graph_def: GraphDef) -> int:
    return sum(count.total for count in item_cast_counts(graph_def).values())


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in [header, *rows]]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


@dataclass(frozen=True)
class Subject:
    """The graph to compare; a built-in graph (``model``) also brings the inputs to run it."""

    title: str
    graph_def: GraphDef
    fetches: tuple[str, ...]
    model: ModelGraph | None = None


# --- default mode: agreement with grappler, overall and per item ------------------------


def _agreement_rows(target: str, agreement: Agreement) -> list[list[str]]:
    """One row for the main graph and one per library function grappler rewrites."""
    rows = [[target, MAIN_GRAPH_LABEL, f"{agreement.judged:,}", f"{agreement.agreed:,}",
             _percent(agreement.agreed, agreement.judged, not agreement.mismatches and not agreement.cast_mismatches),
             f"{agreement.grappler_casts}/{agreement.ours_casts}"]]
    for function in agreement.functions:
        rows.append([target, function.name, f"{function.judged:,}", f"{function.agreed:,}",
                     _percent(function.agreed, function.judged, function.ok),
                     f"{function.grappler_casts}/{function.ours_casts}"])
    return rows


def _mismatch_lines(agreement: Agreement) -> list[str]:
    problems = [f"vertex {m}" for m in agreement.mismatches] + [f"cast {m}" for m in agreement.cast_mismatches]
    problems += [f"library {m}" for m in agreement.library_mismatches]
    for function in agreement.functions:
        problems += [f"function {function.name}: vertex {m}" for m in function.mismatches]
        problems += [f"function {function.name}: cast {m}" for m in function.cast_mismatches]
    lines = [f"  mismatch: {problem}" for problem in problems[:MAX_MISMATCHES_SHOWN]]
    if len(problems) > MAX_MISMATCHES_SHOWN:
        lines.append(f"  ... and {len(problems) - MAX_MISMATCHES_SHOWN} more mismatches")
    if not problems and not agreement.ok:
        lines.append(f"  mismatch: {agreement.explain()}")
    return lines


# --- cross-function mode: what crossing boundaries saves, and what it costs in accuracy ---


def _relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """Largest absolute difference over the largest expected magnitude."""
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    return float(np.max(np.abs(actual.astype(np.float64) - expected))) / max(scale, 1e-12)


def _updates(run: GraphRun, model: ModelGraph) -> np.ndarray:
    """A training step's trainable-variable updates, flattened."""
    return np.concatenate([(run.variables[t] - model.variables[t]).ravel() for t in sorted(model.trainable)])


def _run_quietly(model: ModelGraph, graph_def: GraphDef | None = None) -> GraphRun:
    with _stderr_lines():  # the session's INFO chatter
        return run_model_graph(model, graph_def)


def _errors(model: ModelGraph, float32: GraphRun, graph_def: GraphDef) -> tuple[str, str, str | None]:
    """(output error, update error, failure message or None) of ``graph_def`` run on CPU.

    Output error: the largest :func:`_relative_error` over the fetches. Update error (a
    training step): relative L2 error of all weight updates together.
    """
    try:
        run = _run_quietly(model, graph_def)
    except (tf.errors.OpError, ValueError) as error:  # a type error shows at import (ValueError) or run
        return "does not run", "-", " ".join(str(error).split())
    output = max(_relative_error(run.outputs[fetch], float32.outputs[fetch]) for fetch in model.fetches)
    if not model.trainable:
        return f"{output:.2e}", "-", None
    expected = _updates(float32, model)
    update = float(np.linalg.norm(_updates(run, model) - expected) / np.linalg.norm(expected))
    return f"{output:.2e}", f"{update:.2e}", None


def _cross_rows(
    subject: Subject,
    target: str,
    grappler: tuple[GraphDef, str],
    ours: amp_rewrite.RewriteResult,
    float32: Callable[[], GraphRun],
) -> tuple[list[list[str]], list[list[str]], list[str]]:
    """Rows of the cross-function table and of the per-iteration table, and failure details."""
    rows, details = [], []
    who_to_graph_def = {"grappler": grappler[0], "ours-cross": ours.graph_def}
    who_to_converted = {
        "grappler": grappler[1],
        "ours-cross": _converted(ours.report.vertices_converted, ours.report.casts_to_target),
    }
    for who, graph_def in who_to_graph_def.items():
        counts = item_cast_counts(graph_def).values()
        row = [target, who, str(sum(c.total for c in counts)), str(sum(c.run_time for c in counts)),
               who_to_converted[who]]
        if subject.model is not None:
            output, update, failure = _errors(subject.model, float32(), graph_def)
            row += [output, update]
            if failure:
                details.append(f"{who} does not run: {failure}")
        rows.append(row)
    per_iteration = {who: casts_per_iteration(graph_def) for who, graph_def in who_to_graph_def.items()}
    loops = sorted(set(per_iteration["grappler"]) | set(per_iteration["ours-cross"]))
    loop_rows = [
        [target, body, *(str(per_iteration[who].get(body, "-")) for who in who_to_graph_def)] for body in loops
    ]
    return rows, loop_rows, details


def compare(
    subject: Subject, targets: Sequence[str], *, cross_function: bool = False, entry_functions: Sequence[str] = ()
) -> bool:
    """Print the comparison for each target; True when default mode agrees fully with grappler."""
    graph_def, fetches = subject.graph_def, subject.fetches
    rows, item_rows, details, cross_rows, loop_rows, all_ok = [], [], [], [], [], True
    float32 = functools.cache(lambda: _run_quietly(subject.model))
    for target in targets:
        (grappler, grappler_lines), grappler_seconds = _median_seconds(
            lambda: _grappler_with_log(graph_def, target, fetches), RUNS
        )
        ours, ours_seconds = _median_seconds(
            lambda: amp_rewrite.rewrite_graph_def(graph_def, target=target, fetches=fetches), RUNS
        )
        agreement = compare_rewrites(graph_def, ours.graph_def, grappler)
        all_ok &= agreement.ok
        judged = agreement.judged + sum(f.judged for f in agreement.functions)
        agreed = agreement.agreed + sum(f.agreed for f in agreement.functions)
        rows.append([
            target,
            f"{judged:,}",
            f"{agreed:,}",
            _percent(agreed, judged, agreement.ok),
            _grappler_converted(grappler_lines),
            _converted(ours.report.vertices_converted, ours.report.casts_to_target),
            f"{_total_casts(grappler)}/{_total_casts(ours.graph_def)}",
            f"{grappler_seconds:.3f}",
            f"{ours_seconds:.3f}",
        ])
        item_rows += _agreement_rows(target, agreement)
        details.append(f"{target}:")
        details += [f"  grappler: {line}" for line in grappler_lines or ["(grappler logged no summary)"]]
        details.append(f"  ours:     {ours.report.summary()}")
        details += _mismatch_lines(agreement)
        if cross_function:
            cross = amp_rewrite.rewrite_graph_def(
                graph_def, target=target, fetches=fetches, cross_function=True, entry_functions=entry_functions
            )
            target_rows, target_loop_rows, failures = _cross_rows(
                subject, target, (grappler, _grappler_converted(grappler_lines)), cross, float32
            )
            cross_rows += target_rows
            loop_rows += target_loop_rows
            details += [f"  {failure}" for failure in failures]

    header = ["target", "judged", "agreed", "agreement", "grappler converted", "ours converted",
              "AMP casts g/o", "grappler s", "ours s"]
    print(_table(header, rows))
    print(f"(times: median of {RUNS} runs; counts over the main graph and every function body)\n")
    if graph_def.library.function:
        print("Default mode vs grappler, per item:")
        print(_table(["target", "item", "judged", "agreed", "agreement", "AMP casts g/o"], item_rows))
        print()
    if cross_function:
        header = ["target", "rewrite", "AMP casts", "run-time casts", "converted"]
        if subject.model is not None:
            header += ["output error", "update error"]
            print("Cross-function mode (ours) vs grappler; errors against float32 run on this CPU:")
        else:
            print("Cross-function mode (ours) vs grappler (a --graph has no inputs to run it with):")
        print(_table(header, cross_rows))
        print("(run-time casts: all AMP casts but those of a Const, which constant folding removes)\n")
        if loop_rows:
            print("Run-time casts per loop iteration (body, cond and what they call; an If's costlier branch):")
            print(_table(["target", "loop body", "grappler", "ours-cross"], loop_rows))
            print()
    print("\n".join(details))
    return all_ok


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--smoke", action="store_true",
                        help=f"checks this script: --model {SMOKE_MODEL} --cross-function, every target that can run here")
    source.add_argument("--model", choices=[*MODEL_NAMES, *LOOP_GRAPH_NAMES],
                        help="a built-in model (amp_rewrite.models) or loop graph (amp_rewrite.loops)")
    source.add_argument("--graph", type=Path, help="a GraphDef file: binary .pb or text .pbtxt")
    parser.add_argument("--training", action="store_true",
                        help=f"with --model {'/'.join(MODEL_NAMES)}: the training step, not inference")
    parser.add_argument("--image-size", type=int, help="with --model cnn/resnet50: square input size")
    parser.add_argument("--batch", type=int, default=2, help="with --model: batch size (default 2)")
    parser.add_argument("--fetch", nargs="+", default=[], metavar="NAME",
                        help="with --graph: node names whose outputs are fetched (required)")
    parser.add_argument("--target", choices=[*TARGETS, "both"], default="both")
    parser.add_argument("--cross-function", action="store_true",
                        help="also compare our cross_function=True rewrite with grappler's: casts, loops, errors")
    parser.add_argument("--entry-function", nargs="+", default=[], metavar="NAME",
                        help="with --cross-function: library functions whose signatures must not change")
    args = parser.parse_args(argv)
    if args.smoke:
        args.model, args.cross_function = SMOKE_MODEL, True
    if args.graph is not None and not args.fetch:
        parser.error("--graph needs --fetch NAME...: the nodes whose outputs the graph's user reads")
    if args.model is not None and args.fetch:
        parser.error("--fetch goes with --graph; a --model knows its own fetches")
    if args.model not in MODEL_NAMES and (args.training or args.image_size is not None):
        parser.error(
            f"--training and --image-size go with --model {', '.join(MODEL_NAMES)}; "
            "lstm and gru are always a training step, while_loop a forward pass"
        )
    if args.entry_function and not args.cross_function:
        parser.error("--entry-function goes with --cross-function; default mode keeps every signature")
    return args


def _subject(args: argparse.Namespace) -> Subject:
    """The graph named on the command line; ValueError if it cannot be loaded."""
    if args.model in LOOP_GRAPH_NAMES:
        model = build_loop_graph(args.model, batch=args.batch)
        kind = "training step" if model.training else "forward pass"
        return Subject(f"{args.model} {kind}", model.graph_def, model.fetches, model)
    if args.model is not None:
        model = build_model_graph(args.model, training=args.training, batch=args.batch, image_size=args.image_size)
        kind = "training step" if args.training else "inference"
        return Subject(f"{args.model} {kind}", model.graph_def, model.fetches, model)
    graph_def, fetches = _load_graph_def(args.graph), tuple(args.fetch)
    missing = sorted(set(fetches) - {node.name for node in graph_def.node})
    if missing:
        raise ValueError(f"--fetch {' '.join(missing)}: no such node in {args.graph}; pass node names, not tensors")
    return Subject(str(args.graph), graph_def, fetches)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        subject = _subject(args)
        functions = {f.signature.name for f in subject.graph_def.library.function}
        unknown = sorted(set(args.entry_function) - functions)
        if unknown:
            raise ValueError(f"--entry-function {' '.join(unknown)}: not in the graph's library")
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    library = f", {len(functions)} library functions" if functions else ""
    print(f"{subject.title}: {len(subject.graph_def.node):,} nodes{library}, fetches {', '.join(subject.fetches)}\n")
    targets = TARGETS if args.target == "both" else (args.target,)
    from amp_rewrite.testing.reference import unavailable_reason

    if args.smoke:
        targets = tuple(target for target in targets if unavailable_reason(target) is None)

    for target in targets:
        if unavailable_reason(target) is not None:
            print(f"error: {unavailable_reason(target)}", file=sys.stderr)
            return 2
    try:
        ok = compare(subject, targets, cross_function=args.cross_function, entry_functions=args.entry_function)
    except (amp_rewrite.AmpRewriteError, RuntimeError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
