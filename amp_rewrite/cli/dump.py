"""Write what a rewrite did to a directory, for people: GraphDefs before and after, the
effective lists, Graphviz drawings, one self-contained HTML report and a TensorBoard log.

Same inputs give byte-identical files (STYLE §10), so two dumps can be diffed.
"""
from __future__ import annotations

import collections
import hashlib
import html
import logging
import os
import re
import shutil
import subprocess
import urllib.parse
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml
from google.protobuf import text_format
from tensorflow.core.framework import graph_pb2, node_def_pb2, op_def_pb2
from tensorflow.core.util import event_pb2
from tensorflow.python.lib.io import tf_record

from amp_rewrite.core import casts, graph_io, support, typegraph
from amp_rewrite.core.lists import Colour, OpLists
from amp_rewrite.core.program import MAIN_GRAPH, program_of
from amp_rewrite.core.report import Decision, Report, dtype_name
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
    "deny": ("#f4a3a3", "kept float32: deny list, keep_nodes, or downstream of either"),
    "infer": ("#f7e08a", "kept float32: infer op"),
    "clear": ("#d6d6d6", "kept float32: clear op"),
    "other": ("#ffffff", "not painted, or no float32 type attribute"),
    "cast": ("#a9cdf2", "Cast inserted by the pass"),
}
_DENY_RULES = frozenset({Rule.DENY_LIST.value, Rule.DENY_PROPAGATION.value, Rule.KEEP_NODES.value})
_COLOUR_TO_CLASS = {Colour.ALLOW: "other", Colour.DENY: "deny", Colour.INFER: "infer", Colour.CLEAR: "clear"}

@dataclass(frozen=True)
class _Item:
    """One rewritten item: the main graph or one library function body."""

    function: str  # MAIN_GRAPH or the function's name
    stem: str      # file name without extension, unique in the dump
    before: graph_pb2.GraphDef
    after: graph_pb2.GraphDef

    @property
    def label(self) -> str:
        return "main graph" if self.function == MAIN_GRAPH else self.function


def write_dump(
    directory: str | os.PathLike[str],
    original: graph_pb2.GraphDef,
    result: RewriteResult,
    lists: OpLists,
    *,
    title: str,
    plumbing: Mapping[str, str] | None = None,
    notes: Sequence[str] = (),
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
    ``notes``: more lines for the report's summary (what ``convert`` did to the weights).
    """
    plumbing = dict(plumbing or {})
    painted = lookup_target(result.report.target, quantized=True).colouring  # float8 colours with float16's lists
    if lists.target != painted:
        raise ValueError(
            f"lists are for {lists.target!r} but the rewrite converted to {result.report.target!r};"
            " pass the OpLists that rewrite_graph_def used"
        )
    root = Path(directory)
    items = _items(original, result)
    written: list[Path] = []
    for item in items:
        written.append(_write(root / "before" / f"{item.stem}.pbtxt", _pbtxt(item.before)))
        written.append(_write(root / "after" / f"{item.stem}.pbtxt", _pbtxt(item.after)))
    written.append(_write(root / "lists.yaml", _lists_yaml(lists)))

    function_to_decisions: dict[str, list[Decision]] = collections.defaultdict(list)
    for decision in result.report.decisions:
        function_to_decisions[decision.function].append(decision)
    after_op_defs = result.program.op_defs
    function_to_classes = {
        item.function: _node_classes(item.after, function_to_decisions[item.function], lists) for item in items
    }
    stem_to_note: dict[str, str] = {}
    drawn: set[str] = set()  # stems with an SVG
    dot_binary = shutil.which("dot")
    for item in items:
        dot = _dot(
            item, function_to_classes[item.function], function_to_decisions[item.function], after_op_defs,
            title, result.report.painted,
        )
        dot_path = _write(root / "graphs" / f"{item.stem}.dot", dot)
        written.append(dot_path)
        if item.function in plumbing:
            stem_to_note[item.stem] = f"TensorFlow's plumbing ({plumbing[item.function]}): not drawn"
            continue
        if len(item.after.node) > SVG_MAX_NODES:  # too big to draw node by node: draw its name scopes
            collapsed = _collapsed_dot(item, function_to_classes[item.function], title,
                                       min(SCOPES_MAX, SVG_MAX_NODES))
            if collapsed is not None:
                dot_path = _write(root / "graphs" / f"{item.stem}.scopes.dot", collapsed[0])
                written.append(dot_path)
                svg_path, note = _render_svg(dot_path, collapsed[1], dot_binary, svg_name=f"{item.stem}.svg")
                note = note or (f"{len(item.after.node)} nodes (limit {SVG_MAX_NODES}): the SVG draws"
                                f" {collapsed[1]} name scopes; {item.stem}.dot has every node")
                if svg_path is not None:
                    written.append(svg_path)
                    drawn.add(item.stem)
                stem_to_note[item.stem] = note
                continue
        svg_path, note = _render_svg(dot_path, len(item.after.node), dot_binary)
        if svg_path is not None:
            written.append(svg_path)
            drawn.add(item.stem)
        if note:
            stem_to_note[item.stem] = note

    page = _report_html(title, result.report, items, lists, function_to_classes, stem_to_note, plumbing, drawn,
                        notes)
    written.append(_write(root / "report.html", page))
    written.append(_write_events(root / "tb" / EVENTS_FILE, result.graph_def))
    return written


# --------------------------------------------------------------------------------------
# Items and files


def _items(original: graph_pb2.GraphDef, result: RewriteResult) -> list[_Item]:
    """The main graph and every function the report covers, in the report's order."""
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
        items.append(_Item(name, stem, before, after))
    return items


def _without_library(graph_def: graph_pb2.GraphDef) -> graph_pb2.GraphDef:
    copy = graph_pb2.GraphDef()
    copy.CopyFrom(graph_def)
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
    with tf_record.TFRecordWriter(str(path)) as writer:
        writer.write(event_pb2.Event(wall_time=0.0, file_version="brain.Event:2").SerializeToString())
        graph = graph_def.SerializeToString(deterministic=True)
        writer.write(event_pb2.Event(wall_time=0.0, step=0, graph_def=graph).SerializeToString())
    return path


# --------------------------------------------------------------------------------------
# Graphviz


def _node_classes(graph_def: graph_pb2.GraphDef, decisions: Sequence[Decision], lists: OpLists) -> dict[str, str]:
    """Each node's class in CLASS_TO_STYLE: converted if any of its vertices is, else why kept."""
    node_to_decisions: dict[str, list[Decision]] = collections.defaultdict(list)
    for decision in decisions:
        node_to_decisions[decision.node].append(decision)
    node_to_class = {}
    for node in graph_def.node:
        own = node_to_decisions.get(node.name, ())
        if _is_amp_cast(node):
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


def _is_amp_cast(node: node_def_pb2.NodeDef) -> bool:
    return node.op == "Cast" and node.name.endswith("-" + casts.SUFFIX)


def _dot_quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _output_dtypes(node: node_def_pb2.NodeDef, op_defs: Mapping[str, op_def_pb2.OpDef]) -> list[str]:
    """Dtype name per output port, from the op definition."""
    op_def = support.resolve_op_def(node, op_defs)
    data_inputs = sum(1 for tensor in node.input if not tensor.startswith("^"))
    outputs = typegraph.node_types(node, op_def, data_inputs).outputs
    return [dtype_name(typegraph.dtype_of(node, attr)) for attr in outputs]


def _dot(
    item: _Item,
    node_to_class: Mapping[str, str],
    decisions: Sequence[Decision],
    op_defs: Mapping[str, op_def_pb2.OpDef],
    title: str,
    target: str,
) -> str:
    """The rewritten item as a DOT digraph: fill = node class, casts drawn as arrows,
    data edges labelled with their dtype, control edges dashed."""
    node_to_decisions: dict[str, list[Decision]] = collections.defaultdict(list)
    for decision in decisions:
        node_to_decisions[decision.node].append(decision)
    lines = [
        f"digraph {_dot_quote(item.stem)} {{",
        f"  graph [label={_dot_quote(f'{title} — {item.label}')}, labelloc=t, fontname=Helvetica,"
        " rankdir=TB, nodesep=0.25, ranksep=0.35];",
        '  node [shape=box, style="rounded,filled", fontname=Helvetica, fontsize=10, fillcolor="#ffffff"];',
        '  edge [fontname=Helvetica, fontsize=8, color="#666666", fontcolor="#444444"];',
    ]
    node_to_dtypes = {}
    for node in item.after.node:
        node_to_dtypes[node.name] = _output_dtypes(node, op_defs)
        node_class = node_to_class[node.name]
        tooltip = [f"{node.name} ({node.op})"] + [
            f"{d.attr}: {d.before} → {d.after} [{d.rule}] {d.reason}" for d in node_to_decisions.get(node.name, ())
        ]
        shape, label = "", node.name if node.name == node.op else f"{node.name}\n{node.op}"
        if node_class == "cast":
            source, destination = (dtype_name(node.attr[a].type) for a in ("SrcT", "DstT"))
            shape, label = ", shape=cds", f"Cast\n{source} → {destination}"
        lines.append(
            f"  {_dot_quote(node.name)} [label={_dot_quote(label)},"
            f' fillcolor="{CLASS_TO_STYLE[node_class][0]}"{shape}, tooltip={_dot_quote(chr(10).join(tooltip))}];'
        )
    for node in item.after.node:
        for tensor in node.input:
            ref = graph_io.parse_tensor_name(tensor, consumer=node.name)
            source = _dot_quote(ref.node)
            if ref.is_control:
                lines.append(f"  {source} -> {_dot_quote(node.name)} [style=dashed, color=\"#aaaaaa\"];")
                continue
            dtypes = node_to_dtypes.get(ref.node, ())
            dtype = dtypes[ref.port] if ref.port < len(dtypes) else "?"
            port = f":{ref.port}" if ref.port else ""
            low = ', color="#2e8b2e", fontcolor="#2e8b2e", penwidth=1.6' if dtype == target else ""
            lines.append(f"  {source} -> {_dot_quote(node.name)} [xlabel={_dot_quote(dtype + port)}{low}];")
    lines.append("}")
    return "\n".join(lines) + "\n"


def _scope(name: str, depth: int) -> str:
    return "/".join(name.split("/")[:depth])


def _collapsed_dot(
    item: _Item, node_to_class: Mapping[str, str], title: str, limit: int
) -> tuple[str, int] | None:
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
        classes = {node_to_class.get(member, "other") for member in members}
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


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _breakable(name: str) -> str:
    """Escaped, with a line-break opportunity after each scope separator (no text added)."""
    return _e(name).replace("/", "/<wbr>")


def _link(href: str, text: str) -> str:
    return f'<a href="{_e(urllib.parse.quote(href))}">{_e(text)}</a>'


def _meaning(rule: str) -> str:
    """The one-line meaning of a decision's rule (``rules.Rule``)."""
    return Rule(rule).meaning


def _rule_counts(decisions: Iterable[Decision]) -> str:
    counts = collections.Counter(d.rule for d in decisions if not d.converted)
    return ", ".join(f"{rule} {count}" for rule, count in sorted(counts.items(), key=lambda rc: (-rc[1], rc[0])))


def _report_html(
    title: str,
    report: Report,
    items: Sequence[_Item],
    lists: OpLists,
    function_to_classes: Mapping[str, Mapping[str, str]],
    stem_to_note: Mapping[str, str],
    plumbing: Mapping[str, str],
    drawn: set[str],
    notes: Sequence[str] = (),
) -> str:
    """The page: counts, items and decisions of the model; TensorFlow's plumbing in one
    collapsed table without its decisions (most of a SavedModel's nodes, none of its model).
    Casts are counted one way everywhere: casts to the target, as grappler's summary line."""
    function_to_stats = {stats.function: stats for stats in report.items}
    model_items = [item for item in items if item.function not in plumbing]
    model_stats = [function_to_stats[item.function] for item in model_items]
    function_to_label = {item.function: item.label for item in items}
    function_to_decisions: dict[str, list[Decision]] = collections.defaultdict(list)
    for decision in report.decisions:
        function_to_decisions[decision.function].append(decision)
    model_decisions = [d for d in report.decisions if d.function not in plumbing]
    kept = [d for d in model_decisions if not d.converted]

    summary_lines = "\n".join(
        f"<li><b>{_e(item.label)}</b>: {_e(report.summary(item.function))}</li>" for item in model_items
    ) + "".join(f"\n<li>{_e(note)}</li>" for note in notes)
    item_rows, plumbing_rows = [], []
    for item in items:
        stats = function_to_stats[item.function]
        decisions = function_to_decisions[item.function]
        graph_links = [_link(f"graphs/{item.stem}.dot", "dot")]
        if item.stem in drawn:
            graph_links.insert(0, _link(f"graphs/{item.stem}.svg", "svg"))
        note = f'<div class="note">{_e(stem_to_note[item.stem])}</div>' if item.stem in stem_to_note else ""
        rows = plumbing_rows if item.function in plumbing else item_rows
        rows.append(
            f"<tr><td class=\"name\">{_breakable(item.label)}</td><td class=\"num\">{stats.nodes_before}</td>"
            f"<td class=\"num\">{stats.vertices_converted}</td>"
            f"<td class=\"num\">{stats.casts_to_target}</td>"
            f"<td class=\"num\">{sum(1 for d in decisions if not d.converted)}</td>"
            f"<td>{_e(_rule_counts(decisions)) or '—'}</td>"
            f"<td class=\"files\">{_link(f'before/{item.stem}.pbtxt', 'before')} · "
            f"{_link(f'after/{item.stem}.pbtxt', 'after')} · {' · '.join(graph_links)}{note}</td></tr>"
        )
    rule_rows = "\n".join(
        f'<tr><td><button type="button" class="rule" data-rule="{_e(rule)}">{_e(rule)}</button></td>'
        f'<td class="num">{count}</td><td>{_e(_meaning(rule))}</td></tr>'
        for rule, count in collections.Counter(d.rule for d in kept).most_common()
    )
    decision_rows = []
    for d in model_decisions:
        node_class = function_to_classes.get(d.function, {}).get(d.node, "other")
        function = d.function or MAIN_STEM
        decision_rows.append(
            f'<tr data-function="{_e(function)}" data-rule="{_e(d.rule)}" data-kept="{0 if d.converted else 1}">'
            f"<td>{_breakable(function_to_label.get(d.function, d.function))}</td>"
            f'<td class="name"><span class="sw {node_class}"></span>{_breakable(d.node)}</td>'
            f"<td>{_e(d.op)}</td><td>{_e(d.attr)}</td>"
            f'<td class="{"low" if d.converted else "kept"}">{_e(d.before)} → {_e(d.after)}</td>'
            f'<td title="{_e(_meaning(d.rule))}">{_e(d.rule)}</td><td>{_e(d.reason)}</td></tr>'
        )
    rule_options = "".join(
        f'<option value="{_e(rule)}">{_e(rule)} ({count})</option>'
        for rule, count in sorted(collections.Counter(d.rule for d in model_decisions).items())
    )
    function_options = "".join(
        f'<option value="{_e(item.function or MAIN_STEM)}">{_e(item.label)}</option>' for item in model_items
    )
    plumbing_kinds = collections.Counter(plumbing[item.function] for item in items if item.function in plumbing)
    plumbing_block = "" if not plumbing_rows else _PLUMBING_TEMPLATE.format(
        count=len(plumbing_rows), nodes=sum(function_to_stats[f].nodes_before for f in plumbing if f in function_to_stats),
        kinds=_e(", ".join(f"{kind} {n}" for kind, n in sorted(plumbing_kinds.items()))),
        painted=_e(report.painted), rows="\n".join(plumbing_rows))
    legend = "".join(
        f'<span class="legend"><span class="sw {name}"></span>{_e(text)}</span>'
        for name, (_, text) in CLASS_TO_STYLE.items()
    )
    swatch_css = "".join(f".sw.{name}{{background:{colour}}}" for name, (colour, _) in CLASS_TO_STYLE.items())
    return _HTML_TEMPLATE.format(
        title=_e(title),
        target=_e(report.target),
        painted=_e(report.painted),
        float8_card="" if report.painted == report.target else
        f'<div class="card"><b>{report.float8_matmuls}</b><span>matmuls on float8_e4m3fn</span></div>\n',
        lists=_e(" + ".join(Path(source).name for source in lists.sources) or "built-in"),
        nodes=sum(stats.nodes_before for stats in model_stats),
        converted=sum(stats.vertices_converted for stats in model_stats),
        casts_to_target=sum(stats.casts_to_target for stats in model_stats),
        kept=len(kept),
        plumbing=plumbing_block,
        summary=_e(report.summary()),
        summary_lines=summary_lines,
        item_rows="\n".join(item_rows),
        rule_rows=rule_rows or '<tr><td colspan="3">every float32 vertex was converted</td></tr>',
        rule_options=rule_options,
        function_options=function_options,
        legend=legend,
        swatch_css=swatch_css,
        rows="\n".join(decision_rows),
        total=len(model_decisions),
        script=_SCRIPT,
        style=_STYLE,
    )


_STYLE = """
:root{--fg:#1f2328;--muted:#59636e;--line:#d1d9e0;--bg:#f6f8fa;--accent:#0969da}
*{box-sizing:border-box}
body{margin:0;font:14px/1.45 -apple-system,BlinkMacSystemFont,"Segoe UI",Helvetica,Arial,sans-serif;color:var(--fg)}
main{max-width:1400px;margin:0 auto;padding:24px 28px 48px}
h1{font-size:24px;margin:0 0 4px}
h2{font-size:17px;margin:28px 0 10px;padding-bottom:4px;border-bottom:1px solid var(--line)}
.sub{color:var(--muted);margin:0 0 18px}
.cards{display:flex;gap:12px;flex-wrap:wrap;margin:0 0 12px}
.card{border:1px solid var(--line);border-radius:8px;padding:10px 16px;min-width:150px;background:var(--bg)}
.card b{display:block;font-size:22px}
.card span{color:var(--muted);font-size:12px}
ul.summary{margin:0;padding-left:18px;font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px}
table{border-collapse:collapse;width:100%}
th,td{text-align:left;padding:5px 8px;border-bottom:1px solid var(--line);vertical-align:top}
th{background:var(--bg);font-weight:600;position:sticky;top:0;z-index:1}
td.num,th.num{text-align:right;font-variant-numeric:tabular-nums}
td.name{font-family:ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;font-size:12.5px;overflow-wrap:anywhere}
#nodes{table-layout:fixed}
#nodes td{overflow-wrap:anywhere}
td.low{color:#1a7f37;font-weight:600;white-space:nowrap}
td.kept{color:var(--muted);white-space:nowrap}
td.files{white-space:nowrap}
.note{color:#9a6700;font-size:12px;white-space:normal}
a{color:var(--accent);text-decoration:none}a:hover{text-decoration:underline}
.sw{display:inline-block;width:11px;height:11px;border:1px solid #8c959f;border-radius:3px;margin-right:6px;vertical-align:-1px}
.legend{margin-right:16px;white-space:nowrap;color:var(--muted);font-size:12.5px}
button.rule{font:12.5px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;border:1px solid var(--line);background:#fff;border-radius:12px;padding:1px 9px;cursor:pointer}
button.rule:hover{border-color:var(--accent);color:var(--accent)}
.filters{display:flex;gap:10px;align-items:center;flex-wrap:wrap;margin:0 0 10px;position:sticky;top:0;background:#fff;padding:8px 0;z-index:2}
.filters input[type=search]{flex:1;min-width:260px;padding:6px 10px;border:1px solid var(--line);border-radius:6px;font-size:14px}
.filters select{padding:5px 6px;border:1px solid var(--line);border-radius:6px;font-size:13px;background:#fff}
#count{color:var(--muted);margin-left:auto;font-variant-numeric:tabular-nums}
#nodes th{top:52px}
#nodes tbody tr:nth-child(even){background:#fbfcfd}
#empty{color:var(--muted);padding:12px 8px}
"""

_SCRIPT = """
(function () {
  "use strict";
  var rows = Array.prototype.slice.call(document.querySelectorAll("#nodes tbody tr"));
  var text = rows.map(function (row) { return row.textContent.toLowerCase(); });
  var search = document.getElementById("search"), rule = document.getElementById("rule"),
      fn = document.getElementById("function"), kept = document.getElementById("kept"),
      count = document.getElementById("count"), empty = document.getElementById("empty");
  var timer = null;
  function apply() {
    timer = null;
    var terms = search.value.toLowerCase().split(/\\s+/).filter(Boolean), shown = 0;
    for (var i = 0; i < rows.length; i++) {
      var row = rows[i], ok = (!rule.value || row.dataset.rule === rule.value) &&
        (!fn.value || row.dataset.function === fn.value) && (!kept.checked || row.dataset.kept === "1");
      for (var t = 0; ok && t < terms.length; t++) ok = text[i].indexOf(terms[t]) !== -1;
      row.hidden = !ok;
      if (ok) shown++;
    }
    count.textContent = shown + " of " + rows.length + " rows";
    empty.hidden = shown !== 0;
  }
  function later() {
    if (rows.length < 5000) { apply(); return; }
    if (timer !== null) clearTimeout(timer);
    timer = setTimeout(apply, 120);
  }
  search.addEventListener("input", later);
  [rule, fn, kept].forEach(function (el) { el.addEventListener("change", apply); });
  Array.prototype.forEach.call(document.querySelectorAll("button.rule"), function (button) {
    button.addEventListener("click", function () {
      rule.value = button.dataset.rule; kept.checked = true; apply();
      document.getElementById("decisions").scrollIntoView();
    });
  });
  apply();
})();
"""

_PLUMBING_TEMPLATE = """<details id="plumbing"><summary>TensorFlow's plumbing, not the model: {count} item(s), {nodes} nodes
({kinds}); counted in the "all" line only, their decisions are in after/*.pbtxt</summary>
<table>
<thead><tr><th>item</th><th class="num">nodes</th><th class="num">vertices converted</th><th class="num">casts to {painted}</th><th class="num">kept float32</th><th>kept float32 by rule</th><th>files</th></tr></thead>
<tbody>
{rows}
</tbody>
</table>
</details>
"""

_HTML_TEMPLATE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<title>{title}</title>
<style>{style}{swatch_css}</style>
</head>
<body>
<main>
<h1>{title}</h1>
<p class="sub">amp_rewrite mixed-precision rewrite to <b>{target}</b> · lists: {lists}</p>
<div class="cards">
<div class="card"><b>{nodes}</b><span>nodes before</span></div>
<div class="card"><b>{converted}</b><span>vertices converted</span></div>
<div class="card"><b>{casts_to_target}</b><span>casts to {painted}</span></div>
<div class="card"><b>{kept}</b><span>vertices kept float32</span></div>
{float8_card}</div>
<ul class="summary"><li><b>all</b>: {summary}</li>
{summary_lines}</ul>

<h2>Items</h2>
<table id="items">
<thead><tr><th>item</th><th class="num">nodes</th><th class="num">vertices converted</th><th class="num">casts to {painted}</th><th class="num">kept float32</th><th>kept float32 by rule</th><th>files</th></tr></thead>
<tbody>
{item_rows}
</tbody>
</table>
{plumbing}

<h2>Why vertices stayed float32</h2>
<table id="rules">
<thead><tr><th>rule</th><th class="num">vertices</th><th>meaning</th></tr></thead>
<tbody>
{rule_rows}
</tbody>
</table>

<h2 id="decisions">Decisions: one per float32 (node, type attribute)</h2>
<div>{legend}</div>
<div class="filters">
<input id="search" type="search" placeholder="Filter: node, op, rule, reason… (all words must match)" autocomplete="off" aria-label="filter rows">
<select id="rule" aria-label="rule"><option value="">all rules</option>{rule_options}</select>
<select id="function" aria-label="item"><option value="">all items</option>{function_options}</select>
<label><input id="kept" type="checkbox"> kept float32 only</label>
<span id="count">{total} of {total} rows</span>
</div>
<table id="nodes">
<colgroup><col style="width:9%"><col style="width:27%"><col style="width:10%"><col style="width:5%"><col style="width:11%"><col style="width:11%"><col style="width:27%"></colgroup>
<thead><tr><th>item</th><th>node</th><th>op</th><th>attr</th><th>dtype</th><th>rule</th><th>reason</th></tr></thead>
<tbody>
{rows}
</tbody>
</table>
<div id="empty" hidden>No row matches the filters.</div>
</main>
<script>{script}</script>
</body>
</html>
"""
