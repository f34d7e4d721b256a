"""``--tune speed`` (amp_rewrite/tuning, calibration/speed.py): decisions from timings.

Timings are the machine's, so no test asserts one: the decisions are checked on timings
the test writes (a cache shipped from "another machine", or ``Timings`` by hand), and the
timing itself by what it counts (timed, cached, skipped), never by how long it took.
"""
from __future__ import annotations

import json
import math
import re
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

from amp_rewrite.calibration import speed
from amp_rewrite.calibration.savedmodel import read_model
from amp_rewrite.core.lists import load_lists
from amp_rewrite.core.rewrite import rewrite_graph_def
from amp_rewrite.tuning import cache as timing_cache
from amp_rewrite.tuning.decide import MARGIN, Problem, build_problem, plan_keeps
from amp_rewrite.tuning.shapes import TensorInfo, infer_shapes
from amp_rewrite.tuning.timing import NODE_KEY, Budget, Pair, Timings, cast_pair, op_run, time_pairs
from amp_rewrite.core.program import program_of
from amp_rewrite.core.rules import MEASURED_PREFIX

from conftest import graph_def_of
from test_cli import error_line, run_cli

LOW = types_pb2.DT_BFLOAT16


def _chain() -> graph_pb2.GraphDef:
    """x -> allow1 (MatMul) -> clr1 (Relu) -> allow2 (MatMul) -> out: the bfloat16 lists
    convert the three, weights are Consts (stored low: reading one costs no cast)."""
    def build() -> None:
        x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
        w1 = tf.constant(np.ones((16, 32), np.float32), name="w1")
        w2 = tf.constant(np.ones((32, 8), np.float32), name="w2")
        h = tf.nn.relu(tf.matmul(x, w1, name="allow1"), name="clr1")
        tf.identity(tf.matmul(h, w2, name="allow2"), name="out")
    return graph_def_of(build)


def _problem(graph_def: graph_pb2.GraphDef, batch_sizes=(4,)) -> Problem:
    base = rewrite_graph_def(graph_def, target="bfloat16", fetches=["out"])
    nodes = {"": {d.node for d in base.report.decisions if d.converted}}
    program = program_of(graph_def)
    shapes = {b: infer_shapes(program, {"x": (b, 16)}) for b in batch_sizes}
    return build_problem(program, base.program, nodes, shapes)


def _timings(problem: Problem, ops, cast: float) -> Timings:
    """``ops(node, batch) -> (float32 s, target s)`` for each candidate; every cast ``cast`` s."""
    timings = Timings()
    for (_, node), candidate in problem.candidates.items():
        for batch, pair in candidate.runs.items():
            timings.seconds[pair.first.key], timings.seconds[pair.second.key] = ops(node, batch)
    for pair in problem.pairs(LOW):
        if pair.first.node_def.op == "Cast":
            timings.seconds[pair.first.key] = timings.seconds[pair.second.key] = cast
    return timings


def _plan(problem: Problem, timings: Timings):
    return plan_keeps(problem, timings, "bfloat16", LOW)


def test_the_candidates_are_what_the_lists_convert_with_their_shapes():
    """Every converted node is a candidate, timed at its own shapes at each batch size, and
    each float32 tensor a candidate reads or writes is a cast to time (a shape once); the
    weights (Consts) are not: stored in the target, they need none."""
    problem = _problem(_chain(), (1, 8))
    assert {node for _, node in problem.candidates} == {"allow1", "clr1", "allow2"}
    assert problem.candidates[("", "allow1")].runs[8].first.key.startswith("MatMul(float32[8, 16], float32[16, 32])")
    assert problem.candidates[("", "allow1")].runs[1].second.key.startswith("MatMul(bfloat16[1, 16], bfloat16[16, 32])")
    relu, matmul = problem.candidates[("", "clr1")].runs[8], problem.candidates[("", "allow1")].runs[8]
    assert relu.first.chain and relu.second.chain and not matmul.first.chain  # Relu runs on its input's buffer
    casts = {p.first.key.split(" #")[0] for p in problem.pairs(LOW) if p.first.node_def.op == "Cast"}
    assert casts == {f"Cast(float32[{b}, {n}])" for b in (1, 8) for n in (16, 32, 8)}


def test_an_op_slower_in_the_target_is_kept_when_its_casts_cost_less():
    """clr1 takes 10x float32's time in bfloat16; its two casts cost less than that: kept,
    with its measured speed as the reason, and the rewrite gives it rule measured-slower."""
    problem = _problem(_chain())
    slow = {"clr1": (1e-4, 1e-3)}
    plan = _plan(problem, _timings(problem, lambda n, b: slow.get(n, (1e-3, 2e-4)), cast=1e-5))
    assert set(plan.keep) == {("", "clr1")}
    assert plan.keep[("", "clr1")] == f"{MEASURED_PREFIX}bfloat16 runs it at 0.10x at batch 4 float32's speed on this machine"
    f32, lists, tuned = plan.modeled[4]
    assert tuned < lists and tuned < f32
    lists_kept = load_lists("bfloat16").keeping({"clr1": plan.keep[("", "clr1")]})
    result = rewrite_graph_def(_chain(), target="bfloat16", fetches=["out"], lists=lists_kept)
    decision = result.report.decision("clr1")
    assert (decision.after, decision.rule) == ("float32", "measured-slower")
    assert result.report.decision("allow1").converted and result.report.decision("allow2").converted


def test_an_island_stays_converted_when_its_casts_would_cost_more():
    """The same op 1.5x slower, but the two casts around it (down before it, up after it)
    cost more than it loses, where one alone would not: the chain decides together and
    stays converted."""
    problem = _problem(_chain())
    plan = _plan(problem, _timings(problem, lambda n, b: (1e-4, 1.5e-4) if n == "clr1" else (1e-3, 2e-4),
                                   cast=0.25e-4))
    assert plan.keep == {}
    cheaper = _plan(problem, _timings(problem, lambda n, b: (1e-4, 1.5e-4) if n == "clr1" else (1e-3, 2e-4),
                                      cast=0.1e-4))
    assert set(cheaper.keep) == {("", "clr1")}


def _fusable() -> graph_pb2.GraphDef:
    """x -> allow1 (MatMul) -> bias (BiasAdd) -> act (Relu) -> allow2 (MatMul) -> out: the
    remapper fuses bias and act into allow1, in float32 and bfloat16 alike."""
    def build() -> None:
        x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
        w1 = tf.constant(np.ones((16, 32), np.float32), name="w1")
        w2 = tf.constant(np.ones((32, 8), np.float32), name="w2")
        b = tf.constant(np.ones((32,), np.float32), name="b")
        h = tf.nn.relu(tf.nn.bias_add(tf.matmul(x, w1, name="allow1"), b, name="bias"), name="act")
        tf.identity(tf.matmul(h, w2, name="allow2"), name="out")
    return graph_def_of(build)


def test_ops_the_remapper_fuses_take_their_heads_precision():
    """A bias add and activation timed alone 10x slower in bfloat16 (as unfused kernels are)
    stay converted with the MatMul they fuse into; when that MatMul is kept float32, they
    are too, and say why. An activation with no bias add before it is not fused (the
    chain test keeps its Relu)."""
    problem = _problem(_fusable())
    assert problem.fused == {("", "bias"): ("", "allow1"), ("", "act"): ("", "allow1")}
    assert _problem(_chain()).fused == {}
    slow = {"bias": (1e-4, 1e-3), "act": (1e-4, 1e-3)}
    assert _plan(problem, _timings(problem, lambda n, b: slow.get(n, (1e-3, 2e-4)), cast=1e-5)).keep == {}
    slow["allow1"] = (1e-3, 1e-2)
    plan = _plan(problem, _timings(problem, lambda n, b: slow.get(n, (1e-3, 2e-4)), cast=1e-5))
    assert set(plan.keep) == {("", "allow1"), ("", "bias"), ("", "act")}
    assert plan.keep[("", "act")].startswith(f"{MEASURED_PREFIX}fused into 'allow1' by grappler's remapper")


def test_an_op_a_little_slower_stays_converted_within_the_margin():
    """Slower by less than MARGIN: the target is not clearly slower, nothing moves."""
    problem = _problem(_chain())
    a_little = 1 + MARGIN / 2
    plan = _plan(problem, _timings(problem, lambda n, b: (1e-3, 1e-3 * a_little) if n == "allow2" else (1e-3, 2e-4),
                                   cast=0.0))
    assert plan.keep == {}


def test_a_plan_that_saves_under_the_margin_keeps_everything_float32():
    """Every op 3% faster in bfloat16: within what timing can tell, so all stay float32."""
    problem = _problem(_chain())
    plan = _plan(problem, _timings(problem, lambda n, b: (1e-3, 0.97e-3), cast=0.0))
    assert set(plan.keep) == set(problem.candidates)
    assert all("would not be over 10% faster" in why for why in plan.keep.values())
    assert all(f32 == tuned for f32, _, tuned in plan.modeled.values())


def test_batch_sizes_weigh_until_no_batch_is_modeled_slower():
    """clr1 2x slower in bfloat16 at batch 1 but 10x faster at batch 8, the matmuls faster
    at both. Weighed alike, converting clr1 wins, and batch 1 would be slower than
    float32; weighed again, clr1 stays float32 and both batch sizes gain. For batch 8
    alone everything converts."""
    def ops(node: str, batch: int) -> tuple[float, float]:
        if batch == 1:
            return (1e-4, 2e-4) if node == "clr1" else (1e-4, 0.8e-4)
        return (1e-3, 0.1e-3) if node == "clr1" else (1e-3, 0.5e-3)
    both = _problem(_chain(), (1, 8))
    plan = _plan(both, _timings(both, ops, cast=1e-6))
    assert set(plan.keep) == {("", "clr1")}
    assert all(tuned < f32 for f32, _, tuned in plan.modeled.values()), plan.modeled
    assert plan.modeled[1][1] > plan.modeled[1][0]  # the lists alone are slower at batch 1
    eight = _problem(_chain(), (8,))
    assert _plan(eight, _timings(eight, ops, cast=1e-6)).keep == {}


def _two_branches() -> graph_pb2.GraphDef:
    """x -> allowA -> outA, and x -> allow1 -> clr1 -> allow2 -> out."""
    def build() -> None:
        x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
        tf.identity(tf.matmul(x, tf.constant(np.ones((16, 16), np.float32)), name="allowA"), name="outA")
        h = tf.nn.relu(tf.matmul(x, tf.constant(np.ones((16, 32), np.float32)), name="allow1"), name="clr1")
        tf.identity(tf.matmul(h, tf.constant(np.ones((32, 8), np.float32)), name="allow2"), name="out")
    return graph_def_of(build)


def test_what_is_not_timed_follows_its_neighbours():
    """clr1 has no timing; the matmuls on each side of it are slower in bfloat16 and kept:
    it stays with them rather than pay two casts, and says it was not timed. allowA, on
    its own branch and faster, converts."""
    graph_def = _two_branches()
    base = rewrite_graph_def(graph_def, target="bfloat16", fetches=["out", "outA"])
    nodes = {"": {d.node for d in base.report.decisions if d.converted}}
    program = program_of(graph_def)
    problem = build_problem(program, base.program, nodes, {4: infer_shapes(program, {"x": (4, 16)})})
    timings = _timings(problem, lambda n, b: (1e-3, 1e-4) if n == "allowA" else (1e-4, 1e-3), cast=1e-6)
    for pair in problem.candidates[("", "clr1")].runs.values():
        del timings.seconds[pair.second.key]
    plan = _plan(problem, timings)
    assert set(plan.keep) == {("", "allow1"), ("", "clr1"), ("", "allow2")}
    assert plan.keep[("", "clr1")] == f"{MEASURED_PREFIX}not timed alone; kept float32 with its neighbours, which saves casts"


def test_an_op_too_small_to_time_says_so_and_shows_no_ratio():
    """clr1 took no longer than an empty call in both forms (timing.TOO_SMALL_S): no ratio of
    two clamped times ("0.00x") is shown; it costs nothing either way, so it follows the
    slower matmuls around it, and its reason says it was too small to time."""
    from amp_rewrite.tuning.timing import TOO_SMALL_S

    problem = _problem(_chain())
    timings = _timings(problem, lambda n, b: (1e-4, 1e-3), cast=1e-6)
    for pair in problem.candidates[("", "clr1")].runs.values():
        assert timings.ratio(pair) is not None
        timings.seconds[pair.first.key] = timings.seconds[pair.second.key] = TOO_SMALL_S
        assert timings.too_small(pair) and timings.ratio(pair) is None
    plan = _plan(problem, timings)
    assert set(plan.keep) == {("", "allow1"), ("", "clr1"), ("", "allow2")}
    assert plan.keep[("", "clr1")].startswith(f"{MEASURED_PREFIX}too small to time here (no longer than an empty"
                                              " call), so it costs nothing measurable either way"), plan.keep
    assert "0.00x" not in plan.keep[("", "clr1")]


def test_a_form_no_longer_than_an_empty_call_is_too_small_to_time(monkeypatch):
    """Rule (timing.py): where a form's calls take no longer than the empty call, its
    per-op time is clamped; the pair is then too small to time, both forms TOO_SMALL_S,
    and no ratio of the clamped values is kept."""
    from amp_rewrite.tuning import timing

    pair = timing.cast_pair((4, 16), LOW)
    monkeypatch.setattr(timing._TimingSession, "_call", lambda self, fetch: 1e-5)  # every call as long as the empty one
    with timing._TimingSession([pair]) as session:
        assert session.time_pair(0) == (timing.TOO_SMALL_S, timing.TOO_SMALL_S)


def test_the_empty_call_is_measured_with_each_form_under_the_load_of_then(monkeypatch):
    """Rule (timing.py): the empty call taken off a form's calls is measured between them.
    Here the first 10 empty calls are slow (the machine was loaded), later ones fast, and
    every call of a form 3e-5 s longer than the empty call of then: the op is timed at that,
    not called too small to time against an empty call measured once, under load."""
    from amp_rewrite.tuning import timing

    empties = iter([1e-3] * 10 + [1e-5] * 10_000)
    monkeypatch.setattr(timing._TimingSession, "_call",
                        lambda self, fetch: next(empties) if fetch == "empty" else 1e-5 + 3e-5)
    pair = timing.cast_pair((4, 16), LOW)
    with timing._TimingSession([pair]) as session:
        first, second = session.time_pair(0)
    assert first > timing.TOO_SMALL_S and second == pytest.approx(first)
    assert first * max(timing.COPIES) == pytest.approx(3e-5)


def test_a_pair_is_timed_again_while_the_budget_lasts_and_its_median_kept(monkeypatch, tmp_path):
    """Rule (timing.time_pairs): with budget to spare each pair is measured ``PASSES`` times
    and each form's median kept, so one pass thrown off by the machine's load (here the
    second, 10x) does not decide; the cache holds the medians."""
    from amp_rewrite.tuning import timing

    passes = iter([(1e-5, 2e-5), (1e-4, 2e-4), (2e-5, 3e-5)])
    monkeypatch.setattr(timing._TimingSession, "time_pair", lambda self, index: next(passes))
    pair = timing.cast_pair((4, 16), LOW)
    cache = timing_cache.load_cache(tmp_path / "timings.json")
    cache.put(NODE_KEY, 1e-7)
    timings = time_pairs([pair], cache, Budget(60.0))
    assert timing.PASSES == 3 and timings.timed == 1
    assert (timings.seconds[pair.first.key], timings.seconds[pair.second.key]) == (2e-5, 3e-5)
    assert (cache.get(pair.first.key), cache.get(pair.second.key)) == (2e-5, 3e-5)


def test_what_the_budget_left_untimed_is_estimated_from_its_op_type():
    """allow2 was left untimed by the budget; allow1, a MatMul too, was timed: allow2 is taken
    to cost what allow1 costs per output element. Where allow1 is 10x faster in bfloat16, so
    is allow2, and it converts, where a cost of 0 would have kept it float32 beside the slow
    clr1 to save casts; where allow1 is slower, allow2 is kept, saying it was estimated."""
    problem = _problem(_chain())

    def timed(allow1: tuple[float, float]) -> Timings:
        timings = _timings(problem, lambda n, b: allow1 if n != "clr1" else (1e-4, 3e-4), cast=1e-5)
        for pair in problem.candidates[("", "allow2")].runs.values():
            del timings.seconds[pair.first.key], timings.seconds[pair.second.key]
        return timings

    assert set(_plan(problem, timed((1e-3, 1e-4))).keep) == {("", "clr1")}
    slower = _plan(problem, timed((1e-4, 2e-4)))
    assert set(slower.keep) == {("", "allow1"), ("", "clr1"), ("", "allow2")}
    assert slower.keep[("", "allow2")] == (f"{MEASURED_PREFIX}left untimed by the budget; the MatMul ops timed here"
                                           " run at 0.50x at batch 4 float32's speed in the target, and so it is taken to;"
                                           " the converted ops together would not be over 10% faster than float32 here")


def test_a_keep_reason_without_the_prefix_is_keep_nodes():
    """Only the timing step's reasons (MEASURED_PREFIX) give measured-slower; the user's and
    calibration's keep entries stay keep-nodes."""
    lists = load_lists("bfloat16").keeping({"clr1": "calibration: 7e+04", "allow2": f"{MEASURED_PREFIX}0.5x"})
    report = rewrite_graph_def(_chain(), target="bfloat16", fetches=["out"], lists=lists).report
    assert report.decision("clr1").rule == "keep-nodes" and report.decision("allow2").rule == "measured-slower"


# --- shapes ------------------------------------------------------------------------------------


class _Dense(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(np.ones((16, 8), np.float32), name="w")

    @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": tf.nn.relu(tf.matmul(x, self.w))}


def _save_dense(path: Path) -> Path:
    module = _Dense()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})
    return path


def test_shapes_reach_a_function_body_and_its_variables(tmp_path):
    """A SavedModel's matmul lives in a function its signature calls; its input shapes
    there come from the feed (batch 3) and the variable's handle (16, 8)."""
    model = read_model(_save_dense(tmp_path / "dense"))
    feeds, _ = speed.batch_feeds(model, None, (3,))
    shapes = infer_shapes(model.program, speed._feed_shapes(model, feeds[3]))
    program = program_of(model.graph_def)
    found = [(item, n) for item in shapes.graphs if item for n in program.item(item).node if n.op == "MatMul"]
    assert len(found) == 1
    item, matmul = found[0]
    assert [shapes.info(item, t).shape for t in matmul.input] == [(3, 16), (16, 8)]


# --- timing and the cache ---------------------------------------------------------------------


def _matmul_pairs(sizes=(8, 16)) -> list[Pair]:
    pairs = []
    for size in sizes:
        forms = []
        for dtype in (types_pb2.DT_FLOAT, LOW):
            node_def = graph_pb2.GraphDef().node.add(op="MatMul")
            node_def.attr["T"].type = dtype
            info = TensorInfo(dtype, (size, size))
            forms.append(op_run(node_def, [info, info]))
        pairs.append(Pair(*forms))
    relu = []
    for dtype in (types_pb2.DT_FLOAT, LOW):
        node_def = graph_pb2.GraphDef().node.add(op="Relu")
        node_def.attr["T"].type = dtype
        relu.append(op_run(node_def, [TensorInfo(dtype, (64, 64))], chain=True))
    return pairs + [cast_pair((4, 4), LOW), Pair(*relu)]


def test_a_second_timing_re_times_nothing(tmp_path):
    """The first run times each pair once (an identical pair twice is one); with the cache
    it wrote, the next run times none of them and answers every pair from it."""
    path = tmp_path / "timings.json"
    pairs = _matmul_pairs() + _matmul_pairs((8,))
    first = timing_cache.load_cache(path)
    timed = time_pairs(pairs, first, Budget(60))
    assert (timed.timed, timed.cached, timed.skipped) == (4, 0, 0)
    # each a ratio, or too small to time (a 4x4 cast can take no longer than an empty call on a loaded machine)
    assert all(timed.ratio(p) is not None and timed.ratio(p) > 0 or timed.too_small(p) for p in pairs)
    assert speed.save_cache(first) == ""
    again = time_pairs(pairs, timing_cache.load_cache(path), Budget(60))
    assert (again.timed, again.cached) == (0, len(pairs))
    assert again.seconds == {k: v for k, v in timed.seconds.items()}


def test_a_spent_budget_times_nothing():
    timings = time_pairs(_matmul_pairs(), timing_cache.load_cache(None), Budget(0.0))
    assert (timings.timed, timings.skipped) == (0, 4)


class _Clock:
    """A clock the test moves: ``time.perf_counter`` for the timing's modules."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def take(self, seconds: float) -> None:
        self.now += seconds


def test_a_paused_budget_counts_only_while_it_runs(monkeypatch):
    """Between the op timing and the whole-model check a conversion writes and validates: not timing."""
    from amp_rewrite.tuning import timing

    clock = _Clock()
    monkeypatch.setattr(timing, "time", clock)
    budget = Budget(30.0, started=clock.now)
    clock.take(3)
    budget.pause()
    clock.take(100)
    assert (budget.spent(), budget.left()) == (3, 27)
    budget.resume()
    clock.take(2)
    assert budget.spent() == 5


def test_the_whole_model_check_starts_no_step_past_its_budget(tmp_path, monkeypatch):
    """On a clock the test moves (a model's load 5 s, a call 1 s at batch 1 and 2 s at batch
    4), every budget from 0 to 60 s is kept, but for the two steps nothing predicts (the
    source's load, its first call), each started only with time left; what did not fit is
    said per batch size (a call at batch 4 expected as long as 4 at batch 1), and a budget
    that fits gets its ratios."""
    from amp_rewrite.tuning import timing

    source = _save_chain(tmp_path / "chain")
    model = read_model(source)
    feeds, _ = speed.batch_feeds(model, None, (1, 4))
    tuning = speed.tune_model(model, feeds, target="bfloat16", lists=load_lists("bfloat16"),
                              cache=timing_cache.load_cache(None), budget_s=1e-9)
    clock = _Clock()
    monkeypatch.setattr(speed, "time", clock)
    monkeypatch.setattr(timing, "time", clock)

    def loaded(model, path):
        clock.take(5)
        return lambda fed: lambda: clock.take(2 if fed is feeds[4] else 1)
    monkeypatch.setattr(speed, "_loaded", loaded)
    for budget in np.arange(0, 60.5, 0.5):
        clock.now = 0.0
        checks = speed.check_speed(tuning, tmp_path / "written", seconds=float(budget))
        assert clock.now <= budget or clock.now == 5 or (clock.now - budget <= 1 and clock.now <= 11), (budget, clock.now)
        assert [c.batch for c in checks] == [1, 4]
    assert [c.speed for c in checks] == [1.0, 1.0]
    clock.now = 0.0
    lines = speed.speed_lines(tuning, speed.check_speed(tuning, tmp_path / "written", seconds=7.0))
    assert ("batch 1 not checked: loading the result (about 5.0 s, as the source's load took) does not fit in the"
            " budget left (a larger --tune-budget checks it)") in lines[0], lines
    clock.now = 0.0
    lines = speed.speed_lines(tuning, speed.check_speed(tuning, tmp_path / "written", seconds=16.0))
    assert "batch 4 not checked: its warm-up calls (about 4.00 s each) do not fit in the budget left" in lines[0], lines


@pytest.mark.parametrize("content", [b"not json {", b'{"format": "something else", "machines": {}}',
                                     b"\xff\xfe\x00bytes", b'{"format": "amp-rewrite op timings", "version": 1,'
                                     b' "machines": {"m": {"timings": {"k": "fast"}}}}'])
def test_a_foreign_or_unreadable_cache_is_said_and_left_alone(tmp_path, content):
    """One line names the file; nothing is read from it, and it is not written over."""
    path = tmp_path / "timings.json"
    path.write_bytes(content)
    cache = timing_cache.load_cache(path)
    assert cache.problem.startswith(f"{path}: ") and "\n" not in cache.problem and not cache.timings
    cache.put("MatMul(float32[1, 1]) #x", 1e-3)
    assert speed.save_cache(cache) == "" and path.read_bytes() == content


def test_other_machines_keep_their_sections(tmp_path, monkeypatch):
    """A file shared by a fleet keeps each machine's timings; a machine whose oneDNN ISA is
    lowered is another machine (its kernels differ)."""
    path = tmp_path / "timings.json"
    here = timing_cache.load_cache(path)
    here.put("k", 1.0)
    speed.save_cache(here)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    lowered = timing_cache.load_cache(path)
    assert lowered.key != here.key and lowered.timings == {}
    lowered.put("k", 2.0)
    speed.save_cache(lowered)
    sections = json.loads(path.read_text())["machines"]
    assert {s["timings"]["k"] for s in sections.values()} == {1.0, 2.0}
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert timing_cache.load_cache(path).timings == {"k": 1.0}


def test_the_default_cache_follows_xdg_cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert timing_cache.default_path() == tmp_path / "amp_rewrite" / "timings.json"


@pytest.mark.parametrize("budget", [0, -1, math.nan, math.inf])
def test_a_budget_of_zero_or_less_is_refused(budget):
    with pytest.raises(ValueError, match="use a number of seconds above 0"):
        speed.check_budget(budget)


# --- the command ---------------------------------------------------------------------------------


class _Chain(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = tf.Variable(np.full((16, 32), 0.1, np.float32), name="w1")
        self.w2 = tf.Variable(np.full((32, 8), 0.1, np.float32), name="w2")

    @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": tf.matmul(tf.nn.relu(tf.matmul(x, self.w1)), self.w2)}


def _save_chain(path: Path) -> Path:
    module = _Chain()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})
    return path


def _ship_cache(source: Path, path: Path, slow: str, batch: int = 4) -> Path:
    """A cache as another machine like this one would have written it for ``source``: every
    op and cast of the bfloat16 rewrite timed, bfloat16 5x faster except ``slow`` (10x slower)."""
    model = read_model(source)
    feeds, _ = speed.batch_feeds(model, None, (batch,))
    empty = timing_cache.load_cache(None)
    tuning = speed.tune_model(model, feeds, target="bfloat16", lists=load_lists("bfloat16"), cache=empty,
                              budget_s=1e-9)
    cache = timing_cache.load_cache(path)
    for pair in tuning.problem.pairs(LOW):
        op = pair.first.node_def.op
        cache.put(pair.first.key, 1e-4 if op != "Cast" else 1e-6)
        cache.put(pair.second.key, 1e-3 if op == slow else 2e-5 if op != "Cast" else 1e-6)
    cache.put(NODE_KEY, 1e-7)  # the executor's time per node, which a machine measures once
    assert speed.save_cache(cache) == ""
    return path


def _tuned(*args: object) -> list[object]:
    return ["--target", "bfloat16", "--tune", "speed", "--tune-budget", "3", *args]


def test_convert_with_a_shipped_cache_keeps_the_slow_node_and_every_command_says_why(tmp_path):
    """A cache copied from a machine like this one: convert re-times nothing, keeps the Relu
    it says is slower in bfloat16, times the result against the source, and leaves the
    file as it was; inspect and explain with the same cache show the same decision."""
    source = _save_chain(tmp_path / "chain")
    cache = _ship_cache(source, tmp_path / "timings.json", slow="Relu")
    shipped = cache.read_bytes()
    common = _tuned("--batch-sizes", "4", "--tune-cache", cache)
    run = run_cli("convert", source, tmp_path / "out", *common, "--dump", tmp_path / "report")
    assert run.code == 0, run.err
    timing = next(line for line in run.out.splitlines() if line.startswith("Timing:"))
    assert "1 of 4 converted node(s) kept float32" in timing and "0 op(s) timed" in timing, timing
    page = (tmp_path / "report" / "report.html").read_text(encoding="utf-8")
    assert "measured-slower" in page and "runs it at 0.10x at batch 4" in page
    assert re.search(r"Speed against the source \(median of the rounds' ratios\): batch 4 ", run.out), run.out
    assert "measured-slower 1" in run.out and cache.read_bytes() == shipped
    explained = run_cli("explain", source, "Relu", *common)
    assert "rule: measured-slower" in explained.out, explained.out
    assert "why:  measured: bfloat16 runs it at 0.10x at batch 4 float32's speed on this machine" in explained.out
    inspected = run_cli("inspect", source, *common)
    assert re.search(r"__inference_serve_\d+ +\d+ +3 .*measured-slower 1", inspected.out), inspected.out


def test_a_first_conversion_fills_the_cache_and_a_second_re_times_nothing(tmp_path, monkeypatch):
    """Without --tune-cache the cache is $XDG_CACHE_HOME/amp_rewrite/timings.json; the
    second conversion of the model answers every op from it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    source = _save_chain(tmp_path / "chain")
    first = run_cli("convert", source, tmp_path / "one", *_tuned("--tune-budget", "20"))
    assert first.code == 0, first.err
    assert (tmp_path / "xdg" / "amp_rewrite" / "timings.json").is_file()
    second = run_cli("convert", source, tmp_path / "two", *_tuned("--tune-budget", "20"))
    timing = next(line for line in second.out.splitlines() if line.startswith("Timing:"))
    assert re.search(r" 0 op\(s\) timed, [1-9]\d* from the cache", timing), timing


def test_a_foreign_cache_is_one_warning_and_the_conversion_goes_on(tmp_path):
    source = _save_chain(tmp_path / "chain")
    foreign = tmp_path / "notes.json"
    foreign.write_text('{"my": "notes"}', encoding="utf-8")
    run = run_cli("convert", source, tmp_path / "out", *_tuned("--tune-cache", foreign))
    assert run.code == 0 and (tmp_path / "out" / "saved_model.pb").is_file()
    said = [line for line in run.err.splitlines() if str(foreign) in line]  # (a tiny model may time slower)
    assert said == [f"amp-rewrite: warning: {foreign}: not an amp-rewrite timing cache; timing without it (delete"
                    " the file, or pass another path, to keep timings)"], run.err
    assert foreign.read_text(encoding="utf-8") == '{"my": "notes"}'


@pytest.mark.parametrize(("args", "line"), [
    (("--tune", "speed", "--tune-budget", "0"), "argument --tune-budget: '0': use a number of seconds above 0, e.g. 30"),
    (("--tune", "speed", "--tune-budget", "-5"), "argument --tune-budget: '-5': use a number of seconds above 0, e.g. 30"),
    (("--tune", "speed", "--batch-sizes", "0,8"),
     "argument --batch-sizes: '0,8': use batch sizes like 1,8 (whole numbers, 1 or more)"),
    (("--batch-sizes", "8"), "--batch-sizes: timing options; add --tune speed, or drop them"),
])
def test_bad_tuning_options_are_one_line(tmp_path, args, line):
    source = _save_chain(tmp_path / "chain")
    run = run_cli("convert", source, tmp_path / "out", "--target", "bfloat16", *args)
    assert error_line(run).removeprefix("amp-rewrite: error: ").removesuffix("; see amp-rewrite convert --help") == line
    assert not (tmp_path / "out").exists()


def test_tuning_needs_the_targets_hardware_and_the_shapes(tmp_path):
    """float8 is not tuned; float16 needs a GPU here; a dim beyond the batch that the
    signature leaves open needs --inputs."""
    source = _save_chain(tmp_path / "chain")
    float8 = run_cli("convert", source, tmp_path / "out", "--target", "float8", "--tune", "speed")
    assert error_line(float8).startswith("amp-rewrite: error: --tune speed: not for target float8")
    if not tf.config.list_physical_devices("GPU"):
        float16 = run_cli("convert", source, tmp_path / "out", "--target", "float16", "--tune", "speed")
        assert error_line(float16) == ("amp-rewrite: error: --tune speed: target float16 runs on a GPU and TensorFlow sees none here;"
                                       " convert on the machine you serve on")

    class Open(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32, name="x")])
        def serve(self, x: tf.Tensor) -> tf.Tensor:
            return tf.matmul(x, tf.transpose(x))

    module = Open()
    tf.saved_model.save(module, str(tmp_path / "open"), signatures={"serving_default": module.serve})
    run = run_cli("convert", tmp_path / "open", tmp_path / "out", *_tuned())
    assert error_line(run).endswith("(float32, shape (None, None)) has unknown dims beyond the batch; timing needs"
                                    " their sizes: pass --inputs FILE.npz with arrays of the shapes you serve")


def test_the_python_api_gives_the_decisions_an_overlay_reproduces(tmp_path):
    """amp_rewrite.tune: the keeps as an overlay; rewriting with it gives the tuned graph,
    without timing anything."""
    import amp_rewrite

    source = _save_chain(tmp_path / "chain")
    cache = _ship_cache(source, tmp_path / "timings.json", slow="Relu")
    tuning = amp_rewrite.tune(source, target="bfloat16", batch_sizes=(4,), cache=cache, budget_s=5)
    assert list(tuning.keep) == ["Relu"] and tuning.timings.timed == 0
    overlay = tmp_path / "tuned.yaml"
    overlay.write_text(tuning.overlay(), encoding="utf-8")
    again = amp_rewrite.rewrite_graph_def(tuning.model.graph_def, target="bfloat16", lists=overlay,
                                          fetches=tuning.model.fetches, entry_functions=tuning.model.entry_functions)
    assert again.graph_def == tuning.result.graph_def
    lines = speed.speed_lines(tuning, [speed.SpeedCheck(4, 5, 1e-3, 2e-3, 0.5)])
    assert lines[1].startswith("Speed: slower than the source at batch 4 (0.50x); costliest in bfloat16: ")
    assert "casts" in lines[1]


def _traced_ops(step, x: tf.Tensor) -> dict[str, int]:
    """Op type -> its T attr in ``step``'s registered (rewritten) body, traced on ``x``."""
    from tensorflow.python.eager import context

    body = context.context().get_function_def(step.get_concrete_function(x).name)
    return {node.op: node.attr["T"].type for node in body.node_def if node.op in ("MatMul", "Relu")}


def test_the_live_path_keeps_what_the_cache_says_and_times_nothing(tmp_path, monkeypatch):
    """mixed_precision(timing_cache=...): a step traced at batch 4 keeps the Relu the cache
    says is slower in bfloat16 float32, its matmuls converted; nothing is timed or written.
    Without it, or with a cache of no timings here (one warning), the lists decide alone."""
    import amp_rewrite
    from amp_rewrite.tuning import timing

    source = _save_chain(tmp_path / "chain")
    cache = _ship_cache(source, tmp_path / "timings.json", slow="Relu")
    shipped = cache.read_bytes()
    monkeypatch.setattr(timing, "_TimingSession", None)  # a timing would fail: the live path never times
    chain, x = _Chain(), tf.ones((4, 16))

    def step() -> Callable:
        return tf.function(lambda x: tf.matmul(tf.nn.relu(tf.matmul(x, chain.w1)), chain.w2))
    with amp_rewrite.mixed_precision(target="bfloat16", timing_cache=cache):
        assert _traced_ops(step(), x) == {"MatMul": LOW, "Relu": types_pb2.DT_FLOAT}
    assert cache.read_bytes() == shipped
    with amp_rewrite.mixed_precision(target="bfloat16"):
        assert _traced_ops(step(), x) == {"MatMul": LOW, "Relu": LOW}
    with pytest.warns(UserWarning, match=r"amp_rewrite: .*missing.json: no timings of this machine there \(amp_rewrite"
                      r".tune_step, or amp-rewrite convert --tune speed --tune-cache .*missing.json, fills it\); the"
                      r" lists decide alone"):
        with amp_rewrite.mixed_precision(target="bfloat16", timing_cache=tmp_path / "missing.json"):
            assert _traced_ops(step(), x) == {"MatMul": LOW, "Relu": LOW}
    with pytest.raises(ValueError, match="timing_cache applies to target='bfloat16' or 'float16', not to FP8"):
        with amp_rewrite.mixed_precision(target="float8", timing_cache=cache):
            pass


def _training_step(chain: _Chain, optimizer) -> Callable:
    """A custom loop's step over ``chain``: its forward MatMuls, their gradients, an SGD update."""
    @tf.function
    def step(x: tf.Tensor) -> tf.Tensor:
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(tf.matmul(tf.nn.relu(tf.matmul(x, chain.w1)), chain.w2))
        gradients = tape.gradient(loss, [chain.w1, chain.w2])
        optimizer.apply_gradients(zip(gradients, [chain.w1, chain.w2]))
        return loss
    return step


def test_tune_step_times_the_whole_training_step_and_the_live_rewrite_keeps_what_it_measured(tmp_path, monkeypatch):
    """tune_step times a training step's converted ops, gradients included, into the cache and
    leaves the step itself untraced; the live rewrite of the step then keeps float32 every op
    measured slower (here every one: the target is timed 10x slower) and times nothing."""
    import keras

    import amp_rewrite
    from amp_rewrite.tuning import timing

    chain, x = _Chain(), tf.ones((4, 16))
    optimizer = keras.optimizers.SGD(0.01)
    optimizer.build([chain.w1, chain.w2])
    step = _training_step(chain, optimizer)
    with amp_rewrite.mixed_precision(target="bfloat16"):
        lists_only = _traced_ops(_training_step(chain, optimizer), x)
    assert lists_only == {"MatMul": LOW, "Relu": LOW}  # what the cache must move
    monkeypatch.setattr(timing._TimingSession, "time_pair", lambda self, index: (1e-4, 1e-3))
    cache = tmp_path / "timings.json"
    with amp_rewrite.mixed_precision(target="bfloat16", timing_cache=cache), warnings.catch_warnings():
        warnings.simplefilter("error")  # enabled before the cache exists: its reading waits for the step's trace
        tuned = amp_rewrite.tune_step(step, x, timing_cache=cache, budget_s=30)
        assert step.experimental_get_tracing_count() == 0
        monkeypatch.setattr(timing, "_TimingSession", None)  # a timing would fail: the live path never times
        assert _traced_ops(step, x) == {"MatMul": types_pb2.DT_FLOAT, "Relu": types_pb2.DT_FLOAT}
    assert tuned.timings.timed >= 4 and tuned.candidates >= 6 and len(tuned.plan.keep) == tuned.candidates
    spent = tuned.budget.spent()
    time.sleep(0.05)
    assert tuned.budget.spent() == spent  # what it cost was counted when it ended
    assert re.fullmatch(rf"Timed the step: {tuned.timings.timed} op\(s\) timed, 0 from the cache, .* keeps"
                        rf" {tuned.candidates} of its {tuned.candidates} converted node\(s\) float32", tuned.summary())
    keys = json.loads(cache.read_text())["machines"].popitem()[1]["timings"]
    assert any("ReluGrad" in key for key in keys), sorted(keys)  # the backward pass was timed too


def test_tune_step_refuses_what_it_cannot_time_into(tmp_path):
    import amp_rewrite
    from amp_rewrite.errors import AmpRewriteError

    chain, x = _Chain(), tf.ones((4, 16))
    step = tf.function(lambda x: chain.serve(x)["y"])
    with pytest.raises(AmpRewriteError, match=r"tune_step: function is not a tf.function; pass the training step"):
        amp_rewrite.tune_step(step.python_function, x, timing_cache=tmp_path / "timings.json")
    with pytest.raises(AmpRewriteError, match=r"tune_step: no timing cache file \(timing_cache=None\); pass a"):
        amp_rewrite.tune_step(step, x, timing_cache=None)
    (tmp_path / "foreign.json").write_text("{}")
    with pytest.raises(AmpRewriteError, match=r"tune_step: .*foreign.json: not an amp-rewrite timing cache; pass a"
                                              r" timing_cache path this run can write$"):
        amp_rewrite.tune_step(step, x, timing_cache=tmp_path / "foreign.json")
    assert (tmp_path / "foreign.json").read_text() == "{}"
    unknown_batch = tf.function(lambda x: chain.serve(x)["y"], input_signature=[tf.TensorSpec([None, 16])])
    with pytest.raises(AmpRewriteError, match=r"tune_step: the step's input_signature leaves a shape unknown"
                                              r" \(\(None, 16\)\), and the live rewrite looks timings up by the"):
        amp_rewrite.tune_step(unknown_batch, x, timing_cache=tmp_path / "timings.json")
    with pytest.raises(AmpRewriteError, match=r"timing budget 0: use a number of seconds above 0"):
        amp_rewrite.tune_step(step, x, timing_cache=tmp_path / "timings.json", budget_s=0)


def test_the_readme_commands_run_as_written(tmp_path, monkeypatch):
    """The CLI guide, Tuning for speed: its convert line as written (a cache shipped to the default
    place, so nothing is timed), and its explain line with a node of this model for the README
    model's (the docs tests run both lines on that model, timing it)."""
    text = (Path(__file__).resolve().parent.parent / "docs" / "guides" / "cli.md").read_text(encoding="utf-8")
    block = text.split("## Tuning for speed: `--tune speed`", 1)[1].split("```sh\n", 1)[1].split("```", 1)[0]
    lines = [line.split("#")[0].split() for line in block.strip().splitlines()]
    assert [line[:2] for line in lines] == [["amp-rewrite", "convert"], ["amp-rewrite", "explain"]]
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    source = _save_chain(tmp_path / "my_model")
    for batch in (1, 8):
        _ship_cache(source, tmp_path / "xdg" / "amp_rewrite" / "timings.json", slow="Relu", batch=batch)
    converted = run_cli(*lines[0][1:])
    assert converted.code == 0 and (tmp_path / lines[0][3] / "saved_model.pb").is_file(), converted.err
    assert " 0 op(s) timed" in converted.out
    explained = run_cli(*lines[1][1:3], "Relu", *lines[1][4:])
    assert "rule: measured-slower" in explained.out, explained.out


def test_a_graphdef_file_is_tuned_and_checked_too(tmp_path):
    """A frozen GraphDef: its placeholders give the shapes (unknown batch: --batch-sizes),
    its Consts are the weights; the check runs both graphs in Sessions."""
    from cli_models import write_graph_def

    source = write_graph_def(_chain(), tmp_path / "chain.pb")
    run = run_cli("convert", source, tmp_path / "out.pb", *_tuned("--batch-sizes", "2", "--fetch", "out",
                                                                  "--tune-cache", tmp_path / "timings.json"))
    assert run.code == 0, run.err
    timing = next(line for line in run.out.splitlines() if line.startswith("Timing:"))
    assert re.search(r"of 3 converted node\(s\) kept float32", timing), timing
    assert re.search(r"Speed against the source.*: (batch 2 \d|not timed; nothing is converted)", run.out), run.out
