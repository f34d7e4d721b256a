"""``rewrite_graph_def``: the orchestrator, one call per step of grappler's pass.

The steps, numbered alike here, in the code below and in its DEBUG log lines (the
``amp_rewrite.core.rewrite`` and ``amp_rewrite.core.colouring`` loggers):

1-2. ``lists.load_lists``: the four lists for the target, with TensorFlow's variables
     (spec §2.1 steps 1-2). Once per rewrite; then, for every item (spec §1.2):
3.   ``graph_io.working_copy``: the working copy of the item, the only graph changed.
4.   ``preparation.find_processed_nodes``: which nodes may be painted (spec §1.5, §2.1 step 4),
     and which ones keep_nodes keeps (deny ops in step 7.2).
5.   ``preparation.upgrade_batch_norm_ops``: FusedBatchNorm(Grad) → V2 (spec §2.1 step 5).
6.   ``typegraph.build_type_graph``: the (node, type attribute) vertex graph (spec §2.1 step 6,
     §2.2), and ``colouring.find_tensor_lists``: its TensorList clusters and the implicit
     edges ``typegraph.add_implicit_edges`` adds (spec §2.1 step 7, §2.5).
7.   ``colouring.paint``: grappler's colouring passes 7.0-7.10, spec §2.3's passes 0-10;
     with ``cross_function``, ``boundaries.paint_linked`` repeats it across function boundaries.
8.   ``casts.change_types_and_insert_casts``: the painted dtypes and the casts (spec §2.6).
9.   Back to a GraphDef, and a function body back into its FunctionDef.
10.  Target float8 only: ``float8.quantize_matmuls`` gives the matmuls step 8 converted
     float8_e4m3fn operands (before step 9's FunctionDef), and ``float8.mark_xla_must_compile``
     marks the functions holding one for XLA.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Callable, Iterable

from tensorflow.core.framework import graph_pb2, types_pb2

from amp_rewrite.core import boundaries, casts, colouring, functions, graph_io, hoist, preparation, typegraph
from amp_rewrite.core.canonical import to_float32
from amp_rewrite.core.colouring import PaintContext, Painting
from amp_rewrite.core.float8 import inference as float8
from amp_rewrite.core.lists import OpLists, load_lists
from amp_rewrite.core.program import MAIN_GRAPH, Program, program_of
from amp_rewrite.core.report import ItemStats, PendingDecisions, Report
from amp_rewrite.core.target import FLOAT32_NAME, Target, lookup_target
from amp_rewrite.core.typegraph import Vertex
from amp_rewrite.errors import AmpRewriteError, GraphError, did_you_mean

log = logging.getLogger(__name__)

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


@contextlib.contextmanager
def gc_paused():
    """No cyclic GC inside: a pass over a graph allocates a few small objects per node and
    frees none until it returns, so GC runs would only rescan them, more often the larger the
    graph (the weights step's, ``cli/weights.py``, too)."""
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
    target: str | Target = "float16",
    fetches: Iterable[str] = (),
    lists: str | os.PathLike | OpLists | None = None,
    cross_function: bool | str = False,
    entry_functions: Iterable[str] = (),
    roots: Iterable[str] = (),
    progress: Callable[[int, int], None] | None = None,
    amax: Mapping[tuple[str, str, int], float] | None = None,
    lossy: Mapping[tuple[str, str], str] | None = None,
    preserved: Mapping[tuple[str, str], str] | None = None,
    frozen: RewriteResult | None = None,
) -> RewriteResult:
    """Rewrites ``graph_def`` and its reachable library functions; the input is never modified.

    ``target``: ``"float16"`` (NVIDIA GPU lists) or ``"bfloat16"`` (oneDNN CPU lists), or its ``Target``;
    ``"float8"``: the float16 rewrite whose matmuls then take float8_e4m3fn operands (core/float8/inference.py);
    ``"float32"``: a mixed graph back to float32 (``to_float32``; to retarget one, that first).
    ``amax`` (float8 only, required): ``(function, node, port) -> largest finite |x|`` of float32 tensors
    on calibration inputs (function ``""`` is the main graph); a matmul with an activation operand missing
    from it stays float16.
    ``lossy`` (float8 only): ``(function, node) -> the FP8 error calibration measured`` for matmuls to leave
    float16 (rule ``float8-lossy``). Both may name a function by its stable name, and a node plainly (an overlay's).
    ``fetches``: node (or tensor) names whose outputs must keep their dtype. ``preserved``: ``(function, node)
    -> why`` for more nodes, in any item, that keep their dtypes as fetches do (custom gradients' ones).
    ``lists``: None (built-in), a path to an overlay YAML, or loaded ``OpLists``.

    By default each function body is painted alone and keeps its signature, as grappler does.
    ``cross_function=True`` paints across call and loop boundaries, ``"loops"`` loop ones only
    (``amp-rewrite``'s default), with buffer updates (a KV cache's) clear ops (``boundaries``);
    private functions' signatures may change, never ``entry_functions``' (a SavedModel's signatures).
    ``roots``: functions called from outside the graph (a SavedModel's restored functions),
    rewritten with what they call as if the main graph called them (``functions.reachable_functions``).
    ``progress(done, total)`` is called as items are prepared and finished.
    ``frozen``: an earlier result for a graph that ``graph_def`` extends (a running Session's,
    ``training/session.py``). Its main-graph nodes keep the dtypes they have there, and the
    new ones are painted around them; function bodies are painted as always.
    """
    if target == FLOAT32_NAME:  # no items in the report: to_float32's Canonical says what changed
        return RewriteResult(to_float32(graph_def, fetches=fetches, preserved=preserved).graph_def, Report(target, ()))
    target = lookup_target(target, quantized=True)  # the one check of the user's string
    amax, lossy = _float8_calibration(target, amax, lossy, graph_def)
    # 1-2. The lists (float8's are float16's).
    op_lists = _load_lists(target, lists, cross_function)
    log.debug("step 1-2 lists: %s", " + ".join(op_lists.sources) or "given OpLists")
    fetch_nodes = tuple(graph_io.parse_tensor_name(f).node for f in fetches)  # "x:0" fetches node x
    with gc_paused():  # the working graphs are freed when _rewrite_items returns, before GC resumes
        program = program_of(graph_def)
        functions.check_calls(graph_def, program.library)
        names, links = _functions_and_links(program, tuple(roots), tuple(entry_functions), cross_function)
        rewrite = _Rewrite(program=program, target=lookup_target(target.colouring), op_lists=op_lists,
                           names=names, links=links, fetch_nodes=fetch_nodes,
                           progress=progress or (lambda done, total: None), amax=amax, lossy=lossy,
                           preserved=_by_item(preserved or {}), frozen=_frozen_painting(frozen))
        output, stats, decisions = _rewrite_items(rewrite)
        report = Report(target.name, stats, decisions)
    log.info("%s", report.summary())
    return RewriteResult(output, report)


def _functions_and_links(program: Program, roots: tuple[str, ...], entry_functions: tuple[str, ...],
                         cross_function: bool | str) -> tuple[tuple[str, ...], boundaries.Links]:
    """The functions to rewrite, reachable from the main graph or from ``roots``, and with
    ``cross_function`` how they link. A root is called from outside, so it keeps its
    signature as an entry function does."""
    graph_def = program.graph_def
    names = tuple(functions.reachable_functions(graph_def, program.library, roots=roots))
    if not cross_function:
        return names, boundaries.Links(())
    return names, boundaries.find_links(graph_def, names, (*entry_functions, *roots), program.library,
                                        loops_only=cross_function == boundaries.LOOPS)


def _load_lists(target: Target, lists: str | os.PathLike | OpLists | None, cross_function: bool | str) -> OpLists:
    """Steps 1-2: the lists, with linked boundaries' in-place updates clear (``boundaries``)."""
    if not isinstance(cross_function, bool) and cross_function != boundaries.LOOPS:
        raise AmpRewriteError(f"cross_function={cross_function!r}: choose False (grappler's boundaries), True"
                              f" (calls and loops) or {boundaries.LOOPS!r} (loop boundaries only)")
    op_lists = load_lists(target, lists)
    return boundaries.with_in_place_updates(op_lists) if cross_function else op_lists


def _float8_calibration(target: Target, amax: Mapping[tuple[str, str, int], float] | None,
                        lossy: Mapping[tuple[str, str], str] | None, graph_def: graph_pb2.GraphDef,
                        ) -> tuple[Mapping[tuple[str, str, int], float] | None, Mapping[tuple[str, str], str]]:
    """``amax`` and ``lossy`` checked against the target, and resolved to ``graph_def``'s
    items where they name a function by its stable name or a node plainly."""
    _check_amax(target, amax, lossy)
    if amax is None:
        return None, lossy or {}
    resolved, _ = float8.resolve(float8.Float8Calibration(amax, lossy or {}), graph_def)
    return resolved.amax, resolved.lossy


def _check_amax(target: Target, amax: Mapping[tuple[str, str, int], float] | None,
                lossy: Mapping[tuple[str, str], str] | None) -> None:
    if target.name == float8.TARGET_NAME:
        float8.check_tensorflow()
    if target.name == float8.TARGET_NAME and amax is None:
        raise AmpRewriteError("target 'float8' needs amax, the largest |x| of each float32 tensor on calibration"
                              " inputs ((function, node, port) -> float); calibrate the model first")
    for name, value in (("amax", amax), ("lossy", lossy)):
        if target.name != float8.TARGET_NAME and value is not None:
            raise AmpRewriteError(f"{name} applies to target 'float8', not {target.name!r}; leave it out")


def _frozen_painting(frozen: RewriteResult | None) -> tuple[frozenset[str], frozenset[Vertex]]:
    """The main-graph nodes of an earlier result, and those of their vertices it converted."""
    if frozen is None:
        return frozenset(), frozenset()
    converted = (item.converted for item in frozen.report.pending if item.function == MAIN_GRAPH)
    return frozenset(node.name for node in frozen.graph_def.node), frozenset(itertools.chain.from_iterable(converted))


@dataclass(frozen=True)
class _Rewrite:
    """What every item's steps read, built once per rewrite: the graph's items, steps 1-2's
    lists, the colouring target, the functions to rewrite and how they link, and the caller's
    options."""

    program: Program
    target: Target                     # the colouring target (float16's for float8)
    op_lists: OpLists
    names: tuple[str, ...]             # the functions rewritten, in library order
    links: boundaries.Links            # cross-function slot groups (none unless cross_function)
    fetch_nodes: tuple[str, ...]       # main-graph nodes whose outputs keep their dtypes
    progress: Callable[[int, int], None]
    amax: Mapping[tuple[str, str, int], float] | None  # float8 only (resolved)
    lossy: Mapping[tuple[str, str], str]               # float8 only (resolved)
    preserved: Mapping[str, Mapping[str, str]]         # item -> node -> why it keeps its dtypes
    frozen: tuple[frozenset[str], frozenset[Vertex]]   # an earlier result's main-graph nodes and converted vertices

    def reasons(self, item: str) -> Mapping[str, str]:
        """Node -> why, for the nodes of ``item`` the caller preserved."""
        return self.preserved.get(item, {})


def _by_item(preserved: Mapping[tuple[str, str], str]) -> dict[str, dict[str, str]]:
    """``preserved``'s (item, node) -> why as item -> node -> why."""
    item_to_reasons: dict[str, dict[str, str]] = {}
    for (function, node), why in preserved.items():
        item_to_reasons.setdefault(function, {})[node] = why
    return item_to_reasons


def _rewrite_items(
    rewrite: _Rewrite,
) -> tuple[graph_pb2.GraphDef, tuple[ItemStats, ...], tuple[PendingDecisions, ...]]:
    """Steps 3-10 (module doc) on every item: the main graph, then each function body."""
    program, names, links = rewrite.program, rewrite.names, rewrite.links
    total = 2 * (len(names) + 1)
    items = {MAIN_GRAPH: _prepare(rewrite, MAIN_GRAPH, program.graph_def,
                                  (*rewrite.fetch_nodes, *rewrite.reasons(MAIN_GRAPH)))}
    rewrite.progress(1, total)
    for name in names:
        with _naming(name):
            body = program.item(name)
            kept = set(functions.preserved_nodes(program.library[name], body)) - links.nodes(name)
            items[name] = _prepare(rewrite, name, body, tuple(kept | set(rewrite.reasons(name))))
        rewrite.progress(len(items), total)
    # 7. Colouring: each item alone (grappler), or linked across function boundaries.
    log.debug("step 7 colouring: %d item(s)%s", len(items), ", linked" if links.groups else "")
    if links.groups:
        paintings = boundaries.paint_linked({name: item.ctx for name, item in items.items()},
                                            {name: item.tensor_lists for name, item in items.items()}, links)
    else:
        paintings = {name: colouring.paint(item.ctx, item.tensor_lists) for name, item in items.items()}
    output, stats, decisions, compiled = None, [], [], []
    for name, item in items.items():
        with _naming(name):
            graph, item_stats, item_decisions = _finish(item, paintings[name], name)
            if rewrite.amax is not None:
                item_lossy = {node: why for (function, node), why in rewrite.lossy.items() if function == name}
                graph, item_stats, item_decisions = _quantize(graph, item_stats, item_decisions, name, rewrite.amax,
                                                              item_lossy)
                if item_stats.float8_matmuls and name != MAIN_GRAPH:
                    compiled.append(name)
        if name == MAIN_GRAPH:
            output = graph
        else:
            # 9. The body back into its FunctionDef, at its place in the output's library
            # (the input's library, in the same order, until every function is back).
            program.put(output, name, graph)
        stats.append(item_stats)
        decisions.append(item_decisions)
        rewrite.progress(len(items) + len(stats), total)
    float8.mark_xla_must_compile(output, compiled)
    if links.groups:  # beyond grappler: loops whose signatures may change take their weights' casts out
        output = hoist.hoist_invariant_casts(output, links.functions())
    return output, tuple(stats), tuple(decisions)


def _quantize(
    graph: graph_pb2.GraphDef, stats: ItemStats, decisions: PendingDecisions, function: str,
    amax: Mapping[tuple[str, str, int], float], lossy: Mapping[str, str],
) -> tuple[graph_pb2.GraphDef, ItemStats, PendingDecisions]:
    """Step 10 (module doc) on one item: its converted matmuls' operands to float8."""
    converted = {vertex.node for vertex in decisions.converted if vertex.attr.name == "T"}
    graph, found = float8.quantize_matmuls(graph, function=function, amax=amax, converted=converted, lossy=lossy)
    quantized = sum(decision.quantized for decision in found)
    log.debug("%s: step 10 float8: %d of %d matmuls quantized", function or "main graph", quantized, len(found))
    overrides = {(decision.node, "T"): decision.reason for decision in found}
    return graph, replace(stats, float8_matmuls=quantized), replace(decisions, overrides=overrides)


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
    """One item ready to paint: its working node graph, context, TensorLists and why nodes were skipped."""

    graph_def: graph_pb2.GraphDef
    ctx: PaintContext
    tensor_lists: colouring.TensorLists
    skipped: dict[str, str]


def _prepare(rewrite: _Rewrite, function: str, graph_def: graph_pb2.GraphDef, fetches: tuple[str, ...]) -> _Item:
    """Steps 3-6 (module doc) on one item; ``fetches``: its nodes that keep their dtypes."""
    target, links = rewrite.target, rewrite.links
    frozen = rewrite.frozen if function == MAIN_GRAPH else (frozenset(), frozenset())
    # 3. The working copy as a node graph; every fetch must exist.
    nodes = graph_io.working_copy(graph_def)
    missing = [f for f in fetches if f not in nodes.node_defs]
    if missing:
        close = did_you_mean(missing[0], (node.name for node in graph_def.node))
        raise GraphError(f"fetch node(s) {', '.join(map(repr, missing))} not in the graph; {close}fetch"
                         " the names of its nodes")
    log.debug("%s: step 3 working copy: %d nodes", function or "main graph", len(nodes.node_defs))
    # 4. Which nodes may be painted.
    processed, skipped, kept = preparation.find_processed_nodes(nodes, target, fetches, rewrite.op_lists, function,
                                                                rewrite.reasons(function))
    log.debug("%s: step 4 processed nodes: %d, skipped %d (kept %d)", function or "main graph", len(processed),
              len(skipped), len(kept))
    # 5. FusedBatchNorm(Grad) → V2 on processed nodes, before anything else.
    upgraded = preparation.upgrade_batch_norm_ops(nodes, processed)
    log.debug("%s: step 5 batch-norm upgrade: %d nodes", function or "main graph", upgraded)
    # 6. The (node, type attribute) vertex graph, what colouring reads besides, and the
    # TensorList clusters with their implicit element edges (spec §2.1 steps 6-7).
    types = typegraph.build_type_graph(nodes, PAINTED_DTYPES, rewrite.program.op_defs)
    linked = frozenset(v for v in links.vertices(function) if v in types.succ)
    handles = frozenset(v for v in linked if types.dtype(v) == types_pb2.DT_VARIANT)
    ctx = PaintContext(types, rewrite.op_lists, target, frozenset(processed), processed, linked - handles,
                       pinned=frozenset(boundaries.loop_values(types)) - linked, list_links=handles, kept=kept,
                       frozen_nodes=frozen[0], frozen_allow=frozen[1])
    tensor_lists = colouring.find_tensor_lists(ctx)
    typegraph.add_implicit_edges(types, tensor_lists.edges)
    log.debug("%s: step 6 type graph: %d vertices, %d float32, %d TensorList clusters", function or "main graph",
              len(types.succ), len(ctx.float32), len(tensor_lists.clusters))
    return _Item(graph_def, ctx, tensor_lists, skipped)


def _finish(item: _Item, painting: Painting, function: str) -> tuple[graph_pb2.GraphDef, ItemStats, PendingDecisions]:
    """Step 8 (module doc) on one item, with each float32 vertex's reason; step 9's GraphDef."""
    ctx = item.ctx
    # Reasons first: explain() reads the graph as painted, before any dtype changes. A
    # float32 vertex ends as the target exactly when it is ALLOW (step 8 converts those).
    reasons, skipped = painting.reasons, item.skipped
    explained = {  # explain() would find the painting's reason first unless the node was skipped
        v: colouring.explain(ctx, painting, skipped, v) for v in ctx.float32
        if v.attr.name and (v.node in skipped or v not in reasons)
    }
    reasons.update(explained)  # the painting's own dict: this item's painting is done with
    decisions = PendingDecisions(function, ctx.target.name, ctx.float32, ctx.ops, painting.allow, reasons)
    # 8. Types and casts, the one mutation (of the working copy).
    stats = (casts.change_types_and_insert_casts(ctx.types, ctx.target, painting.allow) if painting.allow
             else casts.CastStats(0, 0, 0))
    log.debug("%s: step 8 types and casts: %d vertices converted, %d casts", function or "main graph",
              stats.vertices_converted, stats.casts_added)
    item_stats = ItemStats(function, len(item.graph_def.node), stats.vertices_converted, stats.casts_added,
                           stats.casts_to_target)
    # 9. Back to a GraphDef (the caller puts a function body back into its FunctionDef).
    graph_def = graph_io.take_graph_def(ctx.types.nodes)  # the item is done with its graph
    log.debug("%s: step 9 back to a GraphDef: %d nodes", function or "main graph", len(graph_def.node))
    return graph_def, item_stats, decisions
