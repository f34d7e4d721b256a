"""``amp-rewrite dump`` (and ``convert --dump``): write what a rewrite did to a directory, for
people: GraphDefs before and after, the effective lists, Graphviz drawings, one
self-contained HTML report and a TensorBoard log.

What a dump shows is built once (``build_dump``: one ``DumpItem`` per rewritten item, with
its decisions, counts and node classes) and rendered from it: pbtxt and DOT text, the HTML
page (a Jinja2 template, ``templates/report.html.j2``, escaping every value by default)
and the TensorBoard log. Same inputs give byte-identical files (STYLE §10), so two dumps
can be diffed.
"""
from __future__ import annotations

import argparse
import collections
import functools
import hashlib
import logging
import os
import re
import shutil
import subprocess
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import jinja2
import markupsafe
import tensorflow as tf
import yaml
from google.protobuf import text_format
from tensorflow.core.framework import graph_pb2, node_def_pb2, op_def_pb2
from tensorflow.core.util import event_pb2

from amp_rewrite.calibration import staging
from amp_rewrite.calibration.savedmodel import Model, plumbing_kinds
from amp_rewrite.cli import graph_view
from amp_rewrite.cli.options import EXIT_OK, Progress, say
from amp_rewrite.cli.steps import (read_and_rewrite, run_divergence, source_line, store_weights, summary_lines,
                                  weights_lines)
from amp_rewrite.core import casts, graph_io, typegraph
from amp_rewrite.core.lists import Colour, OpLists
from amp_rewrite.core.program import MAIN_GRAPH, program_of
from amp_rewrite.core.report import Decision, ItemStats, Report, dtype_name
from amp_rewrite.core.rewrite import RewriteResult
from amp_rewrite.core.rules import Rule
from amp_rewrite.core.target import lookup_target

log = logging.getLogger(__name__)

MAIN_STEM = "main"  # file name of the main graph's item
SVG_MAX_NODES = 1500  # dot needs ~10 s for 2000 nodes of a training graph, minutes for 3000
# Name scopes drawn for a bigger item, at most this many: EfficientNetB0's model function has
# 1,445 scopes at the deepest level under 1,500 (too slow for dot) and 232 one level up (a layer each).
SCOPES_MAX = 400
DOT_TIMEOUT_S = 60
# One fixed name, no timestamp or host: a second dump overwrites the first (TensorBoard
# only needs "tfevents" in the name).
EVENTS_FILE = "events.out.tfevents.0.amp_rewrite"

# Node classes, shared by the drawing and the report: (fill colour, legend text).
CLASS_TO_STYLE = {
    "converted": ("#9be29b", "converted to the target type"),
    "deny": ("#f4a3a3", "kept float32: deny list, keep_nodes, timing, or downstream of them"),
    "infer": ("#f7e08a", "kept float32: infer op"),
    "clear": ("#d6d6d6", "kept float32: clear op"),
    "other": ("#ffffff", "not painted, or no float32 type attribute"),
    "cast": ("#a9cdf2", "Cast inserted by the pass"),
}
_DENY_RULES = frozenset({Rule.DENY_LIST.value, Rule.DENY_PROPAGATION.value, Rule.KEEP_NODES.value,
                         Rule.MEASURED_SLOWER.value})
_COLOUR_TO_CLASS = {Colour.ALLOW: "other", Colour.DENY: "deny", Colour.INFER: "infer", Colour.CLEAR: "clear"}


@dataclass(frozen=True)
class DumpItem:
    """One rewritten item as the dump shows it: the main graph or one library function body."""

    function: str  # MAIN_GRAPH or the function's name
    stem: str      # file name without extension, unique in the dump
    before: graph_pb2.GraphDef
    after: graph_pb2.GraphDef
    stats: ItemStats
    decisions: tuple[Decision, ...]  # the item's, in graph order
    node_to_decisions: Mapping[str, tuple[Decision, ...]]
    node_to_class: Mapping[str, str]  # every node of ``after`` -> its class in CLASS_TO_STYLE
    plumbing: str  # "" for the model's own items; TensorFlow's plumbing: its kind ("save/restore", ...)

    @property
    def label(self) -> str:
        return "main graph" if self.function == MAIN_GRAPH else self.function

    @property
    def kept(self) -> int:
        """Vertices kept float32."""
        return sum(1 for d in self.decisions if not d.converted)

    @property
    def kept_by_rule(self) -> str:
        """"deny-propagation 3, unlisted 1": kept vertices per rule, most first."""
        counts = collections.Counter(d.rule for d in self.decisions if not d.converted)
        return ", ".join(f"{rule} {count}" for rule, count in sorted(counts.items(), key=lambda rc: (-rc[1], rc[0])))


@dataclass(frozen=True)
class Dump:
    """Everything a dump shows, built once by ``build_dump``; every file is rendered from it."""

    title: str
    report: Report
    lists: OpLists
    graph_def: graph_pb2.GraphDef  # the rewritten graph (TensorBoard's)
    op_defs: Mapping[str, op_def_pb2.OpDef]  # the rewritten library's, for the drawings' dtypes
    items: tuple[DumpItem, ...]  # in the report's order
    notes: tuple[str, ...] = ()  # more lines for the summary (what ``convert`` did to the weights)
    source: str = ""  # what the model computed in before the rewrite (steps.source_line); the page opens with it

    @property
    def model_items(self) -> tuple[DumpItem, ...]:
        return tuple(item for item in self.items if not item.plumbing)

    @property
    def plumbing_items(self) -> tuple[DumpItem, ...]:
        return tuple(item for item in self.items if item.plumbing)


@dataclass(frozen=True)
class Drawing:
    """What drawing one item gave: whether an SVG exists, and a note for the report."""

    svg: bool
    note: str = ""


def build_dump(
    original: graph_pb2.GraphDef, result: RewriteResult, lists: OpLists, *, title: str,
    plumbing: Mapping[str, str] | None = None, notes: Sequence[str] = (), source: str = "",
) -> Dump:
    """What ``write_dump`` writes, as one value (arguments as for ``write_dump``)."""
    plumbing = dict(plumbing or {})
    painted = lookup_target(result.report.target, quantized=True).colouring  # float8 colours with float16's lists
    if lists.target != painted:
        raise ValueError(
            f"lists are for {lists.target!r} but the rewrite converted to {result.report.target!r};"
            " pass the OpLists that rewrite_graph_def used"
        )
    function_to_decisions: dict[str, list[Decision]] = collections.defaultdict(list)
    for decision in result.report.decisions:
        function_to_decisions[decision.function].append(decision)
    before_program, after_program = program_of(original), result.program
    taken: set[str] = set()
    items = []
    for stats in result.report.items:
        name = stats.function
        if name == MAIN_GRAPH:
            before, after = _without_library(original), _without_library(result.graph_def)
        else:
            before, after = before_program.item(name), after_program.item(name)
        stem = _file_stem(name, taken)
        taken.add(stem.lower())
        decisions = tuple(function_to_decisions[name])
        node_to_decisions: dict[str, list[Decision]] = collections.defaultdict(list)
        for decision in decisions:
            node_to_decisions[decision.node].append(decision)
        node_to_decisions = {node: tuple(found) for node, found in node_to_decisions.items()}
        items.append(DumpItem(name, stem, before, after, stats, decisions, node_to_decisions,
                              _node_classes(after, node_to_decisions, lists), plumbing.get(name, "")))
    return Dump(title, result.report, lists, result.graph_def, result.program.op_defs, tuple(items), tuple(notes),
                source)


def write_dump(
    directory: str | os.PathLike[str],
    original: graph_pb2.GraphDef,
    result: RewriteResult,
    lists: OpLists,
    *,
    title: str,
    plumbing: Mapping[str, str] | None = None,
    notes: Sequence[str] = (),
    source: str = "",
) -> list[Path]:
    """Write the dump of ``original`` → ``result`` into ``directory`` (created if missing).

    Files: ``before/<item>.pbtxt`` and ``after/<item>.pbtxt`` (the main graph without its
    library, each function body as a GraphDef with ``_Arg``/``_Retval`` nodes),
    ``lists.yaml``, ``graphs/<item>.dot`` (+ ``.svg`` when Graphviz's ``dot`` is on PATH and
    the item has at most ``SVG_MAX_NODES`` nodes), ``report.html`` and ``tb/`` (TensorBoard,
    the rewritten graph). Returns the written paths, in writing order. ``lists`` must be the
    lists the rewrite used (load them once, pass them to both). Files of an earlier dump
    that this one does not write are left alone.

    ``plumbing`` maps items that are TensorFlow's rather than the model's (save/restore
    functions, signature wrappers, a loader's main graph) to their kind: the report shows
    them apart, collapsed, without their decisions, and they are not drawn (their .dot is written).
    ``notes``: more lines for the report's summary (what ``convert`` did to the weights);
    ``source``: the line the report opens with, what the model computed in before.
    """
    dump = build_dump(original, result, lists, title=title, plumbing=plumbing, notes=notes, source=source)
    root = Path(directory)
    written: list[Path] = []
    for item in dump.items:
        written.append(_write(root / "before" / f"{item.stem}.pbtxt", _pbtxt(item.before)))
        written.append(_write(root / "after" / f"{item.stem}.pbtxt", _pbtxt(item.after)))
    written.append(_write(root / "lists.yaml", _lists_yaml(dump.lists)))
    stem_to_drawing: dict[str, Drawing] = {}
    dot_binary = shutil.which("dot")
    for item in dump.items:
        stem_to_drawing[item.stem] = _draw(dump, item, root / "graphs", dot_binary, written)
    stem_to_view = {item.stem: _view(dump, item, stem_to_drawing[item.stem], root / "graphs") for item in dump.model_items}
    written.append(_write(root / "report.html", render_report(dump, stem_to_drawing, stem_to_view)))
    written.append(_write_events(root / "tb" / EVENTS_FILE, dump.graph_def))
    return written


def run(args: argparse.Namespace, progress: Progress) -> int:
    """The command: SRC rewritten (weights stored as convert stores them), summed up, dumped to
    DIR; with --diverge, where the conversion first diverges (``steps.run_divergence``) too."""
    model, result, lists = read_and_rewrite(args, progress)
    divergence = run_divergence(args, model, result, lists, progress).lines() if args.diverge else []
    _, result, stored = store_weights(args, model, result)
    say(args, source_line(model), *summary_lines(model, result.report, lists), *weights_lines(stored), *divergence)
    write_model_dump(args, progress, args.dir, model, result, lists, notes=[*weights_lines(stored), *divergence])
    return EXIT_OK


def write_model_dump(args: argparse.Namespace, progress: Progress, directory: Path, model: Model,
                     result: RewriteResult, lists: OpLists, *, notes: Sequence[str] = ()) -> None:
    """``write_dump`` of a command's model, its report's path said; a directory the run made
    is removed again if it is interrupted."""
    progress(f"writing the dump to {directory}")
    existed = directory.exists()  # an interrupt removes a new one; an earlier dump there cannot be put back
    undo = (lambda: None) if existed else (lambda: shutil.rmtree(directory, ignore_errors=True))
    with staging.undone_if_interrupted(undo, leaves=f"{directory} holds part of a dump" if existed else ""):
        write_dump(directory, model.graph_def, result, lists, title=f"{model.path.name} → {args.target}",
                   plumbing=plumbing_kinds(model), notes=notes, source=source_line(model))
    progress.done()
    say(args, f"Report: {directory.resolve() / 'report.html'}")


def _draw(dump: Dump, item: DumpItem, directory: Path, dot_binary: str | None, written: list[Path]) -> Drawing:
    """Write ``item``'s DOT file and, unless it is plumbing, its SVG (by name scope when it
    has over ``SVG_MAX_NODES`` nodes); appends the paths to ``written``."""
    dot_path = _write(directory / f"{item.stem}.dot", _dot(item, dump.op_defs, dump.title, dump.report.painted))
    written.append(dot_path)
    if item.plumbing:
        return Drawing(False, f"TensorFlow's plumbing ({item.plumbing}): not drawn")
    svg_name, nodes, note = None, len(item.after.node), ""
    if len(item.after.node) > SVG_MAX_NODES:  # too big to draw node by node: draw its name scopes
        collapsed = _collapsed_dot(item, dump.title, min(SCOPES_MAX, SVG_MAX_NODES))
        if collapsed is not None:
            dot_path = _write(directory / f"{item.stem}.scopes.dot", collapsed[0])
            written.append(dot_path)
            svg_name, nodes = f"{item.stem}.svg", collapsed[1]
            note = (f"{len(item.after.node)} nodes (limit {SVG_MAX_NODES}): the SVG draws"
                    f" {collapsed[1]} name scopes; {item.stem}.dot has every node")
    svg_path, failure = _render_svg(dot_path, nodes, dot_binary, svg_name=svg_name)
    if svg_path is not None:
        written.append(svg_path)
    return Drawing(svg_path is not None, failure or note)


# --------------------------------------------------------------------------------------
# Items and files


def _without_library(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef:
    copy = graph_io.copy_graph_def(graph_def)
    copy.ClearField("library")
    return copy


def _file_stem(function: str, taken: set[str]) -> str:
    """A portable file name for an item; a hash of the real name keeps clashes apart
    (case-insensitive file systems included)."""
    if function == MAIN_GRAPH:
        return MAIN_STEM
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", function).lstrip(".")[:120] or "function"
    if stem != function or stem.lower() in taken or stem.lower() == MAIN_STEM:
        stem = f"{stem}-{hashlib.sha1(function.encode('utf-8')).hexdigest()[:8]}"
    return stem


def _write(path: Path, content: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content.encode("utf-8") if isinstance(content, str) else content)
    return path


def _pbtxt(graph_def: graph_pb2.GraphDef) -> str:
    # text_format prints map entries (attrs) sorted by key: stable and diff-friendly.
    return text_format.MessageToString(graph_def)


def _lists_yaml(lists: OpLists) -> str:
    document = {
        "target": lists.target,
        "sources": list(lists.sources),
        "force_all": lists.force_all,
        "infer_as_deny": lists.infer_as_deny,
        "keep_nodes": {entry: lists.keep_reasons.get(entry, "") for entry in lists.keep_nodes},  # an overlay's form
        **{colour.value: sorted(getattr(lists, colour.value)) for colour in Colour},
    }
    header = "# The effective op lists of this rewrite: built-in lists, overlay and environment.\n"
    return header + yaml.safe_dump(document, sort_keys=False, default_flow_style=False, width=1000)


def _write_events(path: Path, graph_def: graph_pb2.GraphDef) -> Path:
    """The events ``tf.summary.graph`` writes, with wall time 0 so the file is reproducible."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        writer.write(event_pb2.Event(wall_time=0.0, file_version="brain.Event:2").SerializeToString())
        graph = graph_def.SerializeToString(deterministic=True)
        writer.write(event_pb2.Event(wall_time=0.0, step=0, graph_def=graph).SerializeToString())
    return path


# --------------------------------------------------------------------------------------
# Graphviz


def _node_classes(
    graph_def: graph_pb2.GraphDef, node_to_decisions: Mapping[str, Sequence[Decision]], lists: OpLists
) -> dict[str, str]:
    """Each node's class in CLASS_TO_STYLE: converted if any of its vertices is, else why kept."""
    node_to_class = {}
    for node in graph_def.node:
        own = node_to_decisions.get(node.name, ())
        if casts.is_amp_cast(node):
            node_to_class[node.name] = "cast"
        elif any(d.converted for d in own):
            node_to_class[node.name] = "converted"
        elif any(d.rule in _DENY_RULES for d in own):
            node_to_class[node.name] = "deny"
        elif own:
            colour = lists.colour(own[0].op)
            node_to_class[node.name] = _COLOUR_TO_CLASS[colour] if colour else "other"
        else:
            node_to_class[node.name] = "other"
    return node_to_class


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot(item: DumpItem, op_defs: Mapping[str, op_def_pb2.OpDef], title: str, target: str) -> str:
    """The rewritten item as a DOT digraph: fill = node class, casts drawn as arrows,
    data edges labelled with their dtype, control edges dashed."""
    lines = [
        f"digraph {_dot_quote(item.stem)} {{",
        f"  graph [label={_dot_quote(f'{title} — {item.label}')}, labelloc=t, fontname=Helvetica,"
        " rankdir=TB, nodesep=0.25, ranksep=0.35];",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10, fillcolor="#ffffff"];',
        '  edge [fontname=Helvetica, fontsize=8, color="#666666", fontcolor="#444444"];',
    ]
    node_to_dtypes = {}
    for node in item.after.node:
        node_to_dtypes[node.name] = _output_dtype_names(node, op_defs)
        node_class = item.node_to_class[node.name]
        tooltip = [f"{node.name} ({node.op})"] + [
            f"{d.attr}: {d.before} → {d.after} [{d.rule}] {d.reason}" for d in item.node_to_decisions.get(node.name, ())
        ]
        shape, label = "", node.name if node.name == node.op else f"{node.name}\n{node.op}"
        if node_class == "cast":
            source, destination = (dtype_name(node.attr[a].type) for a in ("SrcT", "DstT"))
            shape, label = ", shape=cds", f"Cast\n{source} → {destination}"
        lines.append(
            f"  {_dot_quote(node.name)} [label={_dot_quote(label)},"
            f' fillcolor="{CLASS_TO_STYLE[node_class][0]}"{shape}, tooltip={_dot_quote(chr(10).join(tooltip))}];'
        )
    for edge in _edges(item, node_to_dtypes, target):
        source, destination = _dot_quote(edge.source), _dot_quote(edge.destination)
        if not edge.label:
            lines.append(f"  {source} -> {destination} [style=dashed, color=\"#aaaaaa\"];")
            continue
        low = ', color="#2e8b2e", fontcolor="#2e8b2e", penwidth=1.6' if edge.low else ""
        lines.append(f"  {source} -> {destination} [xlabel={_dot_quote(edge.label)}{low}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _output_dtype_names(node: node_def_pb2.NodeDef, op_defs: Mapping[str, op_def_pb2.OpDef]) -> list[str]:
    """The dtype of each output port, by name, as the type graph reads it."""
    return [dtype_name(dtype) for dtype in typegraph.output_dtypes(node, op_defs)]


def _edges(item: DumpItem, node_to_dtypes: Mapping[str, Sequence[str]], target: str) -> list[graph_view.ViewEdge]:
    """Every edge of the rewritten item: data edges labelled dtype[:port] (``low`` when the
    dtype is ``target``), control edges with no label."""
    edges = []
    for node in item.after.node:
        for tensor in node.input:
            ref = graph_io.parse_tensor_name(tensor, consumer=node.name)
            if ref.is_control:
                edges.append(graph_view.ViewEdge(ref.node, node.name, "", False))
                continue
            dtypes = node_to_dtypes.get(ref.node, ())
            dtype = dtypes[ref.port] if ref.port < len(dtypes) else "?"
            port = f":{ref.port}" if ref.port else ""
            edges.append(graph_view.ViewEdge(ref.node, node.name, dtype + port, dtype == target))
    return edges


def _view(dump: Dump, item: DumpItem, drawing: Drawing, directory: Path) -> graph_view.GraphView:
    """What the report draws for a model item: Graphviz's SVG inline when it made one, else
    the built-in layout (bounded), with the reason it stands in."""
    why = drawing.note
    if drawing.svg:
        view = graph_view.from_graphviz((directory / f"{item.stem}.svg").read_text(encoding="utf-8"))
        if view is not None:
            return graph_view.GraphView(view.svg, view.drawn_by, drawing.note)
        why = f"Graphviz's graphs/{item.stem}.svg is too big to embed"
    node_to_dtypes = {node.name: _output_dtype_names(node, dump.op_defs) for node in item.after.node}
    nodes = [graph_view.ViewNode(node.name, node.op, CLASS_TO_STYLE[item.node_to_class[node.name]][0],
                                 "; ".join(f"{d.attr}: {d.before} → {d.after} [{d.rule}]"
                                           for d in item.node_to_decisions.get(node.name, ())))
             for node in item.after.node]
    low = {name for name, node_class in item.node_to_class.items() if node_class in ("converted", "cast")}
    view = graph_view.built_in(nodes, _edges(item, node_to_dtypes, dump.report.painted), low,
                               f"{dump.title} — {item.label}")
    return graph_view.GraphView(view.svg, view.drawn_by, "; ".join(filter(None, (why, view.note))))


def _scope(name: str, depth: int) -> str:
    return "/".join(name.split("/")[:depth])


def _collapsed_dot(item: DumpItem, title: str, limit: int) -> tuple[str, int] | None:
    """The item drawn by name scope: nodes grouped by their first ``depth`` scope parts, at
    the deepest depth that leaves at most ``limit`` groups; a group is green when it holds a
    converted node; a function's arguments and results are one group each. (DOT text,
    number of groups), or None when even the top scopes are too many."""
    names = [node.name for node in item.after.node]
    op_to_group = {"_Arg": "(arguments)", "_Retval": "(results)"}
    fixed = {node.name: op_to_group[node.op] for node in item.after.node if node.op in op_to_group}
    for depth in range(max(name.count("/") for name in names) + 1, 0, -1):
        node_to_group = {name: fixed.get(name) or _scope(name, depth) for name in names}
        if len(set(node_to_group.values())) <= limit:
            break
    else:
        return None
    group_to_nodes: dict[str, list[str]] = collections.defaultdict(list)
    for name in names:
        group_to_nodes[node_to_group[name]].append(name)
    lines = [
        f"digraph {_dot_quote(item.stem)} {{",
        f"  graph [label={_dot_quote(f'{title} — {item.label} (by name scope)')}, labelloc=t, fontname=Helvetica,"
        # Few crossing-minimisation and network-simplex passes: EfficientNetB0's 235 scopes
        # took dot over 2 minutes with the defaults, 5 s with these.
        " rankdir=TB, nodesep=0.25, ranksep=0.35, mclimit=0.1, nslimit=1, nslimit1=1];",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10];',
        '  edge [color="#666666"];',
    ]
    for group, members in group_to_nodes.items():
        classes = {item.node_to_class.get(member, "other") for member in members}
        node_class = "converted" if "converted" in classes else "deny" if "deny" in classes else "other"
        label = members[0] if len(members) == 1 else f"{group}/\n{len(members)} nodes"
        lines.append(f"  {_dot_quote(group)} [label={_dot_quote(label)}, fillcolor=\"{CLASS_TO_STYLE[node_class][0]}\"];")
    edges = sorted({(node_to_group[graph_io.parse_tensor_name(tensor).node], node_to_group[node.name])
                    for node in item.after.node for tensor in node.input
                    if graph_io.parse_tensor_name(tensor).node in node_to_group})
    lines += [f"  {_dot_quote(a)} -> {_dot_quote(b)};" for a, b in edges if a != b]
    lines.append("}")
    return "\n".join(lines) + "\n", len(group_to_nodes)


def _render_svg(
    dot_path: Path, num_nodes: int, dot_binary: str | None, svg_name: str | None = None
) -> tuple[Path | None, str]:
    """Render ``dot_path`` next to itself (as ``svg_name``); (svg path or None, a note for the report)."""
    svg_path = dot_path.with_name(svg_name) if svg_name else dot_path.with_suffix(".svg")
    svg_path.unlink(missing_ok=True)  # never leave a stale drawing from an earlier dump
    if dot_binary is None:
        return None, "no SVG: Graphviz's dot is not installed"
    if num_nodes > SVG_MAX_NODES:
        return None, (
            f"no SVG: {num_nodes} nodes (limit {SVG_MAX_NODES}); render it with"
            f" 'sfdp -Tsvg -o {svg_path.name} {dot_path.name}' or view tb/ in TensorBoard"
        )
    try:
        completed = subprocess.run(
            [dot_binary, "-Tsvg", "-o", str(svg_path), str(dot_path)],
            capture_output=True, text=True, timeout=DOT_TIMEOUT_S, check=False,
        )
    except subprocess.TimeoutExpired:
        svg_path.unlink(missing_ok=True)
        log.warning("dot took over %d s on %s; skipped its SVG", DOT_TIMEOUT_S, dot_path)
        return None, f"no SVG: Graphviz took over {DOT_TIMEOUT_S} s"
    if completed.returncode != 0:
        svg_path.unlink(missing_ok=True)
        error = (completed.stderr.strip().splitlines() or ["no message"])[-1]
        log.warning("dot failed on %s: %s", dot_path, error)
        return None, f"no SVG: Graphviz failed: {error}"
    return svg_path, ""




# --------------------------------------------------------------------------------------
# HTML report


def _breakable(name: object) -> markupsafe.Markup:
    """Escaped, with a line-break opportunity after each scope separator (no text added)."""
    return markupsafe.Markup("/<wbr>").join(markupsafe.escape(str(name)).split("/"))


def _href(path: str) -> str:
    """A relative link to a dump file (the template escapes it)."""
    return urllib.parse.quote(path)


def _meaning(rule: str) -> str:
    """The one-line meaning of a decision's rule (``rules.Rule``)."""
    return Rule(rule).meaning


@functools.cache
def _template() -> jinja2.Template:
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("amp_rewrite.cli", "templates"),
        autoescape=True,  # every value is escaped unless the code marks it safe (_breakable)
        undefined=jinja2.StrictUndefined,  # a misspelt name fails instead of rendering as ""
        keep_trailing_newline=True,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters.update(breakable=_breakable, href=_href, meaning=_meaning)
    return environment.get_template("report.html.j2")


def render_report(dump: Dump, stem_to_drawing: Mapping[str, Drawing],
                  stem_to_view: Mapping[str, graph_view.GraphView] | None = None) -> str:
    """The page: counts, items, the model items' graphs (``stem_to_view``) and decisions;
    TensorFlow's plumbing in one collapsed table without its decisions (most of a
    SavedModel's nodes, none of its model).
    Casts are counted one way everywhere: casts to the target, as grappler's summary line."""
    model = dump.model_items
    kept = [d for item in model for d in item.decisions if not d.converted]
    plumbing_kinds = collections.Counter(item.plumbing for item in dump.plumbing_items)
    return _template().render(
        dump=dump,
        report=dump.report,
        drawings=stem_to_drawing,
        views=stem_to_view or {},
        main_stem=MAIN_STEM,
        classes=CLASS_TO_STYLE,
        sources=" + ".join(Path(source).name for source in dump.lists.sources) or "built-in",
        totals={
            "nodes": sum(item.stats.nodes_before for item in model),
            "converted": sum(item.stats.vertices_converted for item in model),
            "casts_to_target": sum(item.stats.casts_to_target for item in model),
            "kept": len(kept),
            "decisions": sum(len(item.decisions) for item in model),
        },
        kept_rules=collections.Counter(d.rule for d in kept).most_common(),
        rule_options=sorted(collections.Counter(d.rule for item in model for d in item.decisions).items()),
        plumbing_nodes=sum(item.stats.nodes_before for item in dump.plumbing_items),
        plumbing_kinds=", ".join(f"{kind} {n}" for kind, n in sorted(plumbing_kinds.items())),
    )
