"""``amp-rewrite``: rewrite a SavedModel or GraphDef file to mixed precision, and look inside.

Arguments are parsed before TensorFlow is imported (``--help`` and ``--version`` answer
at once); every check that can fail runs before anything is written.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import math
import re
import shutil
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

# No TensorFlow in these two: plain Python.
from amp_rewrite.calibration import staging
from amp_rewrite.errors import AmpRewriteError, ModelError, did_you_mean

if TYPE_CHECKING:
    from amp_rewrite.calibration.savedmodel import Model
    from amp_rewrite.core.lists import OpLists
    from amp_rewrite.core.report import Report
    from amp_rewrite.core.rewrite import RewriteResult
    from amp_rewrite.core.weights import StoredWeights

EXIT_OK, EXIT_VALIDATION, EXIT_USAGE = 0, 1, 2
RANDOM_INPUTS = Path("<random>")  # --calibrate without a file
# core.target's TARGETS and quantized targets, spelled here so --help needs no TensorFlow
TARGET_NAMES = ("float16", "bfloat16", "float8")
METRIC_NAMES = ("max-rel", "p99-rel", "top1-agreement")  # calibration.validate.METRICS, the default second
# Ops whose float16 speed comes from Tensor Cores, and which of their inputs' dims must be multiples of 8.
# DepthwiseConv2dNative is not here: its filter's last dim is the channel multiplier, which no user can change.
TENSOR_CORE_OPS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "Conv2D", "Conv3D", "Conv2DBackpropInput",
                   "Conv2DBackpropFilter", "Einsum")

DESCRIPTION = "Rewrite a SavedModel or GraphDef file to mixed precision (float16, bfloat16 or float8), and look inside."
EXIT_CODES = """\
exit codes:
  0  done
  1  validation failed (outputs over tolerance); nothing is written unless --keep-failed
  2  usage or input error: one line on stderr naming the file, node or op and what to do
  130  interrupted by Ctrl-C (143: by SIGTERM); nothing is left behind
"""
EPILOG = """\
examples:
  amp-rewrite convert my_model/ my_model_fp16/ --validate 8
  amp-rewrite calibrate my_model/ --inputs calib.npz --out keep.yaml
  amp-rewrite inspect my_model/ --target bfloat16
  amp-rewrite explain my_model/ sequential_1/dense_1/MatMul
  amp-rewrite dump my_model/ report/

`amp-rewrite COMMAND --help` describes a command's options, with examples.

""" + EXIT_CODES
# Each command's description (its first line is the one-line help in the list above) and examples.
COMMAND_HELP = {
    "convert": ("Write a mixed-precision copy of SRC (a SavedModel directory or a GraphDef file) to DST.", """\
examples:
  amp-rewrite convert my_model/ my_model_fp16/ --validate 8
  amp-rewrite convert my_model/ my_model_bf16/ --target bfloat16 --inputs batch.npz
  amp-rewrite convert my_model/ my_model_fp16/ --float32-weights   # weights stay float32 (to fine-tune it)
  amp-rewrite convert tf1_model/ out/ --tag-set serve      # the MetaGraphDef to convert
  amp-rewrite convert graph.pb graph_fp16.pb --fetch logits --fetch probs:0
  amp-rewrite convert my_model/ my_model_fp16/ --calibrate calib.npz --inputs held_out.npz
  amp-rewrite convert my_model/ my_model_fp16/ --calibrate random      # no data: random inputs
  amp-rewrite convert my_model/ my_model_fp8/ --target float8 --calibrate calib.npz --inputs held_out.npz
  amp-rewrite convert my_model/ my_model_bf16/ --target bfloat16 --tune speed --batch-sizes 1,8  # timed here

weights:
  convert stores a variable (a GraphDef's Const) in the target dtype when every reader
  reads it through a cast to that dtype: rounded once as the cast rounds it, so the outputs
  do not change, while the per-call casts go and variables/ halves (a serving default: at
  small batches the casts cost more than low precision saves). The others stay float32, and
  convert and inspect say why. --float32-weights keeps every weight float32.

"""),
    "calibrate": ("Measure SRC on calibration data; write the nodes to keep float32 as an overlay YAML for"
                  " convert --lists.", """\
examples:
  amp-rewrite calibrate my_model/ --inputs calib.npz --out keep.yaml
  amp-rewrite convert my_model/ my_model_fp16/ --lists keep.yaml      # then use it
  amp-rewrite calibrate my_model/ --target float8 --inputs calib.npz --out fp8.yaml

"""),
    "inspect": ("Print what a rewrite of SRC would do, function by function; writes nothing.", """\
examples:
  amp-rewrite inspect my_model/
  amp-rewrite inspect my_model/ --target bfloat16 --all   # TensorFlow's plumbing too

"""),
    "explain": ("Print why NODE has its dtype after the rewrite: the rule and its reason; writes nothing.", """\
examples:
  amp-rewrite explain my_model/ sequential_1/dense_1/MatMul
  amp-rewrite explain my_model/ dense_1/MatMul --target bfloat16 --function __inference_serve_42

"""),
    "dump": ("Write SRC's graphs before and after the rewrite, DOT/SVG drawings, report.html and a TensorBoard"
             " log to DIR.", """\
examples:
  amp-rewrite dump my_model/ report/       # then open report/report.html

"""),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors: one line, exit 2
        print(f"amp-rewrite: error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("amp_rewrite")
    except metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _count(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number from ``low`` to ``high`` (None: no limit)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"{text!r}: use a whole number from {low} to {high}" if high is not None
                                             else f"{text!r}: use a whole number, {low} or more")
        return value
    return parse


def _sizes(text: str) -> tuple[int, ...]:
    """``1,8`` -> (1, 8): whole numbers, 1 or more."""
    try:
        sizes = tuple(int(part) for part in text.split(","))
    except ValueError:
        sizes = ()
    if not sizes or min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: use batch sizes like 1,8 (whole numbers, 1 or more)")
    return tuple(dict.fromkeys(sizes))


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: use a number of seconds above 0, e.g. 30")
    return value


def _tuning_options(sub: argparse.ArgumentParser, inputs: bool = True) -> None:
    """--tune speed and its settings (``inputs``: the command has no --inputs of its own)."""
    sub.add_argument("--tune", choices=("speed",),
                     help="speed: time each op the lists convert, here, in float32 and in the target with its"
                          " casts, and keep float32 those that do not pay; convert then times the result"
                          " against SRC (README: Tuning for speed)")
    sub.add_argument("--batch-sizes", type=_sizes, metavar="N[,N...]",
                     help="--tune: the batch sizes to time at (default: the --inputs' batch, or 1)")
    sub.add_argument("--tune-budget", type=_seconds, metavar="SECONDS",
                     help="--tune: seconds the timing may add (default 30)")
    sub.add_argument("--tune-cache", type=Path, metavar="FILE",
                     help="--tune: the timing cache (default $XDG_CACHE_HOME/amp_rewrite/timings.json); a"
                          " second run re-times nothing it holds; copy it to machines like this one")
    if inputs:
        sub.add_argument("--inputs", type=Path, metavar="FILE.npz",
                         help="--tune: inputs of the shapes to time at (needed where dims beyond the batch are"
                              " unknown)")


def _calibration_data(text: str) -> Path:
    """An argparse type: --calibrate's value, DATA.npz or ``random``. A model there is the
    source taken for the value (``convert --calibrate my_model/ out/``): said so, before a
    misleading "required: dst"."""
    if text == "random":
        return RANDOM_INPUTS
    path = Path(text)
    if path.is_dir() or path.suffix in (".pb", ".pbtxt"):
        raise argparse.ArgumentTypeError(f"{text!r} is a model, not calibration data: pass DATA.npz (signature inputs,"
                                         " as --inputs takes) or the word random, e.g. amp-rewrite convert SRC DST"
                                         " --calibrate random")
    return path


def _with_calibrate_value(argv: Sequence[str]) -> list[str]:
    """A bare --calibrate, as earlier versions took it (random inputs), where nothing can be
    taken for its value: at the end, or before another option."""
    argv = list(argv)
    for index in reversed(range(len(argv))):
        if argv[index] == "--calibrate" and (index + 1 == len(argv) or argv[index + 1].startswith("-")):
            argv.insert(index + 1, "random")
    return argv


def _add_command(commands: Any, name: str) -> argparse.ArgumentParser:
    """The subcommand ``name``: its one-line description (also its line in the top-level list),
    examples and the exit codes, from COMMAND_HELP."""
    description, examples = COMMAND_HELP[name]
    return commands.add_parser(name, help=description[0].lower() + description[1:].rstrip("."),
                               description=description, epilog=examples + EXIT_CODES,
                               formatter_class=argparse.RawDescriptionHelpFormatter)


def _common_options(sub: argparse.ArgumentParser) -> None:
    """SRC and the options every command takes."""
    sub.add_argument("src", type=Path, help="SavedModel directory, or GraphDef .pb/.pbtxt file")
    sub.add_argument("--target", choices=TARGET_NAMES, default="float16",
                     help="float16 (NVIDIA GPUs, default), bfloat16 (CPUs with AVX512-BF16/AMX) or float8"
                          " (float16 with float8_e4m3fn matmuls under XLA, compute capability 8.9+; needs"
                          " calibration: convert --calibrate, or --lists from calibrate --target float8)")
    sub.add_argument("--tag-set", metavar="TAGS",
                     help="SavedModel: the MetaGraphDef to read, tags comma-separated as saved_model_cli's"
                          " --tag_set (default: serve)" + ("; convert copies the others as they are"
                                                           if sub.prog.endswith(" convert") else ""))
    sub.add_argument("--lists", type=Path, metavar="OVERLAY.yaml", help="overlay YAML that edits the op lists")
    sub.add_argument("--keep", action="append", default=[], metavar="REGEX",
                     help="keep nodes whose name matches REGEX in float32, as deny ops; FUNCTION::REGEX only"
                          " in that library function (repeatable)")
    sub.add_argument("--fetch", action="append", default=[], metavar="NAME[:PORT]",
                     help="GraphDef only: an output whose dtype must not change (repeatable; default: the"
                          " nodes nothing reads)")
    sub.add_argument("--cross-function", action="store_true",
                     help="let low precision cross function and loop boundaries (beyond grappler)")
    sub.add_argument("--quiet", action="store_true", help="print only errors")
    sub.add_argument("--debug", action="store_true", help="show a traceback on errors")


def _metric_option(sub: argparse.ArgumentParser) -> None:
    """--metric: how validation measures an output's error."""
    sub.add_argument("--metric", choices=METRIC_NAMES, default=METRIC_NAMES[1],
                     help="how an output's error is measured against the target's tolerance: max-rel (largest"
                          " |difference| / largest |float32|, grows with the samples), p99-rel (its 99th"
                          " percentile, default) or top1-agreement (share of samples whose top class changed)")


def _weights_option(sub: argparse.ArgumentParser) -> None:
    """--float32-weights, for the commands that show or write weights."""
    sub.add_argument("--float32-weights", action="store_true",
                     help="keep every weight float32, read through a cast on each call. Default: a variable"
                          " (a GraphDef's Const) that every reader reads in the target dtype is stored in it,"
                          " rounded once as the cast rounds it: same outputs, half the size, no per-call casts."
                          " Keep them float32 to fine-tune the result or restore float32 checkpoints into it")


def _calibration_options(sub: argparse.ArgumentParser) -> None:
    """Calibration's limits, for convert --calibrate and calibrate."""
    sub.add_argument("--max-rounds", type=_count(1, 10), default=5, metavar="N",
                     help="calibration: validation runs at most (1-10, default 5)")
    sub.add_argument("--max-magnitude", type=float, metavar="X",
                     help="calibration: largest |value| a converted node may see untried; above it, it is tried"
                          " and kept float32 if validation needs it (float16 default 16384; over 65504 always"
                          " kept)")
    sub.add_argument("--small-share", type=float, metavar="S",
                     help="calibration: largest share of a tensor's magnitude in values below the target's"
                          " smallest normal (default 0.5)")


def _add_convert(commands: Any) -> None:
    """convert and its options."""
    convert = _add_command(commands, "convert")
    _common_options(convert)
    _weights_option(convert)
    convert.add_argument("dst", type=Path, help="where to write (same kind as SRC)")
    convert.add_argument("--dump", type=Path, metavar="DIR", help="also write inspection dumps to DIR")
    convert.add_argument("--validate", type=_count(1), metavar="N",
                         help="run N random inputs through SRC and the result before writing it; exit 1 if over"
                              " tolerance")
    convert.add_argument("--inputs", type=Path, metavar="FILE.npz", help="real inputs for --validate")
    convert.add_argument("--keep-failed", action="store_true",
                         help="write DST even when validation fails (exit 1 all the same)")
    convert.add_argument("--force", action="store_true", help="replace DST if it exists")
    convert.add_argument("--calibrate", type=_calibration_data, metavar="DATA.npz|random",
                         help="keep float32 the nodes calibration data shows out of the target's range or over"
                              " tolerance: DATA.npz holds signature inputs as --inputs takes; random: random inputs")
    _metric_option(convert)
    _calibration_options(convert)
    _tuning_options(convert, inputs=False)


def build_parser() -> argparse.ArgumentParser:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="amp-rewrite", description=DESCRIPTION, epilog=EPILOG, formatter_class=formatter)
    parser.add_argument("--version", action="version", version=f"amp-rewrite {_version()}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    _add_convert(commands)

    calibrate = _add_command(commands, "calibrate")
    _common_options(calibrate)
    calibrate.add_argument("--inputs", type=Path, metavar="DATA.npz",
                           help="calibration inputs (default: random inputs from the signatures; real data is better)")
    calibrate.add_argument("--out", type=Path, required=True, metavar="FILE.yaml", help="the overlay to write")
    _metric_option(calibrate)
    _calibration_options(calibrate)

    inspect = _add_command(commands, "inspect")
    _common_options(inspect)
    _weights_option(inspect)
    _tuning_options(inspect)
    inspect.add_argument("--all", action="store_true",
                         help="also list TensorFlow's plumbing: save/restore functions, signature wrappers, the"
                              " loader's main graph")

    explain = _add_command(commands, "explain")
    _common_options(explain)
    _tuning_options(explain)
    explain.add_argument("node", help="node name (node names: `amp-rewrite dump SRC DIR`, before/*.pbtxt)")
    explain.add_argument("--function", help="the library function the node is in (default: search all)")

    dump = _add_command(commands, "dump")
    _common_options(dump)
    _weights_option(dump)
    _tuning_options(dump)
    dump.add_argument("dir", type=Path, help="output directory (outside SRC)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command's boundary: an error is one line and exit 2. Signals are the caller's
    (``amp_rewrite.cli``: the console script handles them, a program in process gets
    ``KeyboardInterrupt``)."""
    args = build_parser().parse_args(_with_calibrate_value(sys.argv[1:] if argv is None else argv))
    try:
        return COMMANDS[args.command](args)
    except (AmpRewriteError, OSError) as error:
        if args.debug:
            raise
        message = str(error) if isinstance(error, AmpRewriteError) else f"{error.filename or ''}: {error.strerror}"
        print(f"amp-rewrite: error: {message}", file=sys.stderr)
        return EXIT_USAGE


def _say(args: argparse.Namespace, *lines: str) -> None:
    if lines and not args.quiet:
        print(*lines, sep="\n")


class _Steps:
    """One line per step on stderr ("loading …", then the time it took), so a long run shows
    where it is; silent with --quiet or when stderr is not a terminal."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.on = not args.quiet and sys.stderr.isatty()
        self.started: float | None = None

    def __call__(self, text: str) -> None:
        self.done()
        if self.on:
            print(f"amp-rewrite: {text} …", end="", file=sys.stderr, flush=True)
            self.started = time.monotonic()

    def done(self) -> None:
        if self.on and self.started is not None:
            print(f" {time.monotonic() - self.started:.1f} s", file=sys.stderr, flush=True)
        self.started = None


def _rewrite(args: argparse.Namespace, steps: _Steps) -> tuple[Model, RewriteResult, OpLists]:
    steps("loading TensorFlow")
    from amp_rewrite.calibration.savedmodel import effective_lists, read_model, rewrite_model

    untuned = [flag for flag, value in (("--batch-sizes", "batch_sizes"), ("--tune-budget", "tune_budget"),
                                        ("--tune-cache", "tune_cache")) if getattr(args, value, None) is not None]
    args.tune = getattr(args, "tune", None)
    if untuned and not args.tune:
        raise AmpRewriteError(f"{', '.join(untuned)}: timing options; add --tune speed, or drop them")
    if args.tune:
        from amp_rewrite.calibration.speed import check_target
        from amp_rewrite.core.target import lookup_target

        check_target(lookup_target(args.target, quantized=True))
    steps(f"reading {args.src}")
    lists = effective_lists(args.target, args.lists, args.keep)
    model = read_model(args.src, args.fetch, args.tag_set, constants_in_file=_constants_in_file(args))
    _check_not_mixed_otherwise(args, model, lists)
    float8 = _float8_calibration(args, model, lists)
    steps("rewriting")
    try:
        result = rewrite_model(model, target=args.target, lists=lists, cross_function=args.cross_function, **float8)
    except AmpRewriteError as error:
        raise type(error)(f"{args.src}: {error}") from None  # name the file the graph came from
    steps.done()
    if args.command != "convert":  # convert tunes after calibrating
        _, result, lists = _tune(args, model, lists, result, steps)
    _say(args, *_model_lines(model))
    return model, result, lists


def _constants_in_file(args: argparse.Namespace) -> bool:
    """Whether a frozen graph's large constants may stay in its file (``calibration/frozen.py``):
    the run rewrites the graph and writes it as a .pb, or reports on it; validating,
    calibrating, timing, a dump and a .pbtxt need the values themselves."""
    if args.command not in ("convert", "inspect", "explain"):
        return False
    needs_values = ("validate", "inputs", "calibrate", "tune", "dump")
    return not any(getattr(args, name, None) for name in needs_values) and (
        args.command != "convert" or args.dst.suffix != ".pbtxt")


def _tune(args: argparse.Namespace, model: Model, lists: OpLists, result: RewriteResult,
          steps: _Steps) -> tuple[Any, RewriteResult, OpLists]:
    """``--tune speed``: the converted ops timed here; ``result`` with those that do not pay
    kept float32, and the lists that make it (calibration/speed.py); without it, as they
    were. Cache problems are one warning line each."""
    if not args.tune:
        return None, result, lists
    from amp_rewrite.calibration import speed
    from amp_rewrite.core.target import lookup_target

    target = lookup_target(args.target, quantized=True)
    feeds, notes = speed.batch_feeds(model, args.inputs, args.batch_sizes)
    _say(args, *[f"Note: {note}" for note in notes])
    cache = speed.open_cache(speed.DEFAULT if args.tune_cache is None else args.tune_cache, target)
    if cache.problem:
        print(f"amp-rewrite: warning: {cache.problem}", file=sys.stderr)
    steps(f"timing ops at batch size(s) {', '.join(map(str, feeds))}")
    tuning = speed.tune_model(model, feeds, target=target, lists=lists, cross_function=args.cross_function,
                              budget_s=args.tune_budget or speed.DEFAULT_BUDGET_S, cache=cache, base=result,
                              weights_low=not getattr(args, "float32_weights", False))
    steps.done()
    problem = speed.save_cache(cache)
    if problem:
        print(f"amp-rewrite: warning: {problem}", file=sys.stderr)
    _say(args, tuning.summary(), *[f"Note: {note}" for note in tuning.notes])
    return tuning, tuning.result, tuning.lists


def _check_overlay(args: argparse.Namespace, model: Model, lists: OpLists, found: Any) -> None:
    """The --lists and --keep entries (keep_nodes, and float8's amax and lossy) that name
    nothing in the model: all of them is an error (the overlay is another model's, or an
    export whose names differ), some a warning with the count."""
    from amp_rewrite.core import float8

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


def _every_node(graph_def: Any) -> Iterator[Any]:
    """The NodeDefs of the main graph and of every library function, read from the protos (no body is built)."""
    yield from graph_def.node
    for function in graph_def.library.function:
        yield from function.node_def


def already_low(graph_def: Any, lists: OpLists) -> dict[str, list[str]]:
    """The allow-list nodes (matmuls, convolutions: what a rewrite converts first) that compute
    in float16 or bfloat16 already, by dtype name: a model converted before, or built under a
    Keras mixed policy. The rewrite paints float32 only, so it leaves them as they are."""
    from tensorflow.core.framework import types_pb2

    low = {types_pb2.DT_HALF: "float16", types_pb2.DT_BFLOAT16: "bfloat16"}
    found = collections.defaultdict(list)
    for node in _every_node(graph_def):
        dtypes = {low[value.type] for value in node.attr.values() if value.type in low} if node.op in lists.allow else ()
        for dtype in dtypes:
            found[dtype].append(node.name)
    return dict(found)


def _check_not_mixed_otherwise(args: argparse.Namespace, model: Model, lists: OpLists) -> None:
    """A model already mixed in another low precision than the target's is refused: the rewrite
    would paint its float32 rest and leave the rest as it is, a model in both dtypes, and
    converting those nodes again would start from weights already rounded to the other one."""
    from amp_rewrite.core.target import lookup_target

    painted = lookup_target(args.target, quantized=True).colouring
    other = {dtype: names for dtype, names in already_low(model.graph_def, lists).items() if dtype != painted}
    if other:
        dtype, names = next(iter(other.items()))
        raise ModelError(f"{args.src} is already mixed precision: {len(names)} node(s) compute in {dtype} (e.g."
                         f" {names[0]!r}), which --target {args.target} would leave {dtype}; convert the float32"
                         f" original with --target {args.target}, or pass --target {dtype}")


def _close_to_entry(entry: str, graph_def: Any) -> str:
    """", did you mean 'a'?" for an overlay entry that is a plain node name (not a regex)."""
    name = entry.rpartition("::")[2]
    if re.escape(name) != name:
        return ""
    close = did_you_mean(name, (node.name for node in _every_node(graph_def))).strip()
    return f", {close}" if close else ""


def _float8_calibration(args: argparse.Namespace, model: Model, lists: OpLists) -> dict[str, Any]:
    """Target float8: ``amax`` and ``lossy`` for the rewrite, from the --lists overlay (as
    ``calibrate --target float8`` writes it), or none yet in a run that calibrates (the
    float16 path until calibration measures them). Other targets: nothing. Checks the
    overlay's entries against the model first (``_check_overlay``); an overlay whose amax
    names nothing in the model gives no amax."""
    from amp_rewrite.core import float8
    from amp_rewrite.core.lists import load_float8

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


def _model_lines(model: Model) -> list[str]:
    """What the run took as the model: the MetaGraphDef converted and those left alone, or a
    GraphDef's outputs when no --fetch named them."""
    from amp_rewrite.calibration.savedmodel import tag_set_text

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


def _headline(model: Model, report: Report, lists: OpLists, kinds: dict[str, str]) -> str:
    """The model's total (a SavedModel's own functions, without ``kinds``, its plumbing), or
    "already bfloat16" where the model computes in the target's dtype and nothing is left to convert."""
    items = [item for item in report.items if item.function not in kinds]
    low = already_low(model.graph_def, lists).get(report.painted, [])
    if low and not any(item.vertices_converted for item in items):
        return f"Model: already {report.painted}: 0 nodes to convert ({len(low)} node(s) compute in {report.painted})"
    return _model_headline(report, items) if kinds else report.summary()


def _summary_lines(model: Model, report: Report, lists: OpLists) -> list[str]:
    """One total for the model (the SavedModel's own functions, or the GraphDef), "already
    bfloat16" where it has nothing left to convert, and why its nodes stayed float32; then a
    SavedModel's library total, TensorFlow's plumbing included, as grappler's log counts it."""
    from amp_rewrite.calibration.savedmodel import plumbing_kinds

    kinds = plumbing_kinds(model)
    lines = [_headline(model, report, lists, kinds)]
    kept = collections.Counter(d.rule for d in report.decisions if not d.converted and d.function not in kinds)
    if kept:
        where = " (model)" if kinds else ""
        lines.append(f"Stayed float32{where}: " + ", ".join(f"{rule} {count}" for rule, count in kept.most_common()))
    if kinds:
        lines.append(f"Library total, TensorFlow's plumbing included (as grappler's log counts): converted"
                     f" {report.vertices_converted}/{report.nodes_before} nodes")
    return lines


def cmd_convert(args: argparse.Namespace) -> int:
    staging.check_destination(args.src, args.dst, args.force)
    if args.dump:
        staging.check_outside(args.src, args.dump, "dump directory")
    steps = _Steps(args)
    model, result, lists = _rewrite(args, steps)
    from amp_rewrite.calibration.savedmodel import write_model

    if args.calibrate is not None:
        calibration = _calibrate(args, model, lists, args.calibrate)
        result, lists = calibration.result, calibration.lists
        if calibration.compared and not calibration.ok and not args.keep_failed:
            print(f"amp-rewrite: calibration left outputs over tolerance; nothing was written to {args.dst}"
                  " (--keep-failed writes it anyway)", file=sys.stderr)
            return EXIT_VALIDATION
    tuning, result, lists = _tune(args, model, lists, result, steps)
    written_model, result, stored = _store_weights(args, model, result)
    feeds = None
    if args.validate or args.inputs:
        from amp_rewrite.calibration import validate

        if model.kind == "graphdef" and not model.compared_outputs:
            raise AmpRewriteError(f"{model.path}: --validate needs outputs to compare and the graph has none;"
                                  " name them with --fetch NAME[:PORT]")
        feeds, notes = validate.plan_feeds(model, args.inputs, args.validate or 1)
        validate.check_fits(model, _weights_bytes(model))
        _say(args, *[f"Note: {note}" for note in notes])
    for leftover in staging.remove_leftovers(args.dst):
        _say(args, f"Removed {leftover}, left by an interrupted run")
    if model.is_tf_keras:
        print("amp-rewrite: warning: this SavedModel was saved by tf_keras; tf_keras.models.load_model rebuilds its"
              " float32 layers from keras_metadata.pb and ignores the rewrite; load the result with"
              " tf.saved_model.load or serve it", file=sys.stderr)
    if args.dump:
        _dump(model, result, lists, args.dump, args, steps, _weights_lines(stored))
    failures: list[int] = []  # outputs over tolerance, once validated

    def accept(staged: Path) -> bool:
        steps("validating")
        failures.append(_validate(args, model, result, staged, feeds))
        steps.done()
        return not failures[0] or args.keep_failed

    steps("writing")
    with _checkpoint(args, model, stored) as variables:
        written = write_model(written_model, result.graph_def, args.dst, force=args.force,
                              accept=_speed_checked(args, tuning, steps, accept if feeds is not None else None),
                              variables=variables)
    steps.done()
    _say(args, *_summary_lines(model, result.report, lists), *_weights_lines(stored))
    if written:
        _say(args, f"Wrote {args.dst}")
    if failures and failures[0]:
        what = (f"{args.dst} was written anyway (--keep-failed)" if written
                else f"nothing was written to {args.dst} (--keep-failed writes it anyway)")
        print(f"amp-rewrite: validation failed for {failures[0]} output(s); see above; {what}", file=sys.stderr)
        return EXIT_VALIDATION
    return EXIT_OK


def _speed_checked(args: argparse.Namespace, tuning: Any, steps: _Steps,
                   accept: Callable[[Path], bool] | None) -> Callable[[Path], bool] | None:
    """``accept`` (validation), then with --tune the speed check of what it accepted."""
    if tuning is None:
        return accept

    def checked(staged: Path) -> bool:
        if accept is not None and not accept(staged):
            return False
        _check_speed(args, tuning, staged, steps)
        return True
    return checked


def _check_speed(args: argparse.Namespace, tuning: Any, staged: Path, steps: _Steps) -> None:
    """The written result against the source at each batch size, in what the budget has left."""
    from amp_rewrite.calibration import speed

    steps("timing the result against the source")
    checks = speed.check_speed(tuning, staged)
    steps.done()
    lines = speed.speed_lines(tuning, checks)
    _say(args, lines[0])
    for line in lines[1:]:  # slower than the source: said even with --quiet
        print(f"amp-rewrite: warning: {line}", file=sys.stderr)


def _weights_bytes(model: Model) -> int:
    """The source's weights, in bytes: a frozen graph's, or a SavedModel's checkpoint shards."""
    if model.kind == "graphdef":
        return model.graph_def.ByteSize() + (model.left_in_file.size if model.left_in_file is not None else 0)
    return sum(path.stat().st_size for path in (model.path / "variables").glob("variables.data-*"))


PROGRESS_BYTES = 1 << 30  # a checkpoint this large shows a progress bar over the bytes written


@contextlib.contextmanager
def _checkpoint(args: argparse.Namespace, model: Model, stored: StoredWeights | None) -> Iterator[Any]:
    """The checkpoint ``convert`` writes in place of the source's (None: the source's is copied),
    with a progress bar over its bytes on a terminal for a model of a GB or more, unless --quiet."""
    if model.kind != "savedmodel" or stored is None or not stored.low_keys:
        yield None
        return
    from tqdm import tqdm

    from amp_rewrite.cli.weights import LowCheckpoint

    checkpoint = LowCheckpoint(model, stored)
    shown = not args.quiet and sys.stderr.isatty() and checkpoint.size >= PROGRESS_BYTES
    if shown:
        print(file=sys.stderr)  # the bar below the open "writing …" line
    with tqdm(total=checkpoint.size, unit="B", unit_scale=True, desc="amp-rewrite: writing the checkpoint",
              disable=not shown, file=sys.stderr) as bar:
        checkpoint.progress = bar.update
        yield checkpoint


def _store_weights(args: argparse.Namespace, model: Model,
                   result: RewriteResult) -> tuple[Model, RewriteResult, StoredWeights | None]:
    """The weights in the target dtype, unless --float32-weights: the model to write (its
    object graph's variable dtypes), the graph, and what was stored (None: nothing changed)."""
    import dataclasses

    from amp_rewrite.cli import weights

    if args.float32_weights:
        weights.check_checkpoint(model)
        return model, result, None

    stored = weights.stored_weights(model, result, args.target)
    return weights.with_weights(model, stored), dataclasses.replace(result, graph_def=stored.graph_def), stored


def _weights_lines(stored: StoredWeights | None, every: bool = False) -> list[str]:
    """What happened to the weights; ``every`` float32 one named (inspect --all), else the first few."""
    return ["Weights: kept float32 (--float32-weights)"] if stored is None else stored.summary(every=every)


def _calibrate(args: argparse.Namespace, model: Model, lists: OpLists, data: Path | None) -> Any:
    """Calibration of ``model`` on ``data`` (None or RANDOM_INPUTS: random inputs), each round printed."""
    from amp_rewrite.calibration import calibrate, statistics, validate
    from amp_rewrite.core.target import lookup_target

    random = data is None or data == RANDOM_INPUTS
    if model.kind == "graphdef" and not model.compared_outputs:
        raise AmpRewriteError(f"{model.path}: calibration needs outputs to compare and the graph has none;"
                              " name them with --fetch NAME[:PORT]")
    feeds, notes = validate.plan_feeds(model, None if random else data, calibrate.RANDOM_FEEDS)
    _say(args, *[f"Note: {note}" for note in notes])
    if random:
        print(f"amp-rewrite: warning: calibrating on random inputs ({calibrate.RANDOM_FEEDS} batches, N(0,1) floats,"
              " ids 0-9); real data is better: pass an .npz of the signature inputs", file=sys.stderr)
    thresholds = calibrate.Thresholds.for_target(lookup_target(args.target, quantized=True), args.max_magnitude,
                                                 args.small_share)
    result = calibrate.run_calibration(model, feeds, calibrate.Options(
        target=lookup_target(args.target, quantized=True), lists=lists, cross_function=args.cross_function,
        max_rounds=args.max_rounds, thresholds=thresholds, metric=args.metric,
        source=statistics.RANDOM_INPUTS if random else str(data), say=lambda line: _say(args, line)))
    kept = len(result.kept)
    _say(args, f"Calibration: {kept} node(s) kept float32 ({result.range_kept} by range rules,"
               f" {kept - result.range_kept} by repair), {result.validation_runs} validation run(s)")
    if result.float8 is not None:
        _say(args, f"Calibration: {result.result.report.float8_matmuls} matmul(s) on float8_e4m3fn operands,"
                   f" {len(result.float8.lossy)} kept float16 as too lossy in float8")
    if not result.compared:
        print(f"amp-rewrite: warning: calibration had nothing to compare: no output of {model.path} is a number, so no"
              " run could check the rewrite; its decisions are the range rules' alone", file=sys.stderr)
    if kept and not calibrate.converted_nodes(result.result):
        print(f"amp-rewrite: warning: nothing converted: calibration keeps every node the lists convert float32, so"
              f" the rewrite runs as the float32 model does; target {args.target} does not suit this model as"
              " calibrated", file=sys.stderr)
    return result


def cmd_calibrate(args: argparse.Namespace) -> int:
    staging.check_outside(args.src, args.out, "overlay file")
    steps = _Steps(args)
    model, _, lists = _rewrite(args, steps)
    calibration = _calibrate(args, model, lists, args.inputs)
    import yaml

    base = yaml.safe_load(args.lists.read_text(encoding="utf-8")) if args.lists else None
    if args.keep:
        base = dict(base or {})
        base["keep_nodes"] = list(base.get("keep_nodes") or []) + list(args.keep)
    staging.write_text_atomically(args.out, calibration.overlay(base))
    _say(args, f"Wrote {args.out}: use it with amp-rewrite convert {args.src} DST --target {args.target}"
               f" --lists {args.out}")
    return EXIT_OK if calibration.ok or not calibration.compared else EXIT_VALIDATION


def _validate(args: argparse.Namespace, model: Model, result: RewriteResult, staged: Path, feeds: Any) -> int:
    """Compare the source with the staged copy and print each output's error; returns how
    many outputs are over tolerance."""
    from amp_rewrite.calibration import validate
    from amp_rewrite.core.target import lookup_target

    random = args.inputs is None
    if model.kind == "savedmodel":
        errors = validate.validate_saved_models(model, staged, feeds, random, args.metric)
    else:
        errors = validate.validate_graph_defs(model, result.graph_def, feeds, random, args.metric)
    target = lookup_target(args.target, quantized=True)
    runs = 1 if args.inputs else args.validate
    failed = [e for e in errors if not e.ok(target)]
    inputs = (f"{runs} run(s) of random inputs, which are not the model's data: a pass or a failure here says"
              " little about real inputs (pass them with --inputs FILE.npz)" if random else f"{args.inputs}")
    _say(args, f"Validation ({inputs}; {args.metric}, tolerance {target.tolerance:g}):")
    _say(args, *[f"  {'FAIL' if not e.ok(target) else 'ok  '} {e.signature}/{e.output}: "
                 f"max abs {e.max_abs:.3g}, {validate.shown(e.metric)} {e.error:.3g}" for e in errors])
    return len(failed)


def _dump(model: Model, result: RewriteResult, lists: OpLists, directory: Path, args: argparse.Namespace,
          steps: _Steps, notes: Sequence[str] = ()) -> None:
    from amp_rewrite.cli.dump import write_dump
    from amp_rewrite.calibration.savedmodel import plumbing_kinds

    steps(f"writing the dump to {directory}")
    existed = directory.exists()  # an interrupt removes a new one; an earlier dump there cannot be put back
    undo = (lambda: None) if existed else (lambda: shutil.rmtree(directory, ignore_errors=True))
    with staging.undone_if_interrupted(undo, leaves=f"{directory} holds part of a dump" if existed else ""):
        write_dump(directory, model.graph_def, result, lists, title=f"{model.path.name} → {args.target}",
                   plumbing=plumbing_kinds(model), notes=notes)
    steps.done()
    _say(args, f"Report: {directory.resolve() / 'report.html'}")


def cmd_dump(args: argparse.Namespace) -> int:
    staging.check_outside(args.src, args.dir, "dump directory")
    steps = _Steps(args)
    model, result, lists = _rewrite(args, steps)
    _, result, stored = _store_weights(args, model, result)
    _say(args, *_summary_lines(model, result.report, lists), *_weights_lines(stored))
    _dump(model, result, lists, args.dir, args, steps, _weights_lines(stored))
    return EXIT_OK


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


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


def _plumbing_line(report: Report, kinds: dict[str, str]) -> str:
    """The plumbing collapsed to one line: how many items of each kind, their nodes, and any conversion."""
    counts: dict[str, list[int]] = {}
    for item in report.items:
        kind = kinds.get(item.function)
        if kind:
            counts.setdefault(kind, [0, 0, 0])
            counts[kind][0] += 1
            counts[kind][1] += item.nodes_before
            counts[kind][2] += item.vertices_converted
    parts = [f"{kind} {count} ({nodes} nodes, {converted} converted)" for kind, (count, nodes, converted)
             in counts.items()]
    return "TensorFlow's plumbing, not the model (--all lists it): " + "; ".join(parts)


def cmd_inspect(args: argparse.Namespace) -> int:
    from amp_rewrite.calibration.savedmodel import plumbing_kinds
    from amp_rewrite.core.target import lookup_target

    model, result, lists = _rewrite(args, _Steps(args))
    _, result, stored = _store_weights(args, model, result)
    report = result.report
    kinds = plumbing_kinds(model)
    model_items = [item for item in report.items if item.function not in kinds]
    if args.quiet:  # the headline only
        print(_headline(model, report, lists, kinds))
        return EXIT_OK
    by_item = collections.defaultdict(collections.Counter)
    for d in report.decisions:
        if not d.converted:
            by_item[d.function][d.rule] += 1
    shown = report.items if args.all else model_items
    rows = [
        [item.function or MAIN_GRAPH_LABEL, item.nodes_before, item.vertices_converted, item.casts_to_target,
         ", ".join(f"{rule} {n}" for rule, n in by_item[item.function].most_common(3)),
         *([kinds.get(item.function, "model")] if args.all else [])]
        for item in shown
    ]
    header = ["function", "nodes", "converted", f"casts to {report.painted}", "kept float32 (top reasons)"]
    print(_table(rows, header + (["role"] if args.all else [])))
    if kinds:
        print(_headline(model, report, lists, kinds))
        if not args.all:
            print(_plumbing_line(report, kinds))
    print(report.summary())
    for line in _weights_lines(stored, every=args.all):
        print(line)
    if lookup_target(args.target, quantized=True).device_type == "GPU":  # Tensor Cores
        hints = tensor_core_hints(model, result)
        if hints:
            print("\nTensor Core hints (converted ops with static dims that are not multiples of 8):")
            print("\n".join(f"  {hint}" for hint in hints))
    return EXIT_OK


def _static_shapes(graph_def: Any, function: Any = None) -> dict[str, list[list[int]]]:
    """Output shapes per node from ``_output_shapes`` attrs (and, in a function, its arg_attr)."""
    shapes = {}
    for node in graph_def.node:
        if node.op == "Placeholder" and "shape" in node.attr:
            shapes[node.name] = [[d.size for d in node.attr["shape"].shape.dim]]
        elif node.op == "Const":
            shapes[node.name] = [[d.size for d in node.attr["value"].tensor.tensor_shape.dim]]
        if "_output_shapes" in node.attr:
            shapes[node.name] = [[d.size for d in s.dim] if not s.unknown_rank else []
                                 for s in node.attr["_output_shapes"].list.shape]
    if function is not None:
        for index, arg in enumerate(function.signature.input_arg):
            attrs = function.arg_attr[index].attr if index in function.arg_attr else {}
            if "_output_shapes" in attrs:
                shapes[arg.name] = [[d.size for d in s.dim] for s in attrs["_output_shapes"].list.shape]
    return shapes


def tensor_core_hints(model: Model, result: RewriteResult) -> list[str]:
    """Converted matmul/conv ops whose static input dims are not multiples of 8."""
    from amp_rewrite.core.program import MAIN_GRAPH

    converted = {(d.function, d.node) for d in result.report.decisions if d.converted}
    program = result.program
    hints = []
    for item in sorted({function for function, _ in converted}):
        graph_def = program.item(item)
        shapes = _static_shapes(graph_def, None if item == MAIN_GRAPH else program.library[item])
        for node in graph_def.node:
            if node.op not in TENSOR_CORE_OPS or (item, node.name) not in converted:
                continue
            dims = []
            for tensor in node.input[:2]:
                source = _through_casts(graph_def, tensor)
                producer, _, port = source.partition(":")
                output_shapes = shapes.get(producer, [])
                index = int(port) if port.isdigit() else 0
                if index < len(output_shapes) and output_shapes[index]:
                    dims.append(output_shapes[index][-1])  # channels / features / inner dim
            odd = [d for d in dims if d > 0 and d % 8]
            if odd:
                where = f"{item}: " if item else ""
                hints.append(f"{where}{node.name} ({node.op}): dims {odd} are not multiples of 8")
    return hints


def _through_casts(graph_def: Any, tensor: str) -> str:
    """The tensor behind the rewrite's own casts that ``tensor`` names (itself where it is none)."""
    from amp_rewrite.core.casts import is_amp_cast
    from amp_rewrite.core.graph_io import parse_tensor_name

    nodes = {n.name: n for n in graph_def.node}
    name = parse_tensor_name(tensor).node
    while name in nodes and is_amp_cast(nodes[name]):
        tensor = nodes[name].input[0]
        name = parse_tensor_name(tensor).node
    return tensor


MAIN_GRAPH_LABEL = "(main graph)"  # how tables name the main graph; --function accepts it too
HOW_TO_LIST_NODES = "node names are in the before/*.pbtxt files `amp-rewrite dump SRC DIR` writes"


def cmd_explain(args: argparse.Namespace) -> int:
    from amp_rewrite.core.program import MAIN_GRAPH
    from amp_rewrite.core.rules import Rule

    _, result, _ = _rewrite(args, _Steps(args))
    function = MAIN_GRAPH if args.function == MAIN_GRAPH_LABEL else args.function
    program = result.program
    if function is not None and function not in program.names:
        close = did_you_mean(args.function, [MAIN_GRAPH_LABEL, *filter(None, program.names)])
        raise ModelError(f"no function '{args.function}' in the graph; {close}`amp-rewrite inspect` lists them")
    items = [function] if function is not None else list(program.names)
    found = [(item, node) for item in items for node in program.item(item).node if node.name == args.node]
    where = f" in function '{args.function}'" if function is not None else ""
    if not found:
        names = (node.name for item in items for node in program.item(item).node)
        raise ModelError(f"no node '{args.node}'{where}; {did_you_mean(args.node, names)}{HOW_TO_LIST_NODES}")
    if len({item for item, _ in found}) > 1:
        names = ", ".join(item or MAIN_GRAPH_LABEL for item, _ in found)
        raise ModelError(f"node '{args.node}' exists in several functions ({names}); pick one with --function")
    item, node = found[0]
    matches = [d for d in result.report.decisions if d.node == args.node and d.function == item]
    in_item = f" in function '{item}'" if item else ""
    if not matches:
        print(f"{node.name} ({node.op}){in_item}: no float type attribute, so there is nothing to decide; it runs"
              " as it was")
    for d in matches:
        print(f"{d.node} ({d.op}){in_item}, attribute {d.attr}: {d.before} -> {d.after}")
        print(f"  rule: {d.rule}")
        print(f"  why:  {d.reason}")
        if d.rule == Rule.DENY_PROPAGATION.value and d.source:
            path = _deny_path(result, d.function, d.source, d.node)
            if path:
                print(f"  path: {' -> '.join(path)}")
    return EXIT_OK


def _deny_path(result: RewriteResult, function: str, source: str, node: str) -> list[str]:
    """The shortest data path from the deny op that decided to the node, in the rewritten item."""
    import networkx as nx

    from amp_rewrite.core.casts import is_amp_cast
    from amp_rewrite.core.graph_io import to_networkx

    graph = to_networkx(result.program.item(function))
    try:
        path = nx.shortest_path(graph, source, node)
    except (nx.NetworkXNoPath, nx.NodeNotFound):
        return []
    return [name for name in path if not is_amp_cast(graph.nodes[name]["node_def"])]


COMMANDS = {"convert": cmd_convert, "calibrate": cmd_calibrate, "inspect": cmd_inspect, "explain": cmd_explain,
            "dump": cmd_dump}


if __name__ == "__main__":
    sys.exit(main())
