"""The steps several commands share: read SRC (a model mixed in another dtype back in float32
first) and rewrite it (refusing an overlay that names nothing of it, float8 without amax),
tune it (--tune speed), store its weights in the target dtype, find where the conversion
diverges (--diverge), and the lines that sum up what the rewrite did.
"""
from __future__ import annotations

import argparse
import collections
import dataclasses
import re
import sys
from collections.abc import Sequence
from typing import Any

from amp_rewrite.calibration import diverge, speed, statistics, validate
from amp_rewrite.calibration.calibrate import RANDOM_FEEDS
from amp_rewrite.calibration.savedmodel import (
    Model, canonical_model, effective_lists, float32_outputs, plumbing_kinds, read_model, rewrite_model, tag_set_text,
)
from amp_rewrite.cli import weights
from amp_rewrite.cli.options import Progress, say
from amp_rewrite.core.canonical import low_dtypes
from amp_rewrite.core.float8 import inference as float8
from amp_rewrite.core.functions import LOOP_OPS, split_scope
from amp_rewrite.core.lists import OpLists, load_float8
from amp_rewrite.core.graph_io import every_node
from amp_rewrite.core.precision import already_low, source_precision
from amp_rewrite.core.report import Report
from amp_rewrite.core.rewrite import RewriteResult
from amp_rewrite.core.target import lookup_target
from amp_rewrite.core.weights import StoredWeights
from amp_rewrite.errors import AmpRewriteError, did_you_mean

FLOAT32 = "float32"  # --target float32: back to float32, nothing converted
MAIN_GRAPH_LABEL = "(main graph)"  # how tables name the main graph; explain --function accepts it too


def read_and_rewrite(args: argparse.Namespace, progress: Progress) -> tuple[Model, RewriteResult, OpLists]:
    """SRC read and rewritten as the options say, the lists that made it, and, but for convert
    (which calibrates first), tuned with --tune speed."""
    untuned = [flag for flag, value in (("--batch-sizes", "batch_sizes"), ("--tune-budget", "tune_budget"),
                                        ("--tune-cache", "tune_cache")) if getattr(args, value, None) is not None]
    args.tune = getattr(args, "tune", None)
    if untuned and not args.tune:
        raise AmpRewriteError(f"{', '.join(untuned)}: timing options; add --tune speed, or drop them")
    if getattr(args, "converted", None) and not args.diverge:
        raise AmpRewriteError("--converted DST: the conversion --diverge compares; add --diverge, or drop it")
    if args.tune:
        speed.check_target(lookup_target(args.target, quantized=True))
    progress(f"reading {args.src}")
    lists = effective_lists(args.target, args.lists, args.keep)
    model = read_model(args.src, args.fetch, args.tag_set, constants_in_file=_constants_in_file(args))
    model = retarget(args, with_source(model))
    quantized = _float8_calibration(args, model, lists)
    progress("rewriting")
    try:
        result = rewrite_model(model, target=args.target, lists=lists, cross_function=args.cross_function,
                               **quantized)
    except AmpRewriteError as error:
        raise type(error)(f"{args.src}: {error}") from None  # name the file the graph came from
    progress.done()
    if args.command != "convert":  # convert tunes after calibrating
        _, result, lists = tune(args, model, lists, result, progress)
    say(args, *_model_lines(model))
    return model, result, lists


def read_as_float32(args: argparse.Namespace, progress: Progress) -> Model:
    """``convert --target float32``: SRC read, and back in float32 where it is mixed
    (``retarget``; its ``canonical`` None where it computes in float32 already)."""
    progress(f"reading {args.src}")
    model = retarget(args, read_model(args.src, args.fetch, args.tag_set, constants_in_file=_constants_in_file(args)))
    progress.done()
    say(args, *_model_lines(model))
    return model


def _constants_in_file(args: argparse.Namespace) -> bool:
    """Whether a frozen graph's large constants may stay in its file (``calibration/frozen.py``):
    the run rewrites the graph and writes it as a .pb, or reports on it; validating,
    calibrating, timing, a dump and a .pbtxt need the values themselves."""
    if args.command not in ("convert", "inspect", "explain"):
        return False
    needs_values = ("validate", "inputs", "calibrate", "tune", "dump", "diverge")
    return not any(getattr(args, name, None) for name in needs_values) and (
        args.command != "convert" or args.dst.suffix != ".pbtxt")


def tune(args: argparse.Namespace, model: Model, lists: OpLists, result: RewriteResult,
         progress: Progress) -> tuple[speed.Tuning | None, RewriteResult, OpLists]:
    """``--tune speed``: the converted ops timed here; ``result`` with those that do not pay
    kept float32, and the lists that make it (calibration/speed.py); without it, as they
    were. Cache problems are one warning line each."""
    if not args.tune:
        return None, result, lists
    target = lookup_target(args.target, quantized=True)
    validate.check_fits(model, 2 * weights_bytes(model), "--tune speed runs the source and the result side by side",
                        "convert without --tune here, or tune where both fit")
    feeds, notes = speed.batch_feeds(model, args.inputs, args.batch_sizes)
    say(args, *[f"Note: {note}" for note in notes])
    cache = speed.open_cache(speed.DEFAULT if args.tune_cache is None else args.tune_cache, target)
    if cache.problem:
        print(f"amp-rewrite: warning: {cache.problem}", file=sys.stderr)
    progress(f"timing ops at batch size(s) {', '.join(map(str, feeds))}")
    tuning = speed.tune_model(model, feeds, target=target, lists=lists, cross_function=args.cross_function,
                              budget_s=args.tune_budget or speed.DEFAULT_BUDGET_S, cache=cache, base=result,
                              weights_low=not getattr(args, "float32_weights", False))
    progress.done()
    problem = speed.save_cache(cache)
    if problem:
        print(f"amp-rewrite: warning: {problem}", file=sys.stderr)
    say(args, tuning.summary(), *[f"Note: {note}" for note in tuning.notes])
    return tuning, tuning.result, tuning.lists


def _check_overlay(args: argparse.Namespace, model: Model, lists: OpLists, found: Any) -> None:
    """The --lists and --keep entries (keep_nodes, and float8's amax and lossy) that name
    nothing in the model: all of them is an error (the overlay is another model's, or an
    export whose names differ), some a warning with the count."""
    entries = len(lists.keep_nodes) + (len(found.amax) + len(found.lossy) if found is not None else 0)
    unmatched = lists.unmatched_keep_nodes(model.graph_def)
    if found is not None:
        unmatched += float8.resolve(found, model.graph_def)[1]
    if not entries or not unmatched:
        return
    where = " and ".join(part for part in (str(args.lists or ""), "--keep" if args.keep else "") if part)
    example = f"e.g. {unmatched[0]!r}{_close_to_entry(unmatched[0], model.graph_def)}"
    if len(unmatched) == entries:
        raise AmpRewriteError(f"{where}: none of its {entries} entries names a node of {args.src} ({example}); it"
                              " was written for another model, or an export whose node names differ: calibrate"
                              f" {args.src} again")
    print(f"amp-rewrite: warning: {where}: {len(unmatched)} of {entries} entries name no node of {args.src}"
          f" ({example}); they are ignored", file=sys.stderr)


def retarget(args: argparse.Namespace, model: Model) -> Model:
    """A model that computes in a low precision other than the target's (any, for --target
    float32) back in float32 first (``core/canonical.py``), so the target's lists convert it
    as they would its float32 twin. One computing in the target's dtype only is left as it is
    (nothing to retarget: "already bfloat16"). With --outputs float32 the signatures' low
    outputs are made float32 first (``float32_outputs``)."""
    if getattr(args, "outputs", None) == FLOAT32:
        model = float32_outputs(model)
    painted = args.target if args.target == FLOAT32 else lookup_target(args.target, quantized=True).colouring
    if not set(low_dtypes(model.graph_def)) - {painted}:
        return model
    # A SavedModel's variables stored low widen too, as its checkpoint does on writing; not
    # where the run loads the model here (calibration, timing): that reads variables/ as it is.
    runs_here = args.command == "calibrate" or any(getattr(args, name, None) for name in ("calibrate", "tune"))
    try:
        canonical = canonical_model(model, variables=model.kind == "savedmodel" and not runs_here)
    except AmpRewriteError as error:
        raise type(error)(f"{args.src}: {error}") from None  # name the file the graph came from
    # Low only where dtypes are kept (signatures, calls): nothing goes back, the model is as it was.
    return weights.widen_weights(canonical) if canonical.canonical.changed else model


def _close_to_entry(entry: str, graph_def: Any) -> str:
    """", did you mean 'a'?" for an overlay entry that is a plain node name (not a regex)."""
    name = split_scope(entry)[1]
    if re.escape(name) != name:
        return ""
    close = did_you_mean(name, (node.name for node in every_node(graph_def))).strip()
    return f", {close}" if close else ""


def _float8_calibration(args: argparse.Namespace, model: Model, lists: OpLists) -> dict[str, Any]:
    """Target float8: ``amax`` and ``lossy`` for the rewrite, from the --lists overlay (as
    ``calibrate --target float8`` writes it), or none yet in a run that calibrates (the
    float16 path until calibration measures them). Other targets: nothing. Checks the
    overlay's entries against the model first (``_check_overlay``); an overlay whose amax
    names nothing in the model gives no amax."""
    found = load_float8(args.lists) if args.lists and args.target == "float8" else None
    calibrating = args.command == "calibrate" or getattr(args, "calibrate", None) is not None
    usable = found is not None and bool(float8.resolve(found, model.graph_def)[0].amax)
    if args.target == "float8" and not calibrating and not usable:
        what = (f"{args.lists} has no amax" if found is None else f"no amax in {args.lists} names a tensor of"
                f" {args.src}") if args.lists else "--target float8 needs the amax of each matmul input"
        calibrate = "pass --calibrate DATA.npz (calibration inputs, as --inputs takes), or " \
            if args.command == "convert" else "pass "
        raise AmpRewriteError(f"{what}; {calibrate}--lists OVERLAY.yaml written by amp-rewrite calibrate {args.src}"
                              " --target float8 --inputs DATA.npz --out OVERLAY.yaml")
    _check_overlay(args, model, lists, found)
    if args.target != "float8":
        return {}
    return {"amax": {}} if calibrating else {"amax": found.amax, "lossy": found.lossy}


def run_divergence(args: argparse.Namespace, model: Model, result: RewriteResult, lists: OpLists,
                   progress: Progress) -> diverge.Divergence:
    """``--diverge``: the conversion the options make (``result``, from ``lists`` as read and
    tuned), run beside SRC on --inputs (else random inputs, with a warning), and where it
    first diverges."""
    if model.kind == "graphdef" and not model.compared_outputs:
        raise AmpRewriteError(f"{model.path}: --diverge needs outputs to compare and the graph has none;"
                              " name them with --fetch NAME[:PORT]")
    feeds, notes = validate.plan_feeds(model, args.inputs, RANDOM_FEEDS)
    say(args, *[f"Note: {note}" for note in notes])
    if args.inputs is None:
        print(f"amp-rewrite: warning: --diverge runs on random inputs ({RANDOM_FEEDS} batches, N(0,1) floats, ids"
              " 0-9); a model diverges on the data it meets: pass an .npz of the signature inputs with --inputs",
              file=sys.stderr)
    target = lookup_target(args.target, quantized=True)
    rewrite = diverge.rewriter(model, target, cross_function=args.cross_function, overlay=args.lists)
    converted = read_model(args.converted, args.fetch, args.tag_set) if args.converted else None
    progress("running SRC and its conversion on the inputs")
    divergence = diverge.run_search(model, feeds, diverge.Options(
        target=target, lists=lists, rewrite=rewrite, metric=args.metric, converted=converted, rewritten=result,
        described=statistics.RANDOM_INPUTS if args.inputs is None else str(args.inputs)))
    progress.done()
    return divergence


def _model_lines(model: Model) -> list[str]:
    """What the run took as the model: the MetaGraphDef converted and those left alone, or a
    GraphDef's outputs when no --fetch named them."""
    if model.kind == "graphdef":
        if model.fetches_are_sinks:
            return [f"Outputs (no --fetch; the nodes nothing reads keep their dtypes): {', '.join(model.fetches)}"]
        return []
    others = model.other_tag_sets
    if not others:
        return []
    left = ", ".join(repr(tag_set_text(tags)) for tags in others)
    return [f"MetaGraphDef {tag_set_text(model.tags)!r}: converted; {left}: left as it was"
            f" (convert another with --tag-set TAGS)"]


def with_source(model: Model) -> Model:
    """``model`` with what its file computes in and stores (``Model.source``), read before
    retargeting changes its graph: over the items that run, TensorFlow's plumbing left out
    (its save/restore functions read every variable)."""
    return dataclasses.replace(model, source=source_precision(model.graph_def, skip=plumbing_kinds(model)))


def source_line(model: Model) -> str:
    """What the model computed in before any rewrite or retargeting: "Source: computes 37
    nodes in float16, variables float32: a Keras mixed_float16 export?"."""
    return (model.source or with_source(model).source).line()


def headline(model: Model, report: Report, lists: OpLists, kinds: dict[str, str]) -> str:
    """The model's total (a SavedModel's own functions, without ``kinds``, its plumbing), or
    "already bfloat16" where the model computes in the target's dtype and nothing is left to convert."""
    items = [item for item in report.items if item.function not in kinds]
    low = already_low(model.graph_def, lists).get(report.painted, [])
    if low and not any(item.vertices_converted for item in items):
        return f"Model: already {report.painted}: 0 nodes to convert ({len(low)} node(s) compute in {report.painted})"
    return _model_headline(report, items) if kinds else report.summary()


def _model_headline(report: Report, items: Sequence[Any]) -> str:
    """The summary line's counts over the model's own items (not TensorFlow's plumbing)."""
    converted = sum(item.vertices_converted for item in items)
    nodes = sum(item.nodes_before for item in items)
    casts = sum(item.casts_to_target for item in items)
    line = (f"Model: converted {converted}/{nodes} nodes to {report.painted} using {casts} cast(s) to"
            f" {report.painted} (excluding Const and Variable casts)")
    if report.painted != report.target:
        line += f"; {sum(item.float8_matmuls for item in items)} matmul(s) on float8_e4m3fn operands"
    return line


def summary_lines(model: Model, report: Report, lists: OpLists) -> list[str]:
    """One total for the model (the SavedModel's own functions, or the GraphDef), "already
    bfloat16" where it has nothing left to convert, and why its nodes stayed float32; then a
    SavedModel's library total, TensorFlow's plumbing included, as grappler's log counts it."""
    kinds = plumbing_kinds(model)
    lines = [headline(model, report, lists, kinds)]
    if model.canonical is not None:  # what the source was, said before what became of it
        lines.insert(0, "Model: " + model.canonical.summary())
    kept = collections.Counter(d.rule for d in report.decisions if not d.converted and d.function not in kinds)
    if kept:
        where = " (model)" if kinds else ""
        lines.append(f"Stayed float32{where}: " + ", ".join(f"{rule} {count}" for rule, count in kept.most_common()))
    lines += _loop_lines(report)
    if kinds:
        lines.append(f"Library total, TensorFlow's plumbing included (as grappler's log counts): converted"
                     f" {report.vertices_converted}/{report.nodes_before} nodes")
    return lines


def _loop_lines(report: Report) -> list[str]:
    """How many float32 values the model's loops carry low from one iteration to the next."""
    carried = [d for d in report.decisions if d.op in LOOP_OPS]
    if not carried:
        return []
    low = sum(d.converted for d in carried)
    return [f"Loops: {low} of {len(carried)} float32 loop value(s) carried in {report.target} across iterations"
            " (loop boundaries are linked, beyond grappler; --cross-function links calls too)"]


def store_weights(args: argparse.Namespace, model: Model,
                  result: RewriteResult) -> tuple[Model, RewriteResult, StoredWeights | None]:
    """The weights in the target dtype, unless --float32-weights: the model to write (its
    object graph's variable dtypes), the graph, and what was stored (None: nothing changed)."""
    if args.float32_weights:
        weights.check_checkpoint(model)
        return model, result, None
    stored = weights.stored_weights(model, result, args.target)
    return weights.with_weights(model, stored), dataclasses.replace(result, graph_def=stored.graph_def), stored


def weights_lines(stored: StoredWeights | None, every: bool = False) -> list[str]:
    """What happened to the weights; ``every`` float32 one named (inspect --all), else the first few."""
    return ["Weights: kept float32 (--float32-weights)"] if stored is None else stored.summary(every=every)


def outputs_lines(args: argparse.Namespace, model: Model) -> list[str]:
    """What --outputs float32 changed: the signature outputs made float32, or none to change."""
    if getattr(args, "outputs", None) != FLOAT32:
        return []
    changed = model.float32_outputs
    if not changed:
        return ["Outputs: every floating signature output is float32 already (--outputs float32: nothing to change)"]
    shown = ", ".join(changed[:4]) + (f" and {len(changed) - 4} more" if len(changed) > 4 else "")
    return [f"Outputs: {len(changed)} signature output(s) made float32 (--outputs float32): {shown}"]


def weights_bytes(model: Model) -> int:
    """The source's weights, in bytes: a frozen graph's, or a SavedModel's checkpoint shards."""
    if model.kind == "graphdef":
        return model.graph_def.ByteSize() + (model.left_in_file.size if model.left_in_file is not None else 0)
    return sum(path.stat().st_size for path in (model.path / "variables").glob("variables.data-*"))
