"""``--tune speed`` on a decode loop (issue 48): a ``While`` body's ops timed at the shapes the
loop runs them with, and counted once per iteration of a run.

The model is ``amp_rewrite.testing.decode``'s greedy decode loop (a KV cache preallocated to
the full length, weights read in the body). No test asserts a timing: the costs are tables
the test writes, and what is checked is how the plan counts them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2

from amp_rewrite.calibration import speed
from amp_rewrite.calibration.savedmodel import plumbing_kinds, read_model, rewrite_model
from amp_rewrite.core.lists import load_lists
from amp_rewrite.core.program import MAIN_GRAPH, program_of
from amp_rewrite.core.rewrite import rewrite_graph_def
from amp_rewrite.core.target import lookup_target
from amp_rewrite.errors import ModelError
from amp_rewrite.testing.decode import DecodeShape, save_decode_loop
from amp_rewrite.tuning.decide import Plan, Problem, build_problem, plan_keeps
from amp_rewrite.tuning.shapes import Shapes, infer_shapes
from amp_rewrite.tuning.timing import Timings

LOW = types_pb2.DT_BFLOAT16
SHAPE = DecodeShape(vocab=32, width=8, prompt=3, length=7)  # 6 iterations
BATCH = 3


@pytest.fixture(scope="module")
def loop(tmp_path_factory: pytest.TempPathFactory):
    """The decode loop, read; its feeds at batch ``BATCH``; its shapes there; the problem of
    its bfloat16 rewrite."""
    model = read_model(save_decode_loop(tmp_path_factory.mktemp("decode") / "model", SHAPE))
    feeds, _ = speed.batch_feeds(model, None, [BATCH])
    skip = [item for item, kind in plumbing_kinds(model).items() if kind == "save/restore"]
    shapes = infer_shapes(model.program, speed._feed_shapes(model, feeds[BATCH]), skip)
    base = rewrite_model(model, target="bfloat16", lists=load_lists("bfloat16"))
    nodes: dict[str, set[str]] = {}
    for decision in base.report.decisions:
        if decision.converted:
            nodes.setdefault(decision.function, set()).add(decision.node)
    problem = build_problem(model.program, base.program, nodes, {BATCH: shapes})
    return model, feeds[BATCH], shapes, problem


def _body(shapes: Shapes) -> str:
    (body,) = [item for item in shapes.looped if "body" in item]
    return body


def test_the_ops_of_a_loop_body_get_the_shapes_that_enter_the_loop(loop):
    """The body's converted ops (the projections, the attention over the cache, the softmax,
    the unembedding) are candidates of the body, each with a form to time: every input's
    shape is known (the cache at its full length, the batch the feed's), none is left "not
    timed alone"."""
    _, _, shapes, problem = loop
    body = _body(shapes)
    assert problem.candidates and {item for item, _ in problem.candidates} == {body}
    untimed = [node for node, candidate in problem.candidates.items() if candidate.runs[BATCH] is None]
    assert untimed == []
    ops = {candidate.op for candidate in problem.candidates.values()}
    assert {"MatMul", "Einsum", "Softmax"} <= ops
    keys = {candidate.runs[BATCH].first.key.split(" #")[0] for candidate in problem.candidates.values()}
    width, length = SHAPE.width, SHAPE.length
    assert f"Einsum(float32[{BATCH}, {width}], float32[{BATCH}, {length}, {width}])" in keys
    assert f"MatMul(float32[{BATCH}, {width}], float32[{width}, {SHAPE.vocab}])" in keys


def test_a_run_counts_how_many_times_the_loop_runs_its_body(loop):
    """One run of the model on the feeds: the body runs once per generated token, the
    condition once more; nothing outside the loop is counted."""
    model, feeds, shapes, _ = loop
    repeats, uncounted = speed.loop_repeats(model, feeds, shapes)
    assert uncounted == ""
    body = _body(shapes)
    (condition,) = [item for item in shapes.looped if item != body]
    assert repeats == {body: SHAPE.length - 1, condition: SHAPE.length}
    assert MAIN_GRAPH not in shapes.looped


def _table(problem: Problem, op_s: tuple[float, float], cast_s: float) -> Timings:
    """Every candidate ``op_s`` (float32, bfloat16) seconds, every cast ``cast_s``."""
    timings = Timings()
    for candidate in problem.candidates.values():
        pair = candidate.runs[BATCH]
        timings.seconds[pair.first.key], timings.seconds[pair.second.key] = op_s
    for pair in problem.pairs(LOW):
        if pair.first.node_def.op == "Cast":
            timings.seconds[pair.first.key] = timings.seconds[pair.second.key] = cast_s
    return timings


@pytest.mark.parametrize("op_s, cast_s", [((1e-4, 2e-4), 0.0), ((0.0, 0.0), 1e-5)], ids=["ops", "casts"])
def test_the_body_costs_once_per_iteration(loop, op_s, cast_s):
    """The same timing table, the body counted once and then 6 times: the modeled float32
    and bfloat16 seconds of the converted ops (and, with free ops, of the casts at the
    loop's boundaries) are 6 times as many."""
    _, _, shapes, problem = loop
    once = plan_keeps(problem, _table(problem, op_s, cast_s), "bfloat16", LOW).modeled[BATCH]
    looped = Problem(problem.batch_sizes, problem.candidates, problem.fused, problem.tensors,
                     {_body(shapes): SHAPE.length - 1})
    counted = plan_keeps(looped, _table(looped, op_s, cast_s), "bfloat16", LOW).modeled[BATCH]
    assert once[1] > 0
    assert counted[0] == pytest.approx(once[0] * (SHAPE.length - 1))
    assert counted[1] == pytest.approx(once[1] * (SHAPE.length - 1))
    if op_s == (0.0, 0.0):
        assert once[0] == 0  # what is left is casts: float32 needs none


def test_the_whole_model_speed_is_modeled_from_the_source_time():
    """The source's measured time with its converted ops' float32 seconds replaced by their
    seconds as planned (or as the lists convert them): 100 ms of which 20 ms are converted
    ops that take 30 ms in the target and 25 ms as planned."""
    plan = Plan({}, {1: (0.020, 0.030, 0.025)})
    assert speed.modeled_speed(plan, 1, 0.100) == pytest.approx(0.100 / 0.105)
    assert speed.modeled_speed(plan, 1, 0.100, tuned=False) == pytest.approx(0.100 / 0.110)
    assert speed.modeled_speed(Plan({}, {1: (0.0, 0.0, 0.0)}), 1, 0.100) is None  # nothing timed
    assert speed.modeled_speed(plan, 8, 0.100) is None  # a batch size not planned


def test_tune_model_counts_the_loop(loop, tmp_path: Path):
    """``tune_model`` on the decode loop (no timing: a zero budget) has the body's
    iterations in its problem, and no note of nodes it could not time."""
    model, feeds, shapes, _ = loop
    cache = speed.open_cache(tmp_path / "timings.json", lookup_target("bfloat16"))
    tuning = speed.tune_model(model, {BATCH: feeds}, target="bfloat16", lists=load_lists("bfloat16"), cache=cache,
                              budget_s=1e-9)
    assert tuning.problem.repeats[_body(shapes)] == SHAPE.length - 1
    assert not any("could not be timed" in note for note in tuning.notes), tuning.notes
    assert (f"the loops were not run whole (batch {BATCH} not run: no time left in the budget): a loop body's ops"
            " count as timed alone") in tuning.notes
    assert tuning.problem.loop_scale == {}


def test_a_reshape_in_a_loop_is_timed_at_the_shape_it_makes():
    """A loop body folds a MatMul's output to (2 × batch, 4) and back, the shapes computed
    from the loop value's (``tf.shape``): no static value for the shape input, but shape
    inference knows what each Reshape makes, and that is the value it is timed with."""
    w = np.ones((8, 8), np.float32)

    @tf.function
    def model(x: tf.Tensor) -> tf.Tensor:
        def body(i: tf.Tensor, v: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            h = tf.matmul(v, w, name="allow1")
            folded = tf.reshape(h, tf.stack([tf.shape(h)[0] * 2, 4]), name="fold")
            back = tf.reshape(tf.nn.relu(folded, name="clr1"), tf.shape(h), name="unfold")
            return i + 1, tf.matmul(back, w, name="allow2")
        return tf.while_loop(lambda i, v: i < 3, body, [0, x])[1]

    function = model.get_concrete_function(tf.TensorSpec([None, 8], tf.float32, name="x"))
    graph_def = function.graph.as_graph_def()
    base = rewrite_graph_def(graph_def, target="bfloat16", fetches=[function.outputs[0].op.name])
    nodes: dict[str, set[str]] = {}
    for decision in base.report.decisions:
        if decision.converted:
            nodes.setdefault(decision.function, set()).add(decision.node)
    program = program_of(graph_def)
    problem = build_problem(program, base.program, nodes, {3: infer_shapes(program, {"x": (3, 8)})})
    reshapes = {node: c.runs[3] for (_, node), c in problem.candidates.items() if c.op == "Reshape"}
    assert set(reshapes) == {"while/fold", "while/unfold"}, problem.candidates.keys()
    assert reshapes["while/fold"].first.key.startswith("Reshape(float32[3, 8], int32=[6, 4])")
    assert reshapes["while/unfold"].first.key.startswith("Reshape(float32[6, 4], int32=[3, 8])")


def test_a_loop_whose_run_fails_is_counted_once_and_said(loop, monkeypatch: pytest.MonkeyPatch):
    """Where the counting run fails, each body counts once, and one line names the loop and why."""
    model, feeds, shapes, _ = loop

    def failing(*args: object, **kwargs: object) -> None:
        raise ModelError("model/: signature 'serving_default': the model fails on the timing inputs (no kernel)")

    monkeypatch.setattr(speed.tensor_statistics, "collect", failing)
    repeats, uncounted = speed.loop_repeats(model, feeds, shapes)
    assert repeats == {}
    assert uncounted.startswith("the iterations of ") and _body(shapes) in uncounted and "(no kernel)" in uncounted


def _casts_per_call(model, repeats: dict[str, float]) -> float:
    """The casts the bfloat16 rewrite inserts that run in one call, each counted once per run
    of its function (a loop body's once per iteration); casts of weights and constants left
    out (a variable's reads and lookups), as convert stores those in the target."""
    base = rewrite_model(model, target="bfloat16", lists=load_lists("bfloat16"))
    count = 0.0
    for item in base.program.names:
        nodes = {node.name: node for node in base.program.item(item).node}
        for node in nodes.values():
            read = nodes.get(node.input[0].split(":")[0].lstrip("^")) if node.op == "Cast" and node.input else None
            if node.op == "Cast" and "AutoMixedPrecision" in node.name and (
                    read is None or read.op not in ("Const", "ReadVariableOp", "ResourceGather")):
                count += repeats.get(item, 1.0)
    return count


def test_a_cast_too_small_to_time_costs_a_node_per_iteration(loop):
    """Every cast too small to time (``TOO_SMALL_S``) and the ops as fast in both forms: the
    lists' result is modeled as fast as float32 where a node costs the executor nothing,
    and where it costs ``node_s``, slower by ``node_s`` for each cast the rewrite inserts,
    a loop body's once per iteration; the whole-model speed falls by as much."""
    from amp_rewrite.tuning.timing import TOO_SMALL_S

    model, _, shapes, problem = loop
    repeats = {_body(shapes): float(SHAPE.length - 1)}
    looped = Problem(problem.batch_sizes, problem.candidates, problem.fused, problem.tensors, repeats)
    timings = _table(looped, (1e-4, 1e-4), TOO_SMALL_S)
    free = plan_keeps(looped, timings, "bfloat16", LOW).modeled[BATCH]
    assert free[1] == pytest.approx(free[0])
    timings.node_s = 2e-6
    charged = plan_keeps(looped, timings, "bfloat16", LOW).modeled[BATCH]
    casts = _casts_per_call(model, repeats)
    assert casts >= SHAPE.length - 1  # at least one cast in the body
    assert charged[0] == pytest.approx(free[0])  # float32 has no casts
    assert charged[1] - charged[0] == pytest.approx(casts * 2e-6)
    source_s = 10 * free[0]
    assert speed.modeled_speed(Plan({}, {BATCH: free}), BATCH, source_s, tuned=False) == pytest.approx(1.0)
    assert speed.modeled_speed(Plan({}, {BATCH: charged}), BATCH, source_s, tuned=False) == pytest.approx(
        source_s / (source_s + casts * 2e-6))


def test_a_timed_cast_costs_at_least_a_node():
    """A cast timed faster than the executor runs a node (the noise of a loaded machine) is
    charged the node's time; a slower one its own time."""
    from amp_rewrite.tuning.decide import _Costs
    from amp_rewrite.tuning.timing import cast_pair

    timings = Timings(node_s=3e-6)
    small, large = cast_pair((2, 4), LOW), cast_pair((64, 64), LOW)
    timings.seconds.update({small.first.key: 1e-7, small.second.key: 1e-7, large.first.key: 1e-5,
                            large.second.key: 2e-5})
    costs = _Costs(Problem((BATCH,)), timings, LOW, True)
    assert costs.cast((2, 4)) == (3e-6, 3e-6)
    assert costs.cast((64, 64)) == (1e-5, 2e-5)


def test_a_loop_run_whole_scales_what_its_body_costs_in_the_target(loop):
    """Timed alone, every bfloat16 op is 10% faster and the lists' conversion is planned; run
    whole, the conversion takes 2 ms more than the source: the extra the ops did not
    show lands on the body's bfloat16 seconds (``loop_scale``), the calibrated model
    gives the measured extra back, and every node is kept float32."""
    from amp_rewrite.tuning.decide import loop_scale

    _, _, shapes, problem = loop
    looped = Problem(problem.batch_sizes, problem.candidates, problem.fused, problem.tensors,
                     {_body(shapes): float(SHAPE.length - 1)})
    timings = _table(looped, (1e-4, 0.9e-4), 0.0)
    alone = plan_keeps(looped, timings, "bfloat16", LOW)
    assert alone.keep == {}
    f32, lists, _ = alone.modeled[BATCH]
    source_s = 0.05
    scale = loop_scale(looped, timings, LOW, True, BATCH, source_s=source_s, lists_s=source_s + 0.002)
    assert scale == pytest.approx(1 + (0.002 - (lists - f32)) / lists)  # every bfloat16 second is in the body
    looped.loop_scale[BATCH] = scale
    run = plan_keeps(looped, timings, "bfloat16", LOW)
    assert run.modeled[BATCH][1] - run.modeled[BATCH][0] == pytest.approx(0.002)
    assert set(run.keep) == set(looped.candidates)
    assert speed.modeled_speed(run, BATCH, source_s, tuned=False) == pytest.approx(source_s / (source_s + 0.002))


def test_a_loop_scale_stays_within_its_bounds(loop):
    """A whole run far off what any scale of the body's seconds could give (noise) moves the
    scale to its bound, not past it; a problem with nothing timed in a loop has none."""
    from amp_rewrite.tuning.decide import LOOP_SCALES, loop_scale

    _, _, shapes, problem = loop
    looped = Problem(problem.batch_sizes, problem.candidates, problem.fused, problem.tensors,
                     {_body(shapes): float(SHAPE.length - 1)})
    timings = _table(looped, (1e-4, 1e-4), 0.0)
    assert loop_scale(looped, timings, LOW, True, BATCH, source_s=1.0, lists_s=0.5) == LOOP_SCALES[0]
    assert loop_scale(looped, timings, LOW, True, BATCH, source_s=0.5, lists_s=9.0) == LOOP_SCALES[1]
    assert loop_scale(looped, Timings(), LOW, True, BATCH, source_s=0.5, lists_s=0.6) is None
    outside = Problem(problem.batch_sizes, problem.candidates, problem.fused, problem.tensors)
    assert loop_scale(outside, timings, LOW, True, BATCH, source_s=0.5, lists_s=0.6) is None


def test_tune_model_runs_a_converted_loop_whole(loop, tmp_path: Path):
    """With time in the budget, ``tune_model`` runs the source and the lists' conversion of
    the decode loop whole: the batch gets a scale within bounds, and a note says what ran.
    A second conversion with the same cache and no time to run anything takes the whole
    run's seconds from the cache, and decides as the first."""
    from amp_rewrite.tuning.decide import LOOP_SCALES

    model, feeds, _, _ = loop
    cache = speed.open_cache(tmp_path / "timings.json", lookup_target("bfloat16"))
    tuning = speed.tune_model(model, {BATCH: feeds}, target="bfloat16", lists=load_lists("bfloat16"), cache=cache,
                              budget_s=6.0)
    assert LOOP_SCALES[0] <= tuning.problem.loop_scale[BATCH] <= LOOP_SCALES[1]
    (note,) = [note for note in tuning.notes if "run whole" in note]
    assert note.startswith("the source and the lists' conversion were run whole") and f"batch {BATCH} " in note
    assert speed.save_cache(cache) == ""
    again = speed.tune_model(model, {BATCH: feeds}, target="bfloat16", lists=load_lists("bfloat16"),
                             cache=speed.open_cache(tmp_path / "timings.json", lookup_target("bfloat16")),
                             budget_s=1e-9)  # no time to run anything: the cache's whole run decides
    assert again.problem.loop_scale == tuning.problem.loop_scale
    assert again.plan.keep == tuning.plan.keep
    assert "(the timing cache)" in " ".join(again.notes)


def test_a_cast_back_to_float32_costs_what_the_cast_back_was_timed():
    """A converted producer read by a float32 node pays the cast back to float32; a float32
    producer read by a converted node the cast down; each its own timing."""
    from amp_rewrite.tuning.decide import Candidate, modeled_seconds
    from amp_rewrite.tuning.timing import cast_pair

    shape = (4, 4)
    pair = cast_pair(shape, LOW)
    assert pair.first.node_def.attr["SrcT"].type == types_pb2.DT_FLOAT  # the first form casts down
    timings = Timings()
    timings.seconds.update({pair.first.key: 1e-5, pair.second.key: 3e-5})
    producer, reader = ("g", "a"), ("g", "b")
    problem = Problem((1,), candidates={producer: Candidate(producer, "Relu", {1: None}),
                                        reader: Candidate(reader, "Relu", {1: None})},
                      tensors={("g", "a:0"): (producer, [reader], True, False, {1: shape})})
    assert modeled_seconds(problem, timings, LOW, True, 1, {producer}) == pytest.approx(3e-5)  # back, once
    assert modeled_seconds(problem, timings, LOW, True, 1, {reader}) == pytest.approx(1e-5)  # down


def test_a_loop_that_fails_run_whole_counts_its_ops_as_timed_alone(loop, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch):
    """The conversion failing in the whole run (here: TensorFlow refuses a feed) leaves no
    scale, and one note says why; the plan is made from the ops timed alone."""
    import contextlib

    model, feeds, _, _ = loop

    @contextlib.contextmanager
    def failing(model, graph_def):
        def bind(fed):
            def call():
                raise tf.errors.InvalidArgumentError(None, None, "the feed is refused")
            return call
        yield bind
    monkeypatch.setattr(speed, "_conversion_loaded", failing)
    cache = speed.open_cache(tmp_path / "timings.json", lookup_target("bfloat16"))
    tuning = speed.tune_model(model, {BATCH: feeds}, target="bfloat16", lists=load_lists("bfloat16"), cache=cache,
                              budget_s=6.0)
    assert tuning.problem.loop_scale == {}
    assert "the loops could not be run whole (the feed is refused): a loop body's ops count as timed alone" \
        in tuning.notes
