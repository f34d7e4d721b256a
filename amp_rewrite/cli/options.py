"""The ``amp-rewrite`` command line, without TensorFlow: the parser, the options several
commands share, each command's help and the exit codes; what a run prints (``say``, the
``Progress`` lines), and the paths a command writes, checked before TensorFlow loads.

Arguments are parsed before TensorFlow is imported (``--help`` and ``--version`` answer at
once, a bad destination is refused at once); every check that can fail runs before anything
is written. Each command is the module ``amp_rewrite.cli.<command>`` (``COMMANDS``), its
``run(args, progress)``; ``amp_rewrite.cli.main`` imports it when it runs.
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Sequence

from amp_rewrite.calibration import staging  # plain Python: no TensorFlow

EXIT_OK, EXIT_VALIDATION, EXIT_USAGE = 0, 1, 2
RANDOM_INPUTS = Path("<random>")  # --calibrate without a file
# core.target's TARGETS and quantized targets, spelled here so --help needs no TensorFlow
TARGET_NAMES = ("float16", "bfloat16", "float8")
CONVERT_TARGET_NAMES = (*TARGET_NAMES, "float32")  # convert --target float32: a mixed model back to float32
# calibration.validate.METRICS, the default second
METRIC_NAMES = ("max-rel", "p99-rel", "top1-agreement", "agreement", "prefix-agreement")

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
    "explain": ("Print why NODE has its dtype after the rewrite: the rule and its reason; with --diverge, where the"
                " conversion first diverges from float32 and the --keep that fixes it; writes nothing.", """\
examples:
  amp-rewrite explain my_model/ sequential_1/dense_1/MatMul
  amp-rewrite explain my_model/ dense_1/MatMul --target bfloat16 --function __inference_serve_42
  amp-rewrite explain my_model/ --diverge --inputs batch.npz   # where the conversion leaves float32

"""),
    "dump": ("Write SRC's graphs before and after the rewrite, DOT/SVG drawings, report.html and a TensorBoard"
             " log to DIR.", """\
examples:
  amp-rewrite dump my_model/ report/       # then open report/report.html
  amp-rewrite dump my_model/ report/ --diverge --inputs batch.npz   # the report says where it diverges

"""),
}
# The commands, in --help's order: each is the module amp_rewrite.cli.<command>, and its run(args, progress).
COMMANDS = tuple(COMMAND_HELP)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors: one line, exit 2
        print(f"amp-rewrite: error: {message}; see {self.prog} --help", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def _version() -> str:
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


def with_calibrate_value(argv: Sequence[str]) -> list[str]:
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


def _common_options(sub: argparse.ArgumentParser, targets: tuple[str, ...] = TARGET_NAMES) -> None:
    """SRC and the options every command takes; ``targets``: the --target choices."""
    sub.add_argument("src", type=Path, help="SavedModel directory, or GraphDef .pb/.pbtxt file")
    float32 = (", or float32 (a model already mixed, e.g. a Keras mixed_float16 export, back to float32)"
               if "float32" in targets else "")
    sub.add_argument("--target", choices=targets, default="float16",
                     help="float16 (NVIDIA GPUs, default), bfloat16 (CPUs with AVX512-BF16/AMX) or float8"
                          " (float16 with float8_e4m3fn matmuls under XLA, compute capability 8.9+; needs"
                          " calibration: convert --calibrate, or --lists from calibrate --target float8)" + float32
                          + "; a model mixed in another precision is taken back to float32 first (retargeted)")
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
    sub.add_argument("--cross-function", action="store_const", const=True, default="loops",  # core.boundaries.LOOPS
                     help="let low precision cross function boundaries too (beyond grappler; by default it"
                          " crosses loop boundaries only, so a loop carries its values, a KV cache, low)")
    sub.add_argument("--quiet", action="store_true", help="print only errors")
    sub.add_argument("--debug", action="store_true", help="show a traceback on errors")


def _metric_option(sub: argparse.ArgumentParser, *, per_output: bool = False) -> None:
    """--metric: how validation measures an output's error; with ``per_output``, also
    OUTPUT=NAME for one output (``output_metrics``)."""
    what = ("how an output's error is measured against the target's tolerance: max-rel (largest |difference| /"
            " largest |float32|, grows with the samples), p99-rel (its 99th percentile, default) or top1-agreement"
            " (share of samples whose top class changed)")
    if not per_output:
        sub.add_argument("--metric", choices=METRIC_NAMES[:3], default=METRIC_NAMES[1], help=what)
        return
    sub.add_argument("--metric", action=_MetricAction, default=METRIC_NAMES[1], metavar="[OUTPUT=]NAME",
                     help=what + ", for the floating outputs; integer outputs (ids, classes) are compared by"
                          " agreement (share equal), sequences (2 dims or more) by prefix-agreement (share equal up"
                          " to the first difference). OUTPUT=NAME sets one output's (OUTPUT or SIGNATURE/OUTPUT;"
                          " repeatable)")
    sub.set_defaults(output_metrics={})


def _metric(text: str) -> tuple[str | None, str]:
    """``NAME`` or ``OUTPUT=NAME`` -> (the output or None, the metric)."""
    output, equals, name = text.rpartition("=")
    if name not in METRIC_NAMES or (equals and not output):
        raise argparse.ArgumentTypeError(f"{text!r}: use NAME or OUTPUT=NAME, NAME one of {', '.join(METRIC_NAMES)}")
    return (output or None), name


class _MetricAction(argparse.Action):
    """--metric NAME sets ``metric``; --metric OUTPUT=NAME adds to ``output_metrics``."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        try:
            output, name = _metric(values)
        except argparse.ArgumentTypeError as error:
            raise argparse.ArgumentError(self, str(error)) from None
        if output is None:
            namespace.metric = name
        else:
            namespace.output_metrics = {**namespace.output_metrics, output: name}


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


def _diverge_options(sub: argparse.ArgumentParser) -> None:
    """--diverge and the inputs it runs on (also --tune's), for explain and dump."""
    sub.add_argument("--diverge", action="store_true",
                     help="run SRC and its conversion on the inputs and name the first node whose output is"
                          " over the target's tolerance from float32's, the path to the worst output and the"
                          " --keep that brings the outputs within tolerance (each keep checked by a run)")
    sub.add_argument("--converted", type=Path, metavar="DST",
                     help="--diverge: a conversion of SRC on disk (what convert wrote) to compare, instead of the"
                          " one the options make; the runs that check a keep rewrite SRC with the options")
    sub.add_argument("--inputs", type=Path, metavar="FILE.npz",
                     help="--diverge: the inputs to run (default: random inputs from the signatures; real data"
                          " is better); --tune: inputs of the shapes to time at (needed where dims beyond the"
                          " batch are unknown)")
    _metric_option(sub)


def _add_convert(commands: Any) -> None:
    """convert and its options."""
    convert = _add_command(commands, "convert")
    _common_options(convert, CONVERT_TARGET_NAMES)
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
    convert.add_argument("--outputs", choices=("float32",),
                         help="float32: every floating output of every signature float32 (default: each output"
                              " keeps the dtype the source's signature has, e.g. float16 for a Keras mixed_float16"
                              " export whose last layer is float16)")
    convert.add_argument("--calibrate", type=_calibration_data, metavar="DATA.npz|random",
                         help="keep float32 the nodes calibration data shows out of the target's range or over"
                              " tolerance: DATA.npz holds signature inputs as --inputs takes; random: random inputs")
    _metric_option(convert, per_output=True)
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
    _tuning_options(explain, inputs=False)
    explain.add_argument("node", nargs="?",
                         help="node name (node names: `amp-rewrite dump SRC DIR`, before/*.pbtxt); optional with"
                              " --diverge")
    explain.add_argument("--function", help="the library function the node is in (default: search all)")
    _diverge_options(explain)

    dump = _add_command(commands, "dump")
    _common_options(dump)
    _weights_option(dump)
    _tuning_options(dump, inputs=False)
    dump.add_argument("dir", type=Path, help="output directory (outside SRC)")
    _diverge_options(dump)
    return parser


def check_outputs(args: argparse.Namespace) -> None:
    """The paths the command writes, refused before TensorFlow loads: convert's destination
    (absent unless --force, not inside SRC), and a dump directory or overlay file outside SRC."""
    if args.command == "convert":
        staging.check_destination(args.src, args.dst, args.force)
        if args.dump:
            staging.check_outside(args.src, args.dump, "dump directory")
    elif args.command == "calibrate":
        staging.check_outside(args.src, args.out, "overlay file")
    elif args.command == "dump":
        staging.check_outside(args.src, args.dir, "dump directory")


def say(args: argparse.Namespace, *lines: str) -> None:
    """Print ``lines`` on stdout, unless --quiet."""
    if lines and not args.quiet:
        print(*lines, sep="\n")


class Progress:
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

