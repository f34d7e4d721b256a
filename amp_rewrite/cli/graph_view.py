"""The converted graph drawn inside report.html: Graphviz's SVG when ``dot`` made one, else
an SVG laid out here, so the picture never needs anything installed.

The layout is the layered one Graphviz's ``dot`` uses, reduced to its first steps: layers
by longest path (cycles, as in TF1 loops, share a layer), then a few barycentre sweeps to
untangle each layer's order. Node boxes are as wide as their names, which never wrap. Both
kinds of SVG mark each node as ``<g class="node"><title>NAME</title>``, Graphviz's own
form, so the report's script treats them alike (a click filters the decisions by node).
A big item is bounded: past ``LAYOUT_MAX_NODES`` only its converted region is drawn (the
converted nodes, the casts and their neighbours), and the report says so.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from xml.sax.saxutils import escape, quoteattr

import markupsafe
import networkx as nx

LAYOUT_MAX_NODES = 300  # drawn by the browser: past a few hundred boxes the picture stops being readable
EMBED_MAX_BYTES = 8_000_000  # Graphviz's SVG of 1,500 nodes is ~2 MB; past this the report links it
_NAMESPACES = re.compile(r'\s+xmlns(?::xlink)?="[^"]*"')
_TOOLTIPS = re.compile(r'\s+xlink:title="[^"]*"')
CHAR_W, PAD_X, BOX_H, GAP_X, GAP_Y, MARGIN = 6.8, 14, 34, 18, 46, 16  # px, for 11 px monospace


@dataclass(frozen=True)
class ViewNode:
    name: str
    op: str
    fill: str  # the node class's colour
    tooltip: str


@dataclass(frozen=True)
class ViewEdge:
    source: str
    destination: str
    label: str  # dtype[:port], "" for a control edge
    low: bool  # carries the target dtype


@dataclass(frozen=True)
class GraphView:
    """What the report shows for one item: inline SVG markup, who drew it, what was left out."""

    svg: markupsafe.Markup
    drawn_by: str  # "Graphviz" or "amp_rewrite's layout"
    note: str = ""


def from_graphviz(svg_text: str) -> GraphView | None:
    """Graphviz's SVG file as inline markup (its XML prolog and DOCTYPE dropped), or None if too big."""
    if len(svg_text.encode("utf-8")) > EMBED_MAX_BYTES:
        return None
    start = svg_text.find("<svg")
    if start < 0:
        return None
    opening, rest = svg_text[start:].split(">", 1)
    # Inside HTML an <svg> needs no namespace declarations (the parser knows SVG and xlink:),
    # and the page then names no URL at all: it opens from file:// with nothing to fetch.
    # The tooltips (every decision's reason again) go too: a click shows the decisions' rows.
    return GraphView(markupsafe.Markup(_NAMESPACES.sub("", opening) + ">" + _TOOLTIPS.sub("", rest)), "Graphviz")


def bound(nodes: Sequence[ViewNode], edges: Sequence[ViewEdge], low: set[str],
          limit: int = LAYOUT_MAX_NODES) -> tuple[list[ViewNode], list[ViewEdge], str]:
    """At most ``limit`` nodes: all of them, or the converted region (``low``: converted nodes and
    casts, with their neighbours), then its first ``limit`` in graph order. (nodes, edges, note)."""
    if len(nodes) <= limit:
        return list(nodes), list(edges), ""
    region = set(low)
    for edge in edges:
        if edge.source in low or edge.destination in low:
            region |= {edge.source, edge.destination}
    kept = [node for node in nodes if node.name in region][:limit]
    names = {node.name for node in kept}
    note = (f"{len(kept)} of {len(nodes)} nodes drawn (limit {limit}): the converted region, converted nodes and"
            " casts with their neighbours; the .dot file has every node")
    return kept, [e for e in edges if e.source in names and e.destination in names], note


def _layers(names: Sequence[str], edges: Sequence[ViewEdge]) -> list[list[str]]:
    graph = nx.DiGraph()
    graph.add_nodes_from(names)
    graph.add_edges_from((e.source, e.destination) for e in edges)
    condensed = nx.condensation(graph)  # strongly connected parts (loops) become one vertex each
    component_to_layer: dict[int, int] = {}
    for component in nx.topological_sort(condensed):
        component_to_layer[component] = max((component_to_layer[p] + 1 for p in condensed.predecessors(component)),
                                            default=0)
    layers: list[list[str]] = [[] for _ in range(max(component_to_layer.values(), default=-1) + 1)]
    for name in names:
        layers[component_to_layer[condensed.graph["mapping"][name]]].append(name)
    return layers


def _untangle(layers: list[list[str]], edges: Sequence[ViewEdge], sweeps: int = 4) -> list[list[str]]:
    """Barycentre sweeps, down then up: each node moves to the mean position of its neighbours."""
    predecessors: dict[str, list[str]] = {}
    successors: dict[str, list[str]] = {}
    for edge in edges:
        predecessors.setdefault(edge.destination, []).append(edge.source)
        successors.setdefault(edge.source, []).append(edge.destination)
    for sweep in range(sweeps):
        position = {name: i for layer in layers for i, name in enumerate(layer)}
        neighbours = predecessors if sweep % 2 == 0 else successors
        for layer in layers if sweep % 2 == 0 else reversed(layers):
            def centre(name: str) -> float:
                around = [position[n] for n in neighbours.get(name, ()) if n in position]
                return sum(around) / len(around) if around else position[name]
            layer.sort(key=centre)
            position.update({name: i for i, name in enumerate(layer)})
    return layers


def _box_width(node: ViewNode) -> float:
    return max(len(node.name), len(node.op)) * CHAR_W + 2 * PAD_X


def layout_svg(nodes: Sequence[ViewNode], edges: Sequence[ViewEdge], title: str) -> str:
    """``nodes`` and ``edges`` as one layered SVG, top to bottom, boxes as wide as their names."""
    by_name = {node.name: node for node in nodes}
    edges = [e for e in edges if e.source in by_name and e.destination in by_name and e.source != e.destination]
    layers = _untangle(_layers([node.name for node in nodes], edges), edges)
    widths = [sum(_box_width(by_name[n]) for n in layer) + GAP_X * (len(layer) - 1) for layer in layers]
    width = max(widths, default=0) + 2 * MARGIN
    box: dict[str, tuple[float, float, float]] = {}  # name -> (x, y, width)
    for index, layer in enumerate(layers):
        x = (width - widths[index]) / 2
        for name in layer:
            box[name] = (x, MARGIN + 20 + index * (BOX_H + GAP_Y), _box_width(by_name[name]))
            x += box[name][2] + GAP_X
    height = MARGIN * 2 + 20 + len(layers) * (BOX_H + GAP_Y)
    out = [f'<svg class="layout" width="{width:.0f}" height="{height:.0f}"'
           f' viewBox="0 0 {width:.0f} {height:.0f}" font-family="ui-monospace,Menlo,Consolas,monospace" font-size="11">',
           f'<text x="{MARGIN}" y="{MARGIN + 4}" font-family="Helvetica,Arial,sans-serif" font-size="13">'
           f'{escape(title)}</text>']
    for edge in edges:
        (x1, y1, w1), (x2, y2, w2) = box[edge.source], box[edge.destination]
        a, b = (x1 + w1 / 2, y1 + BOX_H), (x2 + w2 / 2, y2)
        colour = "#2e8b2e" if edge.low else "#999999" if not edge.label else "#666666"
        dash = ' stroke-dasharray="3 3"' if not edge.label else ""
        out.append(f'<path class="edge" d="M{a[0]:.1f},{a[1]:.1f} C{a[0]:.1f},{a[1] + GAP_Y / 2:.1f}'
                   f' {b[0]:.1f},{b[1] - GAP_Y / 2:.1f} {b[0]:.1f},{b[1]:.1f}" fill="none" stroke="{colour}"'
                   f' stroke-width="{1.6 if edge.low else 1}"{dash}><title>{escape(edge.label or "control")}</title></path>')
    for node in nodes:
        x, y, w = box[node.name]
        out.append(f'<g class="node"><title>{escape(node.name)}</title><desc>{escape(node.tooltip)}</desc>'
                   f'<rect x="{x:.1f}" y="{y:.1f}" width="{w:.1f}" height="{BOX_H}" rx="6" fill={quoteattr(node.fill)}'
                   ' stroke="#57606a"/>'
                   f'<text x="{x + w / 2:.1f}" y="{y + 14:.1f}" text-anchor="middle">{escape(node.name)}</text>'
                   f'<text x="{x + w / 2:.1f}" y="{y + 27:.1f}" text-anchor="middle" fill="#59636e">{escape(node.op)}</text>'
                   "</g>")
    out.append("</svg>")
    return "\n".join(out)


def built_in(nodes: Sequence[ViewNode], edges: Sequence[ViewEdge], low: set[str], title: str) -> GraphView:
    """The item drawn by ``layout_svg``, bounded to ``LAYOUT_MAX_NODES`` nodes."""
    kept, kept_edges, note = bound(nodes, edges, low)
    return GraphView(markupsafe.Markup(layout_svg(kept, kept_edges, title)), "amp_rewrite's layout", note)
