"""``rewrite_graph_def``: the orchestrator, in the order of grappler's pass (spec §2.1–2.6)."""
from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
from collections.abc import Collection
from dataclasses import dataclass
from typing import Callable, Iterable

import networkx as nx
from tensorflow.core.framework import graph_pb2, types_pb2

from amp_rewrite.core import boundaries, casts, colouring, functions, graph_io, typegraph
from amp_rewrite.core.colouring import PaintContext, Painting, Reason
from amp_rewrite.core.errors import GraphError
from amp_rewrite.core.lists import Colour, OpLists, load_lists
from amp_rewrite.core.program import MAIN_GRAPH, Program, program_of
from amp_rewrite.core.report import ItemStats, PendingDecisions, Report
from amp_rewrite.core.target import Target, lookup_target
from amp_rewrite.core.typegraph import Vertex

log = logging.getLogger(__name__)

# Grappler feeds every placeholder, and feeds are preserved: inputs keep their dtype.
GRAPH_INPUTS = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})
# The vertices colouring works on: float32 ones, and the variant ones TensorList handles
# pass through. The others can neither be painted nor lead to one that can.
PAINTED_DTYPES = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_VARIANT})


@dataclass(frozen=True)
class RewriteResult:
    graph_def: graph_pb2.GraphDef
    report: Report

    @functools.cached_property
    def program(self) -> Program:
        """The rewritten graph's items, indexed once for all that read them (dump, command)."""
        return program_of(self.graph_def)


def device_type(device: str) -> str | None:
    """``/job:w/replica:0/task:0/device:GPU:0`` → ``GPU``; legacy ``/cpu:0`` → ``CPU``; else None."""
    for part in reversed(device.split("/")):
        if part.startswith("device:"):
            kind = part[len("device:"):].split(":")[0]
            return kind or None
        kind, sep, index = part.partition(":")
        if sep and kind and kind not in ("job", "replica", "task") and (index.isdigit() or index == "*"):
            return kind.upper()
    return None


def find_processed_nodes(
    nodes: nx.MultiDiGraph, target: Target, fetches: Iterable[str], lists: OpLists
) -> tuple[dict[str, str], dict[str, str]]:
    """Nodes the pass may paint (→ kernel device type) and, for the others, why not.

    Not painted: fetched nodes, placeholders and ``_grappler_do_not_remove`` nodes
    (grappler's preserved set), nodes matching the lists' ``keep_nodes``, and nodes placed on another device
    type. An empty device means the target's device.
    """
    wanted = target.device_type
    preserved = set(fetches)
    keeps = lists.keeps if lists.keep_nodes else None
    device_to_kind: dict[str, str | None] = {}  # a graph has few device strings; None: another device type
    processed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for name, data in nodes._node.items():
        node_def = data["node_def"]
        if name in preserved:
            skipped[name] = "fetched: its outputs keep their dtype"
        elif node_def.op in GRAPH_INPUTS:
            skipped[name] = "a graph input (feed): keeps its dtype"
        elif "_grappler_do_not_remove" in node_def.attr and node_def.attr["_grappler_do_not_remove"].b:
            skipped[name] = "marked _grappler_do_not_remove"
        elif keeps is not None and keeps(name):
            skipped[name] = "matches keep_nodes in the lists"
        else:
            device = node_def.device
            if device not in device_to_kind:
                kind = device_type(device) if device else wanted
                device_to_kind[device] = kind if kind is not None and wanted.lower() in kind.lower() else None
            kind = device_to_kind[device]
            if kind is not None:
                processed[name] = kind
            else:
                skipped[name] = f"placed on '{device}', not a {wanted} device"
    return processed, skipped


def upgrade_batch_norm_ops(nodes: nx.MultiDiGraph, processed: Collection[str]) -> None:
    """FusedBatchNorm(Grad) → V2 with ``U=float32`` so ``T`` can change alone (spec §2.1 step 5)."""
    for name, data in nodes._node.items():
        node_def = data["node_def"]
        if node_def.op in ("FusedBatchNorm", "FusedBatchNormGrad") and name in processed:
            node_def.op += "V2"
            node_def.attr["U"].type = types_pb2.DT_FLOAT


def loop_values(types: typegraph.TypeGraph) -> Iterable[Vertex]:
    """The ``T[i]`` vertices of functional While ops.

    The bfloat16 lists make While/StatelessWhile clear ops, and grappler then paints a loop
    value while the body and cond keep float32 signatures: an invalid graph (TF 2.21).
    We keep those values float32 unless ``cross_function`` changes the bodies with them.
    """
    for name, op in types.ops.items():
        if op in ("While", "StatelessWhile"):
            for index in range(len(types.node_defs[name].attr["T"].list.type)):
                yield Vertex(name, typegraph.TypeAttr("T", index))


def explain(ctx: PaintContext, painting: Painting, skipped: dict[str, str], vertex: Vertex) -> Reason:
    """Why one vertex has its final colour."""
    if vertex.node in skipped and vertex not in painting.allow and vertex not in painting.deny:
        return Reason("not-processed", skipped[vertex.node])
    reason = painting.reasons.get(vertex)  # every ALLOW and DENY vertex has one
    if reason is not None:
        return reason
    op = ctx.op(vertex)
    if ctx.pinned and vertex in ctx.pinned:
        return Reason("loop-value", "loop value of a functional While whose body and cond keep float32 signatures")
    if not painting.allow:
        return Reason("no-allow-ops", "no allow-list op in the graph, so nothing is converted")
    colour = ctx.colour(vertex.node)
    if colour is None:
        if op in ctx.lists.reasons:  # in the float32 section of the built-in file
            return Reason("slower-converted", f"op {op}: {ctx.lists.reasons[op]}")
        return Reason("unlisted", f"op {op} is in no list")
    if colour in (Colour.CLEAR, Colour.INFER) and not ctx.has_target_kernel(vertex):
        return Reason("no-kernel", f"no {ctx.target.name} kernel for {op} on {ctx.kernel_device[vertex.node]}")
    if colour is Colour.INFER:
        bounded = f" (deny op {op} acting as infer: {ctx.bounded[vertex.node]})" if vertex.node in ctx.bounded else ""
        return Reason("infer-isolated", f"infer op neither between allow ops nor directly after one{bounded}")
    return Reason("clear-isolated", "clear op not connected to an allow op through clear ops")


@contextlib.contextmanager
def _gc_paused():
    """The pass allocates ~10 small objects per node and frees none until it returns:
    cyclic GC runs would only rescan them (a third of the time on a 7k-node graph)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def rewrite_graph_def(
    graph_def: graph_pb2.GraphDef,
    *,
    target: str = "float16",
    fetches: Iterable[str] = (),
    lists: str | os.PathLike | OpLists | None = None,
    cross_function: bool = False,
    entry_functions: Iterable[str] = (),
    progress: Callable[[int, int], None] | None = None,
) -> RewriteResult:
    """Rewrites ``graph_def`` and its reachable library functions; the input is never modified.

    ``target``: ``"float16"`` (NVIDIA GPU lists) or ``"bfloat16"`` (oneDNN CPU lists).
    ``fetches``: node (or tensor) names whose outputs must keep their dtype.
    ``lists``: None (built-in), a path to an overlay YAML, or loaded ``OpLists``.

    By default each function body is painted on its own, exactly like grappler, and keeps
    its signature. ``cross_function=True`` paints across call and loop boundaries so
    low-precision values stay low precision there; private functions' signatures may then
    change, never those of ``entry_functions`` (e.g. a SavedModel's signature functions).
    ``progress(done, total)`` is called as items are prepared and finished.
    """
    target = lookup_target(target)  # the one check of the user's string
    op_lists = load_lists(target, lists)
    fetch_nodes = tuple(graph_io.parse_tensor_name(f).node for f in fetches)  # "x:0" fetches node x
    with _gc_paused():  # the working graphs are freed when _rewrite_items returns, before GC resumes
        functions.check_calls(graph_def)
        program = program_of(graph_def)
        names = functions.reachable_functions(graph_def)
        links = boundaries.find_links(graph_def, names, entry_functions) if cross_function else boundaries.Links(())
        output, stats, decisions = _rewrite_items(program, target, fetch_nodes, op_lists, names, links,
                                                  progress or (lambda done, total: None))
        report = Report(target.name, stats, decisions)
    log.info("%s", report.summary())
    return RewriteResult(output, report)


def _rewrite_items(
    program: Program, target: Target, fetch_nodes: tuple[str, ...], op_lists: OpLists,
    names: list[str], links: boundaries.Links, progress: Callable[[int, int], None],
) -> tuple[graph_pb2.GraphDef, tuple[ItemStats, ...], tuple[PendingDecisions, ...]]:
    total = 2 * (len(names) + 1)
    # Steps 2-5 for every item: the main graph, then each function body.
    items = {MAIN_GRAPH: _prepare(program.graph_def, target, fetch_nodes, op_lists, links, MAIN_GRAPH, program)}
    progress(1, total)
    for name in names:
        with _naming(name):
            body = program.item(name)
            preserved = set(functions.preserved_nodes(program.library[name], body)) - links.nodes(name)
            items[name] = _prepare(body, target, tuple(preserved), op_lists, links, name, program)
        progress(len(items), total)
    # Step 6: colouring, each item alone (grappler) or linked across boundaries.
    paintings = _paint_linked(items, links) if links.groups else {n: colouring.paint(i.ctx) for n, i in items.items()}
    # Steps 7-8: types, casts and decisions per item; functions go back into the library.
    output, stats, decisions = None, [], []
    for name, item in items.items():
        with _naming(name):
            graph, item_stats, item_decisions = _finish(item, paintings[name], name)
        if name == MAIN_GRAPH:
            output = graph
        else:
            # The output's library is the input's, in the same order, until each function is put back.
            rewritten = functions.to_function_def(graph, program.library[name], program.op_defs)
            output.library.function[program.positions[name]].CopyFrom(rewritten)
        stats.append(item_stats)
        decisions.append(item_decisions)
        progress(len(items) + len(stats), total)
    return output, tuple(stats), tuple(decisions)


@contextlib.contextmanager
def _naming(function: str):
    """Errors inside a function body name the function."""
    try:
        yield
    except GraphError as error:
        message = str(error)
        raise GraphError(message if message.startswith("function") else f"function '{function}': {message}") from None


@dataclass(frozen=True)
class _Item:
    """One item ready to paint: its working node graph, context and why nodes were skipped."""

    graph_def: graph_pb2.GraphDef
    ctx: PaintContext
    skipped: dict[str, str]


def _prepare(
    graph_def: graph_pb2.GraphDef, target: Target, fetches: tuple[str, ...], op_lists: OpLists,
    links: boundaries.Links, function: str, program: Program,
) -> _Item:
    """Steps 2-5 of grappler's pass on one item (spec §2.1); step 1, the lists, is the caller's."""
    # 2. Working copy as a node graph; every fetch must exist.
    nodes = graph_io.to_networkx(graph_def)
    missing = [f for f in fetches if f not in nodes]
    if missing:
        raise GraphError(f"fetch node(s) {', '.join(map(repr, missing))} not in the graph")
    # 3. Which nodes may be painted.
    processed, skipped = find_processed_nodes(nodes, target, fetches, op_lists)
    # 4. FusedBatchNorm(Grad) → V2 on processed nodes, before anything else.
    upgrade_batch_norm_ops(nodes, processed)
    # 5. The (node, type attribute) vertex graph.
    types = typegraph.build_type_graph(nodes, PAINTED_DTYPES, program.op_defs)
    linked = frozenset(v for v in links.vertices(function) if v in types.graph)
    handles = frozenset(v for v in linked if types.dtype(v) == types_pb2.DT_VARIANT)
    ctx = PaintContext(types, op_lists, target, frozenset(processed), processed, linked - handles,
                       pinned=frozenset(loop_values(types)) - linked, list_links=handles)
    return _Item(graph_def, ctx, skipped)


def _paint_linked(items: dict[str, _Item], links: boundaries.Links) -> dict[str, Painting]:
    """Step 6 with ``cross_function``: paint, spread colours over linked groups, repeat.

    A group of linked values whose value comes from a DENY vertex on any side is denied
    on every side (so deny propagates into a callee as if it were inlined); otherwise,
    once any member is ALLOW, it seeds ALLOW on every side. TensorList clusters joined
    through linked list handles share one element dtype the same way. A group moves from
    nothing to ALLOW to DENY at most, so this ends. Finally a group converts only if all
    its members do, so both sides of every boundary agree.
    """
    def dtype(item: str, vertex: Vertex) -> int:
        return items[item].ctx.types.dtype(vertex) if vertex in items[item].ctx.types.graph else types_pb2.DT_INVALID

    groups = [list(g) for g in links.groups if boundaries.is_float32_group(g, dtype)]
    seeds: dict[str, set[Vertex]] = {name: set() for name in items}
    deny_seeds: dict[str, set[Vertex]] = {name: set() for name in items}
    list_groups: list[list[tuple[str, Vertex]]] | None = None
    while True:
        paintings = {}
        for name, item in items.items():
            item.ctx.seeds, item.ctx.deny_seeds = frozenset(seeds[name]), frozenset(deny_seeds[name])
            paintings[name] = colouring.paint(item.ctx)
        if list_groups is None:  # clusters depend on the graphs only, not on the seeds
            list_groups = _joined_tensor_lists(items, paintings, links)

        def denied(item: str, vertex: Vertex) -> bool:
            deny = paintings[item].deny
            return vertex in deny or any(f in deny for f in items[item].ctx.types.graph.pred[vertex])

        grew = False
        for group in groups + list_groups:
            if any(denied(i, v) for i, v in group):
                for i, v in group:
                    seeds[i].discard(v)
                    grew |= v not in deny_seeds[i]
                    deny_seeds[i].add(v)
            elif all(v.node in items[i].ctx.processed for i, v in group) and any(
                v in paintings[i].allow for i, v in group
            ):
                for i, v in group:
                    grew |= v not in seeds[i]
                    seeds[i].add(v)
        if not grew:
            break
    for group in groups + list_groups:
        if not all(v in paintings[i].allow for i, v in group):
            for i, v in group:
                if v in paintings[i].allow:
                    painting = paintings[i]
                    reasons = dict(painting.reasons)
                    reasons[v] = Reason("cross-function", "the other side of its function boundary stays float32")
                    paintings[i] = Painting(painting.allow - {v}, painting.deny, reasons, painting.clusters)
    return paintings


def _joined_tensor_lists(
    items: dict[str, _Item], paintings: dict[str, Painting], links: boundaries.Links
) -> list[list[tuple[str, Vertex]]]:
    """Element vertices of TensorList clusters that share lists through linked handles."""
    slot_group = {slot: index for index, group in enumerate(links.groups) for slot in group}
    parent: dict[object, object] = {}

    def find(key: object) -> object:
        while parent.setdefault(key, key) != key:
            key = parent[key]
        return key

    element: dict[object, set[tuple[str, Vertex]]] = {}
    for name, painting in paintings.items():
        for index, cluster in enumerate(painting.clusters):
            if not cluster.touches:
                continue
            key = (name, index)
            element[key] = {(name, colouring.tensor_list_float_vertex(items[name].ctx, n)) for n in cluster.members}
            for vertex in cluster.touches:
                parent[find(key)] = find(("group", slot_group[(name, vertex)]))
    joined: dict[object, set[tuple[str, Vertex]]] = {}
    for key, vertices in element.items():
        joined.setdefault(find(key), set()).update(vertices)
    return [sorted(vertices, key=str) for vertices in joined.values()]


def _finish(item: _Item, painting: Painting, function: str) -> tuple[graph_pb2.GraphDef, ItemStats, PendingDecisions]:
    """Steps 7-8: each float32 vertex's reason, then types and casts, then a GraphDef."""
    ctx = item.ctx
    # Reasons first: explain() reads the graph as painted, before any dtype changes. A
    # float32 vertex ends as the target exactly when it is ALLOW (step 7 converts those).
    reasons, skipped = painting.reasons, item.skipped
    explained = {  # explain() would find the painting's reason first unless the node was skipped
        v: explain(ctx, painting, skipped, v) for v in ctx.float32
        if v.attr.name and (v.node in skipped or v not in reasons)
    }
    decisions = PendingDecisions(function, ctx.target.name, ctx.float32, ctx.ops, painting.allow,
                                 {**reasons, **explained})
    # 7. Types and casts, the one mutation (of the working copy).
    stats = casts.change_types_and_insert_casts(ctx, painting) if painting.allow else casts.CastStats(0, 0, 0)
    # 8. Back to a GraphDef, with the item's counts.
    item_stats = ItemStats(function, len(item.graph_def.node), stats.vertices_converted, stats.casts_added,
                           stats.casts_to_target)
    return graph_io.take_graph_def(ctx.types.nodes), item_stats, decisions  # the item is done with its graph

