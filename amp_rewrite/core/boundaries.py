"""Beyond grappler: which dtypes a call and its callee must share (``cross_function=True``).

Grappler paints each function body alone, so every call boundary and every loop-carried
value stays float32 and gets casts on both sides, inside loop bodies on every iteration
(spec §6). To let float16 cross a boundary, the dtype on the caller's side and on the
callee's ``_Arg``/``_Retval`` must change together. This module finds those groups
("links"): for a call, input *i* with the callee's argument *i* and output *j* with its
result *j*; for a ``While``, the loop value *i* with argument *i* of body and cond and
result *i* of the body; for an ``If``, input *i* with both branches' argument *i*,
output *j* with both branches' result *j*.

A link is only made when every function in it is rewritten here and is private: not an
entry point the caller names, not a gradient of record, and called only by the
functional ops above. Everything else keeps grappler's fixed-float32 boundary.
``cross_function="loops"`` links loops alone (the value a loop carries from one iteration
to the next), the calls and branches keeping grappler's boundary.

Linked, an in-place update of a loop-carried buffer (a decode loop's KV cache written
one position per iteration, :data:`IN_PLACE_UPDATE_OPS`) is a clear op: it passes its
buffer's dtype through, so the cache stays in the target dtype across iterations instead
of being cast down and up on each one. Grappler has these ops in no list (float32). A
linked loop's casts of weights it only reads move before the loop (``hoist``).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Mapping

from networkx.utils import UnionFind
from tensorflow.core.framework import function_pb2, graph_pb2, node_def_pb2, types_pb2

from amp_rewrite.core import colouring, typegraph
from amp_rewrite.core.colouring import PaintContext, Painting
from amp_rewrite.core.functions import LOOP_OPS, RETVAL_SUFFIX, called_functions
from amp_rewrite.core.lists import OpLists
from amp_rewrite.core.program import MAIN_GRAPH
from amp_rewrite.core.rules import Reason, Rule
from amp_rewrite.core.typegraph import TypeAttr, TypeGraph, Vertex

Slot = tuple[str, Vertex]  # (item, vertex): MAIN_GRAPH or a function name

_T = TypeAttr("T")
LOOPS = "loops"  # cross_function's value that links loop boundaries only
# Ops that write a slice of a buffer and return it: no arithmetic, a copy at most.
IN_PLACE_UPDATE_OPS = {
    "TensorScatterUpdate": "writes slices into a buffer (a KV cache); no arithmetic",
    "XlaDynamicUpdateSlice": "writes a slice into a buffer (keras' slice_update, a KV cache); no arithmetic",
    "TensorStridedSliceUpdate": "writes a slice into a buffer; no arithmetic",
    "InplaceUpdate": "writes rows into a buffer; no arithmetic",
}


def with_in_place_updates(op_lists: OpLists) -> OpLists:
    """``op_lists`` with the in-place update ops in no list made clear (linked painting only)."""
    added = {op: why for op, why in IN_PLACE_UPDATE_OPS.items() if op_lists.colour(op) is None}
    if not added:
        return op_lists
    return replace(op_lists, clear=op_lists.clear | added.keys(),
                   reasons={**op_lists.reasons, **{op: f"{why} (cross-function)" for op, why in added.items()}})


@dataclass(frozen=True)
class Links:
    """Groups of slots that must share one dtype, and what each item must treat as clear."""

    groups: tuple[frozenset[Slot], ...]

    def vertices(self, item: str) -> frozenset[Vertex]:
        return frozenset(v for group in self.groups for i, v in group if i == item)

    def nodes(self, item: str) -> frozenset[str]:
        return frozenset(v.node for v in self.vertices(item))

    def functions(self) -> frozenset[str]:
        """The functions with a linked slot: private, rewritten, their signatures free to change."""
        return frozenset(item for group in self.groups for item, _ in group if item != MAIN_GRAPH)


def _arg(function: function_pb2.FunctionDef, index: int) -> Vertex:
    return Vertex(function.signature.input_arg[index].name, _T)


def _ret(function: function_pb2.FunctionDef, index: int) -> Vertex:
    return Vertex(function.signature.output_arg[index].name + RETVAL_SUFFIX, _T)


def _call_groups(
    item: str, node: node_def_pb2.NodeDef, library: Mapping[str, function_pb2.FunctionDef], loops_only: bool = False,
) -> tuple[list[list[Slot]], set[str]]:
    """Slot groups for one functional node, and the functions it links (``loops_only``: loops' alone)."""
    if loops_only and node.op not in LOOP_OPS:
        return [], set()

    def fn(attr: str) -> function_pb2.FunctionDef:
        return library[node.attr[attr].func.name]

    groups: list[list[Slot]] = []
    if node.op in ("PartitionedCall", "StatefulPartitionedCall"):
        f = fn("f")
        for i in range(len(node.attr["Tin"].list.type)):
            groups.append([(item, Vertex(node.name, TypeAttr("Tin", i))), (f.signature.name, _arg(f, i))])
        for j in range(len(node.attr["Tout"].list.type)):
            groups.append([(item, Vertex(node.name, TypeAttr("Tout", j))), (f.signature.name, _ret(f, j))])
        return groups, {f.signature.name}
    if node.op in LOOP_OPS:
        body, cond = fn("body"), fn("cond")
        for i in range(len(node.attr["T"].list.type)):
            groups.append([
                (item, Vertex(node.name, TypeAttr("T", i))), (body.signature.name, _arg(body, i)),
                (body.signature.name, _ret(body, i)), (cond.signature.name, _arg(cond, i)),
            ])
        return groups, {body.signature.name, cond.signature.name}
    if node.op in ("If", "StatelessIf"):
        branches = [fn("then_branch"), fn("else_branch")]
        for i in range(len(node.attr["Tin"].list.type)):
            groups.append([(item, Vertex(node.name, TypeAttr("Tin", i)))] + [(b.signature.name, _arg(b, i)) for b in branches])
        for j in range(len(node.attr["Tout"].list.type)):
            groups.append([(item, Vertex(node.name, TypeAttr("Tout", j)))] + [(b.signature.name, _ret(b, j)) for b in branches])
        return groups, {b.signature.name for b in branches}
    return [], set()


def find_links(
    graph_def: graph_pb2.GraphDef, rewritten: Iterable[str], entry_functions: Iterable[str],
    library: Mapping[str, function_pb2.FunctionDef], *, loops_only: bool = False,
) -> Links:
    """The float32 slot groups that may change dtype together across function boundaries;
    ``library``: ``graph_def``'s functions by name (``Program.library``); ``loops_only``:
    across loop boundaries alone."""
    rewritten = set(rewritten)
    fixed = set(entry_functions) | {g.function_name for g in graph_def.library.gradient}
    fixed |= {g.gradient_func for g in graph_def.library.gradient}
    bodies = [(MAIN_GRAPH, graph_def.node)] + [(name, f.node_def) for name, f in library.items()]
    joined = UnionFind()
    callee_slots: set[Slot] = set()
    for item, nodes in bodies:
        for node in nodes:
            groups, callees = _call_groups(item, node, library, loops_only)
            referenced = set(called_functions(node)) & library.keys()
            if (item != MAIN_GRAPH and item not in rewritten) or not groups:
                fixed |= referenced  # called from a body we don't rewrite, or by an unknown op
                continue
            fixed |= referenced - callees
            for caller, *callee in groups:
                callee_slots.update(callee)
                for slot in callee:
                    joined.union(caller, slot)
    members: dict[Slot, set[Slot]] = defaultdict(set)
    for slot in joined:  # in the order first seen: the groups' order
        members[joined[slot]].add(slot)

    def usable(slot: Slot) -> bool:
        item = slot[0]
        if slot in callee_slots:
            return item in rewritten and item not in fixed
        return item == MAIN_GRAPH or item in rewritten

    return Links(tuple(frozenset(g) for g in members.values() if all(usable(slot) for slot in g)))


def is_float32_group(group: frozenset[Slot], dtype_of) -> bool:
    """A group is worth linking only if every slot is float32 (``dtype_of(item, vertex)``)."""
    return all(dtype_of(item, vertex) == types_pb2.DT_FLOAT for item, vertex in group)


def loop_values(types: TypeGraph) -> Iterator[Vertex]:
    """The ``T[i]`` vertices of functional While ops.

    The bfloat16 lists make While/StatelessWhile clear ops, and grappler then paints a loop
    value while the body and cond keep float32 signatures: an invalid graph (TF 2.21).
    We keep those values float32 unless ``cross_function`` changes the bodies with them.
    """
    for name, op in types.ops.items():
        if op in LOOP_OPS:
            for index in range(len(types.node_defs[name].attr["T"].list.type)):
                yield Vertex(name, typegraph.TypeAttr("T", index))


def paint_linked(
    contexts: Mapping[str, PaintContext], tensor_lists: Mapping[str, colouring.TensorLists], links: Links
) -> dict[str, Painting]:
    """Step 7 of the rewrite with ``cross_function``: paint, spread colours over linked groups, repeat.

    A group of linked values whose value comes from a DENY vertex on any side is denied
    on every side (so deny propagates into a callee as if it were inlined); otherwise,
    once any member is ALLOW, it seeds ALLOW on every side. TensorList clusters joined
    through linked list handles share one element dtype the same way. A group moves from
    nothing to ALLOW to DENY at most, so this ends. Finally a group converts only if all
    its members do, so both sides of every boundary agree.
    """
    def dtype(item: str, vertex: Vertex) -> int:
        return contexts[item].types.dtype(vertex) if vertex in contexts[item].types.succ else types_pb2.DT_INVALID

    groups = [list(g) for g in links.groups if is_float32_group(g, dtype)]
    seeds: dict[str, set[Vertex]] = {name: set() for name in contexts}
    deny_seeds: dict[str, set[Vertex]] = {name: set() for name in contexts}
    list_groups: list[list[tuple[str, Vertex]]] | None = None
    while True:
        paintings = {}
        for name, ctx in contexts.items():
            paintings[name] = colouring.paint(ctx, tensor_lists[name], frozenset(seeds[name]), frozenset(deny_seeds[name]))
        if list_groups is None:  # clusters depend on the graphs only, not on the seeds
            list_groups = _joined_tensor_lists(contexts, paintings, links)

        def denied(item: str, vertex: Vertex) -> bool:
            deny = paintings[item].deny
            return vertex in deny or any(f in deny for f in contexts[item].types.pred[vertex])

        grew = False
        for group in groups + list_groups:
            if any(denied(i, v) for i, v in group):
                for i, v in group:
                    seeds[i].discard(v)
                    grew |= v not in deny_seeds[i]
                    deny_seeds[i].add(v)
            elif all(v.node in contexts[i].processed for i, v in group) and any(
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
                    reasons[v] = Reason(Rule.CROSS_FUNCTION, "the other side of its function boundary stays float32")
                    paintings[i] = Painting(painting.allow - {v}, painting.deny, reasons, painting.clusters)
    return paintings


def _joined_tensor_lists(
    contexts: Mapping[str, PaintContext], paintings: Mapping[str, Painting], links: Links
) -> list[list[tuple[str, Vertex]]]:
    """Element vertices of TensorList clusters that share lists through linked handles."""
    slot_group = {slot: index for index, group in enumerate(links.groups) for slot in group}
    shared = UnionFind()
    element: dict[object, set[tuple[str, Vertex]]] = {}
    for name, painting in paintings.items():
        for index, cluster in enumerate(painting.clusters):
            if not cluster.touches:
                continue
            key = (name, index)
            element[key] = {(name, colouring.tensor_list_float_vertex(contexts[name], n)) for n in cluster.members}
            for vertex in cluster.touches:
                shared.union(("group", slot_group[(name, vertex)]), key)
    joined: dict[object, set[tuple[str, Vertex]]] = {}
    for key, vertices in element.items():
        joined.setdefault(shared[key], set()).update(vertices)
    return [sorted(vertices, key=str) for vertices in joined.values()]
