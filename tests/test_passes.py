"""One small graph per colouring rule, each calling its pass directly (spec §2.3, step 7.N).

The graphs have 3-6 nodes whose names say the colour they should end with (``allow1``,
``deny1``, ``inf1``, ``clr1``); the lists are written out here, not the built-in ones, so
a test shows the whole rule: ``MatMul`` allow, ``Exp`` deny, ``AddV2`` infer, ``Relu`` and
``Identity`` clear. The target is bfloat16 on the CPU, where TensorFlow registers the
kernels the kernel checks ask for. Each pass gets the sets the passes before it would
have made, so when a pass breaks, the test named after its rule fails, and only that one.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import tensorflow as tf
from tensorflow.core.framework import types_pb2

from amp_rewrite.core import colouring, graph_io, preparation, typegraph
from amp_rewrite.core.colouring import PaintContext, Painting
from amp_rewrite.core.lists import OpLists
from amp_rewrite.core.rewrite import PAINTED_DTYPES
from amp_rewrite.core.rules import Reason, Rule
from amp_rewrite.core.target import BFLOAT16
from amp_rewrite.core.typegraph import TypeAttr, Vertex

from conftest import graph_def_of

LISTS = OpLists(
    target="bfloat16", allow={"MatMul"}, deny={"Exp"}, infer={"AddV2"}, clear={"Relu", "Identity"}
)
T = TypeAttr("T")


def context(build: Callable[[], object], *, unprocessed: Iterable[str] = (), lists: OpLists = LISTS) -> PaintContext:
    """The paint context of the graph ``build`` makes: every node processed on the CPU
    except ``unprocessed``, placeholders (grappler preserves feeds) and the nodes the
    lists' keep_nodes keep."""
    nodes = graph_io.working_copy(graph_def_of(build))
    kept = preparation.find_processed_nodes(nodes, BFLOAT16, (), lists)[2]
    types = typegraph.build_type_graph(nodes, PAINTED_DTYPES)
    skipped = set(unprocessed) | set(kept)
    processed = {name: "CPU" for name, op in types.ops.items() if name not in skipped and op != "Placeholder"}
    return PaintContext(types, lists, BFLOAT16, frozenset(processed), processed, kept=kept)


def t(*nodes: str) -> set[Vertex]:
    """The ``T`` vertices of ``nodes``."""
    return {Vertex(node, T) for node in nodes}


def x(shape: tuple[int, ...] = (2, 2)) -> tf.Tensor:
    return tf.compat.v1.placeholder(tf.float32, shape, name="x")


def test_allow_list_adds_every_vertex_of_processed_allow_ops():
    """Step 7.1: every vertex of a processed allow-list op is ALLOW; an unprocessed one is not."""
    def build():
        a = tf.matmul(x(), x(), name="allow1")
        tf.matmul(a, a, name="mm_unprocessed")

    ctx = context(build, unprocessed=["mm_unprocessed"])
    found = colouring.add_allowlist_ops(ctx)
    assert set(found) == t("allow1")
    assert {reason.rule for reason in found.values()} == {Rule.ALLOW_LIST}


def test_deny_propagates_through_clear_and_infer_towards_deny_or_infer_ops():
    """Step 7.2: deny spreads downstream of a deny op through clear and infer ops, but only
    along paths that end at another deny or infer op (spec §2.3 pass 2)."""
    def build():
        d = tf.exp(x(), name="deny1")
        c = tf.nn.relu(d, name="deny2_clr")  # leads to an infer op: denied
        tf.add(c, c, name="deny3_inf")
        tf.identity(tf.identity(d, name="clr_dead_end"), name="clr_end")  # leads nowhere: left alone

    ctx = context(build)
    found = colouring.propagate_deny_forward(ctx, set())
    assert set(found) == t("deny1", "deny2_clr", "deny3_inf")
    assert found[Vertex("deny1", T)].rule is Rule.DENY_LIST
    assert found[Vertex("deny3_inf", T)] == (Rule.DENY_PROPAGATION, found[Vertex("deny3_inf", T)].text, "deny1")


def test_clear_and_infer_ops_between_allow_ops_become_allow():
    """Step 7.4: a clear or infer op both downstream and upstream of allow ops is ALLOW; one
    only downstream (its output reaches no allow op) is not (spec §2.3 pass 4)."""
    def build():
        a = tf.matmul(x(), x(), name="allow1")
        c = tf.nn.relu(a, name="clr1")
        i = tf.add(c, c, name="inf1")
        tf.matmul(i, i, name="allow2")
        tf.nn.relu(a, name="clr_after")

    ctx = context(build)
    allow = t("allow1", "allow2")
    found = colouring.add_clear_and_infer_between_allow(ctx, allow, set())
    assert set(found) == t("clr1", "inf1")
    assert {reason.rule for reason in found.values()} == {Rule.BETWEEN_ALLOW}


def test_infer_op_directly_after_allow_becomes_allow_unless_a_deny_feeds_it():
    """Step 7.5: an infer op fed by an ALLOW vertex and by no DENY vertex is ALLOW."""
    def build():
        a = tf.matmul(x(), x(), name="allow1")
        tf.add(a, a, name="inf_after")
        d = tf.exp(a, name="deny1")
        tf.add(a, d, name="inf_deny_fed")

    ctx = context(build)
    found = colouring.add_infer_after_allow(ctx, t("allow1"), t("deny1"))
    assert set(found) == t("inf_after")
    assert found[Vertex("inf_after", T)].rule is Rule.INFER_AFTER_ALLOW


def test_allow_spreads_both_ways_through_clear_ops_but_not_through_infer_ops():
    """Step 7.6: clear ops joined to an ALLOW vertex through clear ops, up- or downstream,
    are ALLOW; an infer op stops the spread (spec §2.3 pass 6)."""
    def build():
        up = tf.identity(x(), name="clr_up")
        a = tf.matmul(up, up, name="allow1")
        c = tf.nn.relu(a, name="clr_down")
        i = tf.add(c, c, name="inf1")
        tf.nn.relu(i, name="clr_beyond_infer")

    ctx = context(build)
    found = colouring.propagate_allow_through_clear(ctx, t("allow1"), set())
    assert set(found) == t("clr_up", "clr_down")
    assert {reason.rule for reason in found.values()} == {Rule.CLEAR_PROPAGATION}


def _conv_backprop_input() -> None:
    """allow1: a Conv2DBackpropInput, whose ``input_sizes`` is a fixed int32 input."""
    tf.raw_ops.Conv2DBackpropInput(
        input_sizes=tf.constant([1, 4, 4, 1], name="sizes"), filter=x((1, 1, 1, 1)),
        out_backprop=tf.ones([1, 4, 4, 1], name="grad"), strides=[1, 1, 1, 1], padding="SAME", name="allow1",
    )


def test_allow_op_vertices_the_op_definition_rejects_are_removed():
    """Step 7.7: an allow-list op's vertex whose op definition does not admit the target
    (here Conv2DBackpropInput's fixed int32 ``input_sizes``) leaves ALLOW (pass 7)."""
    ctx = context(_conv_backprop_input, lists=OpLists(target="bfloat16", allow={"Conv2DBackpropInput"}, deny=(),
                                                      infer=(), clear=()))
    allow = set(colouring.add_allowlist_ops(ctx))
    sizes = Vertex("allow1", TypeAttr(fixed=types_pb2.DT_INT32))
    assert t("allow1") | {sizes} <= allow
    removed = colouring.remove_unconvertible_allow(ctx, allow)
    assert set(removed) == {sizes}
    assert removed[sizes].rule is Rule.UNCONVERTIBLE


def test_allow_op_vertices_of_a_quantized_node_are_removed():
    """Step 7.7: a node with a quantized dtype anywhere (here Dequantize's ``T``, quint8) keeps
    its float vertices out of ALLOW even when its op is allowlisted; a float-only node of the
    same graph stays."""
    def build():
        quantized = tf.raw_ops.QuantizeV2(input=x(), min_range=-1.0, max_range=1.0, T=tf.quint8, name="quantize")
        tf.raw_ops.Dequantize(input=quantized.output, min_range=quantized.output_min,
                              max_range=quantized.output_max, name="allow_quantized")
        tf.identity(x(), name="allow1")

    lists = OpLists(target="bfloat16", allow={"Dequantize", "Identity"}, deny=(), infer=(), clear=())
    ctx = context(build, lists=lists)
    allow = set(colouring.add_allowlist_ops(ctx))
    dequantized = Vertex("allow_quantized", TypeAttr("dtype"))
    assert {dequantized} | t("allow1") <= allow
    removed = colouring.remove_unconvertible_allow(ctx, allow)
    assert dequantized in removed and removed[dequantized] == Reason(Rule.UNCONVERTIBLE, "the node is quantized")
    assert not t("allow1") & removed.keys()


def _v1_loop() -> None:
    """A v1 while loop's skeleton: Enter → Merge ⇄ NextIteration, the body one MatMul."""
    from tensorflow.python.ops import control_flow_ops  # Merge/NextIteration builders

    enter = tf.raw_ops.Enter(data=x(), frame_name="loop", name="enter")
    merge_ = control_flow_ops.merge([enter, enter], name="merge")[0]
    body = tf.matmul(merge_, merge_, name="allow1")
    tf.raw_ops.NextIteration(data=body, name="next")


def test_next_iteration_takes_the_colour_of_the_merge_it_feeds():
    """Step 7.9: NextIteration and the Merge nodes it feeds share one colour: all Merges
    ALLOW adds the NextIteration; one Merge not ALLOW removes them all (pass 9)."""
    def build():
        _v1_loop()

    graph_def = graph_def_of(build)
    merge = next(n for n in graph_def.node if n.name == "merge")
    merge.input[1] = "next"  # close the loop: Merge(enter, next)
    types = typegraph.build_type_graph(graph_io.working_copy(graph_def), PAINTED_DTYPES)
    processed = {name: "CPU" for name in types.ops if name != "x"}
    ctx = PaintContext(types, LISTS, BFLOAT16, frozenset(processed), processed)

    allow, reasons = colouring.match_recurrent_edges(ctx, t("allow1", "merge"))
    assert allow == t("allow1", "merge", "next") and set(reasons) == t("next")
    allow, reasons = colouring.match_recurrent_edges(ctx, t("allow1", "next"))
    assert allow == t("allow1") and set(reasons) == t("next")
    assert {reason.rule for reason in reasons.values()} == {Rule.RECURRENT_EDGE}


def test_existing_cast_whose_consumers_are_all_allow_produces_the_target():
    """Step 7.10: a Cast to float32 whose consumers are all ALLOW gets the target as DstT;
    one with a float32 consumer keeps float32 (pass 10)."""
    def build():
        i = tf.compat.v1.placeholder(tf.int32, [2, 2], name="i")
        c = tf.cast(i, tf.float32, name="cast_to_target")
        tf.matmul(c, c, name="allow1")
        k = tf.cast(i, tf.float32, name="cast_kept")
        tf.matmul(k, k, name="allow2")
        tf.exp(k, name="deny1")

    ctx = context(build)
    found = colouring.retarget_existing_casts(ctx, t("allow1", "allow2"))
    assert set(found) == {Vertex("cast_to_target", TypeAttr("DstT"))}
    assert {reason.rule for reason in found.values()} == {Rule.EXISTING_CAST}


def test_deny_op_of_a_nonpositive_argument_acts_as_infer():
    """A deny op whose argument cannot be positive (``exp(-relu(x))``: |result| <= 1) acts
    as an infer op; ``exp(relu(x))`` stays a deny op."""
    def build():
        r = tf.nn.relu(x(), name="r")
        tf.exp(tf.negative(r, name="neg"), name="bounded_exp")
        tf.exp(r, name="deny1")

    ctx = context(build)
    assert set(ctx.bounded) == {"bounded_exp"} and "-Relu(...)" in ctx.bounded["bounded_exp"]
    assert ctx.colour("bounded_exp").value == "infer" and ctx.colour("deny1").value == "deny"


def test_explain_names_the_rule_of_each_vertex_no_pass_painted():
    """Vertices no pass painted are explained by ``explain``: an infer op not next to an
    allow op, a clear op joined to none, an op in no list, a node the pass may not touch."""
    def build():
        a = tf.matmul(x(), x(), name="allow1")
        tf.exp(a, name="deny1")
        y = tf.compat.v1.placeholder(tf.float32, [2, 2], name="y")
        tf.add(y, y, name="inf_isolated")
        tf.nn.relu(tf.sigmoid(a, name="unlisted1"), name="clr_isolated")

    ctx = context(build)
    painting = colouring.paint(ctx, colouring.find_tensor_lists(ctx))
    skipped = {name: "a graph input (feed): keeps its dtype" for name in ("x", "y")}
    rules = {v.node: colouring.explain(ctx, painting, skipped, v).rule for v in ctx.float32 if v.attr.name}
    assert rules["inf_isolated"] is Rule.INFER_ISOLATED
    assert rules["clr_isolated"] is Rule.CLEAR_ISOLATED
    assert rules["unlisted1"] is Rule.UNLISTED
    assert rules["x"] is Rule.NOT_PROCESSED
    assert rules["allow1"] is Rule.ALLOW_LIST and rules["deny1"] is Rule.DENY_LIST


def test_kept_node_acts_as_a_deny_op_and_the_rest_is_coloured_as_without_it():
    """keep_nodes (beyond grappler): a kept node stays float32 and is a root of step 7.2
    like a deny op: the clear and infer ops downstream of it that lead to an infer or
    deny op are denied with it as the source. A clear op leading only to an allow op is
    not, and every other vertex gets the colour it gets without the entry."""
    def build():
        k = tf.matmul(x(), x(), name="kept1")
        c = tf.nn.relu(k, name="deny1_clr")  # leads to an infer op: denied
        i = tf.add(c, c, name="deny2_inf")
        tf.matmul(i, i, name="allow1")
        r = tf.nn.relu(k, name="clr_to_allow")  # leads to an allow op only: ALLOW through clear
        tf.matmul(r, r, name="allow2")

    reason = "calibration: output 0 reached 2.1e+05, over float16's safe magnitude 1.6e+04"
    ctx = context(build, lists=LISTS.keeping({"kept1": reason}))
    painting = colouring.paint(ctx, colouring.find_tensor_lists(ctx))
    plain = context(build)
    unkept = colouring.paint(plain, colouring.find_tensor_lists(plain))

    assert painting.deny == t("kept1", "deny1_clr", "deny2_inf") and unkept.deny == set()
    assert painting.allow == unkept.allow - painting.deny == t("allow1", "clr_to_allow", "allow2")
    propagated = Reason(Rule.DENY_PROPAGATION, "downstream of kept node 'kept1' through clear/infer ops", "kept1")
    assert painting.reasons[Vertex("deny1_clr", T)] == painting.reasons[Vertex("deny2_inf", T)] == propagated
    assert colouring.explain(ctx, painting, {}, Vertex("kept1", T)) == Reason(Rule.KEEP_NODES, reason, "kept1")


def test_kept_node_without_a_reason_names_its_entry():
    """A keep_nodes entry given no reason: the kept vertex's reason names the entry, its source."""
    def build():
        tf.matmul(x(), x(), name="kept1")

    ctx = context(build, lists=LISTS.keeping({"kept.*": ""}))
    painting = colouring.paint(ctx, colouring.find_tensor_lists(ctx))
    assert colouring.explain(ctx, painting, {}, Vertex("kept1", T)) == (
        Rule.KEEP_NODES, "matches keep_nodes entry 'kept.*'", "kept.*")


def test_kept_node_is_not_painted_by_the_passes_that_ignore_processed():
    """Steps 7.9 and 7.10 read every node, processed or not (as grappler does); a kept
    NextIteration takes its Merges out of ALLOW, and a kept Cast keeps float32 though its
    consumers are all ALLOW."""
    def build():
        i = tf.compat.v1.placeholder(tf.int32, [2, 2], name="i")
        c = tf.cast(i, tf.float32, name="kept_cast")
        tf.matmul(c, c, name="allow1")

    ctx = context(build, lists=LISTS.keeping({"kept_cast": ""}))
    assert colouring.retarget_existing_casts(ctx, t("allow1")) == {}

    def loop():
        _v1_loop()

    graph_def = graph_def_of(loop)
    next(n for n in graph_def.node if n.name == "merge").input[1] = "next"  # Merge(enter, next)
    types = typegraph.build_type_graph(graph_io.working_copy(graph_def), PAINTED_DTYPES)
    kept = {"next": Reason(Rule.KEEP_NODES, "matches keep_nodes entry 'next'", "next")}
    processed = {name: "CPU" for name in types.ops if name not in ("x", "next")}
    ctx = PaintContext(types, LISTS, BFLOAT16, frozenset(processed), processed, kept=kept)
    allow, reasons = colouring.match_recurrent_edges(ctx, t("allow1", "merge"))
    assert allow == t("allow1") and set(reasons) == t("merge")
    assert reasons[Vertex("merge", T)].rule is Rule.RECURRENT_EDGE


def _tensor_list() -> None:
    """A list written with one MatMul's output and read back: reserve → set → get."""
    a = tf.matmul(x(), x(), name="allow1")
    handle = tf.raw_ops.TensorListReserve(element_shape=[2, 2], num_elements=1, element_dtype=tf.float32,
                                          name="reserve")
    handle = tf.raw_ops.TensorListSetItem(input_handle=handle, index=0, item=a, name="set")
    tf.raw_ops.TensorListGetItem(input_handle=handle, index=0, element_shape=[2, 2], element_dtype=tf.float32,
                                 name="get")


def test_tensor_list_ops_joined_by_handles_form_one_cluster_that_shares_a_colour():
    """Steps 7.0 and 7.3: TensorList ops joined by their handles form a cluster (safe: no
    handle leaves the graph); once one member's element type is ALLOW all are, and one
    DENY member makes them all DENY (spec §2.5)."""
    ctx = context(_tensor_list)
    clusters, unsafe = colouring.find_tensor_list_clusters(ctx)
    assert unsafe == {}
    assert {cluster.members for cluster in clusters} == {frozenset({"reserve", "set", "get"})}
    element = {colouring.tensor_list_float_vertex(ctx, node) for node in ("reserve", "set", "get")}
    set_element = colouring.tensor_list_float_vertex(ctx, "set")

    allow, deny, reasons = colouring.match_tensor_list_colours(ctx, clusters, {set_element}, set())
    assert allow == element and deny == set() and set(reasons) == element - {set_element}
    allow, deny, reasons = colouring.match_tensor_list_colours(ctx, clusters, set(element), {set_element})
    assert allow == set() and deny == element
    assert {reason.rule for reason in reasons.values()} == {Rule.TENSOR_LIST}


def test_tensor_list_cluster_with_a_kept_member_is_denied():
    """Steps 7.0 and 7.3: a kept TensorList op is a member the pass may not touch, so its
    cluster is denied whole, though its element is written with an ALLOW vertex."""
    ctx = context(_tensor_list, lists=LISTS.keeping({"get": ""}))
    painting = colouring.paint(ctx, colouring.find_tensor_lists(ctx))
    element = {colouring.tensor_list_float_vertex(ctx, node) for node in ("reserve", "set", "get")}
    assert element <= painting.deny and not element & painting.allow
    assert t("allow1") <= painting.allow


def test_tensor_list_cluster_with_an_unprocessed_member_is_denied():
    """Step 7.0: a cluster with a member the pass may not touch is unsafe: its root's
    element type is DENY."""
    ctx = context(_tensor_list, unprocessed=["get"])
    _, unsafe = colouring.find_tensor_list_clusters(ctx)
    assert unsafe and {reason.rule for reason in unsafe.values()} == {Rule.TENSOR_LIST}
    assert all("'get'" in reason.text for reason in unsafe.values())


def test_paint_returns_a_value_and_leaves_its_inputs_alone():
    """``paint`` changes nothing it is given: the TensorList edges are added before it (step
    6), and painting one context twice gives equal paintings and the same graph."""
    lists = OpLists(target="bfloat16", allow={"MatMul"}, deny=(), infer=(),
                    clear={"TensorListReserve", "TensorListSetItem", "TensorListGetItem"})
    ctx = context(_tensor_list, lists=lists)
    tensor_lists = colouring.find_tensor_lists(ctx)
    writer, reader = (colouring.tensor_list_float_vertex(ctx, node) for node in ("set", "get"))
    assert tensor_lists.edges == ((writer, reader),)
    typegraph.add_implicit_edges(ctx.types, tensor_lists.edges)
    edges = set(ctx.types.graph.edges)
    first, second = colouring.paint(ctx, tensor_lists), colouring.paint(ctx, tensor_lists)
    assert isinstance(first, Painting) and first.allow == second.allow
    assert t("allow1") | {writer, reader} <= first.allow  # the list carries allow1's output
    assert first.deny == second.deny and first.reasons == second.reasons
    assert set(ctx.types.graph.edges) == edges


def _list_written_by_allow_and_deny() -> None:
    """One list written by an allow op's output (``set``) and a deny op's (``push``), read
    by ``get`` into an infer op: deny spreads into ``push`` (step 7.2), and the cluster
    rule (7.3) then denies ``set``, which an allow-list entry put in ALLOW (7.1)."""
    a = tf.matmul(x(), x(), name="allow1")
    handle = tf.raw_ops.TensorListReserve(element_shape=[2, 2], num_elements=2, element_dtype=tf.float32,
                                          name="reserve")
    handle = tf.raw_ops.TensorListSetItem(input_handle=handle, index=0, item=a, name="set")
    handle = tf.raw_ops.TensorListPushBack(input_handle=handle, tensor=tf.exp(a, name="deny1"), name="push")
    item = tf.raw_ops.TensorListGetItem(input_handle=handle, index=0, element_shape=[2, 2],
                                        element_dtype=tf.float32, name="get")
    tf.add(item, 1.0, name="inf1")


def test_a_vertex_ends_with_the_reason_of_the_step_that_decided_its_colour():
    """``paint``: when several steps give one vertex a reason, the one explaining its final
    colour wins. ``set`` was ALLOW by its list (7.1) and is DENY by the cluster rule (7.3):
    its reason is the cluster's, not the allow list's. A vertex denied twice keeps the
    first denial's reason (7.0's, naming the unprocessed member), and one converted though
    a later step denied it too keeps the reason that converted it (a ``cross_function``
    seed that deny propagation also reaches: ALLOW wins in step 8)."""
    lists = OpLists(target="bfloat16", allow={"MatMul", "TensorListSetItem"}, deny={"Exp"}, infer={"AddV2"},
                    clear={"TensorListReserve", "TensorListPushBack", "TensorListGetItem"})
    ctx = context(_list_written_by_allow_and_deny, lists=lists)
    tensor_lists = colouring.find_tensor_lists(ctx)
    typegraph.add_implicit_edges(ctx.types, tensor_lists.edges)
    painting = colouring.paint(ctx, tensor_lists)
    element = {node: colouring.tensor_list_float_vertex(ctx, node) for node in ("reserve", "set", "push", "get")}
    assert set(element.values()) <= painting.deny and not set(element.values()) & painting.allow
    assert painting.reasons[element["push"]].rule is Rule.DENY_PROPAGATION
    assert painting.reasons[element["set"]].rule is Rule.TENSOR_LIST, painting.reasons[element["set"]]

    ctx = context(_tensor_list, unprocessed=["get"])
    painting = colouring.paint(ctx, colouring.find_tensor_lists(ctx))
    reserve = colouring.tensor_list_float_vertex(ctx, "reserve")
    assert reserve in painting.deny and "unprocessed node 'get'" in painting.reasons[reserve].text

    def chain() -> None:
        tf.add(tf.nn.relu(tf.exp(x(), name="deny1"), name="clr1"), 1.0, name="inf1")

    ctx = context(chain)
    painting = colouring.paint(ctx, colouring.find_tensor_lists(ctx), seeds=frozenset(t("clr1")))
    assert t("clr1") <= painting.allow & painting.deny
    assert painting.reasons[Vertex("clr1", T)].rule is Rule.CROSS_FUNCTION
    assert painting.reasons[Vertex("inf1", T)].rule is Rule.DENY_PROPAGATION


def test_a_vertex_taken_out_of_allow_ends_with_the_reason_of_the_step_that_took_it():
    """``paint``: Conv2DBackpropInput's int32 ``input_sizes`` is ALLOW by the list (7.1) and
    taken out by 7.7: its reason is 7.7's, while ``T`` keeps the allow list's."""
    ctx = context(_conv_backprop_input, lists=OpLists(target="bfloat16", allow={"Conv2DBackpropInput"}, deny=(),
                                                      infer=(), clear=()))
    painting = colouring.paint(ctx, colouring.find_tensor_lists(ctx))
    sizes = Vertex("allow1", TypeAttr(fixed=types_pb2.DT_INT32))
    assert sizes not in painting.allow and painting.reasons[sizes].rule is Rule.UNCONVERTIBLE
    assert painting.reasons[Vertex("allow1", T)].rule is Rule.ALLOW_LIST
