"""Deciding which vertices become low precision: grappler's passes, in grappler's order.

Every pass is a function over the vertex graph that returns new sets; nothing here
touches a GraphDef. ``paint`` is step 7 of the rewrite: it runs them as steps 7.0-7.10,
spec §2.3's passes 0-10 (TensorFlow 2.21 semantics: the infer-after-allow pass runs for
every target). Each vertex that ends up ALLOW or DENY gets a reason: its ``rules.Rule``
and a line naming the list, pass and neighbour that decided it. ``explain`` gives the
others theirs.
"""
from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2

from amp_rewrite.core import support
from amp_rewrite.core.graph_io import parse_tensor_name
from amp_rewrite.core.lists import Colour, OpLists
from amp_rewrite.core.rules import Reason, Rule
from amp_rewrite.core.target import Target
from amp_rewrite.core.typegraph import TypeAttr, TypeGraph, Vertex
from amp_rewrite.errors import GraphError

log = logging.getLogger(__name__)


DT_FLOAT = types_pb2.DT_FLOAT
TENSOR_LIST_READERS = frozenset(
    {"TensorListConcat", "TensorListConcatV2", "TensorListGather", "TensorListGetItem",
     "TensorListPopBack", "TensorListStack"}
)
TENSOR_LIST_WRITERS = frozenset(
    {"TensorListFromTensor", "TensorListPushBack", "TensorListPushBackBatch", "TensorListScatter",
     "TensorListScatterV2", "TensorListScatterIntoExistingList", "TensorListSetItem", "TensorListSplit"}
)
# Nodes a TensorList handle cannot be followed through (spec §2.5). Grappler stops only at
# these and direct function calls; we also stop at every op that calls a function (While,
# If, Case, ...): grappler paints a list half outside a loop while the loop body reads it
# as float32, and the graph fails at run time ("op elements float but list elements half").
TENSOR_LIST_BOUNDARIES = frozenset(
    {"_Arg", "_Retval", "OptionalFromValue", "OptionalGetValue", "PartitionedCall", "Placeholder",
     "StatefulPartitionedCall"}
)


@functools.lru_cache(maxsize=None)
def calls_functions(op: str) -> bool:
    """A registered op with a function attribute (While, If, Case, MapDataset, ...)."""
    op_def = support.registered_op_def(op)
    return op_def is not None and any(a.type in ("func", "list(func)") for a in op_def.attr)


# Deny ops that are safe where their argument cannot be positive: exp maps (-inf, 0] into
# (0, 1], so nothing overflows and the absolute error stays within a rounding step. There
# they act as infer ops (GELU's gradient exp(-x^2), a stable softmax's exp(x - max(x))).
# Expm1 has the same bound but stays denied: on a CPU its bfloat16 kernel costs more extra
# time than a cast on each side would, while Exp's costs less (tools/bench_ops.py times both;
# docs/design/differences.md has the numbers).
BOUNDED_WHEN_NONPOSITIVE = frozenset({"Exp"})
# Ops whose output is never negative.
NONNEGATIVE_OPS = frozenset(
    {"Abs", "Exp", "Relu", "Relu6", "Sigmoid", "Softmax", "Softplus", "Sqrt", "Square", "SquaredDifference"}
)


class KernelMemo:
    """The kernel checks' answers, filled as the passes ask (``PaintContext.has_target_kernel``).

    An answer depends on the node alone (op, attrs, device), never on colours, so every
    pass of one item shares one memo: ``by_vertex`` per vertex asked, and ``by_kernel``
    per (op, attr, device, other constrained types) for the unlabelled nodes that
    TensorFlow resolves to the same kernel.
    """

    def __init__(self) -> None:
        self.by_vertex: dict[Vertex, bool] = {}
        self.by_kernel: dict[tuple, bool] = {}


@dataclass(frozen=True)
class PaintContext:
    """What the passes read: the vertex graph, the lists, and per-vertex support checks.

    Frozen: a pass reads it and returns what it found. ``ops``, ``float32`` and ``bounded``
    are derived from the fields on first use; the kernel checks' answers go to ``memo``.
    """

    types: TypeGraph
    lists: OpLists
    target: Target
    processed: frozenset[str]
    kernel_device: Mapping[str, str]  # processed node -> device type for the kernel check
    # cross_function=True only: call/boundary vertices that act as clear ops.
    boundary: frozenset[Vertex] = frozenset()
    list_links: frozenset[Vertex] = frozenset()  # linked variant slots TensorLists may cross
    # Loop values of functional While ops whose bodies keep their signatures: never painted.
    pinned: frozenset[Vertex] = frozenset()
    # Unprocessed nodes a keep_nodes entry keeps -> why: never painted, and deny ops for step 7.2.
    kept: Mapping[str, Reason] = field(default_factory=dict)
    # Nodes a running Session already runs (``rewrite_graph_def(frozen=)``): their converted
    # vertices, ``frozen_allow``, are ALLOW from step 7.1 on, and no pass paints another of them
    # (7.4-7.6 and 7.10; the others decide from neighbours that are frozen too).
    frozen_nodes: frozenset[str] = frozenset()
    frozen_allow: frozenset[Vertex] = frozenset()
    memo: KernelMemo = field(default_factory=KernelMemo, repr=False, compare=False)

    @functools.cached_property
    def ops(self) -> Mapping[str, str]:
        """node -> op."""
        return self.types.ops

    @functools.cached_property
    def float32(self) -> Mapping[Vertex, None]:
        """The float32 vertices, in graph order: read before the rewrite, as casts change
        dtypes only after colouring."""
        return self.types.float32

    @functools.cached_property
    def bounded(self) -> Mapping[str, str]:
        """Deny nodes that act as infer ones: node -> why their argument is <= 0."""
        return nonpositive_arguments(self.types, bounded_ops(self.lists))

    def colour(self, node: str) -> Colour | None:
        """The node's list, as the passes read it: a bounded deny op is an infer op."""
        return Colour.INFER if node in self.bounded else self.lists.colour(self.ops[node])

    def is_infer(self, node: str) -> bool:
        """``colour(node) is Colour.INFER``, for the hot loops."""
        return self.ops[node] in self.lists.infer or node in self.bounded

    def is_clear(self, vertex: Vertex) -> bool:
        # Both sets are usually empty; testing that first saves hashing the vertex.
        if self.boundary and vertex in self.boundary:
            return True
        return self.ops[vertex.node] in self.lists.clear and not (self.pinned and vertex in self.pinned)

    def op(self, vertex: Vertex) -> str:
        return self.ops[vertex.node]

    def is_processed(self, vertex: Vertex) -> bool:
        return vertex.node in self.processed

    def is_float32(self, vertex: Vertex) -> bool:
        """Float32 before the rewrite."""
        return vertex in self.float32

    def op_allows_target(self, vertex: Vertex) -> bool:
        """SupportsF16DataType: the op definition admits the target dtype."""
        attr = vertex.attr
        return support.op_allows_dtype(self.op(vertex), attr.name, attr.fixed, self.target.dtype)

    def has_target_kernel(self, vertex: Vertex) -> bool:
        """SupportsF16: op definition and a registered kernel for the changed node."""
        found = self.memo.by_vertex.get(vertex)
        if found is None:
            found = self.memo.by_vertex[vertex] = self._has_target_kernel(vertex)
        return found

    def _has_target_kernel(self, vertex: Vertex) -> bool:
        if self.boundary and vertex in self.boundary:
            # A boundary vertex is a call's or function's own dtype, not a kernel's.
            return self.op_allows_target(vertex)
        node, attr = vertex
        op = self.ops[node]
        others = None if node in self.types.labelled else support.kernel_inputs(op, attr.name, attr.index >= 0)
        if others is None:
            return self.op_allows_target(vertex) and self._kernel_check(vertex)
        # Unlabelled nodes of one op, device and other constrained types share the answer.
        key = (op, attr, self.kernel_device.get(node))
        if others:
            attrs = self.types.node_defs[node].attr
            for name in others:
                value = attrs.get(name)
                if value is None:  # the kernel check reports the missing attr
                    return self.op_allows_target(vertex) and self._kernel_check(vertex)
                key += (value.type or value.SerializeToString(deterministic=True),)
        found = self.memo.by_kernel.get(key)
        if found is None:
            found = self.memo.by_kernel[key] = self.op_allows_target(vertex) and self._kernel_check(vertex)
        return found

    def _kernel_check(self, vertex: Vertex) -> bool:
        node_def = self.types.node_def(vertex.node)
        if vertex.attr.index < 0:
            return support.has_kernel_with_type(node_def, vertex.attr.name, self.target.dtype,
                                                self.kernel_device[vertex.node])
        attrs = dict(node_def.attr)
        changed = type(attrs[vertex.attr.name])()
        changed.CopyFrom(attrs[vertex.attr.name])
        changed.list.type[vertex.attr.index] = self.target.dtype
        attrs[vertex.attr.name] = changed
        return support.has_kernel(node_def, attrs, self.kernel_device[vertex.node])


def bounded_ops(lists: OpLists) -> frozenset[str]:
    """The deny ops that act as infer ops where their argument is never positive; none
    under TREAT_INFER_AS_DENY, which denies infer ops too."""
    return frozenset() if lists.infer_as_deny else lists.deny & BOUNDED_WHEN_NONPOSITIVE


def nonpositive_arguments(types: TypeGraph, ops: frozenset[str]) -> dict[str, str]:
    """Nodes of ``ops`` whose argument cannot be positive -> how that shows in the graph.

    Three shapes qualify: ``-f(x)`` for an op ``f`` in ``NONNEGATIVE_OPS``; ``c * f(x)``
    with a constant ``c`` that has no positive element; ``x - max(x)``, the max kept
    with its reduced dimensions.
    """
    found: dict[str, str] = {}
    if not ops:
        return found
    for node, op in types.ops.items():
        if op not in ops:
            continue
        producer = types.data_producer(node, 0)
        if producer is None:
            continue
        argument = producer[0]
        how = _nonpositive(types, argument)
        if how:
            found[node] = f"its argument '{argument}' is {how} <= 0"
    return found


def _nonpositive(types: TypeGraph, node: str) -> str:
    """How ``node``'s output 0 is never positive, or "" when the graph does not show it."""
    op = types.ops[node]
    if op not in ("Neg", "Mul", "Sub"):
        return ""
    inputs = [types.data_producer(node, port) for port in range(len(types.types[node].inputs))]
    if None in inputs:
        return ""
    producers = [types.ops[src] for src, _ in inputs]
    if op == "Neg" and producers[0] in NONNEGATIVE_OPS:
        return f"-{producers[0]}(...)"
    if op == "Mul":
        for factor, other in ((0, 1), (1, 0)):
            if producers[factor] in NONNEGATIVE_OPS and _nonpositive_constant(types, inputs[other][0]):
                return f"{producers[factor]}(...) times a non-positive constant"
    if (
        op == "Sub" and producers[1] == "Max" and types.data_producer(inputs[1][0], 0) == inputs[0]
        and _keeps_dims(types.node_def(inputs[1][0]))  # else max(x) broadcasts along other axes
    ):
        return "x - max(x)"
    return ""


def _keeps_dims(node_def: node_def_pb2.NodeDef) -> bool:
    value = node_def.attr.get("keep_dims")
    return value is not None and value.b


def constants_read(graph_def: graph_pb2.GraphDef) -> frozenset[str]:
    """The main graph's Const nodes whose values colouring reads (``c * f(x)`` above: a
    factor of a Mul); a reader that leaves large constants in their file reads these in."""
    consts = {node.name for node in graph_def.node if node.op == "Const"}
    return frozenset(ref.node for node in graph_def.node if node.op == "Mul"
                     for ref in map(parse_tensor_name, node.input[:2]) if not ref.is_control and ref.node in consts)


def _nonpositive_constant(types: TypeGraph, node: str) -> bool:
    node_def = types.node_def(node)
    if node_def.op != "Const" or "value" not in node_def.attr:
        return False
    values = tf.make_ndarray(node_def.attr["value"].tensor)
    return values.dtype.kind == "f" and bool(np.all(values <= 0))


FROZEN_CONVERTED = Reason(Rule.FROZEN, "its node already runs converted in the Session's rewritten copy")
FROZEN_FLOAT32 = Reason(Rule.FROZEN, "its node already runs float32 in the Session's rewritten copy")


@dataclass(frozen=True)
class Painting:
    """The outcome of colouring: ALLOW and DENY vertices, and why each is there."""

    allow: frozenset[Vertex]
    deny: frozenset[Vertex]
    reasons: Mapping[Vertex, Reason]
    clusters: tuple[TensorListCluster, ...] = ()


def _reach(
    types: TypeGraph, root: Vertex, enter: Callable[[Vertex], bool], *, inputs: bool, outputs: bool
) -> list[Vertex]:
    """Pre-order DFS from ``root`` (always entered) through vertices ``enter`` accepts."""
    seen, stack, order = {root}, [root], []
    pred, succ = types.pred, types.succ
    while stack:
        vertex = stack.pop()
        order.append(vertex)
        if inputs and outputs:
            neighbours: Iterable[Vertex] = itertools.chain(pred[vertex], succ[vertex])
        else:
            neighbours = pred[vertex] if inputs else succ[vertex]
        for other in neighbours:
            if other not in seen and enter(other):
                seen.add(other)
                stack.append(other)
    return order


def _closure(
    neighbours: Mapping[Vertex, Iterable[Vertex]], roots: Iterable[Vertex], enter: Callable[[Vertex], bool]
) -> set[Vertex]:
    """The roots and every vertex ``enter`` accepts that a path of accepted vertices joins
    to one: the union of ``_reach`` from each root, for an ``enter`` that does not change
    (so each vertex is asked once)."""
    found = set(roots)
    asked = set(found)
    stack = list(found)
    while stack:
        for other in neighbours[stack.pop()]:
            if other not in asked:
                asked.add(other)
                if enter(other):
                    found.add(other)
                    stack.append(other)
    return found


def _vertices(ctx: PaintContext) -> Iterator[Vertex]:
    return iter(ctx.types.succ)


# --- TensorList clusters (spec §2.5) -----------------------------------------------------


def tensor_list_float_vertex(ctx: PaintContext, node: str) -> Vertex | None:
    """The element-dtype vertex of a TensorList op, if it is float32."""
    node_def = ctx.types.node_def(node)
    if "TensorList" not in node_def.op:
        return None
    for attr in ctx.types.types[node].attrs:
        vertex = Vertex(node, attr)
        if attr.name and attr.index < 0 and ctx.is_float32(vertex):
            return vertex
    return None


class TensorListCluster(NamedTuple):
    """TensorList ops sharing lists, and the linked boundary slots the lists cross."""

    members: frozenset[str]
    touches: frozenset[Vertex] = frozenset()  # cross_function only: e.g. a While's T[i]


@dataclass(frozen=True)
class TensorLists:
    """What step 6 finds about an item's TensorLists (spec §2.1 step 7, §2.5) for colouring:
    the clusters, the unsafe clusters' roots with why (step 7.0 denies them), and the
    writer → reader element edges, which ``typegraph.add_implicit_edges`` adds to the graph."""

    clusters: tuple[TensorListCluster, ...] = ()
    unsafe: Mapping[Vertex, Reason] = field(default_factory=dict)
    edges: tuple[tuple[Vertex, Vertex], ...] = ()


def find_tensor_lists(ctx: PaintContext) -> TensorLists:
    """The item's TensorList clusters, unsafe roots and implicit edges (``TensorLists``)."""
    clusters, unsafe = find_tensor_list_clusters(ctx)
    # A cluster is found from each of its members (as grappler does): one edge once, in order.
    edges = tuple(dict.fromkeys(edge for cluster in clusters for edge in tensor_list_implicit_edges(ctx, cluster)))
    return TensorLists(tuple(clusters), unsafe, edges)


def find_tensor_list_clusters(ctx: PaintContext) -> tuple[list[TensorListCluster], dict[Vertex, Reason]]:
    """Float32 TensorList ops joined by their handles, and the roots of unsafe clusters.

    A handle that reaches a function boundary makes the cluster unsafe, unless the
    boundary is linked (``cross_function``): then the cluster records it and continues
    on the other side, where the caller matches both sides' colours.
    """
    clusters: list[TensorListCluster] = []
    deny: dict[Vertex, Reason] = {}
    handle = TypeAttr(fixed=types_pb2.DT_VARIANT)
    functions = ctx.types.op_defs
    for node, op in ctx.ops.items():
        if "TensorList" not in op:
            continue  # tensor_list_float_vertex would say None
        root = Vertex(node, handle)
        if node not in ctx.processed or root not in ctx.types.succ:
            continue
        root_float = tensor_list_float_vertex(ctx, node)
        if root_float is None:
            continue
        members, touches = {node}, set()
        for vertex in _reach(ctx.types, root, lambda v: True, inputs=True, outputs=True):
            op = ctx.op(vertex)
            if vertex in ctx.list_links:
                touches.add(vertex)
            elif tensor_list_float_vertex(ctx, vertex.node) is not None:
                members.add(vertex.node)
                if vertex.node not in ctx.processed:
                    deny.setdefault(root_float, Reason(Rule.TENSOR_LIST, f"TensorList cluster includes unprocessed node '{vertex.node}'", vertex.node))
            elif op in TENSOR_LIST_BOUNDARIES or op in functions or calls_functions(op):
                deny.setdefault(root_float, Reason(Rule.TENSOR_LIST, f"TensorList handle crosses '{vertex.node}' ({op})", vertex.node))
        clusters.append(TensorListCluster(frozenset(members), frozenset(touches)))
    return clusters, deny


def tensor_list_implicit_edges(ctx: PaintContext, cluster: TensorListCluster) -> list[tuple[Vertex, Vertex]]:
    """Writer → reader element edges: what is written into a list flows to what is read."""
    edges = []
    handle = TypeAttr(fixed=types_pb2.DT_VARIANT)
    for node in cluster.members:
        if ctx.types.node_def(node).op not in TENSOR_LIST_READERS or node not in ctx.processed:
            continue
        reader = tensor_list_float_vertex(ctx, node)
        for vertex in _reach(ctx.types, Vertex(node, handle), ctx.is_processed, inputs=True, outputs=False):
            writer = tensor_list_float_vertex(ctx, vertex.node)
            if ctx.op(vertex) in TENSOR_LIST_WRITERS and writer is not None:
                edges.append((writer, reader))
    return edges


def match_tensor_list_colours(
    ctx: PaintContext, clusters: Iterable[TensorListCluster], allow: set[Vertex], deny: set[Vertex],
) -> tuple[set[Vertex], set[Vertex], dict[Vertex, Reason]]:
    """Steps 7.3 and 7.8: all members of a cluster share one colour, DENY wins, else ALLOW
    spreads. Returns new allow and deny sets and this rule's reason for each vertex it
    moved (to DENY, or out of nothing into ALLOW)."""
    clusters = list(clusters)
    if not clusters:
        return allow, deny, {}
    allow, deny = set(allow), set(deny)
    found: dict[Vertex, Reason] = {}
    for cluster in clusters:
        members = [tensor_list_float_vertex(ctx, node) for node in cluster.members]
        if any(v in deny for v in members):
            for v in members:
                if v not in deny:
                    found[v] = Reason(Rule.TENSOR_LIST, "TensorList cluster shares one dtype and a member must stay float32")
                allow.discard(v)
                deny.add(v)
        elif any(v in allow for v in members):
            for v in members:
                if v not in allow:
                    allow.add(v)
                    found[v] = Reason(Rule.TENSOR_LIST, "TensorList cluster shares one dtype and a member is converted")
    return allow, deny, found


# --- the numbered passes: step 7.N is spec §2.3's pass N ----------------------------------


def add_allowlist_ops(ctx: PaintContext) -> dict[Vertex, Reason]:
    """Step 7.1: every vertex of a processed allowlisted node (or forced, UNSAFE_FORCE_ALL)."""
    allow: dict[Vertex, Reason] = {}
    op_to_reason: dict[str, Reason | None] = {}  # None: the op's vertices stay unpainted here
    ops, processed, lists = ctx.ops, ctx.processed, ctx.lists
    # Every vertex, not only the graph's: one of another dtype still makes the allow set
    # non-empty, and with it which later passes run and how the rest is explained.
    for node in ctx.types.vertices:
        if node not in processed:
            continue
        op = ops[node]
        if op in op_to_reason:
            reason = op_to_reason[op]
        elif op in lists.allow:
            reason = op_to_reason[op] = Reason(Rule.ALLOW_LIST, f"op {op} is on the allow list")
        elif lists.force_all and _can_force(op):
            reason = op_to_reason[op] = Reason(Rule.FORCE_ALL, f"op {op} forced by TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL=UNSAFE_FORCE_ALL")
        else:
            reason = op_to_reason[op] = None
        if reason is not None:
            for vertex in ctx.types.node_vertices(node):
                allow[vertex] = reason
    return allow


def _can_force(op: str) -> bool:
    """CanForceFP16: not Const, not SoftmaxCrossEntropyWithLogits, stateless, no ref args."""
    if op in ("Const", "SoftmaxCrossEntropyWithLogits"):
        return False
    op_def = support.registered_op_def(op)
    if op_def is None or op_def.is_stateful:
        return False
    return not any(arg.is_ref for arg in list(op_def.input_arg) + list(op_def.output_arg))


def propagate_deny_forward(
    ctx: PaintContext, deny: set[Vertex], deny_seeds: frozenset[Vertex] = frozenset()
) -> dict[Vertex, Reason]:
    """Step 7.2: deny spreads from deny ops through clear/infer ops that lead to deny/infer ops.

    Not restricted to processed nodes. Beyond grappler, the float32 vertices of kept nodes
    (``ctx.kept``) are roots like a deny op's. ``deny_seeds`` (``cross_function``) are roots too:
    vertices whose value comes from a deny path across a function boundary. Returns the
    newly denied vertices with reasons.
    """
    if ctx.lists.force_all:
        return {}
    types = ctx.types
    lists = ctx.lists
    ops, stoppers, clear, kept = ctx.ops, lists.deny | lists.infer, lists.clear, ctx.kept
    denied = set(deny)
    stopper_vertices, roots = [], []  # roots: the deny ops' and kept nodes' vertices
    for node, vertices in ctx.types.vertices.items():
        stopper, keeps = ops[node] in stoppers, bool(kept) and node in kept
        if not (stopper or keeps):
            continue
        deny_op = stopper and ctx.colour(node) is Colour.DENY
        for v in vertices:
            if v is None:
                continue
            if stopper:
                stopper_vertices.append(v)
                if deny_op and v not in denied:
                    roots.append(v)
                    continue
            if keeps and v not in denied and v in ctx.float32:
                roots.append(v)
    if deny_seeds:  # cross_function: deny from across a boundary
        roots += [v for v in _vertices(ctx) if v in deny_seeds]
    if not roots:
        return {}
    # Pinned loop values are clear ops all the same: deny passes through them.
    upstream = _closure(types.pred, stopper_vertices, lambda v: ops[v.node] in clear or ctx.is_clear(v))
    added: dict[Vertex, Reason] = {}
    for root in roots:
        op = ctx.op(root)
        if root in denied and root not in deny_seeds:
            continue
        propagated = None  # one Reason for every vertex this root denies
        for vertex in _reach(types, root, lambda v: v not in denied and v in upstream, inputs=False, outputs=True):
            if vertex not in denied:
                denied.add(vertex)
                if vertex == root:
                    added[vertex] = kept.get(root.node) or Reason(Rule.DENY_LIST, f"op {op} is on the deny list")
                    continue
                if propagated is None:
                    what = f"kept node '{root.node}'" if root.node in kept else f"deny op {op} ('{root.node}')"
                    propagated = Reason(Rule.DENY_PROPAGATION, f"downstream of {what} through clear/infer ops",
                                        root.node)
                added[vertex] = propagated
    return added


def _allow_op_vertices(ctx: PaintContext, seeds: frozenset[Vertex]) -> list[Vertex]:
    """Step 7.4's roots, in graph order: the vertices of processed allowlisted nodes, the
    ``seeds`` of processed ones, and the frozen converted vertices."""
    ops, processed, allow_ops, frozen_allow = ctx.ops, ctx.processed, ctx.lists.allow, ctx.frozen_allow
    roots: list[Vertex] = []
    for node, vertices in ctx.types.vertices.items():
        if node in processed and ops[node] in allow_ops:
            roots += [v for v in vertices if v is not None]
        elif seeds or frozen_allow:
            roots += [v for v in vertices if v is not None and (v in seeds and node in processed or v in frozen_allow)]
    return roots


def add_clear_and_infer_between_allow(
    ctx: PaintContext, allow: set[Vertex], deny: set[Vertex], seeds: frozenset[Vertex] = frozenset()
) -> dict[Vertex, Reason]:
    """Step 7.4: clear/infer vertices both downstream and upstream of allowlist ops (grappler logs "pass 3")."""
    types, lists = ctx.types, ctx.lists
    ops, processed, float32 = ctx.ops, ctx.processed, ctx.float32
    # Seeds (cross_function) count as allow ops: across the boundary they meet one.
    # Frozen converted vertices are roots too: the allow ops that made them so are frozen.
    frozen = ctx.frozen_nodes
    roots = _allow_op_vertices(ctx, seeds)

    allow_ops, infer_ops, clear_ops, bounded = lists.allow, lists.infer, lists.clear, ctx.bounded
    boundary, pinned, has_target_kernel = ctx.boundary, ctx.pinned, ctx.has_target_kernel

    def enter_downstream(v: Vertex) -> bool:
        node = v.node
        op = ops[node]
        return (
            op not in allow_ops and v not in deny and node in processed and node not in frozen
            # ctx.is_infer(node) or ctx.is_clear(v), inlined
            and (op in infer_ops or node in bounded or bool(boundary) and v in boundary
                 or op in clear_ops and not (pinned and v in pinned))
            and v in float32 and has_target_kernel(v)  # the closure asks each vertex once: no memo first
        )

    downstream = _closure(types.succ, roots, enter_downstream)
    upstream: set[Vertex] = set()
    added: dict[Vertex, Reason] = {}
    fanins = types.pred
    for root in roots:
        if root in upstream:
            continue
        # _reach(graph, root, lambda v: v not in upstream and v in downstream, inputs=True), inlined
        # (one call per allow vertex): marking at push time is the same test as its ``seen``.
        between = None  # one Reason for every vertex found from this root
        upstream.add(root)
        stack = [root]
        while stack:
            vertex = stack.pop()
            if vertex not in allow and vertex not in added:
                if between is None:
                    between = Reason(Rule.BETWEEN_ALLOW, f"between allow ops (upstream of '{root.node}')", root.node)
                added[vertex] = between
            for other in fanins[vertex]:
                if other not in upstream and other in downstream:
                    upstream.add(other)
                    stack.append(other)
    return added


def add_infer_after_allow(ctx: PaintContext, allow: set[Vertex], deny: set[Vertex]) -> dict[Vertex, Reason]:
    """Step 7.5: an infer vertex fed by an allow vertex and by no deny vertex (TF 2.20+: all targets;
    grappler logs "pass 4").

    One sweep in vertex order, so a vertex added here can qualify a later one.
    """
    fanins_of = ctx.types.pred
    added: dict[Vertex, Reason] = {}
    ops, processed, frozen, infer_ops, bounded, float32 = (ctx.ops, ctx.processed, ctx.frozen_nodes, ctx.lists.infer,
                                                          ctx.bounded, ctx.float32)
    for node, vertices in ctx.types.vertices.items():
        if node not in processed or node in frozen or not (ops[node] in infer_ops or node in bounded):
            continue  # ctx.is_infer(node), inlined
        for vertex in vertices:
            if (vertex is None or vertex in deny or vertex in allow or vertex in added or vertex not in float32
                    or not ctx.op_allows_target(vertex)):
                continue
            feeder = None  # the first fanin in ALLOW; none at all if any is DENY
            for fanin in fanins_of[vertex]:
                if fanin in deny:
                    break
                if feeder is None and (fanin in allow or fanin in added):
                    feeder = fanin
            else:
                if feeder is not None:
                    added[vertex] = Reason(Rule.INFER_AFTER_ALLOW, f"infer op directly after allow node '{feeder.node}'",
                                           feeder.node)
    return added


def propagate_allow_through_clear(ctx: PaintContext, allow: set[Vertex], deny: set[Vertex]) -> dict[Vertex, Reason]:
    """Step 7.6: allow spreads both ways through clear vertices, never through infer ones (grappler logs "pass 5")."""
    painted = set(allow)
    used: set[Vertex] = set()
    added: dict[Vertex, Reason] = {}

    ops, processed, float32, frozen, clear_ops = ctx.ops, ctx.processed, ctx.float32, ctx.frozen_nodes, ctx.lists.clear
    boundary, pinned = ctx.boundary, ctx.pinned
    kernel_answers, has_target_kernel, reads_ref_variable = ctx.memo.by_vertex, ctx.has_target_kernel, \
        ctx.types.reads_ref_variable

    def enter(v: Vertex) -> bool:
        node = v.node
        return (
            v not in painted and v not in deny and node in processed and node not in frozen
            and (bool(boundary) and v in boundary or ops[node] in clear_ops and not (pinned and v in pinned))
            and v in float32 and (kernel_answers.get(v) or has_target_kernel(v)) and not reads_ref_variable(node)
        )

    fanins, fanouts = ctx.types.pred, ctx.types.succ
    # Once ``enter`` says no, it says no for good: the vertex is painted or can never be
    # entered; one it lets in is painted by that walk. So each vertex is asked once, over
    # all the walks.
    asked: set[Vertex] = set()
    for node, vertices in ctx.types.vertices.items():
        if node not in processed:
            continue
        for root in vertices:
            if root is None or root not in painted or root in used:
                continue
            # _reach(graph, root, enter, inputs=True, outputs=True), inlined (one call per allow vertex).
            spread = None  # one Reason for every vertex found from this root
            asked.add(root)
            stack = [root]
            while stack:
                vertex = stack.pop()
                used.add(vertex)
                if vertex not in painted:
                    painted.add(vertex)
                    if spread is None:
                        spread = Reason(Rule.CLEAR_PROPAGATION,
                                        f"clear op connected to allow node '{root.node}' through clear ops", root.node)
                    added[vertex] = spread
                for other in itertools.chain(fanins[vertex], fanouts[vertex]):
                    if other not in asked:
                        asked.add(other)
                        if enter(other):
                            stack.append(other)
    return added


def remove_unconvertible_allow(ctx: PaintContext, allow: set[Vertex]) -> dict[Vertex, Reason]:
    """Step 7.7: allowlisted vertices whose op definition rejects the target, or quantized nodes (grappler logs
    "pass 6")."""
    removed: dict[Vertex, Reason] = {}
    allows: dict[tuple[str, TypeAttr], bool] = {}  # op_allows_target by (op, attr): the same for every node
    ops, allow_ops, quantized = ctx.ops, ctx.lists.allow, ctx.types.quantized
    for vertex in allow:
        node, attr = vertex
        op = ops[node]
        if op not in allow_ops:
            continue
        allowed = allows.get((op, attr))
        if allowed is None:
            allowed = allows[(op, attr)] = ctx.op_allows_target(vertex)
        if not allowed:
            removed[vertex] = Reason(Rule.UNCONVERTIBLE, f"the op definition of {op} does not allow the target dtype for {attr}")
        elif node in quantized:
            removed[vertex] = Reason(Rule.UNCONVERTIBLE, "the node is quantized")
    return removed


def match_recurrent_edges(ctx: PaintContext, allow: set[Vertex]) -> tuple[set[Vertex], dict[Vertex, Reason]]:
    """Step 7.9: NextIteration and the Merge nodes it feeds share one colour (v1 while loops);
    a kept NextIteration keeps its Merges float32."""
    allow = set(allow)
    reasons: dict[Vertex, Reason] = {}
    t = TypeAttr("T")
    for node, op in ctx.ops.items():
        if op != "NextIteration":
            continue
        merges = []
        for consumer, _ in ctx.types.data_consumers(node, 0):
            consumer_op = ctx.types.node_def(consumer).op
            if consumer_op != "Merge":
                raise GraphError(
                    f"node '{node}': expected Merge node after NextIteration, got {consumer_op}"
                    f" ('{consumer}'); the while loop is malformed"
                )
            merges.append(Vertex(consumer, t))
        next_iteration = Vertex(node, t)
        if all(m in allow for m in merges) and node not in ctx.kept:
            if next_iteration not in allow:
                allow.add(next_iteration)
                reasons[next_iteration] = Reason(Rule.RECURRENT_EDGE, "matches the colour of the Merge node(s) it feeds")
        else:
            for vertex in merges + [next_iteration]:
                if vertex in allow:
                    allow.discard(vertex)
                    why = "it is kept" if node in ctx.kept else "a Merge it feeds stays float32"
                    reasons[vertex] = Reason(Rule.RECURRENT_EDGE, f"recurrent edge of '{node}': {why}", node)
    return allow, reasons


def retarget_existing_casts(ctx: PaintContext, allow: set[Vertex]) -> dict[Vertex, Reason]:
    """Step 7.10: a float32-producing Cast whose consumers are all ALLOW produces the target
    directly, unless it is kept (grappler asks this of unprocessed Casts too)."""
    added: dict[Vertex, Reason] = {}
    dst = TypeAttr("DstT")
    for node, op in ctx.ops.items():
        if op != "Cast" or node in ctx.kept or node in ctx.frozen_nodes:
            continue
        vertex = Vertex(node, dst)
        if not ctx.is_float32(vertex):
            continue
        consumers = [ctx.types.input_vertex(c, port) for c, port in ctx.types.data_consumers(node, 0)]
        if consumers and all(c in allow for c in consumers):
            added[vertex] = Reason(Rule.EXISTING_CAST, "existing Cast whose consumers are all converted")
    return added


class _Reasons:
    """Which reason a vertex ends with when several steps give it one: the one that explains
    its final colour. A converted vertex has the reason of the last step that added it to
    ALLOW (7.8 re-adds what 7.7 took out); a vertex kept float32 and denied, of the first
    step that denied it (no step undoes a denial, and a later one only agrees); one a step
    took out of ALLOW without denying it, of the last such step (7.7, 7.9)."""

    def __init__(self) -> None:
        self.allow: dict[Vertex, Reason] = {}
        self.deny: dict[Vertex, Reason] = {}
        self.removed: dict[Vertex, Reason] = {}

    def added(self, step: str, found: Mapping[Vertex, Reason]) -> None:
        log.debug("step %s: %d vertices", step, len(found))
        self.allow.update(found)

    def denied(self, step: str, found: Mapping[Vertex, Reason]) -> None:
        log.debug("step %s: %d vertices", step, len(found))
        for vertex, why in found.items():
            self.deny.setdefault(vertex, why)

    def moved(self, step: str, found: Mapping[Vertex, Reason], allow: set[Vertex], deny: set[Vertex]) -> None:
        """A step that moves vertices both ways: each reason goes where its vertex went."""
        log.debug("step %s: %d vertices", step, len(found))
        for vertex, why in found.items():
            if vertex in allow:
                self.allow[vertex] = why
            elif vertex in deny:
                self.deny.setdefault(vertex, why)
            else:
                self.removed[vertex] = why

    def final(self, allow: set[Vertex], deny: set[Vertex]) -> dict[Vertex, Reason]:
        final = {v: why for v, why in self.removed.items() if v not in deny}
        final.update(self.deny)
        final.update((v, self.allow[v]) for v in allow)
        return final


def paint(
    ctx: PaintContext, tensor_lists: TensorLists, seeds: frozenset[Vertex] = frozenset(),
    deny_seeds: frozenset[Vertex] = frozenset(),
) -> Painting:
    """Step 7 of the rewrite: grappler's colouring passes in order, 7.0-7.10 being spec
    §2.3's passes 0-10, each one call logged at DEBUG; returns the painting and changes
    nothing it is given.

    ``tensor_lists``: ``find_tensor_lists(ctx)``, whose edges are already in the graph.
    ``seeds`` and ``deny_seeds`` (``cross_function`` only): vertices known to be converted,
    or to carry a value from a deny path, on the other side of their function boundary.
    """
    why, clusters = _Reasons(), tuple(tensor_lists.clusters)
    allow, deny = _first_colours(ctx, tensor_lists, seeds, deny_seeds, why)  # 7.0 and 7.1
    if not allow:
        log.info("No allowlist ops found, nothing to do")
        return Painting(frozenset(), frozenset(deny), why.final(allow, deny), clusters)
    # 7.2 Deny propagation through clear/infer.
    deny_found = propagate_deny_forward(ctx, deny, deny_seeds)
    why.denied("7.2 deny propagation", deny_found)
    deny |= deny_found.keys()
    # 7.3 TensorList colour match.
    allow, deny, found = match_tensor_list_colours(ctx, clusters, allow, deny)
    why.moved("7.3 tensor-list colours", found, allow, deny)
    # 7.4 Clear/infer between allow ops.
    found = add_clear_and_infer_between_allow(ctx, allow, deny, seeds)
    why.added("7.4 between allow", found)
    allow |= found.keys()
    # 7.5 Infer directly after allow.
    found = add_infer_after_allow(ctx, allow, deny)
    why.added("7.5 infer after allow", found)
    allow |= found.keys()
    # 7.6 Allow through clear.
    found = propagate_allow_through_clear(ctx, allow, deny)
    why.added("7.6 allow through clear", found)
    allow |= found.keys()
    # 7.7 Remove unconvertible allowlist vertices.
    removed = remove_unconvertible_allow(ctx, allow)
    allow -= removed.keys()
    why.moved("7.7 unconvertible", removed, allow, deny)
    # 7.8 TensorList colour match again.
    allow, deny, found = match_tensor_list_colours(ctx, clusters, allow, deny)
    why.moved("7.8 tensor-list colours", found, allow, deny)
    # 7.9 Recurrent edges.
    allow, found = match_recurrent_edges(ctx, allow)
    why.moved("7.9 recurrent edges", found, allow, deny)
    # 7.10 Existing casts.
    found = retarget_existing_casts(ctx, allow)
    why.added("7.10 existing casts", found)
    allow |= found.keys()
    return Painting(frozenset(allow), frozenset(deny), _say_bounded(ctx, why.final(allow, deny), allow), clusters)


def _first_colours(
    ctx: PaintContext, tensor_lists: TensorLists, seeds: frozenset[Vertex], deny_seeds: frozenset[Vertex],
    why: _Reasons,
) -> tuple[set[Vertex], set[Vertex]]:
    """Steps 7.0 and 7.1: the roots of unsafe TensorList clusters (and ``deny_seeds``) denied,
    the allowlist ops' vertices (and ``seeds``, and frozen converted vertices) allowed."""
    deny_found = {**tensor_lists.unsafe, **{v: CROSSING_DENY for v in deny_seeds if v not in tensor_lists.unsafe}}
    why.denied("7.0 tensor-list clusters", deny_found)
    allow_found = add_allowlist_ops(ctx)
    allow_found.update((v, CROSSING_ALLOW) for v in seeds if v not in allow_found)
    allow_found.update((v, FROZEN_CONVERTED) for v in ctx.frozen_allow if v in ctx.types.succ)
    why.added("7.1 allow list", allow_found)
    return set(allow_found), set(deny_found)


CROSSING_DENY = Reason(Rule.CROSS_FUNCTION, "a value from a deny path crosses this function boundary")
CROSSING_ALLOW = Reason(Rule.CROSS_FUNCTION, "shares its dtype with converted values across a function boundary")


def _say_bounded(ctx: PaintContext, reasons: dict[Vertex, Reason], allow: set[Vertex]) -> dict[Vertex, Reason]:
    """``reasons`` with each converted vertex of a bounded deny op saying why it acts as infer."""
    for node, why in ctx.bounded.items():
        for vertex in ctx.types.node_vertices(node):
            if vertex in allow:
                rule, text, source = reasons[vertex]
                reasons[vertex] = Reason(rule, f"{text}; deny op {ctx.ops[node]} acts as infer: {why}", source)
    return reasons


@functools.lru_cache(maxsize=1024)
def _unlisted(op: str) -> Reason:
    """The reason of an op in no list: one value per op, as most float32 vertices kept have it."""
    return Reason(Rule.UNLISTED, f"op {op} is in no list")


def explain(ctx: PaintContext, painting: Painting, skipped: dict[str, str], vertex: Vertex) -> Reason:
    """Why one vertex has its final colour."""
    kept = ctx.kept.get(vertex.node)
    if kept is not None:  # whatever else denied it, the entry decided
        return kept
    if vertex.node in ctx.frozen_nodes and vertex not in painting.allow:
        return FROZEN_FLOAT32
    if vertex.node in skipped and vertex not in painting.allow and vertex not in painting.deny:
        return Reason(Rule.NOT_PROCESSED, skipped[vertex.node])
    reason = painting.reasons.get(vertex)  # every ALLOW and DENY vertex has one
    if reason is not None:
        return reason
    op = ctx.op(vertex)
    if ctx.pinned and vertex in ctx.pinned:
        return Reason(Rule.LOOP_VALUE, "loop value of a functional While whose body and cond keep float32 signatures")
    if not painting.allow:
        return Reason(Rule.NO_ALLOW_OPS, "no allow-list op in the graph, so nothing is converted")
    colour = ctx.colour(vertex.node)
    if colour is None:
        if op in ctx.lists.reasons:  # in the float32 section of the built-in file
            return Reason(Rule.SLOWER_CONVERTED, f"op {op}: {ctx.lists.reasons[op]}")
        return _unlisted(op)
    if colour in (Colour.CLEAR, Colour.INFER) and not ctx.has_target_kernel(vertex):
        return Reason(Rule.NO_KERNEL, f"no {ctx.target.name} kernel for {op} on {ctx.kernel_device[vertex.node]}")
    if colour is Colour.INFER:
        bounded = f" (deny op {op} acting as infer: {ctx.bounded[vertex.node]})" if vertex.node in ctx.bounded else ""
        return Reason(Rule.INFER_ISOLATED, f"infer op neither between allow ops nor directly after one{bounded}")
    return Reason(Rule.CLEAR_ISOLATED, "clear op not connected to an allow op through clear ops")
