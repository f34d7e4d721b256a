"""``amp-rewrite``: rewrite a SavedModel or GraphDef file to mixed precision, and look inside.

    amp-rewrite convert SRC DST [--target float16|bfloat16] [--lists OVERLAY.yaml] [--keep REGEX ...]
                                [--cross-function] [--dump DIR] [--validate N] [--inputs FILE.npz] [--force]
    amp-rewrite inspect SRC     a table per function: nodes, converted, casts, why ops stayed float32
    amp-rewrite explain SRC NODE [--function F]   why NODE has its dtype
    amp-rewrite dump SRC DIR    before/after graphs, DOT/SVG, report.html, TensorBoard log

A GraphDef file (.pb or .pbtxt) takes --fetch NAME for each output to preserve. Exit codes:
0 done, 1 validation failed, 2 usage or input error (one line on stderr; --debug shows a
traceback).
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from pathlib import Path
from typing import Sequence


from amp_rewrite._quiet import silence_native_stderr  # noqa: E402

if os.path.basename(sys.argv[0]) == "amp-rewrite":
    silence_native_stderr()

from amp_rewrite.core.errors import AmpRewriteError  # noqa: E402
from amp_rewrite.core.program import MAIN_GRAPH  # noqa: E402
from amp_rewrite.core.report import Report  # noqa: E402
from amp_rewrite.core.rewrite import RewriteResult  # noqa: E402
from amp_rewrite.core.rules import Rule  # noqa: E402
from amp_rewrite.core.lists import OpLists  # noqa: E402
from amp_rewrite.core.target import TARGETS, lookup_target  # noqa: E402
from amp_rewrite.cli.savedmodel import Model, ModelError, effective_lists, read_model, rewrite_model, write_model  # noqa: E402

EXIT_OK, EXIT_VALIDATION, EXIT_USAGE = 0, 1, 2
# Ops whose float16 speed comes from Tensor Cores, and which of their inputs' dims must be multiples of 8.
TENSOR_CORE_OPS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "Conv2D", "Conv3D", "Conv2DBackpropInput",
                   "Conv2DBackpropFilter", "DepthwiseConv2dNative", "Einsum")
PROGRESS_THRESHOLD = 20  # show a progress bar from this many functions on


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors: one line, exit 2
        self.print_usage(sys.stderr)
        print(f"amp-rewrite: error: {message}", file=sys.stderr)
        sys.exit(EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="amp-rewrite", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def common(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("src", type=Path, help="SavedModel directory, or GraphDef .pb/.pbtxt file")
        sub.add_argument("--target", choices=TARGETS, default="float16",
                         help="float16 (NVIDIA GPUs, default) or bfloat16 (CPUs with AVX512-BF16/AMX)")
        sub.add_argument("--lists", type=Path, help="overlay YAML that edits the op lists")
        sub.add_argument("--keep", action="append", default=[], metavar="REGEX",
                         help="keep nodes whose name matches REGEX in float32 (repeatable)")
        sub.add_argument("--fetch", action="append", default=[], metavar="NAME",
                         help="GraphDef only: an output node whose dtype must not change (repeatable)")
        sub.add_argument("--cross-function", action="store_true",
                         help="let low precision cross function and loop boundaries (beyond grappler)")
        sub.add_argument("--quiet", action="store_true", help="print only errors")
        sub.add_argument("--debug", action="store_true", help="show a traceback on errors")

    convert = commands.add_parser("convert", help="write a rewritten copy of SRC to DST")
    common(convert)
    convert.add_argument("dst", type=Path, help="where to write (same kind as SRC)")
    convert.add_argument("--dump", type=Path, metavar="DIR", help="also write inspection dumps to DIR")
    convert.add_argument("--validate", type=int, default=0, metavar="N",
                         help="run N random inputs through SRC and DST; exit 1 if over tolerance")
    convert.add_argument("--inputs", type=Path, metavar="FILE.npz", help="real inputs for --validate")
    convert.add_argument("--force", action="store_true", help="replace DST if it exists")

    inspect = commands.add_parser("inspect", help="what a rewrite would do, per function; writes nothing")
    common(inspect)

    explain = commands.add_parser("explain", help="why NODE has its dtype after the rewrite")
    common(explain)
    explain.add_argument("node", help="node name")
    explain.add_argument("--function", help="the library function the node is in (default: search all)")

    dump = commands.add_parser("dump", help="write before/after graphs, DOT/SVG, report.html, TensorBoard log")
    common(dump)
    dump.add_argument("dir", type=Path, help="output directory")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (AmpRewriteError, OSError) as error:
        if args.debug:
            raise
        message = str(error) if isinstance(error, AmpRewriteError) else f"{error.filename or ''}: {error.strerror}"
        print(f"amp-rewrite: error: {message}", file=sys.stderr)
        return EXIT_USAGE


def _say(args: argparse.Namespace, *lines: str) -> None:
    if not args.quiet:
        print(*lines, sep="\n")


def _rewrite(args: argparse.Namespace) -> tuple[Model, RewriteResult, OpLists]:
    lists = effective_lists(args.target, args.lists, args.keep)
    model = read_model(args.src, args.fetch)
    if args.fetch and model.kind == "savedmodel":
        raise ModelError(f"{args.src}: --fetch applies to GraphDef files; a SavedModel's outputs come from its signatures")
    count = len(model.graph_def.library.function)
    bar = None
    if count >= PROGRESS_THRESHOLD and not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        bar = tqdm(total=1, unit="item", desc="rewriting", leave=False)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    try:
        result = rewrite_model(model, target=args.target, lists=lists, cross_function=args.cross_function)
        if bar is not None:
            progress(1, 1)
    except AmpRewriteError as error:
        raise type(error)(f"{args.src}: {error}") from None  # name the file the graph came from
    finally:
        if bar is not None:
            bar.close()
    return model, result, lists


def _summary_lines(report: Report) -> list[str]:
    lines = [report.summary()]
    kept = report.kept_float32()
    if kept:
        lines.append("Stayed float32: " + ", ".join(f"{rule} {count}" for rule, count in kept.items()))
    return lines


def cmd_convert(args: argparse.Namespace) -> int:
    model, result, lists = _rewrite(args)
    given = None
    if args.inputs:
        from amp_rewrite.cli.validate import check_inputs

        given = check_inputs(model, args.inputs)  # a bad file is an error before anything is written
    destination = write_model(model, result.graph_def, args.dst, force=args.force)
    _say(args, *_summary_lines(result.report), f"Wrote {destination}")
    if args.dump:
        _dump(model, result, lists, args.dump, args)
    if args.validate or args.inputs:
        from amp_rewrite.cli import validate

        runs = max(args.validate, 1)
        if model.kind == "savedmodel":
            errors = validate.validate_saved_models(model.path, destination, runs, given)
        else:
            errors = validate.validate_graph_defs(model, result.graph_def, runs, given)
        target = lookup_target(args.target)
        failed = [e for e in errors if not e.ok(target)]
        _say(args, f"Validation ({runs} run(s); tolerance {target.tolerance:g} of each output's scale):")
        _say(args, *[f"  {'FAIL' if not e.ok(target) else 'ok  '} {e.signature}/{e.output}: "
                     f"max abs {e.max_abs:.3g}, max rel {e.max_rel:.3g}" for e in errors])
        if failed:
            print(f"amp-rewrite: validation failed for {len(failed)} output(s); see above", file=sys.stderr)
            return EXIT_VALIDATION
    return EXIT_OK


def _dump(model: Model, result: RewriteResult, lists: OpLists, directory: Path, args: argparse.Namespace) -> None:
    from amp_rewrite.cli.dump import write_dump

    write_dump(directory, model.graph_def, result, lists, title=f"{model.path.name} → {args.target}")
    _say(args, f"Report: {directory.resolve() / 'report.html'}")


def cmd_dump(args: argparse.Namespace) -> int:
    model, result, lists = _rewrite(args)
    _say(args, *_summary_lines(result.report))
    _dump(model, result, lists, args.dir, args)
    return EXIT_OK


def _table(rows: list[list[str]], header: list[str]) -> str:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


def cmd_inspect(args: argparse.Namespace) -> int:
    model, result, _ = _rewrite(args)
    report = result.report
    by_item = collections.defaultdict(collections.Counter)
    for d in report.decisions:
        if not d.converted:
            by_item[d.function][d.rule] += 1
    rows = [
        [item.function or "(main graph)", item.nodes_before, item.vertices_converted, item.casts_added,
         ", ".join(f"{rule} {n}" for rule, n in by_item[item.function].most_common(3))]
        for item in report.items
    ]
    print(_table(rows, ["function", "nodes", "converted", "casts", "kept float32 (top reasons)"]))
    print(report.summary())
    if lookup_target(args.target).device_type == "GPU":  # Tensor Cores
        hints = tensor_core_hints(model, result)
        if hints:
            print("\nTensor Core hints (converted ops with static dims that are not multiples of 8):")
            print("\n".join(f"  {hint}" for hint in hints))
    return EXIT_OK


def _static_shapes(graph_def, function=None) -> dict[str, list[list[int]]]:
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


def _through_casts(graph_def, tensor: str) -> str:
    nodes = {n.name: n for n in graph_def.node}
    name = tensor.split(":")[0].lstrip("^")
    while name in nodes and nodes[name].op == "Cast" and name.endswith("-AutoMixedPrecision"):
        tensor = nodes[name].input[0]
        name = tensor.split(":")[0]
    return tensor


def cmd_explain(args: argparse.Namespace) -> int:
    _, result, _ = _rewrite(args)
    matches = [d for d in result.report.decisions if d.node == args.node
               and (args.function is None or d.function == args.function)]
    if not matches:
        items = {d.function for d in result.report.decisions}
        where = f" in function '{args.function}'" if args.function else ""
        if args.function is not None and args.function not in items:
            raise ModelError(f"no function '{args.function}' was rewritten; `amp-rewrite inspect` lists them")
        raise ModelError(f"node '{args.node}'{where} has no float32 type attribute to decide; check the name"
                         " with `amp-rewrite inspect` or --function")
    functions_found = sorted({d.function for d in matches})
    if len(functions_found) > 1:
        raise ModelError(f"node '{args.node}' exists in several functions ({', '.join(f or '(main graph)' for f in functions_found)});"
                         " pick one with --function")
    for d in matches:
        where = f" in function '{d.function}'" if d.function else ""
        print(f"{d.node} ({d.op}){where}, attribute {d.attr}: {d.before} -> {d.after}")
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

    from amp_rewrite.core.graph_io import to_networkx

    graph = to_networkx(result.program.item(function))
    try:
        path = nx.shortest_path(graph, source, node)
    except (nx.NetworkXNoPath, nx.NodeNotFound):
        return []
    return [name for name in path if not re.search(r"-CastTo\w+-\d+-AutoMixedPrecision$", name)]


COMMANDS = {"convert": cmd_convert, "inspect": cmd_inspect, "explain": cmd_explain, "dump": cmd_dump}


if __name__ == "__main__":
    sys.exit(main())
