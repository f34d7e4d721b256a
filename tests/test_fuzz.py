"""Property-based fuzzing of rewrite_graph_def against float32 and against grappler.

Random DAGs of real ops from all four lists and unlisted ones (``fuzz_graphs.py``):
random fetches, devices and control inputs, existing float16 sections, v1 and functional
loops and conds, and list edits through TensorFlow's variables. For every example and
target:

1. the caller's GraphDef is untouched;
2. the rewrite imports into a ``tf.Graph`` (every edge's dtypes check);
3. it computes what the original computes: exactly, once every float16/bfloat16 type
   is put back to float32 (so a cast on the wrong tensor, port or consumer shows), and
   within the target's tolerance as it stands, on CPU;
4. rewriting it again changes nothing (unless a list edit lists Cast);
5. every float32 vertex and every cast agrees with grappler's own pass, both ways, but
   for the README's intended differences (``deviations.py``: functional While loop values
   kept float32 in bfloat16, TensorLists handed to a loop), and then grappler's graph
   must be the one that fails to run.

Property 5 needs live grappler on graphs nobody recorded: it runs where grappler can
answer (``recorded_grappler.live_unavailable``) and is skipped with the reason elsewhere;
properties 1-4 run everywhere. The regression graphs at the end are fixed, so they are
held against grappler's recorded answers on every machine.

``make test`` runs a bounded, derandomized search (50 examples per target);
``AMP_FUZZ_EXAMPLES=2000`` (``make fuzz``) runs a long random one. Failures found are
kept at the end as small hand-built graphs.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping

import numpy as np
import pytest
import tensorflow as tf
from conftest import TARGET_TO_TOLERANCE, TARGETS
from fuzz_graphs import CATALOGUE, FuzzGraph, GraphPlan, ListEdit, Step, build_graph, graph_plans
from hypothesis import HealthCheck, Phase, example, given, settings
from tensorflow.core.framework import types_pb2
from tensorflow.core.framework.graph_pb2 import GraphDef

import amp_rewrite
import deviations
import recorded_grappler
from amp_rewrite.testing.reference import compare_rewrites, run_grappler

_LONG_RUN = int(os.environ.get("AMP_FUZZ_EXAMPLES", "0"))
_SETTINGS = settings(
    max_examples=_LONG_RUN or 50,
    derandomize=not _LONG_RUN,  # CI is reproducible; the long run explores
    # Shrinking a failure takes minutes: only the long run does it. The bounded run
    # reports the example as found, with its @reproduce_failure blob.
    phases=tuple(Phase) if _LONG_RUN else (Phase.explicit, Phase.generate),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
_LOW_TYPES = frozenset({types_pb2.DT_HALF, types_pb2.DT_BFLOAT16})


def as_float32(graph_def: GraphDef) -> GraphDef:
    """A copy with every float16/bfloat16 type attr, in the graph and in library function
    bodies, set to float32: casts become no-ops, so the copy computes exactly what the
    original computes if the rewrite is wired right."""
    copy = GraphDef()
    copy.CopyFrom(graph_def)
    nodes = list(copy.node) + [node for function in copy.library.function for node in function.node_def]
    for node in nodes:
        for value in node.attr.values():
            if value.WhichOneof("value") == "type" and value.type in _LOW_TYPES:
                value.type = types_pb2.DT_FLOAT
            elif value.WhichOneof("value") == "list":
                for index, dtype in enumerate(value.list.type):
                    if dtype in _LOW_TYPES:
                        value.list.type[index] = types_pb2.DT_FLOAT
    return copy


def run_unoptimized(graph_def: GraphDef, outputs: tuple[str, ...], feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    """conftest's run_on_cpu with the session's own grappler passes off: we test the graph
    as written. TF 2.21's arithmetic optimizer itself breaks some valid float32 graphs:
    IdentityN(img, mat) -> IdentityN(:1) -> Selu -> Min(axis 0, keep_dims) -> AddV2(., mat),
    fetching the first IdentityN's output 0 too, fails with "Incompatible shapes"."""
    cpu_graph_def = GraphDef()
    cpu_graph_def.CopyFrom(graph_def)
    for node in list(cpu_graph_def.node) + [n for f in cpu_graph_def.library.function for n in f.node_def]:
        node.device = ""
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(cpu_graph_def, name="")
    config = tf.compat.v1.ConfigProto(device_count={"GPU": 0})
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        values = session.run(list(outputs), feed_dict=feeds)
    return [np.asarray(value, dtype=np.float32) for value in values]


_CONTROL_FLOW_OPS = frozenset({"Enter", "RefEnter", "Exit", "RefExit", "Switch", "RefSwitch", "Merge", "RefMerge",
                                "NextIteration", "RefNextIteration", "LoopCond"})
_TARGET_TO_ENUM = {"float16": types_pb2.DT_HALF, "bfloat16": types_pb2.DT_BFLOAT16}


def round_every_tensor(graph_def: GraphDef, target: str) -> GraphDef:
    """A copy whose every float32 tensor is rounded to the target dtype and back (a pair
    of casts) before its consumers see it: how far its outputs move from float32 shows how
    much low precision they can bear."""
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    copy = GraphDef()
    copy.CopyFrom(graph_def)
    del copy.node[:]
    low = _TARGET_TO_ENUM[target]
    rounded: dict[str, str] = {}
    for node in graph_def.node:
        operation = graph.get_operation_by_name(node.name)
        if node.op in _CONTROL_FLOW_OPS:
            continue
        for port, tensor in enumerate(operation.outputs):
            if tensor.dtype == tf.float32:
                rounded[f"{node.name}:{port}"] = f"{node.name}-{port}-Rounded"
    for node in graph_def.node:
        new = copy.node.add()
        new.CopyFrom(node)
        for index, tensor in enumerate(node.input):
            key = tensor if ":" in tensor or tensor.startswith("^") else f"{tensor}:0"
            if key in rounded:
                new.input[index] = rounded[key]
    for source, name in rounded.items():
        for suffix, source_dtype, destination_dtype, input_ in (
            ("-Low", types_pb2.DT_FLOAT, low, source),
            ("", low, types_pb2.DT_FLOAT, name + "-Low"),
        ):
            cast = copy.node.add(name=name + suffix, op="Cast", input=[input_])
            cast.attr["SrcT"].type = source_dtype
            cast.attr["DstT"].type = destination_dtype
    return copy


def _assert_close(label: str, outputs: tuple[str, ...], want: list[np.ndarray], got: list[np.ndarray],
                  tolerance: float, rounded: list[np.ndarray] | None = None) -> None:
    """Relative tolerance with an absolute floor scaled to each output's magnitude (as
    conftest's assert_numerics_match) but at least to 1, the scale of the graph's inputs:
    an output that cancels to ~0 keeps the rounding error of its O(1) operands. Where
    ``rounded`` (``round_every_tensor``'s outputs) already moves by an eighth of the
    tolerance, the output is too ill-conditioned to judge (a chain of low-precision
    MatMuls that cancel) and is skipped: 2% of outputs for float16, 7% for bfloat16."""
    for index, (name, expected, actual) in enumerate(zip(outputs, want, got)):
        finite = np.isfinite(expected)
        scale = max(float(np.max(np.abs(expected[finite]), initial=0.0)), 1.0)
        if rounded is not None:
            moved = float(np.max(np.abs(rounded[index] - expected)[finite], initial=0.0))
            if moved > tolerance * scale / 8:
                continue
        np.testing.assert_allclose(
            actual[finite], expected[finite], rtol=tolerance, atol=tolerance * scale, err_msg=f"{label}: {name}"
        )


@contextlib.contextmanager
def _environment(environ: Mapping[str, str]) -> Iterator[None]:
    saved = {name: os.environ.get(name) for name in environ}
    os.environ.update(environ)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                del os.environ[name]
            else:
                os.environ[name] = value


# Grappler's answer for a graph: GraphDef, target=, fetches= -> GraphDef.
Grappler = Callable[..., GraphDef]


def check_rewrite(fuzz: FuzzGraph, target: str, grappler: Grappler | None) -> None:
    """Properties 1-4 of the module docstring for one graph and target, and property 5
    with ``grappler``'s answers unless None, with the graph's list edits in the
    environment of both implementations."""
    with _environment(fuzz.environ):
        ours = _check_rewrite(fuzz, target)
        if grappler is not None:
            _assert_agrees_with_grappler(fuzz, target, fuzz.graph_def, ours, grappler)


def check_agreement(fuzz: FuzzGraph, target: str) -> None:
    """Property 5 alone, with live grappler."""
    with _environment(fuzz.environ):
        ours = amp_rewrite.rewrite_graph_def(fuzz.graph_def, target=target, fetches=fuzz.fetches).graph_def
        _assert_agrees_with_grappler(fuzz, target, fuzz.graph_def, ours, run_grappler)


def _check_rewrite(fuzz: FuzzGraph, target: str) -> GraphDef:
    original = fuzz.graph_def
    before = original.SerializeToString(deterministic=True)
    result = amp_rewrite.rewrite_graph_def(original, target=target, fetches=fuzz.fetches)
    ours = result.graph_def
    assert original.SerializeToString(deterministic=True) == before, "rewrite_graph_def modified its input"

    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(ours, name="")

    def run(graph_def: GraphDef) -> list[np.ndarray]:
        return run_unoptimized(graph_def, fuzz.outputs, fuzz.feeds)

    _assert_close("rewrite with float32 types restored", fuzz.outputs, run(as_float32(original)),
                  run(as_float32(ours)), 1e-5)
    _assert_close(f"{target} rewrite", fuzz.outputs, run(original), run(ours), TARGET_TO_TOLERANCE[target],
                  run(round_every_tensor(original, target)))

    again = amp_rewrite.rewrite_graph_def(ours, target=target, fetches=fuzz.fetches).graph_def
    if _casts_listed(fuzz.environ):  # the second pass paints the first one's casts
        with tf.Graph().as_default():
            tf.graph_util.import_graph_def(again, name="")
    else:
        changed = sorted(
            {n.name for n in again.node} ^ {n.name for n in ours.node}
            | {n.name for n, m in zip(again.node, ours.node) if n != m}
        )
        assert again == ours, f"rewriting twice changed nodes {changed[:10]}"
    return ours


def _casts_listed(environ: Mapping[str, str]) -> bool:
    """With Cast in a list, a second rewrite paints the first one's casts: not idempotent."""
    return any(name.endswith("_ADD") and "Cast" in value.split(",") for name, value in environ.items())


# What grappler's graph fails with where a modelled deviation shows (deviations.py):
# a painted loop value, a painted list handed to a loop.
_GRAPPLER_BREAKS = {deviations.LOOP_VALUE: "passed bfloat16 expected float", deviations.LIST_HANDED_TO_LOOP: "list elements"}


def _assert_agrees_with_grappler(
    fuzz: FuzzGraph, target: str, original: GraphDef, ours: GraphDef, ask_grappler: Grappler
) -> None:
    """Property 5: every vertex and cast agrees, both ways, but for the modelled deviations
    (``deviations``); where one shows, grappler's graph must be the one that fails to run.
    Nothing to compare where the recording has no answer on this release."""
    grappler = ask_grappler(original, target=target, fetches=fuzz.fetches)
    if grappler is None:
        return
    found = deviations.judge(compare_rewrites(original, ours, grappler), original, target)
    assert not found.unexplained, f"amp_rewrite and grappler disagree ({target}):\n{found.explain()}"
    for kind, message in _GRAPPLER_BREAKS.items():
        if found.counts[kind]:
            with pytest.raises(tf.errors.InvalidArgumentError, match=message):
                run_unoptimized(grappler, fuzz.outputs, fuzz.feeds)


def _explicit_examples(test):
    """Plans for rules random plans reach rarely, tried before the random ones."""
    for plan in (
        GraphPlan(  # an op whose definition rejects the target, moved to allow
            seed=0, steps=(Step("MatMul"), Step("Zeta"), Step("MatMul")), list_edits=(ListEdit("Zeta", "allow"),)
        ),
        GraphPlan(seed=0, steps=(Step("Exp"), Step("WhileV1"), Step("Tanh"))),  # a v1 loop entered from a deny op
        # an existing Cast to float32 feeding only allow ops: it casts to the target
        GraphPlan(seed=0, steps=(Step("Float16Section"), Step("MatMul"), Step("Tanh"))),
        GraphPlan(  # TENSOR_CORES_ONLY (float16: only allow ops) next to a float16 section
            seed=0, steps=(Step("Float16Section"), Step("Tanh"), Step("MatMul"), Step("Relu")),
            level="TENSOR_CORES_ONLY",
        ),
    ):
        test = example(plan=plan)(test)
    return test


@pytest.mark.parametrize("target", TARGETS)
def test_random_graphs(target: str) -> None:
    """Properties 1-4 on random graphs of 10–300 nodes."""

    @_SETTINGS
    @given(plan=graph_plans())
    @_explicit_examples
    def check(plan: GraphPlan) -> None:
        check_rewrite(build_graph(plan), target, grappler=None)

    check()


@pytest.mark.parametrize("target", TARGETS)
def test_random_graphs_agree_with_grappler(target: str) -> None:
    """Property 5 on the same random graphs, where live grappler can answer."""
    reason = recorded_grappler.live_unavailable(target)
    if reason is not None:
        pytest.skip(f"live grappler cannot answer: {reason}")

    @_SETTINGS
    @given(plan=graph_plans())
    @_explicit_examples
    def check(plan: GraphPlan) -> None:
        check_agreement(build_graph(plan), target)

    check()


# --------------------------------------------------------------------------------------
# Failures found by the fuzzer, shrunk by hand to the smallest graph that shows them.


def _identity_between_allow_ops(device: str) -> FuzzGraph:
    """allow1 -> kept1 (Identity, unpainted) -> allow2 -> fetch. kept1 needs a cast on
    each side; the second is counted by asking whether kept1 reads a ref variable, after
    kept1's input was already rewired to the first cast."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="x")
        allow1 = tf.raw_ops.MatMul(a=x, b=x, name="allow1")
        with tf.device(device):
            kept1 = tf.raw_ops.Identity(input=allow1, name="kept1")
        allow2 = tf.raw_ops.MatMul(a=kept1, b=x, name="allow2")
        tf.raw_ops.Tanh(x=allow2, name="fetch")
    feeds = {"x:0": np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(4, 4)}
    fetches = ("fetch",) if device else ("kept1", "fetch")
    return FuzzGraph(graph.as_graph_def(), fetches, ("kept1:0", "fetch:0"), feeds)


def _deny_path_through_loop() -> FuzzGraph:
    """deny1 (Exp) -> functional While loop value -> clr1 (Relu) -> infer1 (Tanh), and
    clr1 -> allow1 (MatMul). bfloat16 lists make While clear, so grappler carries deny
    through the loop value (clear, upstream of infer1) to clr1, which stays float32. We
    keep the loop value float32, which is intended, but also stop deny there and paint
    clr1 bfloat16 from allow1: a deny path lowered."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="x")
        deny1 = tf.raw_ops.Exp(x=x, name="deny1")
        _, loop = tf.compat.v1.while_loop(
            lambda i, h: i < 2, lambda i, h: (i + 1, tf.raw_ops.Relu(features=h)), [tf.constant(0), deny1], name="loop"
        )
        clr1 = tf.raw_ops.Relu(features=loop, name="clr1")
        tf.raw_ops.Tanh(x=clr1, name="infer1")
        allow1 = tf.raw_ops.MatMul(a=clr1, b=x, name="allow1")
        tf.raw_ops.Identity(input=allow1, name="fetch")
    feeds = {"x:0": np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(4, 4)}
    return FuzzGraph(graph.as_graph_def(), ("fetch",), ("fetch:0", "infer1:0"), feeds)


def _other_device(target: str) -> str:
    """A device type the target does not paint."""
    return "/device:CPU:0" if target == "float16" else "/device:GPU:0"


# name -> (graph for a target, the targets where it fails today and why; empty once
# fixed — a strict xfail would flag a fix that was not recorded here).
REGRESSIONS: dict[str, tuple[Callable[[str], FuzzGraph], dict[str, str]]] = {
    # Found as KeyError 'reversev236-0-CastToFp32-0-AutoMixedPrecision' (bfloat16).
    "fetched_identity_between_allow_ops": (
        lambda target: _identity_between_allow_ops(""),
        {},  # fixed: reads_ref_variable() saw a node whose input was already rewired to a new cast
    ),
    # The same, the Identity kept float32 by its device instead of a fetch.
    "identity_on_other_device_between_allow_ops": (
        lambda target: _identity_between_allow_ops(_other_device(target)),
        {},  # fixed with fetched_identity_between_allow_ops
    ),
    # Found as "while10/while/Identity_3 attr T: ours=DT_BFLOAT16 grappler=DT_FLOAT" (bfloat16).
    "deny_path_through_functional_while": (
        lambda target: _deny_path_through_loop(),
        {},  # fixed: deny propagation passes through pinned loop values
    ),
}


def _regression_cases() -> list:
    cases = []
    for name, (build, target_to_reason) in REGRESSIONS.items():
        for target in TARGETS:
            reason = target_to_reason.get(target)
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            cases.append(pytest.param(build, target, id=f"{name}-{target}", marks=marks))
    return cases


@pytest.mark.parametrize(("build", "target"), _regression_cases())
def test_regression(build: Callable[[str], FuzzGraph], target: str) -> None:
    check_rewrite(build(target), target, grappler=recorded_grappler.rewrite)


def test_generator_builds_every_catalogue_entry() -> None:
    """Each catalogue entry builds, alone and with a device and a control input."""
    for op in CATALOGUE:
        fuzz = build_graph(GraphPlan(seed=0, steps=(Step("MatMul"), Step(op, device="/device:GPU:0", control=1))))
        assert fuzz.fetches and fuzz.outputs, op
