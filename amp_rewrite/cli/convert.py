"""``amp-rewrite convert``: a mixed-precision copy of SRC written to DST. The steps, in order:
rewrite, calibrate (--calibrate), tune (--tune speed), store the weights in the target dtype,
plan the validation, write the dump (--dump), then write DST, its staged copy accepted only
once validated and timed.
"""
from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from amp_rewrite.calibration import speed, staging, validate
from amp_rewrite.calibration.savedmodel import Model, write_model
from amp_rewrite.cli.calibrate import calibrate_model
from amp_rewrite.cli.dump import write_model_dump
from amp_rewrite.cli.options import EXIT_OK, EXIT_VALIDATION, Progress, say
from amp_rewrite.cli.steps import (
    FLOAT32, outputs_lines, read_and_rewrite, read_as_float32, store_weights, summary_lines, tune, weights_bytes,
    weights_lines,
)
from amp_rewrite.cli.weights import LowCheckpoint, retargeted_weights_lines
from amp_rewrite.core.rewrite import RewriteResult
from amp_rewrite.core.target import lookup_target
from amp_rewrite.core.weights import StoredWeights
from amp_rewrite.errors import AmpRewriteError

PROGRESS_BYTES = 1 << 30  # a checkpoint this large shows a progress bar over the bytes written


def run(args: argparse.Namespace, progress: Progress) -> int:
    """DST written (exit 0); exit 1, nothing written unless --keep-failed, where calibration
    or validation leaves outputs over tolerance."""
    if args.target == FLOAT32:
        return _to_float32(args, progress)
    model, result, lists = read_and_rewrite(args, progress)
    if args.calibrate is not None:
        calibration = calibrate_model(args, model, lists, args.calibrate)
        result, lists = calibration.result, calibration.lists
        if calibration.compared and not calibration.ok and not args.keep_failed:
            print(f"amp-rewrite: calibration left outputs over tolerance; nothing was written to {args.dst}"
                  " (--keep-failed writes it anyway)", file=sys.stderr)
            return EXIT_VALIDATION
    tuning, result, lists = tune(args, model, lists, result, progress)
    written_model, result, stored = store_weights(args, model, result)
    retargeted = retargeted_weights_lines(model, stored, force=args.force)  # refuses a value out of range
    if _nothing_to_do(model, result, stored):
        say(args, *summary_lines(model, result.report, lists), *outputs_lines(args, model),
            f"Model: {args.src} is {result.report.painted} already, its weights too: nothing to do, nothing written to"
            f" {args.dst}")
        return EXIT_OK
    feeds = _validation_feeds(args, model)
    say(args, *_unchecked_functions(args, model))
    for leftover in staging.remove_leftovers(args.dst):
        say(args, f"Removed {leftover}, left by an interrupted run")
    if model.is_tf_keras:
        print("amp-rewrite: warning: this SavedModel was saved by tf_keras; tf_keras.models.load_model rebuilds its"
              " float32 layers from keras_metadata.pb and ignores the rewrite; load the result with"
              " tf.saved_model.load or serve it", file=sys.stderr)
    if args.dump:
        write_model_dump(args, progress, args.dump, model, result, lists, notes=weights_lines(stored))
    acceptance = _Acceptance(args=args, model=model, result=result, feeds=feeds, tuning=tuning, progress=progress)
    progress("writing")
    with _checkpoint(args, model, stored) as variables:
        written = write_model(written_model, result.graph_def, args.dst, force=args.force,
                              accept=acceptance if acceptance.checks else None, variables=variables)
    progress.done()
    say(args, *summary_lines(model, result.report, lists), *outputs_lines(args, model), *weights_lines(stored),
        *retargeted, *_untimed_speed(args, result))
    if written:
        say(args, f"Wrote {args.dst}")
    if acceptance.failed:
        what = (f"{args.dst} was written anyway (--keep-failed)" if written
                else f"nothing was written to {args.dst} (--keep-failed writes it anyway)")
        print(f"amp-rewrite: validation failed for {acceptance.failed} output(s); see above; {what}", file=sys.stderr)
        return EXIT_VALIDATION
    return EXIT_OK


# What --target float32 leaves out: it converts nothing, so nothing is calibrated, tuned or kept.
_NOT_FOR_FLOAT32 = (("--calibrate", "calibrate"), ("--tune", "tune"), ("--lists", "lists"), ("--keep", "keep"),
                    ("--dump", "dump"), ("--validate", "validate"), ("--inputs", "inputs"),
                    ("--batch-sizes", "batch_sizes"), ("--tune-budget", "tune_budget"), ("--tune-cache", "tune_cache"))


def _to_float32(args: argparse.Namespace, progress: Progress) -> int:
    """``--target float32``: SRC back in float32 (``core/canonical.py``), its signatures and
    weights as they were; a model in float32 already is said so, and nothing is written."""
    given = [flag for flag, name in _NOT_FOR_FLOAT32 if getattr(args, name, None) not in (None, False, [])]
    if given:
        raise AmpRewriteError(f"{', '.join(given)}: not with --target float32, which converts nothing back to low"
                              " precision; drop them")
    model = read_as_float32(args, progress)
    if model.canonical is None and not model.float32_outputs:
        say(args, f"Model: already float32: 0 nodes to change back; nothing to do, nothing written to {args.dst}")
        return EXIT_OK
    progress("writing")
    with _checkpoint(args, model, None) as variables:
        written = write_model(model, model.graph_def, args.dst, force=args.force, variables=variables)
    progress.done()
    changed = ["Model: " + model.canonical.summary()] if model.canonical is not None else []
    say(args, *changed, *outputs_lines(args, model), *_float32_weights_lines(model))
    if written:
        say(args, f"Wrote {args.dst}")
    return EXIT_OK


def _float32_weights_lines(model: Model) -> list[str]:
    """What --target float32 did with the weights: float32 masters stay; those stored low are
    widened (a SavedModel's checkpoint, a GraphDef's constants), or else read through a cast."""
    low = model.canonical.low_variables if model.canonical is not None else ()
    widened = retargeted_weights_lines(model, None, force=False)  # a checkpoint's keys, a GraphDef's constants
    if widened:
        return widened
    if not low:
        return ["Weights: float32, as they were"]
    return [f"Weights: {len(low)} variable(s) stay stored in low precision (e.g. {low[0]!r}), read through a cast to"
            " float32: the precision they lost earlier is not recovered"]


def _unchecked_functions(args: argparse.Namespace, model: Model) -> list[str]:
    """Where the run checks the result by running it, the converted functions that no
    signature runs (``Model.unsigned_functions``), named in one note."""
    checks = [flag for flag, given in (("--validate", args.validate or args.inputs), ("--calibrate", args.calibrate),
                                       ("--tune", args.tune)) if given]
    if not checks or model.kind != "savedmodel" or not model.unsigned_functions:
        return []
    names, flags = model.unsigned_functions, " and ".join((", ".join(checks[:-1]), checks[-1])) if len(checks) > 1 \
        else checks[0]
    return [f"Note: {len(names)} restored function(s) that no signature calls (e.g. {names[0]}) are converted by the"
            f" lists alone, unchecked: {flags} {'run' if len(checks) > 1 else 'runs'} the signatures only"]


def _nothing_to_do(model: Model, result: RewriteResult, stored: StoredWeights | None) -> bool:
    """The source computes in the target's dtype already (``headline``'s "already"), and the run
    would change nothing: no node converted, no weight stored anew, nothing retargeted."""
    return (model.canonical is None and not model.float32_outputs and not result.report.vertices_converted
            and result.report.painted == result.report.target
            and (stored is None or not stored.low_keys) and bool(model.source and model.source.compute))


def _untimed_speed(args: argparse.Namespace, result: RewriteResult) -> list[str]:
    """Without --tune nothing timed the result: where the lists are known to lose to float32
    here (``live.untimed_slowdown``), one line says so and how to measure it."""
    if args.tune or not result.report.vertices_converted:
        return []
    from amp_rewrite.training import live  # only here: the rest of convert needs no training module

    why = live.untimed_slowdown(args.target)
    if why is None:
        return []
    how = ("run with --tune speed to time each converted op here and keep float32 what is slower"
           if args.target == "bfloat16" else "serve it on a GPU, and time it there with --tune speed")
    return [f"Speed: not measured: {why}; {how}"]


def _validation_feeds(args: argparse.Namespace, model: Model) -> _Feeds | None:
    """The inputs --validate (random) or --inputs (the file's) feeds to SRC and the result,
    once the model is known to fit in memory twice; None without either option."""
    if not (args.validate or args.inputs):
        return None
    if model.kind == "graphdef" and not model.compared_outputs:
        raise AmpRewriteError(f"{model.path}: --validate needs outputs to compare and the graph has none;"
                              " name them with --fetch NAME[:PORT]")
    _metrics(args).check(model)
    draws = validate.plan_draws(model) if args.inputs is None else None
    feeds, notes = validate.plan_feeds(model, args.inputs, args.validate or 1, draws=draws)
    validate.check_fits(model, weights_bytes(model))
    say(args, *[f"Note: {note}" for note in notes])
    if draws is None:
        return _Feeds(feeds, None)
    return _Feeds(feeds, validate.describe_draws(draws), tuple(validate.unbounded(draws)))


@dataclass(frozen=True)
class _Feeds:
    """What validation feeds, and how its random inputs were drawn (None: the --inputs file's)."""

    feeds: validate.Feeds
    drawn: str | None
    guessed: tuple[str, ...] = ()  # the integer inputs no table bounds, drawn 0-9


@dataclass(kw_only=True)
class _Acceptance:
    """What ``write_model`` asks of the staged copy before it moves into place: validation
    (where there are feeds), then with --tune the speed check. It keeps how many outputs
    validation found over tolerance, for the run's last line."""

    args: argparse.Namespace
    model: Model
    result: RewriteResult
    feeds: _Feeds | None  # None: no validation
    tuning: speed.Tuning | None   # None: no --tune
    progress: Progress
    failed: int = 0  # outputs over tolerance, once validated

    @property
    def checks(self) -> bool:
        return self.feeds is not None or self.tuning is not None

    def __call__(self, staged: Path) -> bool:
        if self.feeds is not None:
            self.progress("validating")
            self.failed = _validate(self.args, self.model, self.result, staged, self.feeds)
            self.progress.done()
            if self.failed and not self.args.keep_failed:
                return False
        if self.tuning is not None:
            _check_speed(self.args, self.tuning, staged, self.progress)
        return True


def _validate(args: argparse.Namespace, model: Model, result: RewriteResult, staged: Path,
              planned: _Feeds) -> int:
    """Compare the source with the staged copy and print each output's error; returns how
    many outputs are over tolerance."""
    random, feeds = args.inputs is None, planned.feeds
    if model.kind == "savedmodel":
        errors = validate.validate_saved_models(model, staged, feeds, random, _metrics(args), guessed=planned.guessed)
    else:
        errors = validate.validate_graph_defs(model, result.graph_def, feeds, random, _metrics(args),
                                              guessed=planned.guessed)
    target = lookup_target(args.target, quantized=True)
    runs = 1 if args.inputs else args.validate
    failed = [e for e in errors if not e.ok(target)]
    inputs = (f"{runs} run(s) of random inputs, which are not the model's data: a pass or a failure here says"
              " little about real inputs (pass them with --inputs FILE.npz)" if random else f"{args.inputs}")
    say(args, f"Validation ({inputs}; {args.metric}, tolerance {target.tolerance:g}):")
    if planned.drawn is not None:
        say(args, f"  random inputs: {planned.drawn}")
    say(args, *[f"  {'FAIL' if not e.ok(target) else 'ok  '} {e.signature}/{e.output}: {e.describe()}"
                for e in errors])
    return len(failed)


def _metrics(args: argparse.Namespace) -> validate.MetricChoice:
    """--metric: the floating outputs' metric, and OUTPUT=NAME's."""
    return validate.MetricChoice(args.metric, args.output_metrics)


def _check_speed(args: argparse.Namespace, tuning: speed.Tuning, staged: Path, progress: Progress) -> None:
    """The written result against the source at each batch size, in what the budget has left."""
    progress("timing the result against the source")
    checks = speed.check_speed(tuning, staged)
    progress.done()
    lines = speed.speed_lines(tuning, checks)
    say(args, lines[0])
    for line in lines[1:]:  # slower than the source: said even with --quiet
        print(f"amp-rewrite: warning: {line}", file=sys.stderr)


@contextlib.contextmanager
def _checkpoint(args: argparse.Namespace, model: Model, stored: StoredWeights | None) -> Iterator[LowCheckpoint | None]:
    """The checkpoint ``convert`` writes in place of the source's (None: the source's is copied),
    with a progress bar over its bytes on a terminal for a model of a GB or more, unless --quiet."""
    if model.kind != "savedmodel" or (stored is None or not stored.low_keys) and not model.widened_keys:
        yield None
        return
    checkpoint = LowCheckpoint(model, stored)
    shown = not args.quiet and sys.stderr.isatty() and checkpoint.size >= PROGRESS_BYTES
    if shown:
        print(file=sys.stderr)  # the bar below the open "writing …" line
    with tqdm(total=checkpoint.size, unit="B", unit_scale=True, desc="amp-rewrite: writing the checkpoint",
              disable=not shown, file=sys.stderr) as bar:
        checkpoint.progress = bar.update
        yield checkpoint
