"""``amp-rewrite calibrate``: measure SRC on calibration data and write the nodes to keep
float32 as an overlay for ``convert --lists``. ``calibrate_model`` is also ``convert --calibrate``'s step.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from amp_rewrite.calibration import calibrate, staging, statistics, validate
from amp_rewrite.calibration.savedmodel import Model
from amp_rewrite.cli.options import EXIT_OK, EXIT_VALIDATION, RANDOM_INPUTS, Progress, say
from amp_rewrite.cli.steps import read_and_rewrite
from amp_rewrite.core.lists import OpLists
from amp_rewrite.core.target import lookup_target
from amp_rewrite.errors import AmpRewriteError


def run(args: argparse.Namespace, progress: Progress) -> int:
    """The overlay written to --out (the --lists overlay and --keep entries it starts from
    kept); exit 1 where calibration left outputs over tolerance."""
    model, _, lists = read_and_rewrite(args, progress)
    calibration = calibrate_model(args, model, lists, args.inputs)
    base = yaml.safe_load(args.lists.read_text(encoding="utf-8")) if args.lists else None
    if args.keep:
        base = dict(base or {})
        base["keep_nodes"] = list(base.get("keep_nodes") or []) + list(args.keep)
    staging.write_text_atomically(args.out, calibration.overlay(base))
    say(args, f"Wrote {args.out}: use it with amp-rewrite convert {args.src} DST --target {args.target}"
              f" --lists {args.out}")
    return EXIT_OK if calibration.ok or not calibration.compared else EXIT_VALIDATION


def calibrate_model(args: argparse.Namespace, model: Model, lists: OpLists,
                    data: Path | None) -> calibrate.Calibration:
    """Calibration of ``model`` on ``data`` (None or RANDOM_INPUTS: random inputs), each round printed."""
    random = data is None or data == RANDOM_INPUTS
    if model.kind == "graphdef" and not model.compared_outputs:
        raise AmpRewriteError(f"{model.path}: calibration needs outputs to compare and the graph has none;"
                              " name them with --fetch NAME[:PORT]")
    draws = validate.plan_draws(model) if random else None
    feeds, notes = validate.plan_feeds(model, None if random else data, calibrate.RANDOM_FEEDS, draws=draws)
    say(args, *[f"Note: {note}" for note in notes])
    if draws is not None:
        print(f"amp-rewrite: warning: calibrating on random inputs ({calibrate.RANDOM_FEEDS} batches:"
              f" {validate.describe_draws(draws)}); real data is better: pass an .npz of the signature inputs",
              file=sys.stderr)
    thresholds = calibrate.Thresholds.for_target(lookup_target(args.target, quantized=True), args.max_magnitude,
                                                 args.small_share)
    result = calibrate.run_calibration(model, feeds, calibrate.Options(
        target=lookup_target(args.target, quantized=True), lists=lists, cross_function=args.cross_function,
        max_rounds=args.max_rounds, thresholds=thresholds, metric=args.metric,
        source=statistics.RANDOM_INPUTS if random else str(data), say=lambda line: say(args, line)))
    kept = len(result.kept)
    say(args, f"Calibration: {kept} node(s) kept float32 ({result.range_kept} by range rules,"
              f" {kept - result.range_kept} by repair), {result.validation_runs} validation run(s)")
    if result.float8 is not None:
        say(args, f"Calibration: {result.result.report.float8_matmuls} matmul(s) on float8_e4m3fn operands,"
                  f" {len(result.float8.lossy)} kept float16 as too lossy in float8")
    if not result.compared:
        print(f"amp-rewrite: warning: calibration had nothing to compare: no output of {model.path} is a number, so no"
              " run could check the rewrite; its decisions are the range rules' alone", file=sys.stderr)
    if kept and not calibrate.converted_nodes(result.result):
        print(f"amp-rewrite: warning: nothing converted: calibration keeps every node the lists convert float32, so"
              f" the rewrite runs as the float32 model does; target {args.target} does not suit this model as"
              " calibrated", file=sys.stderr)
    return result
