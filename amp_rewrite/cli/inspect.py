"""``amp-rewrite inspect``: what a rewrite of SRC would do, function by function, and where
Tensor Cores would go unused; writes nothing.
"""
from __future__ import annotations

import argparse
import collections
from typing import Any

from amp_rewrite.calibration.savedmodel import plumbing_kinds
from amp_rewrite.cli.options import EXIT_OK, Progress
from amp_rewrite.cli.steps import (
    MAIN_GRAPH_LABEL, headline, read_and_rewrite, source_line, store_weights, weights_lines,
)
from amp_rewrite.core.float8.inference import amp_source
from amp_rewrite.core.graph_io import data_inputs
from amp_rewrite.core.program import MAIN_GRAPH
from amp_rewrite.core.report import Report
from amp_rewrite.core.rewrite import RewriteResult
from amp_rewrite.core.target import lookup_target

# Ops whose float16 speed comes from Tensor Cores, and which of their inputs' dims must be multiples of 8.
# DepthwiseConv2dNative is not here: its filter's last dim is the channel multiplier, which no user can change.
TENSOR_CORE_OPS = ("MatMul", "BatchMatMul", "BatchMatMulV2", "Conv2D", "Conv3D", "Conv2DBackpropInput",
                   "Conv2DBackpropFilter", "Einsum")


def run(args: argparse.Namespace, progress: Progress) -> int:
    """What the model already computes in, a row per function (with --all, TensorFlow's
    plumbing too), the totals, the weights and the Tensor Core hints; with --quiet, the
    model's total alone."""
    model, result, lists = read_and_rewrite(args, progress)
    _, result, stored = store_weights(args, model, result)
    report = result.report
    kinds = plumbing_kinds(model)
    model_items = [item for item in report.items if item.function not in kinds]
    if args.quiet:  # the headline only
        print(headline(model, report, lists, kinds))
        return EXIT_OK
    print(source_line(model))
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
        print(headline(model, report, lists, kinds))
        if not args.all:
            print(_plumbing_line(report, kinds))
    print(report.summary())
    for line in weights_lines(stored, every=args.all):
        print(line)
    if lookup_target(args.target, quantized=True).device_type == "GPU":  # Tensor Cores
        hints = tensor_core_hints(result)
        if hints:
            print("\nTensor Core hints (converted ops with static dims that are not multiples of 8):")
            print("\n".join(f"  {hint}" for hint in hints))
    return EXIT_OK


def _table(rows: list[list[Any]], header: list[str]) -> str:
    """``rows`` under ``header``, each column as wide as its widest cell."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(header, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)


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


def tensor_core_hints(result: RewriteResult) -> list[str]:
    """Converted matmul/conv ops whose static input dims are not multiples of 8."""
    converted = {(d.function, d.node) for d in result.report.decisions if d.converted}
    program = result.program
    hints = []
    for item in sorted({function for function, _ in converted}):
        graph_def = program.item(item)
        shapes = _static_shapes(graph_def, None if item == MAIN_GRAPH else program.library[item])
        nodes = {node.name: node for node in graph_def.node}
        for node in graph_def.node:
            if node.op not in TENSOR_CORE_OPS or (item, node.name) not in converted:
                continue
            dims = []
            for tensor in data_inputs(node)[:2]:
                source = amp_source(nodes, tensor)
                output_shapes = shapes.get(source.node, [])
                if source.port < len(output_shapes) and output_shapes[source.port]:
                    dims.append(output_shapes[source.port][-1])  # channels / features / inner dim
            odd = [d for d in dims if d > 0 and d % 8]
            if odd:
                where = f"{item}: " if item else ""
                hints.append(f"{where}{node.name} ({node.op}): dims {odd} are not multiples of 8")
    return hints
