"""Spec §5 as conformance tests: grappler's own AMP test cases, checked against live grappler.

Every case builds the graph its C++ or Python original describes (node names say
the expected colour: allow, deny, infer, clr, fetch) and checks (a) the spec's
expected dtypes and cast count on our result and on grappler's, (b) that our
result agrees with grappler's vertex by vertex and cast by cast and, where the
graph runs on CPU, (c) that our rewrite computes the float32 outputs within
tolerance. Where the spec and live TensorFlow 2.21 disagree, live TF wins and the
docstring says so.

Cases 1–31 are the parametrised CUDA/FP16_CPU tests, run here for float16;
cases 37–41 are the oneDNN tests, run for bfloat16 (40 and 41 for both targets).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    TARGETS,
    assert_colours,
    assert_numerics_match,
    assert_unchanged,
    check_against_grappler,
    count_casts_by_kind,
    graph_def_of,
    op_of,
)
from tensorflow.core.framework.graph_pb2 import GraphDef

import amp_rewrite
import recorded_grappler
from amp_rewrite.core.casts import is_amp_cast
from amp_rewrite.core.lists import held_float32
from amp_rewrite.testing.reference import compare_rewrites, run_grappler, vertex_dtypes

raw = tf.raw_ops
FLOAT = tf.float32


def _const(value: float, shape: list[int], name: str) -> tf.Tensor:
    return tf.constant(value, dtype=FLOAT, shape=shape, name=name)


# --------------------------------------------------------------------------------------
# §5.1 C++ cases 1–11: colouring of plain graphs


def _build_simple(device: str = "") -> GraphDef:
    """Case 3: input→Exp deny1→Relu clr1→Sqrt infer1→Relu clr2→MatMul allow1→Relu clr3→
    Log infer2→Relu clr4→SparseMatMul deny2→Relu clr5→fetch."""

    def build() -> None:
        with tf.device(device):
            inp = _const(1.0 / 32, [32, 32], "input")
            clr1 = raw.Relu(features=raw.Exp(x=inp, name="deny1"), name="clr1")
            clr2 = raw.Relu(features=raw.Sqrt(x=clr1, name="infer1"), name="clr2")
            clr3 = raw.Relu(features=raw.MatMul(a=clr2, b=clr2, name="allow1"), name="clr3")
            clr4 = raw.Relu(features=raw.Log(x=clr3, name="infer2"), name="clr4")
            clr5 = raw.Relu(features=raw.SparseMatMul(a=clr4, b=clr4, name="deny2"), name="clr5")
            raw.Identity(input=clr5, name="fetch")

    return graph_def_of(build)


SIMPLE_KEPT = ("input:dtype", "deny1", "clr1", "infer1", "infer2", "clr4", "deny2:Ta", "deny2:Tb", "clr5", "fetch")


def test_no_op() -> None:
    """Case 1 NoOp: with no allowlist op the pass changes nothing."""

    def build() -> None:
        inp = _const(1.0 / 32, [32, 32], "input")
        clr1 = raw.Relu(features=raw.Exp(x=inp, name="deny1"), name="clr1")
        clr2 = raw.Relu(features=raw.Sqrt(x=clr1, name="infer1"), name="clr2")
        raw.Identity(input=clr2, name="fetch")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["fetch"])
    assert_unchanged(rewrites)


def _build_already_low(dtype: tf.DType) -> GraphDef:
    """Cases 2/37: Const→Cast cst1(to low)→MatMul allow1→Relu clr1→Cast cst2(to float)→Relu clr2→fetch."""

    def build() -> None:
        cst1 = raw.Cast(x=_const(1.0, [32, 32], "input"), DstT=dtype, name="cst1")
        clr1 = raw.Relu(features=raw.MatMul(a=cst1, b=cst1, name="allow1"), name="clr1")
        clr2 = raw.Relu(features=raw.Cast(x=clr1, DstT=FLOAT, name="cst2"), name="clr2")
        raw.Identity(input=clr2, name="fetch")

    return graph_def_of(build)


@pytest.mark.parametrize(("target", "dtype"), [("float16", tf.float16), ("bfloat16", tf.bfloat16)])
def test_already_low_precision(target: str, dtype: tf.DType) -> None:
    """Cases 2 AlreadyFp16 / 37 AlreadyBf16: ops already in the target type are left alone,
    no cast is added and the float32 tail (clr2) stays float32."""
    rewrites = check_against_grappler(_build_already_low(dtype), target, ["fetch"])
    assert_unchanged(rewrites)
    assert_colours(rewrites, lowered=["cst1:DstT", "allow1", "clr1", "cst2:SrcT"], kept=["cst2:DstT", "clr2"])


def test_simple() -> None:
    """Case 3 Simple: allow spreads through clear ops (clr2, clr3) but not through infer ops
    that are neither between allow ops nor directly after one at pass 4 (infer1, infer2),
    and never past deny ops; +2 casts."""
    graph_def = _build_simple()
    rewrites = check_against_grappler(graph_def, "float16", ["fetch"])
    assert_colours(rewrites, lowered=["clr2", "allow1", "clr3"], kept=SIMPLE_KEPT, casts=2)
    assert_numerics_match(rewrites, ["fetch"])


def test_simple_summary_matches_grappler_log() -> None:
    """§2.6: the report line counts changed vertices over original nodes and casts to f16
    whose source is not a Const/Variable (strings taken from grappler 2.21's INFO log)."""
    rewrites = check_against_grappler(_build_simple(), "float16", ["fetch"])
    assert rewrites.summary == (
        "Converted 3/12 nodes to float16 precision using 1 cast(s) to float16 (excluding Const and Variable casts)"
    )


def test_no_infer_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Case 4 NoInferOp: LEVEL=TREAT_INFER_AS_DENY makes every infer op a deny op, so the
    infer ops stay float32 and only clear ops around the two MatMuls convert; +4."""
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL", "TREAT_INFER_AS_DENY")

    def build() -> None:
        inp = _const(1.0 / 32, [32, 32], "input")
        clr1 = raw.Relu(features=raw.Exp(x=inp, name="deny1"), name="clr1")
        clr2 = raw.Relu(features=raw.Sqrt(x=clr1, name="infer1"), name="clr2")
        clr3 = raw.Relu(features=raw.MatMul(a=clr2, b=clr2, name="allow1"), name="clr3")
        clr4 = raw.Relu(features=raw.Log(x=clr3, name="infer2"), name="clr4")
        allow2 = raw.MatMul(a=clr4, b=clr4, name="allow2")
        raw.Identity(input=raw.Log(x=allow2, name="infer3"), name="fetch")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["fetch"])
    assert_colours(
        rewrites,
        lowered=["clr2", "allow1", "clr3", "clr4", "allow2"],
        kept=["input:dtype", "deny1", "clr1", "infer1", "infer2", "infer3"],
        casts=4,
    )


def test_bidirectional_clear_chain() -> None:
    """Case 5 BidirectionalClearChain: clear propagation (pass 5) runs backwards from allow1
    to clr1, then forwards through ShapeN clr3 and backwards/forwards to clr2 and clr4; +3."""

    def build() -> None:
        inp = _const(1.0 / 32, [32, 32], "input")
        clr1 = raw.Relu(features=inp, name="clr1")
        clr2 = raw.Relu(features=inp, name="clr2")
        allow1 = raw.MatMul(a=clr1, b=clr1, name="allow1")
        raw.ShapeN(input=[clr1, clr2], name="clr3")
        clr4 = raw.Relu(features=clr2, name="clr4")
        raw.Identity(input=allow1, name="fetch1")
        raw.Identity(input=clr4, name="fetch2")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["fetch1", "fetch2"])
    assert_colours(rewrites, lowered=["clr1", "clr2", "allow1", "clr3", "clr4"], casts=3)


def test_preserve_fetches() -> None:
    """Case 6 PreserveFetches: fetched nodes (allow1, clr2, clr3) are preserved and never
    painted, even an allowlist op; only allow2 converts; +2."""

    def build() -> None:
        inp = _const(1.0 / 32, [32, 32], "input")
        allow1 = raw.MatMul(a=inp, b=inp, name="allow1")
        infer1 = raw.Sqrt(x=raw.Relu(features=allow1, name="clr1"), name="infer1")
        clr2 = raw.Relu(features=raw.Exp(x=infer1, name="deny1"), name="clr2")
        clr3 = raw.Relu(features=raw.MatMul(a=clr2, b=clr2, name="allow2"), name="clr3")
        raw.Relu(features=raw.Exp(x=clr3, name="deny2"), name="clr4")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["allow1", "clr2", "clr3"])
    assert_colours(
        rewrites,
        lowered=["allow2"],
        kept=["input:dtype", "allow1", "clr1", "infer1", "deny1", "clr2", "clr3", "deny2", "clr4"],
        casts=2,
    )


@pytest.mark.parametrize(
    ("target", "other_device"),
    [
        ("float16", "/job:localhost/replica:0/task:0/device:CPU:0"),
        ("bfloat16", "/job:localhost/replica:0/task:0/device:GPU:0"),
    ],
)
def test_preserve_cpu_nodes(target: str, other_device: str) -> None:
    """Case 7 PreserveCPUNodes (CUDA), mirrored for bfloat16 with a GPU node: a node
    explicitly on another device type than the target's is not processed, so allow2 and
    its clear successor stay float32. infer1 (Tanh right after allow1) converts: pass 4
    runs in every mode in TF >= 2.20 (the spec's 2025 expectation); +2."""

    def build() -> None:
        inp = _const(1.0 / 32, [32, 32], "input")
        clr1 = raw.Relu(features=inp, name="clr1")
        infer1 = raw.Tanh(x=raw.MatMul(a=clr1, b=clr1, name="allow1"), name="infer1")
        with tf.device(other_device):
            allow2 = raw.MatMul(a=infer1, b=infer1, name="allow2")
        raw.Identity(input=raw.Relu(features=allow2, name="clr2"), name="fetch")

    rewrites = check_against_grappler(graph_def_of(build), target, ["fetch"])
    assert_colours(rewrites, lowered=["clr1", "allow1", "infer1"], kept=["allow2", "clr2"], casts=2)


def test_preserve_identity_after_variable() -> None:
    """Case 8 PreserveIdentityAfterVariable: an Identity reading a ref variable (VariableV2)
    is not entered by clear propagation, so the variable read stays float32 and gets a
    cast; the same Identity after a Const converts; +5."""

    def build() -> None:
        inp = _const(1.0 / 32, [32, 32], "input")
        var1 = raw.VariableV2(shape=[32, 32], dtype=FLOAT, name="var1")
        allow1 = raw.MatMul(a=inp, b=raw.Identity(input=var1, name="clr1"), name="allow1")
        clr2 = raw.Identity(input=_const(1.0 / 32, [32, 32], "input2"), name="clr2")
        allow2 = raw.MatMul(a=inp, b=clr2, name="allow2")
        raw.Identity(input=allow1, name="fetch1")
        raw.Identity(input=allow2, name="fetch2")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["fetch1", "fetch2"])
    assert_colours(
        rewrites, lowered=["clr2", "allow1", "allow2"], kept=["input:dtype", "var1:dtype", "clr1"], casts=5
    )
    assert rewrites.summary == (
        "Converted 3/9 nodes to float16 precision using 0 cast(s) to float16 (excluding Const and Variable casts)"
    )


def test_fused_batch_norm() -> None:
    """Case 9 FusedBatchNorm: FusedBatchNorm(Grad) is upgraded to V2 with U=float; T follows
    the surrounding allow ops while the U (scale/mean/variance) vertices stay float32; +3."""

    def build() -> None:
        inp = _const(1.0 / 32, [2, 8, 8, 4], "input")
        weight = _const(2.0, [3, 3, 4, 4], "weight")
        scale = _const(3.0, [4], "scale")
        offset = _const(4.0, [4], "offset")
        mean = _const(5.0, [0], "mean")
        variance = _const(6.0, [0], "variance")
        allow1 = raw.Conv2D(input=inp, filter=weight, strides=[1, 1, 1, 1], padding="SAME", name="allow1")
        fbn1 = raw.FusedBatchNorm(
            x=allow1, scale=scale, offset=offset, mean=mean, variance=variance, data_format="NHWC", name="fbn1"
        )
        bng1 = raw.FusedBatchNormGrad(
            y_backprop=fbn1.y,
            x=allow1,
            scale=scale,
            reserve_space_1=fbn1.reserve_space_1,
            reserve_space_2=fbn1.reserve_space_2,
            data_format="NHWC",
            name="bng1",
        )
        infer1 = raw.Add(x=fbn1.y, y=bng1.x_backprop, name="infer1")
        allow2 = raw.Conv2D(input=infer1, filter=weight, strides=[1, 1, 1, 1], padding="SAME", name="allow2")
        raw.Identity(input=allow2, name="fetch")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["fetch"])
    assert_colours(
        rewrites, lowered=["fbn1", "bng1", "infer1", "allow1", "allow2"], kept=["fbn1:U", "bng1:U"], casts=3
    )
    for _, graph_def in rewrites.results():
        assert (op_of(graph_def, "fbn1"), op_of(graph_def, "bng1")) == ("FusedBatchNormV2", "FusedBatchNormGradV2")


def test_repeated_and_list_type_attrs() -> None:
    """Case 10 RepeatedAndListTypeAttrs: every element of IdentityN's list attr T is its
    own vertex, and AddN's N repeated inputs share one T vertex; all convert; +2."""

    def build() -> None:
        inp = _const(1.0 / 32, [32, 32], "input")
        allow1 = raw.MatMul(a=inp, b=inp, name="allow1")
        clr1 = raw.IdentityN(input=[allow1, allow1, allow1], name="clr1")
        infer1 = raw.AddN(inputs=list(clr1), name="infer1")
        raw.Identity(input=raw.MatMul(a=infer1, b=infer1, name="allow2"), name="fetch")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["fetch"])
    assert_colours(
        rewrites, lowered=["clr1:T[0]", "clr1:T[1]", "clr1:T[2]", "infer1", "allow1", "allow2"], casts=2
    )


def test_existing_cast() -> None:
    """Case 11 ExistingCast: a user Cast(bool→float) feeding only allow vertices is
    re-targeted to bool→half (pass 10) instead of getting a new cast; +1 (before fetch)."""

    def build() -> None:
        cst1 = raw.Cast(x=tf.constant(True, shape=[32, 32], name="input"), DstT=FLOAT, name="cst1")
        raw.Identity(input=raw.MatMul(a=cst1, b=cst1, name="allow1"), name="fetch")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["fetch"])
    assert_colours(rewrites, lowered=["cst1:DstT", "allow1"], casts=1)
    for _, graph_def in rewrites.results():
        assert vertex_dtypes(graph_def)[("cst1", "SrcT")] == tf.bool.as_datatype_enum


# --------------------------------------------------------------------------------------
# §5.1 case 12 and the NextIteration check: hand-built v1 loops


def _build_loop(*, second_merge: bool, nxt1_consumer: str) -> GraphDef:
    """input→Exp deny1→Enter ent1→Merge mrg1(ent1, nxt1)→Switch swt1→Sqrt infer1(swt1:1)→
    MatMul allow1→NextIteration nxt1; Exit ext1(swt1:0)→fetch. ``second_merge`` adds
    mrg2 = Merge(ent1, nxt1) (case 12); ``nxt1_consumer`` = "Identity" adds a non-Merge
    consumer clr1 of nxt1."""

    def build() -> None:
        deny1 = raw.Exp(x=_const(1.0 / 32, [32, 32], "input"), name="deny1")
        ent1 = raw.Enter(data=deny1, frame_name="loop1", name="ent1")
        # The back edge mrg1:1 <- nxt1 is wired below, after nxt1 exists.
        mrg1 = raw.Merge(inputs=[ent1, ent1], name="mrg1")
        lpc1 = raw.LoopCond(input=tf.constant(False, name="con1"), name="lpc1")
        swt1 = raw.Switch(data=mrg1.output, pred=lpc1, name="swt1")
        infer1 = raw.Sqrt(x=swt1.output_true, name="infer1")
        nxt1 = raw.NextIteration(data=raw.MatMul(a=infer1, b=infer1, name="allow1"), name="nxt1")
        raw.Identity(input=raw.Exit(data=swt1.output_false, name="ext1"), name="fetch")
        if second_merge:
            raw.Merge(inputs=[ent1, nxt1], name="mrg2")
        if nxt1_consumer == "Identity":
            raw.Identity(input=nxt1, name="clr1")

    graph_def = graph_def_of(build)
    next(node for node in graph_def.node if node.name == "mrg1").input[1] = "nxt1"
    return graph_def


def test_recurrent_edge_colour_mismatch() -> None:
    """Case 12 RecurrentEdgeColorMismatch: mrg1 is deny (between deny1 and infer1), so the
    NextIteration nxt1 and the second Merge mrg2 it feeds are forced back to float32
    (pass 9); only allow1 converts; +2."""
    rewrites = check_against_grappler(_build_loop(second_merge=True, nxt1_consumer=""), "float16", ["fetch"])
    assert_colours(
        rewrites,
        lowered=["allow1"],
        kept=["deny1", "ent1", "mrg1", "swt1", "infer1", "nxt1", "mrg2", "ext1", "fetch"],
        casts=2,
    )


def test_next_iteration_must_feed_merge() -> None:
    """§2.3 pass 9: every consumer of a NextIteration must be a Merge. grappler fails the
    pass ("Expected Merge node after NextIteration, got Identity"); we raise an
    AmpRewriteError that names the node."""
    graph_def = _build_loop(second_merge=False, nxt1_consumer="Identity")
    with pytest.raises(RuntimeError, match="Expected Merge node after NextIteration, got Identity"):
        run_grappler(graph_def, target="float16", fetches=["fetch"])
    with pytest.raises(amp_rewrite.AmpRewriteError, match="nxt1"):
        amp_rewrite.rewrite_graph_def(graph_def, target="float16", fetches=("fetch",))


# --------------------------------------------------------------------------------------
# §5.1 cases 13–16 and 39: TensorList clusters


def _build_tensor_list_set_get(infer_op: str) -> GraphDef:
    """Cases 13/39: list tl1 written with input, allow1, allow2 and read back; an unrelated
    list tl2 only ever holds ``input`` and is read straight into a fetch."""
    shape = [32, 32]

    def build() -> None:
        tl1 = raw.TensorListReserve(element_shape=shape, num_elements=8, element_dtype=FLOAT, name="tl1")
        inp = _const(1.0 / 32, shape, "input")
        idx1, idx2, idx3 = (tf.constant(i, name=f"idx{i}") for i in (1, 2, 3))
        raw.TensorListSetItem(input_handle=tl1, index=idx1, item=inp, name="tl1w1")
        allow1 = raw.MatMul(a=inp, b=inp, name="allow1")
        tl1w2 = raw.TensorListSetItem(input_handle=tl1, index=idx2, item=allow1, name="tl1w2")
        tl1rs = raw.TensorListResize(input_handle=tl1w2, size=6, name="tl1rs")
        tl1r1 = raw.TensorListGetItem(
            input_handle=tl1rs, index=idx2, element_shape=shape, element_dtype=FLOAT, name="tl1r1"
        )
        if infer_op == "Tanh":
            infer1 = raw.Tanh(x=tl1r1, name="infer1")
        else:
            infer1 = raw.Mul(x=tl1r1, y=tl1r1, name="infer1")
        allow2 = raw.MatMul(a=infer1, b=infer1, name="allow2")
        tl1w3 = raw.TensorListSetItem(input_handle=tl1, index=idx3, item=allow2, name="tl1w3")
        tl1r2 = raw.TensorListGetItem(
            input_handle=tl1w3, index=idx3, element_shape=shape, element_dtype=FLOAT, name="tl1r2"
        )
        tl2 = raw.TensorListReserve(element_shape=shape, num_elements=8, element_dtype=FLOAT, name="tl2")
        tl2w1 = raw.TensorListSetItem(input_handle=tl2, index=idx1, item=inp, name="tl2w1")
        tl2r1 = raw.TensorListGetItem(
            input_handle=tl2w1, index=idx1, element_shape=shape, element_dtype=FLOAT, name="tl2r1"
        )
        raw.Identity(input=tl1r2, name="fetch1")
        raw.Identity(input=tl2r1, name="fetch2")

    return graph_def_of(build)


@pytest.mark.parametrize(("target", "infer_op"), [("float16", "Tanh"), ("bfloat16", "Mul")])
def test_tensor_list_set_get(target: str, infer_op: str) -> None:
    """Cases 13/39 TensorListSetGet: a TensorList cluster is painted as one (element_dtype of
    the list and every writer/reader), following the allow ops written into it; the tl2
    cluster holds no allow data and stays float32; TensorListResize is a pass-through; +2."""
    rewrites = check_against_grappler(_build_tensor_list_set_get(infer_op), target, ["fetch1", "fetch2"])
    low = [f"{node}:element_dtype" for node in ("tl1", "tl1w1", "tl1w2", "tl1r1", "tl1w3")]
    kept = [f"{node}:element_dtype" for node in ("tl2", "tl2w1", "tl2r1")]
    assert_colours(rewrites, lowered=low + ["allow1", "infer1", "allow2"], kept=kept, casts=2)
    assert_numerics_match(rewrites, ["fetch1", "fetch2"])


def test_tensor_list_push_pop() -> None:
    """Case 14 TensorListPushPop: as SetGet with EmptyTensorList/PushBack/PopBack; +2."""
    shape = [32, 32]

    def build() -> None:
        tl1 = raw.EmptyTensorList(element_shape=shape, max_num_elements=8, element_dtype=FLOAT, name="tl1")
        inp = _const(1.0 / 32, shape, "input")
        tl1w1 = raw.TensorListPushBack(input_handle=tl1, tensor=inp, name="tl1w1")
        allow1 = raw.MatMul(a=inp, b=inp, name="allow1")
        tl1w2 = raw.TensorListPushBack(input_handle=tl1w1, tensor=allow1, name="tl1w2")
        tl1r1 = raw.TensorListPopBack(input_handle=tl1w2, element_shape=shape, element_dtype=FLOAT, name="tl1r1")
        infer1 = raw.Tanh(x=tl1r1.tensor, name="infer1")
        allow2 = raw.MatMul(a=infer1, b=infer1, name="allow2")
        tl1w3 = raw.TensorListPushBack(input_handle=tl1, tensor=allow2, name="tl1w3")
        tl1r2 = raw.TensorListPopBack(input_handle=tl1w3, element_shape=shape, element_dtype=FLOAT, name="tl1r2")
        tl2 = raw.EmptyTensorList(element_shape=shape, max_num_elements=8, element_dtype=FLOAT, name="tl2")
        tl2w1 = raw.TensorListPushBack(input_handle=tl2, tensor=inp, name="tl2w1")
        tl2r1 = raw.TensorListPopBack(input_handle=tl2w1, element_shape=shape, element_dtype=FLOAT, name="tl2r1")
        raw.Identity(input=tl1r2.tensor, name="fetch1")
        raw.Identity(input=tl2r1.tensor, name="fetch2")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["fetch1", "fetch2"])
    low = [f"{node}:element_dtype" for node in ("tl1", "tl1w1", "tl1w2", "tl1r1", "tl1w3")]
    kept = [f"{node}:element_dtype" for node in ("tl2", "tl2w1", "tl2r1")]
    assert_colours(rewrites, lowered=low + ["allow1", "infer1", "allow2"], kept=kept, casts=2)
    assert_numerics_match(rewrites, ["fetch1:0", "fetch2:0"])


def test_tensor_list_from_tensor() -> None:
    """Case 15 TensorListFromTensor: FromTensor/Stack carry allow data; an unfetched
    PushBack tl2w1 on an allow-painted list is force-painted with its cluster (otherwise
    the graph would be invalid); +2."""

    def build() -> None:
        inp = _const(1.0 / 32, [32, 32], "input")
        allow1 = raw.MatMul(a=inp, b=inp, name="allow1")
        tl1 = raw.TensorListFromTensor(tensor=allow1, element_shape=[32], name="tl1")
        tl1r1 = raw.TensorListStack(input_handle=tl1, element_shape=[32], element_dtype=FLOAT, name="tl1r1")
        infer1 = raw.Tanh(x=tl1r1, name="infer1")
        raw.Identity(input=raw.MatMul(a=infer1, b=infer1, name="allow2"), name="fetch1")
        tl2 = raw.TensorListFromTensor(tensor=allow1, element_shape=[32], name="tl2")
        raw.TensorListPushBack(input_handle=tl2, tensor=inp, name="tl2w1")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["fetch1"])
    assert_colours(
        rewrites,
        lowered=["allow1", "tl1:element_dtype", "tl1r1:element_dtype", "infer1", "allow2"]
        + ["tl2:element_dtype", "tl2w1:element_dtype"],
        casts=2,
    )
    assert_numerics_match(rewrites, ["fetch1"])


def test_tensor_list_push_back_batch_and_concat_lists() -> None:
    """Case 16 TensorListPushBackBatchAndConcatLists: clusters are followed through a
    batch of list handles (Pack/Split/Reshape of variants) and ConcatLists; +2."""
    shape = [32, 32]

    def build() -> None:
        inp = _const(1.0 / 32, shape, "input")
        allow1 = raw.MatMul(a=inp, b=inp, name="allow1")
        tl1 = raw.EmptyTensorList(element_shape=shape, max_num_elements=8, element_dtype=FLOAT, name="tl1")
        tl2 = raw.EmptyTensorList(element_shape=shape, max_num_elements=8, element_dtype=FLOAT, name="tl2")
        tl1_tl2 = raw.Pack(values=[tl1, tl2], name="tl1_tl2")
        allow1_allow1 = raw.Pack(values=[allow1, allow1], name="allow1_allow1")
        tl12w1 = raw.TensorListPushBackBatch(input_handles=tl1_tl2, tensor=allow1_allow1, name="tl12w1")
        outputs = raw.Split(axis=tf.constant(0, name="split_axis"), value=tl12w1, num_split=2, name="tl12w1_outputs")
        scalar_shape = tf.constant(0, dtype=tf.int32, shape=[0], name="scalar_shape")
        output0 = raw.Reshape(tensor=outputs[0], shape=scalar_shape, name="tl12w1_output0")
        output1 = raw.Reshape(tensor=outputs[1], shape=scalar_shape, name="tl12w1_output1")
        tl3 = raw.TensorListConcatLists(input_a=output0, input_b=output1, element_dtype=FLOAT, name="tl3")
        tl3r1 = raw.TensorListPopBack(input_handle=tl3, element_shape=shape, element_dtype=FLOAT, name="tl3r1")
        infer1 = raw.Tanh(x=tl3r1.tensor, name="infer1")
        raw.Identity(input=raw.MatMul(a=infer1, b=infer1, name="allow2"), name="fetch1")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["fetch1"])
    lists = [f"{node}:element_dtype" for node in ("tl1", "tl2", "tl3", "tl3r1")]
    assert_colours(rewrites, lowered=["allow1", "allow2", "infer1"] + lists, casts=2)


# --------------------------------------------------------------------------------------
# §5.1 cases 18–31: BatchMatMul and the infer-op family


def test_batch_mat_mul() -> None:
    """Case 18 BatchMatMul: allowlisted when cuda >= 9010 (our virtual GPU reports 12050); +2."""

    def build() -> None:
        inp = _const(1.0 / 33, [64, 32, 32], "input")
        raw.Identity(input=raw.BatchMatMul(x=inp, y=inp, name="allow1"), name="fetch1")

    rewrites = check_against_grappler(graph_def_of(build), "float16", ["fetch1"])
    assert_colours(rewrites, lowered=["allow1"], kept=["input:dtype", "fetch1"], casts=2)
    assert_numerics_match(rewrites, ["fetch1"])


# op -> (factory, input range) as in the C++ tests' RunTest calls.
INFER_OP_CASES = {
    "Elu": (lambda x, name: raw.Elu(features=x, name=name), -5.0, 5.0),
    "Erf": (lambda x, name: raw.Erf(x=x, name=name), -5.0, 5.0),
    "Erfc": (lambda x, name: raw.Erfc(x=x, name=name), -5.0, 5.0),
    "Inv": (lambda x, name: raw.Inv(x=x, name=name), 0.01, 10.0),
    "Log": (lambda x, name: raw.Log(x=x, name=name), 0.01, 10.0),
    "Log1p": (lambda x, name: raw.Log1p(x=x, name=name), -0.99, 9.0),
    "LogSoftmax": (lambda x, name: raw.LogSoftmax(logits=x, name=name), -8.0, 8.0),
    "Reciprocal": (lambda x, name: raw.Reciprocal(x=x, name=name), 0.01, 10.0),
    "Sigmoid": (lambda x, name: raw.Sigmoid(x=x, name=name), -5.0, 5.0),
    "Softmax": (lambda x, name: raw.Softmax(logits=x, name=name), -8.0, 8.0),
    "Softplus": (lambda x, name: raw.Softplus(features=x, name=name), -5.0, 5.0),
    "Sqrt": (lambda x, name: raw.Sqrt(x=x, name=name), 0.0, 10.0),
    "Tanh": (lambda x, name: raw.Tanh(x=x, name=name), -5.0, 5.0),
}
INFER_SIZE = 128


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("op", sorted(INFER_OP_CASES))
def test_infer_op_between_allow_ops(op: str, target: str) -> None:
    """Cases 19–31 (EluOp … TanhOp): an infer op between two MatMuls (x @ I) converts with
    them; the fed Placeholder stays float32. Numerics use the C++ test's input range.
    Also run for bfloat16, whose infer list contains all these ops but those we hold
    float32 (lists/bfloat16.yaml's float32 section): they stay float32, with a cast on each side."""
    factory, low, high = INFER_OP_CASES[op]

    def build() -> None:
        inp = tf.compat.v1.placeholder(FLOAT, [INFER_SIZE, INFER_SIZE], name="input")
        eye = tf.constant(np.eye(INFER_SIZE, dtype=np.float32), name="eye")
        infer1 = factory(raw.MatMul(a=inp, b=eye, name="allow1"), "infer1")
        raw.Identity(input=raw.MatMul(a=infer1, b=eye, name="allow2"), name="fetch1")

    rewrites = check_against_grappler(graph_def_of(build), target, ["fetch1"])
    if op in held_float32(target):
        assert_colours(rewrites, lowered=["allow1", "allow2"], kept=["infer1", "input:dtype", "eye:dtype"], casts=5)
    else:
        assert_colours(rewrites, lowered=["allow1", "infer1", "allow2"], kept=["input:dtype", "eye:dtype"], casts=3)
    values = np.random.default_rng(0).uniform(low, high, [INFER_SIZE, INFER_SIZE]).astype(np.float32)
    assert_numerics_match(rewrites, ["fetch1"], {"input": values})


# --------------------------------------------------------------------------------------
# §5.1 cases 34/36 analogues and 38, 40, 41


@pytest.mark.parametrize(("target", "device"), [("float16", "/device:CPU:0"), ("bfloat16", "/device:GPU:0")])
def test_nodes_on_another_device_are_not_painted(target: str, device: str) -> None:
    """Cases 34/36 analogues (§1.5): only nodes on the target's device type are processed;
    the Simple graph placed wholly on the other device is left unchanged."""
    rewrites = check_against_grappler(_build_simple(device), target, ["fetch"])
    assert_unchanged(rewrites)


def test_kernel_check_asks_each_nodes_own_device_type() -> None:
    """§1.5, bfloat16: a node placed on an XLA_CPU device is processed (its type contains
    CPU) but has no bfloat16 Relu kernel there, so clr_xla stays float32 while the same op
    on the CPU, clr_cpu, converts: one kernel answer per device type, not per op."""

    def build() -> None:
        x = tf.compat.v1.placeholder(FLOAT, [4, 4], name="x")
        allow1 = raw.MatMul(a=x, b=x, name="allow1")
        with tf.device("/device:XLA_CPU:0"):
            clr_xla = raw.Relu(features=allow1, name="clr_xla")
        clr_cpu = raw.Relu(features=raw.MatMul(a=clr_xla, b=x, name="allow2"), name="clr_cpu")
        raw.Identity(input=raw.MatMul(a=clr_cpu, b=x, name="allow3"), name="fetch")

    rewrites = check_against_grappler(graph_def_of(build), "bfloat16", ["fetch"])
    assert_colours(rewrites, lowered=["allow1", "allow2", "clr_cpu", "allow3"], kept=["clr_xla"], casts=4)
    assert rewrites.report.decision("clr_xla").rule == "no-kernel"


GPU_FULL_NAME = "/job:localhost/replica:0/task:0/device:GPU:0"
# Per target: each cast (named modulo its index) and the device grappler gives it.
PLACED_CASTS = {
    "float16": {"input-0-CastToFp16": "/device:CPU:0", "cpu_clr0-0-CastToFp16": "/device:CPU:0",
                "allow1-0-CastToFp32": GPU_FULL_NAME, "allow2-0-CastToFp32": "/device:GPU:0"},
    "bfloat16": {"allow2-0-CastToBf16": "/device:GPU:0", "cpu_allow3-0-CastToFp32": "/device:CPU:0"},
}


@pytest.mark.parametrize("target", TARGETS)
def test_a_cast_sits_on_its_source_nodes_device(target: str) -> None:
    """§2.6: a cast goes on its source node's device, spelled as the graph spells it (short
    ``/device:GPU:0`` or the full name), whichever device its consumers are on. input and
    cpu_clr0 are on the CPU, allow1 (full name) and allow2 (short) on the GPU, cpu_* after
    them on the CPU: for float16 only the GPU MatMuls convert, for bfloat16 only the CPU one
    (cpu_allow3), and each cast's device is its source's, in ours and in grappler's."""

    def build() -> None:
        with tf.device("/device:CPU:0"):
            inp = _const(1.0 / 32, [32, 32], "input")
            cpu_clr0 = raw.Relu(features=inp, name="cpu_clr0")
        with tf.device(GPU_FULL_NAME):
            allow1 = raw.MatMul(a=cpu_clr0, b=cpu_clr0, name="allow1")
        with tf.device("/device:GPU:0"):
            allow2 = raw.MatMul(a=allow1, b=inp, name="allow2")
        with tf.device("/device:CPU:0"):
            cpu_deny1 = raw.Exp(x=allow2, name="cpu_deny1")
            cpu_allow3 = raw.MatMul(a=allow2, b=allow2, name="cpu_allow3")
            cpu_clr2 = raw.Relu(features=allow1, name="cpu_clr2")
        raw.Identity(input=raw.AddV2(x=cpu_deny1, y=cpu_allow3, name="clr1"), name="fetch")
        raw.Identity(input=cpu_clr2, name="fetch2")

    rewrites = check_against_grappler(graph_def_of(build), target, ["fetch", "fetch2"])
    lowered = ["allow1", "allow2"] if target == "float16" else ["cpu_allow3"]
    assert_colours(rewrites, lowered=lowered, kept=["cpu_clr0", "cpu_deny1", "cpu_clr2"],
                   casts=len(PLACED_CASTS[target]))
    for label, result in rewrites.results():
        placed = {node.name.rsplit("-", 2)[0]: node.device for node in result.node if is_amp_cast(node)}
        assert placed == PLACED_CASTS[target], label
    assert_numerics_match(rewrites, ["fetch", "fetch2"])


def test_simple_bfloat16() -> None:
    """Case 38 Simple (BF16): Log is infer for bfloat16 (named deny2 in the C++ test) and is
    not directly after an allow vertex at pass 4, so like Simple only clr2, allow1, clr3
    convert; +2."""

    def build() -> None:
        inp = _const(1.0 / 32, [32, 32], "input")
        clr1 = raw.Relu(features=raw.Exp(x=inp, name="deny1"), name="clr1")
        clr2 = raw.Relu(features=raw.Sqrt(x=clr1, name="infer1"), name="clr2")
        clr3 = raw.Relu(features=raw.MatMul(a=clr2, b=clr2, name="allow1"), name="clr3")
        clr4 = raw.Relu(features=raw.Log(x=clr3, name="deny2"), name="clr4")
        clr5 = raw.Relu(features=raw.SparseMatMul(a=clr4, b=clr4, name="deny3"), name="clr5")
        raw.Identity(input=clr5, name="fetch")

    rewrites = check_against_grappler(graph_def_of(build), "bfloat16", ["fetch"])
    kept = ["input:dtype", "deny1", "clr1", "infer1", "deny2", "clr4", "deny3:Ta", "deny3:Tb", "clr5", "fetch"]
    assert_colours(rewrites, lowered=["clr2", "allow1", "clr3"], kept=kept, casts=2)
    assert_numerics_match(rewrites, ["fetch"])


def test_simple_graph_bfloat16_summary() -> None:
    """§2.6 report line in bfloat16 mode (string taken from grappler 2.21's INFO log)."""
    rewrites = check_against_grappler(_build_simple(), "bfloat16", ["fetch"])
    assert_colours(rewrites, lowered=["clr2", "allow1", "clr3"], kept=SIMPLE_KEPT, casts=2)
    assert rewrites.summary == (
        "Converted 3/12 nodes to bfloat16 precision using 1 cast(s) to bfloat16 (excluding Const and Variable casts)"
    )


@pytest.mark.parametrize("target", TARGETS)
def test_infer_follow_up_stream_allow(target: str) -> None:
    """Case 40 InferFollowUpStreamAllow: an infer op (BiasAdd) fed by an allow op converts
    at pass 4 and the clear op after it follows; +4. The spec lists it for BF16 and
    FP16_CPU; live TF 2.21 runs pass 4 in CUDA mode too, so float16 gives the same."""

    def build() -> None:
        input1 = _const(1.0 / 32, [2, 8, 8, 16], "input1")
        weight = _const(2.0, [3, 3, 16, 16], "weight")
        allow = raw.Conv2D(input=input1, filter=weight, strides=[1, 1, 1, 1], padding="SAME", name="allow")
        infer = raw.BiasAdd(value=allow, bias=_const(1.0 / 32, [16], "input2"), name="infer")
        raw.Identity(input=raw.Relu(features=infer, name="clr"), name="fetch")

    rewrites = check_against_grappler(graph_def_of(build), target, ["fetch"])
    assert_colours(rewrites, lowered=["allow", "infer", "clr"], kept=["fetch"], casts=4)
    assert_numerics_match(rewrites, ["fetch"])


@pytest.mark.parametrize("target", TARGETS)
def test_infer_follow_up_stream_deny(target: str) -> None:
    """Case 41 InferFollowUpStreamDeny: with no allowlist op nothing converts, even an infer
    op; the graph is unchanged (+0)."""

    def build() -> None:
        deny = raw.Pow(x=_const(1.0 / 32, [2, 8, 8, 16], "input1"), y=_const(2.0, [2, 8, 8, 16], "input2"), name="deny")
        infer = raw.BiasAdd(value=deny, bias=_const(1.0 / 32, [16], "input3"), name="infer")
        raw.Identity(input=raw.Relu(features=infer, name="clr"), name="fetch")

    rewrites = check_against_grappler(graph_def_of(build), target, ["fetch"])
    assert_unchanged(rewrites)


# --------------------------------------------------------------------------------------
# §5.2 Python auto_mixed_precision_test.py (TF1-style graphs, resource variables)


class _Model:
    """The Python test's helpers: variables from a seeded generator, TF's default names."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def input(self, shape: list[int]) -> tf.Variable:
        return tf.Variable(self.rng.standard_normal(shape).clip(-2, 2).astype(np.float32))

    def weight(self, shape: list[int]) -> tf.Variable:
        fan_in, fan_out = int(np.prod(shape[:-1])), shape[-1]
        limit = np.sqrt(6.0 / (fan_in + fan_out))
        return tf.Variable(self.rng.uniform(-limit, limit, shape).astype(np.float32))

    def conv_bn(self, x: tf.Tensor) -> tf.Tensor:
        i = tf.reshape(x, [-1, 8, 8, 1])
        y = tf.nn.conv2d(i, self.weight([3, 3, 1, 6]), strides=[1, 1, 1, 1], padding="SAME")
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(y, self.weight([6]), self.weight([6]), is_training=True)
        return tf.identity(y)

    def conv3d_bn(self, x: tf.Tensor) -> tf.Tensor:
        i = tf.reshape(x, [-1, 8, 8, 8, 1])
        y = tf.nn.conv3d(i, self.weight([3, 3, 3, 1, 6]), strides=[1, 1, 1, 1, 1], padding="SAME")
        y = tf.reshape(y, [-1, 8, 8, 6])
        y, _, _ = tf.compat.v1.nn.fused_batch_norm(y, self.weight([6]), self.weight([6]), is_training=True)
        return tf.identity(y)

    def matmul_act(self, x: tf.Tensor) -> tf.Tensor:
        return tf.nn.relu(tf.matmul(tf.reshape(x, [8, 8]), self.weight([8, 8])))

    def conv_pool(self, x: tf.Tensor) -> tf.Tensor:
        def layer(h: tf.Tensor, shape: list[int]) -> tf.Tensor:
            h = tf.nn.conv2d(h, self.weight(shape), strides=[1, 1, 1, 1], padding="SAME")
            h = tf.nn.relu(tf.nn.bias_add(h, tf.constant(0.1, shape=[shape[-1]])))
            return tf.compat.v1.nn.max_pool(h, ksize=[1, 2, 2, 1], strides=[1, 2, 2, 1], padding="SAME")

        return layer(layer(tf.reshape(x, [-1, 8, 8, 1]), [3, 3, 1, 6]), [3, 3, 6, 4])


def _python_case(build: Callable[[_Model], list[tf.Tensor]]) -> tuple[GraphDef, list[str]]:
    """Build a Python-test graph; return it and the fetched tensors' names."""
    fetched: list[str] = []

    def run_build() -> None:
        fetched.extend(tensor.name for tensor in build(_Model()))

    return graph_def_of(run_build), fetched


def _gradients(y: tf.Tensor, xs: list[tf.Tensor]) -> list[tf.Tensor]:
    """Gradients as ``Optimizer.compute_gradients`` makes them: gated, so an op's several
    input gradients pass through ``tuple/control_dependency`` Identity nodes and the
    fetched (preserved) nodes are those Identities, not the backprop ops themselves."""
    return tf.compat.v1.gradients(y, xs, gate_gradients=True)


def _fetch_nodes(tensors: list[str]) -> list[str]:
    return sorted({tensor.split(":")[0] for tensor in tensors})


@pytest.mark.parametrize("target", TARGETS)
def test_conv_bn(target: str) -> None:
    """test_conv_bn [cuda, mkl]: Conv2D, FusedBatchNormV3 and Conv2D_1 convert; casts: 3 to
    the target (Conv2D input and filter, Conv2D_1 filter) and 1 back (after the second
    batch norm, before the fetched Identity)."""

    def build(model: _Model) -> list[tf.Tensor]:
        return [model.conv_bn(model.conv_bn(model.input([2, 8, 8, 1])))]

    graph_def, fetches = _python_case(build)
    rewrites = check_against_grappler(graph_def, target, _fetch_nodes(fetches))
    assert_colours(rewrites, lowered=["Conv2D", "FusedBatchNormV3", "Conv2D_1"], kept=["FusedBatchNormV3:U"], casts=4)
    kind = "CastToFp16" if target == "float16" else "CastToBf16"
    assert count_casts_by_kind(rewrites.ours) == {kind: 3, "CastToFp32": 1}
    # All three casts to the target read a variable, so none is counted (§2.6).
    assert rewrites.summary == (
        f"Converted 7/56 nodes to {target} precision using 0 cast(s) to {target} (excluding Const and Variable casts)"
    )
    assert_numerics_match(rewrites, fetches)


@pytest.mark.parametrize("target", TARGETS)
def test_conv3d_bn(target: str) -> None:
    """test_conv3d_bn [mkl; cuda skipped upstream for old cuDNN, our virtual GPU has cuDNN
    9.3]: Conv3D, FusedBatchNormV3, Conv3D_1 convert; 3 casts to the target, 1 back."""

    def build(model: _Model) -> list[tf.Tensor]:
        return [model.conv3d_bn(model.conv3d_bn(model.input([2, 8, 8, 8, 1])))]

    graph_def, fetches = _python_case(build)
    rewrites = check_against_grappler(graph_def, target, _fetch_nodes(fetches))
    assert_colours(rewrites, lowered=["Conv3D", "FusedBatchNormV3", "Conv3D_1"], casts=4)
    kind = "CastToFp16" if target == "float16" else "CastToBf16"
    assert count_casts_by_kind(rewrites.ours) == {kind: 3, "CastToFp32": 1}


@pytest.mark.parametrize("target", TARGETS)
def test_conv3d(target: str) -> None:
    """test_conv3d [mkl; cuda skipped upstream]: Conv3D and its input/filter gradients
    (Conv3DBackpropInputV2, Conv3DBackpropFilterV2) convert."""

    def build(model: _Model) -> list[tf.Tensor]:
        x, f = model.input([2, 8, 8, 8, 1]), model.weight([3, 3, 3, 1, 6])
        y = tf.identity(tf.nn.conv3d(x, f, strides=[1, 1, 1, 1, 1], padding="SAME"))
        return [y, *_gradients(y, [x, f])]

    graph_def, fetches = _python_case(build)
    rewrites = check_against_grappler(graph_def, target, _fetch_nodes(fetches))
    grads = ["gradients/Conv3D_grad/Conv3DBackpropInputV2", "gradients/Conv3D_grad/Conv3DBackpropFilterV2"]
    assert_colours(rewrites, lowered=["Conv3D", *grads])


@pytest.mark.parametrize("target", TARGETS)
def test_conv_bn_dropout(target: str) -> None:
    """test_conv_bn_dropout [cuda, mkl]: conv_bn → dropout → Add 'addition' → conv_bn →
    gradient: Conv2D, FusedBatchNormV3, addition and Conv2D_1 convert."""

    def build(model: _Model) -> list[tf.Tensor]:
        x = model.input([2, 8, 8, 1])
        y = tf.nn.dropout(model.conv_bn(x), rate=0.5, seed=1)
        y = tf.identity(model.conv_bn(tf.add(y, 1.0, name="addition")))
        return [y, *_gradients(y, [x])]

    graph_def, fetches = _python_case(build)
    rewrites = check_against_grappler(graph_def, target, _fetch_nodes(fetches))
    assert_colours(rewrites, lowered=["Conv2D", "FusedBatchNormV3", "addition", "Conv2D_1"])


def test_conv_pool() -> None:
    """test_conv_pool [cuda]: (Conv2D→BiasAdd→Relu→MaxPool)×2: Conv2D, Relu, MaxPool,
    Conv2D_1 convert; 1 cast back, before the fetched MaxPool_1. Live TF 2.21 inserts 5
    casts to float16, not the spec's 4: the input and two filter reads plus one per bias
    Const (both BiasAdds convert, and each bias is its own Const)."""

    def build(model: _Model) -> list[tf.Tensor]:
        return [model.conv_pool(model.input([2, 8, 8, 1]))]

    graph_def, fetches = _python_case(build)
    rewrites = check_against_grappler(graph_def, "float16", _fetch_nodes(fetches))
    assert_colours(rewrites, lowered=["Conv2D", "Relu", "MaxPool", "Conv2D_1"])
    assert count_casts_by_kind(rewrites.ours) == {"CastToFp16": 5, "CastToFp32": 1}
    assert_numerics_match(rewrites, fetches)


def test_depthwise_conv2d() -> None:
    """test_depthwise_conv2d [cuda, cuDNN >= 8]: the depthwise conv and both its gradients
    convert (allowlisted from cuDNN 8; our virtual GPU reports 9.3)."""

    def build(model: _Model) -> list[tf.Tensor]:
        x, f = model.input([2, 8, 8, 1]), model.weight([3, 3, 1, 4])
        y = tf.identity(tf.nn.depthwise_conv2d(x, f, strides=[1, 1, 1, 1], padding="SAME"))
        return [y, *_gradients(y, [x, f])]

    graph_def, fetches = _python_case(build)
    rewrites = check_against_grappler(graph_def, "float16", _fetch_nodes(fetches))
    grads = [
        "gradients/depthwise_grad/DepthwiseConv2dNativeBackpropInput",
        "gradients/depthwise_grad/DepthwiseConv2dNativeBackpropFilter",
    ]
    assert_colours(rewrites, lowered=["depthwise", *grads])


def test_multi_paths() -> None:
    """test_multi_paths [cuda]: split into 3 channels → 3×conv_pool → concat → gradient:
    split, every Conv2D/Relu/MaxPool and concat convert."""

    def build(model: _Model) -> list[tf.Tensor]:
        x = model.input([2, 8, 8, 3])
        parts = tf.split(x, num_or_size_splits=3, axis=3)
        y = tf.identity(tf.concat([model.conv_pool(part) for part in parts], axis=3))
        return [y, *_gradients(y, [x])]

    graph_def, fetches = _python_case(build)
    rewrites = check_against_grappler(graph_def, "float16", _fetch_nodes(fetches))
    suffixes = [""] + [f"_{i}" for i in range(1, 6)]
    per_path = [f"{op}{suffix}" for suffix in suffixes for op in ("Conv2D", "Relu", "MaxPool")]
    assert_colours(rewrites, lowered=["split", *per_path, "concat"])


@pytest.mark.parametrize("target", TARGETS)
def test_multi_paths_2(target: str) -> None:
    """test_multi_paths_2 [cuda, mkl]: y = relu(x@w1) + relu(x@w2) + x with its gradient:
    both MatMuls and Relus convert."""

    def build(model: _Model) -> list[tf.Tensor]:
        x = model.input([8, 8])
        y = model.matmul_act(x) + model.matmul_act(x) + x
        return [*_gradients(y, [x]), y]

    graph_def, fetches = _python_case(build)
    rewrites = check_against_grappler(graph_def, target, _fetch_nodes(fetches))
    assert_colours(rewrites, lowered=["MatMul", "Relu", "MatMul_1", "Relu_1"])
    assert_numerics_match(rewrites, fetches)


# --------------------------------------------------------------------------------------
# The oracle itself (amp_rewrite.testing.reference): it must see differences and nothing else


def _recorded_answer(original: GraphDef) -> GraphDef:
    """grappler's float16 answer for ``original``, to test the comparison on."""
    grappler = recorded_grappler.rewrite(original, target="float16", fetches=["fetch"])
    if grappler is None:
        recorded_grappler.skip_comparison()
    return grappler


def _rename_node(graph_def: GraphDef, old: str, new: str) -> None:
    for node in graph_def.node:
        node.name = new if node.name == old else node.name
        node.input[:] = [new if tensor == old else tensor for tensor in node.input]


def test_compare_rewrites_ignores_order_port_zero_and_cast_ids() -> None:
    """grappler re-sorts nodes, writes "x" for "x:0" and numbers casts; none of it is a
    difference."""
    original = _build_simple()
    grappler = _recorded_answer(original)
    ours = GraphDef()
    ours.CopyFrom(grappler)
    ours.node.sort(key=lambda node: node.name, reverse=True)
    _rename_node(ours, "infer1-0-CastToFp16-0-AutoMixedPrecision", "infer1-0-CastToFp16-7-AutoMixedPrecision")
    clr2 = next(node for node in ours.node if node.name == "clr2")
    clr2.input[0] += ":0"
    agreement = compare_rewrites(original, ours, grappler)
    assert agreement.ok, agreement.explain()
    assert (agreement.judged, agreement.ours_casts, agreement.grappler_casts) == (13, 2, 2)


def test_compare_rewrites_reports_vertex_and_cast_differences() -> None:
    """A vertex with another dtype and a cast feeding other consumers are both reported."""
    original = _build_simple()
    grappler = _recorded_answer(original)
    ours = GraphDef()
    ours.CopyFrom(grappler)
    clr3 = next(node for node in ours.node if node.name == "clr3")
    clr3.attr["T"].type = tf.float32.as_datatype_enum
    infer2 = next(node for node in ours.node if node.name == "infer2")
    infer2.input[0] = "clr3"
    agreement = compare_rewrites(original, ours, grappler)
    assert not agreement.ok
    assert agreement.mismatches == ("clr3 attr T: ours=DT_FLOAT grappler=DT_HALF",)
    assert agreement.cast_mismatches == (
        "clr3-0-CastToFp32: consumers ours=[] grappler=[('infer2', 0)]",
    )


def test_compare_rewrites_reports_a_cast_on_another_device() -> None:
    """A cast wired alike but placed on another device than grappler's is a difference."""
    original = _build_simple("/device:GPU:0")
    grappler = _recorded_answer(original)
    ours = GraphDef()
    ours.CopyFrom(grappler)
    cast = next(node for node in ours.node if node.name.startswith("infer1-0-CastToFp16-"))
    assert cast.device == "/device:GPU:0"
    cast.device = "/device:CPU:0"
    agreement = compare_rewrites(original, ours, grappler)
    assert not agreement.ok and agreement.mismatches == ()
    assert agreement.cast_mismatches == ("infer1-0-CastToFp16: device ours='/device:CPU:0' grappler='/device:GPU:0'",)


def test_run_grappler_accepts_unknown_placeholder_shapes_without_fetches() -> None:
    """grappler's item builder rejects placeholders with unknown dimensions and graphs
    without fetches; run_grappler works around both and returns the original shape."""

    def build() -> None:
        inp = tf.compat.v1.placeholder(FLOAT, [None, 32], name="input")
        raw.MatMul(a=inp, b=_const(1.0, [32, 32], "weight"), name="allow1")

    graph_def = graph_def_of(build)
    grappler = run_grappler(graph_def, target="float16")
    uncast = sorted(node.name for node in grappler.node if not node.name.endswith("-AutoMixedPrecision"))
    assert uncast == sorted(node.name for node in graph_def.node)
    placeholder = next(node for node in grappler.node if node.name == "input")
    assert placeholder.attr["shape"] == next(node for node in graph_def.node if node.name == "input").attr["shape"]
    assert vertex_dtypes(grappler)[("allow1", "T")] == tf.float16.as_datatype_enum
