"""``amp-rewrite explain``: why NODE has its dtype after the rewrite, the rule and its reason
(and for a node kept by a deny op downstream, the path from it); with ``--diverge``, where
the conversion first diverges from float32 on inputs (``calibration/diverge.py``); writes nothing.
"""
from __future__ import annotations

import argparse

import networkx as nx
from tensorflow.core.framework import node_def_pb2

from amp_rewrite.cli.options import EXIT_OK, Progress
from amp_rewrite.cli.steps import MAIN_GRAPH_LABEL, read_and_rewrite, run_divergence
from amp_rewrite.core.casts import is_amp_cast
from amp_rewrite.core.graph_io import to_networkx
from amp_rewrite.core.program import MAIN_GRAPH, Program
from amp_rewrite.core.rewrite import RewriteResult
from amp_rewrite.core.rules import Rule
from amp_rewrite.errors import AmpRewriteError, ModelError, did_you_mean

HOW_TO_LIST_NODES = "node names are in the before/*.pbtxt files `amp-rewrite dump SRC DIR` writes"


def run(args: argparse.Namespace, progress: Progress) -> int:
    """NODE's decisions (``explain_node``), and with --diverge where the conversion first
    diverges from float32 (``steps.run_divergence``); exit 0 whether or not it diverges."""
    if args.node is None and not args.diverge:
        raise AmpRewriteError("name a NODE to explain, or pass --diverge to find where the conversion first diverges"
                              " from float32")
    model, result, lists = read_and_rewrite(args, progress)
    if args.node is not None:
        explain_node(args, result)
    if args.diverge:
        print(*run_divergence(args, model, result, lists, progress).lines(), sep="\n")
    return EXIT_OK


def explain_node(args: argparse.Namespace, result: RewriteResult) -> None:
    """Each float type attribute of NODE: its dtypes before and after, the rule and why."""
    item, node = _find_node(args, result.program)
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


def _find_node(args: argparse.Namespace, program: Program) -> tuple[str, node_def_pb2.NodeDef]:
    """NODE's item (``--function``'s, or the one item that has it) and its NodeDef; a name not
    there, or in several items, is one line naming the close ones."""
    function = MAIN_GRAPH if args.function == MAIN_GRAPH_LABEL else args.function
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
    return found[0]


def _deny_path(result: RewriteResult, function: str, source: str, node: str) -> list[str]:
    """The shortest data path from the deny op that decided to the node, in the rewritten item."""
    graph = to_networkx(result.program.item(function))
    try:
        path = nx.shortest_path(graph, source, node)
    except (nx.NetworkXNoPath, nx.NodeNotFound):
        return []
    return [name for name in path if not is_amp_cast(graph.nodes[name]["node_def"])]

