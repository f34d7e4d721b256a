"""rewrite_graph_def as a user meets it: arguments, bad input, the block list, the report."""
from __future__ import annotations

import copy
import dataclasses
import pickle
import types

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2

import amp_rewrite
import recorded_grappler
from amp_rewrite import GraphError, _tf, rewrite_graph_def
from amp_rewrite.core import typegraph
from amp_rewrite.core.report import Report
from amp_rewrite.core.target import BFLOAT16, lookup_target
from conftest import assert_numerics_match, check_against_grappler, dtype_of, graph_def_of


def _chain():
    """input -> MatMul allow1 -> Relu clr1 -> Exp deny1 -> Identity fetch."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="input")
        allow1 = tf.raw_ops.MatMul(a=x, b=x, name="allow1")
        clr1 = tf.raw_ops.Relu(features=allow1, name="clr1")
        deny1 = tf.raw_ops.Exp(x=clr1, name="deny1")
        tf.identity(deny1, name="fetch")
    return graph.as_graph_def()


def _node(graph_def, name):
    return next(n for n in graph_def.node if n.name == name)


def test_unknown_target_lists_the_allowed_values():
    """One error for an unknown target, whichever entry point meets it first; it names the
    targets that entry point takes (both take float8, whose lists are float16's)."""
    with pytest.raises(ValueError, match="^unknown target 'int8'; use one of float16, bfloat16, float8$"):
        rewrite_graph_def(_chain(), target="int8")
    with pytest.raises(ValueError, match="^unknown target 'int8'; use one of float16, bfloat16, float8$"):
        amp_rewrite.load_lists("int8")


def test_a_target_is_one_frozen_value_and_the_rewrite_takes_its_name_or_it():
    """``lookup_target`` turns the user's string into its one ``Target``; the rewrite gives
    the same result for the name and the value, and converts to the value's dtype."""
    target = lookup_target("bfloat16")
    assert lookup_target(target) is target is BFLOAT16 and target.name in amp_rewrite.TARGETS
    with pytest.raises(dataclasses.FrozenInstanceError):
        target.dtype = types_pb2.DT_HALF  # type: ignore[misc]
    by_name = rewrite_graph_def(_chain(), target="bfloat16", fetches=["fetch"])
    by_value = rewrite_graph_def(_chain(), target=target, fetches=["fetch"])
    assert by_name.graph_def == by_value.graph_def and by_name.report == by_value.report
    assert by_value.report.target == "bfloat16"
    assert _node(by_value.graph_def, "allow1").attr["T"].type == target.dtype == types_pb2.DT_BFLOAT16


@pytest.mark.parametrize("target, kind", [("float16", "CastToFp16"), ("bfloat16", "CastToBf16")])
def test_casts_are_named_shared_and_placed_like_grappler(target, kind):
    """One cast per source port and direction, named <src>-<port>-<Kind>-<id>-AutoMixedPrecision."""
    graph_def = _chain()
    _node(graph_def, "allow1").device = "/job:localhost/replica:0/task:0/device:CPU:0" if target == "bfloat16" else ""
    out = rewrite_graph_def(graph_def, target=target, fetches=["fetch"]).graph_def
    casts = {n.name: n for n in out.node if n.op == "Cast"}
    assert set(casts) == {f"input-0-{kind}-0-AutoMixedPrecision", "clr1-0-CastToFp32-0-AutoMixedPrecision"}
    to_target = casts[f"input-0-{kind}-0-AutoMixedPrecision"]
    assert list(_node(out, "allow1").input) == [to_target.name, to_target.name]  # shared by both inputs
    assert to_target.device == _node(graph_def, "input").device
    assert list(_node(out, "deny1").input) == ["clr1-0-CastToFp32-0-AutoMixedPrecision"]


def test_the_rewrites_casts_are_told_apart_from_the_users():
    """``casts.is_amp_cast`` is the one test for a cast the rewrite added: every cast of a
    rewrite passes it; a user's Cast, even one named like ours in part, does not."""
    from amp_rewrite.core import casts as core_casts

    graph_def = _chain()
    user = graph_def.node.add(name="user-AutoMixedPrecision", op="Cast")
    user.input.append("input")
    user.attr["SrcT"].type = user.attr["DstT"].type = types_pb2.DT_FLOAT
    out = rewrite_graph_def(graph_def, target="bfloat16", fetches=["fetch"]).graph_def
    added = {n.name for n in out.node if core_casts.is_amp_cast(n)}
    assert added == {"input-0-CastToBf16-0-AutoMixedPrecision", "clr1-0-CastToFp32-0-AutoMixedPrecision"}
    assert not core_casts.is_amp_cast(_node(out, "allow1"))


def test_cast_ids_skip_names_already_taken():
    graph_def = _chain()
    taken = graph_def.node.add()
    taken.CopyFrom(_node(graph_def, "input"))
    taken.name = "input-0-CastToFp16-0-AutoMixedPrecision"
    out = rewrite_graph_def(graph_def, fetches=["fetch"]).graph_def
    assert any(n.name == "input-0-CastToFp16-1-AutoMixedPrecision" for n in out.node)


def test_output_is_deterministic_and_input_untouched():
    graph_def = _chain()
    before = graph_def.SerializeToString(deterministic=True)
    first = rewrite_graph_def(graph_def, fetches=["fetch"]).graph_def.SerializeToString(deterministic=True)
    second = rewrite_graph_def(graph_def, fetches=["fetch"]).graph_def.SerializeToString(deterministic=True)
    assert first == second
    assert graph_def.SerializeToString(deterministic=True) == before


def test_reports_compare_by_their_decisions():
    """Decisions are made when first read; equality still looks at them, not only at counts."""
    first, second = (rewrite_graph_def(_chain(), fetches=["fetch"]).report for _ in range(2))
    assert first == second and first.decisions == second.decisions
    assert first != Report(first.target, first.items)  # the same counts, no decisions
    assert pickle.loads(pickle.dumps(first)) == first == copy.deepcopy(first)


def test_rewriting_twice_changes_nothing_more():
    once = rewrite_graph_def(_chain(), fetches=["fetch"]).graph_def
    twice = rewrite_graph_def(once, fetches=["fetch"])
    assert twice.graph_def == once
    assert twice.report.vertices_converted == 0


def test_report_summary_and_reasons():
    report = rewrite_graph_def(_chain(), fetches=["fetch"]).report
    assert report.summary() == (
        "Converted 2/5 nodes to float16 precision using 1 cast(s) to float16 (excluding Const and Variable casts)"
    )
    assert report.decision("allow1").rule == "allow-list"
    assert report.decision("clr1").after == "float16"
    assert report.decision("deny1").rule == "deny-list"
    assert report.decision("fetch").rule == "not-processed"
    assert report.kept_float32()["deny-list"] == 1


def test_keep_nodes_blocks_a_node_by_name_or_regex(tmp_path):
    """Beyond grappler (tensorflow#40562): a node block list keeps matching nodes float32."""
    overlay = tmp_path / "keep.yaml"
    overlay.write_text("keep_nodes: ['all.w1']\n")
    result = rewrite_graph_def(_chain(), fetches=["fetch"], lists=str(overlay))
    assert _node(result.graph_def, "allow1").attr["T"].type == types_pb2.DT_FLOAT
    assert result.report.decision("allow1")[6:] == ("keep-nodes", "matches keep_nodes entry 'all.w1'", "all.w1")
    assert result.report.vertices_converted == 0
    assert not [n for n in result.graph_def.node if n.op == "Cast"]


def _nested_functions() -> tuple[tf.Graph, dict[str, str]]:
    """A MatMul named ``mm`` in the main graph, in ``outer`` and in ``inner``, which
    ``outer`` calls; returns the graph and the functions' library names."""
    @tf.function(autograph=False)
    def inner(a):
        return tf.raw_ops.MatMul(a=a, b=a, name="mm")

    @tf.function(autograph=False)
    def outer(a):
        return inner(tf.raw_ops.MatMul(a=a, b=a, name="mm"))

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="input")
        tf.identity(outer(tf.raw_ops.MatMul(a=x, b=x, name="mm")), name="fetch")
    graph_def = graph.as_graph_def()
    names = {f.signature.name.split("_")[3]: f.signature.name for f in graph_def.library.function}
    return graph_def, names


def test_function_scoped_keep_entry_keeps_the_node_of_that_function_only():
    """``FUNCTION::PATTERN`` keeps the matching node of that library function only: the
    same-named MatMul in the main graph and in the calling function is converted. An entry
    without ``::`` keeps it everywhere."""
    graph_def, names = _nested_functions()
    lists = amp_rewrite.load_lists("float16").keeping({f"{names['inner']}::m.": "calibration: 7e+04"})
    report = rewrite_graph_def(graph_def, fetches=["fetch"], lists=lists).report
    kept = report.decision("mm", function=names["inner"])
    assert (kept.after, kept.rule, kept.reason, kept.source) == (
        "float32", "keep-nodes", "calibration: 7e+04", f"{names['inner']}::m.")
    assert report.decision("mm").after == report.decision("mm", function=names["outer"]).after == "float16"

    everywhere = rewrite_graph_def(graph_def, fetches=["fetch"], lists=lists.keeping({"mm": ""})).report
    assert {everywhere.decision("mm", function=f).rule for f in ("", names["outer"], names["inner"])} == {"keep-nodes"}
    assert everywhere.vertices_converted == 0


def test_node_on_another_device_type_is_not_painted():
    graph_def = _chain()
    _node(graph_def, "allow1").device = "/device:CPU:0"
    result = rewrite_graph_def(graph_def, target="float16", fetches=["fetch"])
    assert _node(result.graph_def, "allow1").attr["T"].type == types_pb2.DT_FLOAT
    assert "not a GPU device" in result.report.decision("allow1").reason


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda g: _node(g, "clr1").input.__setitem__(0, "nowhere"), "node 'clr1': input 'nowhere' names a node"),
        (lambda g: _node(g, "clr1").input.__setitem__(0, "allow1:x"), "node 'clr1': malformed input 'allow1:x'"),
        (lambda g: _node(g, "clr1").input.__setitem__(0, "allow1:3"), "names output 3 of 'allow1'"),
        (lambda g: setattr(_node(g, "clr1"), "op", "NoSuchOp"), "op 'NoSuchOp' is neither registered"),
        (lambda g: _node(g, "clr1").input.append("allow1"), "node 'clr1' \\(Relu\\): expected 1 data input\\(s\\), got 2"),
        (lambda g: _node(g, "allow1").input.insert(1, "input"), "node 'allow1' \\(MatMul\\): expected 2 data input\\(s\\), got 3"),
        (lambda g: _node(g, "clr1").input.pop(), "node 'clr1' \\(Relu\\): expected 1 data input\\(s\\), got 0"),
        (lambda g: _node(g, "clr1").input.__setitem__(0, "^allow1"), "node 'clr1' \\(Relu\\): expected 1 .* got 0"),
        (lambda g: g.node.add().CopyFrom(_node(g, "clr1")), "duplicate node name 'clr1'"),
        (lambda g: _node(g, "clr1").attr["bogus"].CopyFrom(_node(g, "clr1").attr["T"]), "attribute 'bogus'"),
    ],
)
@pytest.mark.parametrize("cached", [False, True], ids=["first-of-its-op", "op-seen-before"])
def test_bad_graphs_raise_one_clear_error_naming_the_node(mutate, message, cached, monkeypatch):
    """Nodes of an op seen before share its port map and have their port counts checked
    with their edges instead: both ways give the same error."""
    monkeypatch.setattr(typegraph, "_REGISTERED_LAYOUTS", {})
    monkeypatch.setattr(typegraph, "_REGISTERED_NODE_TYPES", {})
    if cached:
        rewrite_graph_def(_chain(), fetches=["fetch"])
    graph_def = _chain()
    mutate(graph_def)
    before = graph_def.SerializeToString(deterministic=True)
    with pytest.raises(GraphError, match=message):
        rewrite_graph_def(graph_def, fetches=["fetch"])
    assert graph_def.SerializeToString(deterministic=True) == before


def test_unknown_fetch_is_an_error():
    with pytest.raises(GraphError, match="fetch node\\(s\\) 'missing' not in the graph"):
        rewrite_graph_def(_chain(), fetches=["missing"])


def test_errors_are_value_errors_and_public():
    assert issubclass(amp_rewrite.GraphError, amp_rewrite.AmpRewriteError)
    assert issubclass(amp_rewrite.AmpRewriteError, ValueError)


def test_unsafe_force_all_converts_unlisted_ops_like_grappler(monkeypatch):
    """LEVEL=UNSAFE_FORCE_ALL allows every processed stateless non-Const op and skips deny
    propagation: Exp -> MatMul -> Sum all become half (spec §4), as grappler does."""
    from conftest import check_against_grappler, dtype_of

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="input")
        deny1 = tf.raw_ops.Exp(x=x, name="deny1")
        allow1 = tf.raw_ops.MatMul(a=deny1, b=deny1, name="allow1")
        deny2 = tf.raw_ops.Sum(input=allow1, axis=tf.constant([0]), name="deny2")
        tf.identity(deny2, name="fetch")
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL", "UNSAFE_FORCE_ALL")
    rewrites = check_against_grappler(graph.as_graph_def(), "float16", ["fetch"])
    for node in ("deny1", "allow1", "deny2"):
        assert dtype_of(rewrites.ours, node) == types_pb2.DT_HALF


def test_unsafe_force_all_on_a_fixed_float_port_is_a_clear_error(monkeypatch):
    """Grappler fails the whole pass ("Failed to set type attribute") when a forced node has a
    fixed float32 port (ResizeBilinear's output); we name the node and say what to do."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [1, 4, 4, 1], name="input")
        allow1 = tf.raw_ops.Conv2D(input=x, filter=tf.ones([1, 1, 1, 1]), strides=[1, 1, 1, 1], padding="SAME",
                                   name="allow1")
        resize = tf.raw_ops.ResizeBilinear(images=allow1, size=[8, 8], name="resize")
        tf.identity(resize, name="fetch")
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL", "UNSAFE_FORCE_ALL")
    with pytest.raises(GraphError, match="node 'resize' \\(ResizeBilinear\\).*keep_nodes"):
        rewrite_graph_def(graph.as_graph_def(), fetches=["fetch"])


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_quantized_allowlisted_op_is_removed_like_grappler(monkeypatch, target):
    """Pass 6 drops allowlisted vertices of quantized nodes: QuantizedMatMul added to the
    allow list still keeps every attribute, exactly as grappler decides."""
    from conftest import check_against_grappler

    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="input")
        allow1 = tf.raw_ops.MatMul(a=x, b=x, name="allow1")
        q = tf.constant(np.ones([4, 4], np.uint8), tf.quint8)
        low, high = tf.constant(0.0), tf.constant(1.0)
        qmm = tf.raw_ops.QuantizedMatMul(a=q, b=q, min_a=low, max_a=high, min_b=low, max_b=high, name="qmm")
        tf.identity(allow1, name="fetch1")
        tf.identity(qmm.out, name="fetch2")
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_ADD", "QuantizedMatMul")
    rewrites = check_against_grappler(graph.as_graph_def(), target, ["fetch1", "fetch2"])
    qmm_node = _node(rewrites.ours, "qmm")
    assert qmm_node.attr["Toutput"].type == types_pb2.DT_QINT32
    assert _node(rewrites.ours, "allow1").attr["T"].type != types_pb2.DT_FLOAT


def _gelu_between_matmuls():
    """MatMul mm1 -> Erfc gelu -> Mul scale -> MatMul mm2 -> Identity fetch: GELU's shape."""
    x = tf.compat.v1.placeholder(tf.float32, [8, 8], name="input")
    mm1 = tf.raw_ops.MatMul(a=x, b=x, name="mm1")
    gelu = tf.raw_ops.Erfc(x=mm1, name="gelu")
    scale = tf.raw_ops.Mul(x=gelu, y=mm1, name="scale")
    tf.identity(tf.raw_ops.MatMul(a=scale, b=x, name="mm2"), name="fetch")


def test_ops_slower_in_bfloat16_stay_float32_with_the_reason(monkeypatch):
    """bfloat16 keeps Erfc (lists/bfloat16.yaml's float32 section) float32 and says why,
    while grappler, given the same lists, agrees; its own infer list would convert Erfc,
    and putting Erfc back on the infer list makes ours do so too."""
    graph_def = graph_def_of(_gelu_between_matmuls)
    rewrites = check_against_grappler(graph_def, "bfloat16", ["fetch"])
    assert dtype_of(rewrites.ours, "gelu") == types_pb2.DT_FLOAT
    assert dtype_of(rewrites.ours, "scale") == types_pb2.DT_BFLOAT16
    decision = rewrites.report.decision("gelu")
    assert decision.rule == "slower-converted" and "takes 4.6-5.0x float32's time" in decision.reason
    # grappler's own lists: no edit of ours, Erfc converted.
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_INFERLIST_ADD", "Erfc")
    put_back = check_against_grappler(graph_def, "bfloat16", ["fetch"])
    assert dtype_of(put_back.ours, "gelu") == types_pb2.DT_BFLOAT16
    # float16 (GPU) lists have no float32 section.
    monkeypatch.delenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_INFERLIST_ADD")
    assert dtype_of(check_against_grappler(graph_def, "float16", ["fetch"]).ours, "gelu") == types_pb2.DT_HALF


def _bounded_exp(argument: str):
    """input -> MatMul mm1 -> <argument> -> Exp bump -> Mul scale (by mm1) -> MatMul mm2 -> fetch.

    ``argument`` builds Exp's argument from mm1: shapes where the graph shows it is never
    positive (GELU's and erf's gradient exp(-x^2), a stable softmax's exp(x - max x)) and
    look-alikes where it may be positive.
    """
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [8, 8], name="input")
        mm1 = tf.raw_ops.MatMul(a=x, b=x, name="mm1")
        arguments = {
            "-square": lambda: tf.raw_ops.Neg(x=tf.raw_ops.Square(x=mm1, name="square"), name="arg"),
            "-abs": lambda: tf.raw_ops.Neg(x=tf.raw_ops.Abs(x=mm1, name="abs"), name="arg"),
            "relu*-0.5": lambda: tf.raw_ops.Mul(x=tf.raw_ops.Relu(features=mm1), y=tf.constant(-0.5), name="arg"),
            "x-max(x)": lambda: tf.raw_ops.Sub(
                x=mm1, y=tf.raw_ops.Max(input=mm1, axis=tf.constant([1]), keep_dims=True, name="max"), name="arg"),
            "-tanh": lambda: tf.raw_ops.Neg(x=tf.raw_ops.Tanh(x=mm1, name="tanh"), name="arg"),
            "relu*0.5": lambda: tf.raw_ops.Mul(x=tf.raw_ops.Relu(features=mm1), y=tf.constant(0.5), name="arg"),
            "relu*[-1,...,0.5]": lambda: tf.raw_ops.Mul(  # one positive element is enough to overflow
                x=tf.raw_ops.Relu(features=mm1), y=tf.constant([-1.0] * 7 + [0.5]), name="arg"),
            "x-max(y)": lambda: tf.raw_ops.Sub(
                x=mm1, y=tf.raw_ops.Max(input=x, axis=tf.constant([1]), keep_dims=True, name="max"), name="arg"),
            "x-max(x) without keep_dims": lambda: tf.raw_ops.Sub(  # [8, 8] - [8] subtracts row maxima from columns
                x=mm1, y=tf.raw_ops.Max(input=mm1, axis=tf.constant([1]), keep_dims=False, name="max"), name="arg"),
            "x": lambda: tf.raw_ops.Identity(input=mm1, name="arg"),
        }
        bump = tf.raw_ops.Exp(x=arguments[argument](), name="bump")
        scale = tf.raw_ops.Mul(x=bump, y=mm1, name="scale")
        tf.identity(tf.raw_ops.MatMul(a=scale, b=x, name="mm2"), name="fetch")
    return graph_def_of(build)


@pytest.mark.parametrize("target, argument", [
    ("bfloat16", "-square"),  # Square is in no float16 list: the path from mm1 would break there
    *((target, argument) for target in ("float16", "bfloat16") for argument in ("-abs", "relu*-0.5", "x-max(x)")),
])
def test_exp_of_a_nonpositive_argument_is_an_infer_op(target, argument):
    """exp maps (-inf, 0] into (0, 1]: nothing to overflow, so a deny-listed Exp whose
    argument the graph shows to be <= 0 converts like an infer op, and the values feeding
    and leaving it need no casts. grappler, told the same (the oracle swaps such a node
    for an infer op), agrees; with its own per-op lists it keeps Exp float32."""
    graph_def = _bounded_exp(argument)
    rewrites = check_against_grappler(graph_def, target, ["fetch"])
    low = dtype_of(rewrites.ours, "mm1")
    assert low != types_pb2.DT_FLOAT
    assert dtype_of(rewrites.ours, "bump") == dtype_of(rewrites.ours, "scale") == low
    casts = {n.name for n in rewrites.ours.node if n.op == "Cast"}
    assert not casts & {*_node(rewrites.ours, "bump").input, *_node(rewrites.ours, "scale").input}
    decision = rewrites.report.decision("bump")
    assert "deny op Exp acts as infer: its argument 'arg' is" in decision.reason
    plain = recorded_grappler.rewrite(graph_def, target=target, fetches=["fetch"], our_lists=False)
    assert plain is None or dtype_of(plain, "bump") == types_pb2.DT_FLOAT
    feeds = {"input": np.random.default_rng(0).uniform(-1, 1, (8, 8)).astype(np.float32)}
    assert_numerics_match(rewrites, ["fetch"], feeds)


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
@pytest.mark.parametrize("argument", ["-tanh", "relu*0.5", "relu*[-1,...,0.5]", "x-max(y)", "x-max(x) without keep_dims",
                                      "x"])
def test_exp_of_an_argument_that_may_be_positive_stays_denied(target, argument):
    rewrites = check_against_grappler(_bounded_exp(argument), target, ["fetch"])
    assert dtype_of(rewrites.ours, "bump") == types_pb2.DT_FLOAT
    assert rewrites.report.decision("bump").rule == "deny-list"


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_treat_infer_as_deny_denies_a_bounded_exp_too(target, monkeypatch):
    """The level denies infer ops, so an Exp that would act as one stays a deny op; grappler
    agrees (the oracle gives it no stand-in then)."""
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL", "TREAT_INFER_AS_DENY")
    rewrites = check_against_grappler(_bounded_exp("-abs"), target, ["fetch"])
    assert dtype_of(rewrites.ours, "bump") == types_pb2.DT_FLOAT
    assert rewrites.report.decision("bump").rule == "deny-list"


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_a_kernel_label_decides_alone_like_grappler(target):
    """A ``_kernel`` label picks kernels of its own: a labelled Relu with no such kernel
    stays float32 between two MatMuls, while an unlabelled one of the same op converts."""
    def build():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="input")
        first = tf.raw_ops.MatMul(a=x, b=x, name="first")
        plain = tf.raw_ops.Relu(features=first, name="plain")
        labelled = tf.raw_ops.Relu(features=plain, name="labelled")
        tf.identity(tf.raw_ops.MatMul(a=labelled, b=x, name="second"), name="fetch")

    graph_def = graph_def_of(build)
    _node(graph_def, "labelled").attr["_kernel"].s = b"no_such_label"
    rewrites = check_against_grappler(graph_def, target, ["fetch"])
    float32 = types_pb2.DT_FLOAT
    assert dtype_of(rewrites.ours, "plain") != float32
    assert dtype_of(rewrites.ours, "labelled") == float32
    assert rewrites.report.decision("labelled").rule == "no-kernel"


def test_float8_target_needs_tensorflow_2_18() -> None:
    """XLA before TensorFlow 2.18 drops a round trip through float8: there the float8 target
    is refused with one line saying why; from 2.18 on the same call rewrites."""
    from amp_rewrite.core.float8 import inference as float8

    @tf.function
    def matmul(x: tf.Tensor) -> tf.Tensor:
        return tf.matmul(x, tf.ones([4, 4]), name="mm")

    graph_def = matmul.get_concrete_function(tf.TensorSpec([2, 4])).graph.as_graph_def()
    amax = {("", "x", 0): 1.0}
    if _tf.tensorflow_version() < float8.MIN_TENSORFLOW:
        with pytest.raises(amp_rewrite.AmpRewriteError, match=r"target 'float8' needs TensorFlow 2\.18 or newer: "
                                                              r"TensorFlow [\d.]+'s XLA drops a round trip"):
            amp_rewrite.rewrite_graph_def(graph_def, target="float8", amax=amax)
    else:
        result = amp_rewrite.rewrite_graph_def(graph_def, target="float8", amax=amax)
        assert result.report.target == "float8"


def _running_and_extended():
    """A graph a Session already runs, and the same graph with ops added after: each new op
    would repaint a running node if painted afresh."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="input")
        w = tf.constant(np.full((4, 4), 0.5, np.float32), name="w")
        feat = tf.raw_ops.Identity(input=x, name="clr_feat")        # float32: no allow op near it
        tf.raw_ops.Sum(input=feat, axis=[0, 1], name="total")
        allow1 = tf.raw_ops.MatMul(a=x, b=w, name="allow1")
        clr1 = tf.raw_ops.Relu(features=allow1, name="clr1")         # converted: after allow1
        tf.raw_ops.Exp(x=clr1, name="deny1")
        infer_iso = tf.raw_ops.AddV2(x=clr1, y=clr1, name="infer_iso")  # float32: clr1 is painted after 7.5
        tf.raw_ops.Cast(x=tf.raw_ops.Cast(x=x, DstT=tf.float64), DstT=tf.float32, name="cast_idle")
        running = graph.as_graph_def()
        tf.raw_ops.MatMul(a=feat, b=w, name="allow_new")                 # afresh: clr_feat converted
        clr_new = tf.raw_ops.Identity(input=clr1, name="clr_new")
        add = tf.raw_ops.AddV2(x=clr_new, y=clr_new, name="infer_new")   # between running and new allow ops
        tf.raw_ops.MatMul(a=add, b=w, name="allow_new2")
        tf.raw_ops.MatMul(a=graph.get_tensor_by_name("cast_idle:0"), b=w, name="allow_new3")  # afresh: Cast retargeted
        tf.raw_ops.MatMul(a=infer_iso, b=w, name="allow_new4")          # afresh: infer_iso between allow ops
    return running, graph.as_graph_def()


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_frozen_nodes_keep_their_dtypes_and_new_ops_are_painted_around_them(target):
    """``frozen=`` an earlier result: every node it rewrote comes out exactly as there (the
    Session mirror cannot change a node it runs), with rule "frozen"; new ops are painted with
    them as fixed neighbours: a new MatMul reads a frozen float32 node through a new cast, an
    infer op between a frozen converted op and a new MatMul is converted. Painted afresh, the
    same graph would repaint three running nodes. Both compute float32's values within tolerance."""
    running, extended = _running_and_extended()
    low = lookup_target(target).dtype
    first = rewrite_graph_def(running, target=target)
    grown = rewrite_graph_def(extended, target=target, frozen=first)
    before = {n.name: n for n in first.graph_def.node}
    after = {n.name: n for n in grown.graph_def.node}
    assert {name: after[name] for name in before} == before
    assert [dtype_of(grown.graph_def, n) for n in ("allow_new", "clr_new", "infer_new", "allow_new2", "allow_new3", "allow_new4")] == [low] * 6
    running_float32 = [dtype_of(grown.graph_def, "clr_feat"), dtype_of(grown.graph_def, "cast_idle", "DstT"),
                       dtype_of(grown.graph_def, "infer_iso")]
    assert running_float32 == [types_pb2.DT_FLOAT] * 3
    assert grown.report.decision("clr_feat").rule == grown.report.decision("clr1").rule == "frozen"
    afresh = rewrite_graph_def(extended, target=target).graph_def
    assert [dtype_of(afresh, "clr_feat"), dtype_of(afresh, "cast_idle", "DstT"), dtype_of(afresh, "infer_iso")] == [low] * 3
    fetches = ["allow_new:0", "allow_new2:0", "allow_new3:0", "allow_new4:0", "deny1:0", "total:0"]
    feeds = {"input:0": np.random.RandomState(0).uniform(-1, 1, (4, 4)).astype(np.float32)}
    assert_numerics_match(types.SimpleNamespace(target=target, original=extended, ours=grown.graph_def), fetches, feeds)
