"""``cross_function=True``: low precision crosses call and loop boundaries, and the result stays a valid graph.

grappler paints every function body alone, so each call and loop boundary stays float32
with casts on both sides, inside loop bodies on every iteration (spec §2.7, §6). The
cross-function mode links a call's (or loop's) dtypes with its callee's ``_Arg``/``_Retval``
so a low-precision value can stay low precision across. Checked on the built-in loop
graphs of :mod:`amp_rewrite.testing.loops` (Keras 3 LSTM and GRU training steps, a ``tf.while_loop``
with a ``tf.cond`` and a nested ``tf.function``), for both targets:

1. default mode still equals grappler, both ways, in every function body (and in the main
   graph but for the modelled deviations, ``deviations``) and keeps every signature;
2. cross mode runs fewer casts than grappler, in all and per loop iteration
   (``amp_rewrite.testing.loops.casts_per_iteration``);
3. cross mode's graph is well typed (every call/loop agrees with its callee's signature,
   it imports) and computes the float32 graph's numbers within the target's tolerance;
4. a function named in ``entry_functions`` keeps its signature while private ones may
   change, and a function whose call sites disagree keeps float32 on both sides of every call.
"""
from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.framework.graph_pb2 import GraphDef

import amp_rewrite
import deviations
import recorded_grappler
from amp_rewrite.core import functions
from amp_rewrite.testing.loops import LOOP_GRAPH_NAMES, build_loop_graph, casts_per_iteration, item_cast_counts
from amp_rewrite.testing.models import GraphRun, ModelGraph, run_graph, run_model_graph
from amp_rewrite.testing.reference import compare_rewrites

from conftest import TARGET_TO_DTYPE, TARGET_TO_TOLERANCE, TARGETS, assert_model_close_to_float32

# Graphs whose every loop must run strictly fewer casts per iteration than grappler's.
STRICTLY_FEWER_PER_ITERATION = frozenset({"while_loop"})


class Case:
    """One loop graph with its float32 run and, per target, the three rewrites (cached)."""

    def __init__(self, name: str) -> None:
        self.model: ModelGraph = build_loop_graph(name)
        self.float32: GraphRun = run_model_graph(self.model)
        self._rewrites: dict[tuple[str, bool], amp_rewrite.RewriteResult] = {}
        self._grappler: dict[str, GraphDef] = {}

    def default(self, target: str) -> amp_rewrite.RewriteResult:
        return self._rewrite(target, cross_function=False)

    def cross(self, target: str) -> amp_rewrite.RewriteResult:
        return self._rewrite(target, cross_function=True)

    def _rewrite(self, target: str, *, cross_function: bool) -> amp_rewrite.RewriteResult:
        if (target, cross_function) not in self._rewrites:
            self._rewrites[(target, cross_function)] = amp_rewrite.rewrite_graph_def(
                self.model.graph_def, target=target, fetches=self.model.fetches, cross_function=cross_function
            )
        return self._rewrites[(target, cross_function)]

    def grappler(self, target: str) -> GraphDef | None:
        """Grappler's rewrite; None without a recorded answer on this release."""
        if target not in self._grappler:
            self._grappler[target] = recorded_grappler.rewrite(self.model.graph_def, target=target, fetches=self.model.fetches)
        return self._grappler[target]


@pytest.fixture(scope="module", params=LOOP_GRAPH_NAMES)
def case(request: pytest.FixtureRequest) -> Case:
    return Case(request.param)


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> str:
    return request.param


def _signatures(graph_def: GraphDef) -> dict[str, bytes]:
    return {f.signature.name: f.signature.SerializeToString(deterministic=True) for f in graph_def.library.function}


def _assert_well_typed(graph_def: GraphDef) -> None:
    """Every call and loop matches its callee's signature, and TensorFlow imports the graph."""
    functions.check_calls(graph_def)  # GraphError names the call whose types disagree
    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(graph_def, name="")


# --- default mode is grappler ------------------------------------------------------------


def test_default_mode_agrees_with_grappler_in_every_function(case: Case, target: str) -> None:
    """Without cross_function every function body is painted alone, as grappler does: each
    body agrees with grappler vertex for vertex and cast for cast, both ways, and so does
    the main graph except where grappler breaks the graph: TensorLists handed to a loop
    stay float32 in ours (``deviations.KERAS_LOOP_STEP``; see
    tests/test_functions.py::test_keras_recurrent_training_step)."""
    grappler = case.grappler(target)
    if grappler is None:
        recorded_grappler.skip_comparison()
    agreement = compare_rewrites(case.model.graph_def, case.default(target).graph_def, grappler)
    assert agreement.functions, "no function body was compared"
    expected = {} if case.model.name == "while_loop" else deviations.KERAS_LOOP_STEP
    deviations.assert_agrees_but_for(agreement, case.model.graph_def, target, expected)


def test_default_mode_keeps_every_signature(case: Case, target: str) -> None:
    """Default mode never changes a function's signature: every caller stays valid as it is."""
    assert _signatures(case.default(target).graph_def) == _signatures(case.model.graph_def)


# --- cross mode casts less ---------------------------------------------------------------


def test_cross_mode_runs_fewer_casts_than_grappler(case: Case, target: str) -> None:
    """Values that stay low precision across boundaries need no cast pair there: fewer casts
    run in all (casts of a Const do not count: constant folding removes them, spec §2.7)."""
    answer = case.grappler(target)
    if answer is None:
        recorded_grappler.skip_comparison()
    ours = sum(c.run_time for c in item_cast_counts(case.cross(target).graph_def).values())
    grappler = sum(c.run_time for c in item_cast_counts(answer).values())
    assert ours < grappler, f"{case.model.name} ({target}): {ours} run-time casts, grappler {grappler}"


def test_cross_mode_runs_no_more_casts_per_loop_iteration(case: Case, target: str) -> None:
    """A loop-carried value that stays low precision is not cast in and out of the body on
    every iteration: no loop runs more casts per iteration than under grappler, and on the
    while_loop graph every loop runs fewer."""
    answer = case.grappler(target)
    if answer is None:
        recorded_grappler.skip_comparison()
    ours, grappler = casts_per_iteration(case.cross(target).graph_def), casts_per_iteration(answer)
    assert ours and set(ours) == set(grappler), (sorted(ours), sorted(grappler))
    strictly = case.model.name in STRICTLY_FEWER_PER_ITERATION
    worse = {body: (ours[body], grappler[body]) for body in ours
             if ours[body] > grappler[body] or (strictly and ours[body] == grappler[body])}
    assert not worse, f"{case.model.name} ({target}) loop body: (ours, grappler) casts per iteration {worse}"


# --- cross mode stays a valid graph with the same numbers -------------------------------


def test_cross_mode_graph_is_well_typed(case: Case, target: str) -> None:
    """Both sides of every boundary changed together: each While/If/call's type attrs equal
    its callee's signature, and TensorFlow imports the graph."""
    _assert_well_typed(case.cross(target).graph_def)


def test_cross_mode_converts_a_boundary(case: Case, target: str) -> None:
    """Cross mode does cross: some private function's signature takes the target dtype."""
    low = TARGET_TO_DTYPE[target]
    changed = [
        f.signature.name for f in case.cross(target).graph_def.library.function
        if any(arg.type == low for arg in [*f.signature.input_arg, *f.signature.output_arg])
    ]
    assert changed, f"no signature holds {types_pb2.DataType.Name(low)}"


def test_cross_mode_matches_float32(case: Case, target: str) -> None:
    """The rewritten graph runs on CPU and computes the float32 graph's outputs within the
    target's tolerance; a training step's loss and weight updates too."""
    assert_model_close_to_float32(case.model, case.float32, case.cross(target).graph_def, target)


# --- which signatures may change ---------------------------------------------------------


def _while_loop_functions(graph_def: GraphDef) -> tuple[str, str]:
    """(loop body, nested tf.function) of the while_loop graph, found by the nodes calling them."""
    (loop,) = [node for node in graph_def.node if node.op in ("While", "StatelessWhile")]
    (call,) = [node for node in graph_def.node if node.op in ("PartitionedCall", "StatefulPartitionedCall")]
    return loop.attr["body"].func.name, call.attr["f"].func.name


@pytest.fixture(scope="module")
def while_loop() -> Case:
    return Case("while_loop")


def test_entry_function_keeps_its_signature(while_loop: Case, target: str) -> None:
    """A function named in ``entry_functions`` (e.g. a SavedModel signature) keeps its
    signature, so its boundary stays float32; private functions (the loop body) still
    change. The graph runs and matches float32."""
    model = while_loop.model
    body, project = _while_loop_functions(model.graph_def)
    result = amp_rewrite.rewrite_graph_def(
        model.graph_def, target=target, fetches=model.fetches, cross_function=True, entry_functions=[project]
    )
    before, after = _signatures(model.graph_def), _signatures(result.graph_def)
    assert after[project] == before[project]
    assert after[body] != before[body], "the private loop body kept its float32 signature"
    _assert_well_typed(result.graph_def)
    assert_model_close_to_float32(model, while_loop.float32, result.graph_def, target)


def test_all_entry_functions_keep_every_signature(while_loop: Case, target: str) -> None:
    """With every function an entry point, cross mode may change no signature at all."""
    model = while_loop.model
    result = amp_rewrite.rewrite_graph_def(
        model.graph_def, target=target, fetches=model.fetches, cross_function=True,
        entry_functions=[f.signature.name for f in model.graph_def.library.function],
    )
    assert _signatures(result.graph_def) == _signatures(model.graph_def)
    assert_model_close_to_float32(model, while_loop.float32, result.graph_def, target)


# --- one function, two call sites ---------------------------------------------------------

_WIDTH = 8


def _shared_callee_graph(second_site: str | None) -> tuple[GraphDef, tuple[str, ...]]:
    """x → MatMul allow1 → shared(·) → out, and a second call of the same ``shared``:

    * ``"deny"``: x → Exp deny1 → shared(·), added to out. Inlined, the copy of the infer
      op after deny1 would stay float32 (deny spreads into infer ops, spec §2.3 pass 2)
      and the copy after allow1 would not: one body cannot be both.
    * ``"fetched"``: x → MatMul allow2 → shared(·), a call node that is fetched itself, so
      it is preserved and keeps float32 (spec §2.7).

    ``shared`` (one library function for both calls) is Add infer_shared → MatMul allow_shared → Relu.
    """
    w_value = np.random.default_rng(0).uniform(-0.5, 0.5, (_WIDTH, _WIDTH)).astype(np.float32)

    @tf.function
    def shared(h: tf.Tensor) -> tf.Tensor:
        return tf.nn.relu(tf.matmul(tf.add(h, 0.5, name="infer_shared"), tf.constant(w_value), name="allow_shared"))

    def main(x: tf.Tensor) -> tuple[tf.Tensor, ...]:
        first = shared(tf.matmul(x, tf.constant(w_value), name="allow1"))
        if second_site == "deny":
            return (tf.identity(first + shared(tf.exp(x, name="deny1")), name="out"),)
        if second_site == "fetched":
            return tf.identity(first, name="out"), shared(tf.matmul(x, tf.constant(w_value), name="allow2"))
        return (tf.identity(first, name="out"),)

    concrete = tf.function(main).get_concrete_function(tf.TensorSpec([_WIDTH, _WIDTH], name="x"))
    graph_def = concrete.graph.as_graph_def()
    # tf.function returns each output through an Identity; fetch the second call itself.
    calls = [node.name for node in graph_def.node if node.op.endswith("PartitionedCall") and "allow2" in node.input[0]]
    return graph_def, ("out", *calls)


def _calls(graph_def: GraphDef) -> dict[str, tuple[str, str, str]]:
    """Per call node: (Tin[0], Tout[0] as dtype names, callee), keyed by the op feeding it (allow1, deny1, ...)."""
    producers = {node.name: node for node in graph_def.node}
    name = types_pb2.DataType.Name

    def source(tensor: str) -> str:
        node = producers[tensor.split(":")[0]]
        return source(node.input[0]) if node.op == "Cast" else node.name  # look through our casts

    return {
        source(node.input[0]): (name(node.attr["Tin"].list.type[0]), name(node.attr["Tout"].list.type[0]),
                                node.attr["f"].func.name)
        for node in graph_def.node if node.op in ("PartitionedCall", "StatefulPartitionedCall")
    }


def _run_shared(graph_def: GraphDef, fetches: tuple[str, ...]) -> list[np.ndarray]:
    x = np.random.default_rng(1).uniform(-1, 1, (_WIDTH, _WIDTH)).astype(np.float32)
    outputs = run_graph(graph_def, fetches=fetches, feeds={"x:0": x}).outputs
    return [outputs[fetch] for fetch in fetches]


@pytest.mark.parametrize("second_site", ["deny", "fetched"])
def test_function_called_from_incompatible_sites_keeps_float32_boundaries(second_site: str, target: str) -> None:
    """``shared`` is called after MatMul allow1 and from a second site that needs float32
    (see ``_shared_callee_graph``): one signature cannot serve both, so the argument stays
    float32 at both calls and in the callee, as under grappler. With the deny site, deny
    reaches into the callee as if it were inlined (its ``infer_shared`` stays float32),
    while the result, after the callee's own MatMul→Relu, is the same for both callers
    and may be low precision. A fetched call keeps both sides float32. The graph is well
    typed and matches float32."""
    graph_def, fetches = _shared_callee_graph(second_site)
    calls = _calls(graph_def)
    assert len(calls) == 2 and len({callee for _, _, callee in calls.values()}) == 1, calls
    callee = calls["allow1"][2]
    result = amp_rewrite.rewrite_graph_def(graph_def, target=target, fetches=fetches, cross_function=True)
    rewritten = _calls(result.graph_def)
    assert {site: tin for site, (tin, _, _) in rewritten.items()} == {site: "DT_FLOAT" for site in calls}
    outputs = {tout for _, tout, _ in rewritten.values()}
    assert len(outputs) == 1, rewritten  # both callers agree with the one callee signature
    body = next(f for f in result.graph_def.library.function if f.signature.name == callee)
    assert [arg.type for arg in body.signature.input_arg] == [types_pb2.DT_FLOAT]  # the argument keeps float32
    if second_site == "fetched":
        assert _signatures(result.graph_def)[callee] == _signatures(graph_def)[callee]
    else:
        infer = next(node for node in body.node_def if node.name == "infer_shared")
        assert infer.attr["T"].type == types_pb2.DT_FLOAT, "deny must reach into the callee"
    _assert_well_typed(result.graph_def)
    tolerance = TARGET_TO_TOLERANCE[target]
    for got, want in zip(_run_shared(result.graph_def, fetches), _run_shared(graph_def, fetches)):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance * float(np.max(np.abs(want))))


def test_function_called_from_one_allow_site_takes_low_precision(target: str) -> None:
    """The same callee called only after MatMul allow1: its argument and result, and the
    call's, take the target dtype together (the contrast to the two-site cases)."""
    graph_def, fetches = _shared_callee_graph(None)
    result = amp_rewrite.rewrite_graph_def(graph_def, target=target, fetches=fetches, cross_function=True)
    low = TARGET_TO_DTYPE[target]
    ((site, (tin, tout, callee)),) = _calls(result.graph_def).items()
    assert (site, tin, tout) == ("allow1", types_pb2.DataType.Name(low), types_pb2.DataType.Name(low))
    signature = next(f.signature for f in result.graph_def.library.function if f.signature.name == callee)
    assert [arg.type for arg in [*signature.input_arg, *signature.output_arg]] == [low, low]
    _assert_well_typed(result.graph_def)
