"""Calibration (``amp_rewrite.calibration.statistics`` and ``amp_rewrite.calibration.calibrate``):

1. the statistics of one instrumented run equal NumPy's on the same tensors, in the main
   graph, in a called function's body and across a loop's iterations;
2. range rules keep float32 the converted nodes that read or write a tensor over the
   format's limit or mostly below the smallest normal, and nothing else; tensors between
   the safe magnitude and the limit are tried, and kept only if the validation run needs it;
3. repair by validation finds an overflow the range rules were told not to see, within
   the cap on runs, and says so when the cap is reached; it is monotonic (a worse run's
   decisions never stand);
4. the overlay reproduces the calibrated rewrite byte for byte without data, and names a
   traced function by its stable name;
5. the CLI: ``convert --calibrate`` and ``calibrate --out``, and bad input (exit 2, one line);
6. a model without a numeric output has "nothing to compare", never "ok"; a run the loaded
   session cannot take in is loaded afresh and said, and no other error is hidden; a TF1
   while loop's tensors are left unmeasured and the rest calibrates; the caller's code
   between runs stays eager.
"""
from __future__ import annotations

import logging
import math
import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml
from tensorflow.core.framework import graph_pb2

import amp_rewrite
from amp_rewrite.calibration import calibrate, statistics, validate
from amp_rewrite.calibration.savedmodel import Model, graph_sinks, read_model
from amp_rewrite.core.lists import load_lists
from amp_rewrite.core.program import program_of
from amp_rewrite.core.target import lookup_target

from conftest import NEEDS_FLOAT8
from test_cli import assert_ok, error_line, run_cli

TINY = float(np.finfo(np.float16).tiny)
WIDTH = 64


def _weights(seed: int, shape: tuple[int, ...], scale: float) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def mlp_graph_def(scale: float = 1.0) -> graph_pb2.GraphDef:
    """x → MatMul(w1) → Relu → MatMul(w2) → Mean: a frozen two-layer MLP; inputs × ``scale``
    set how large the first MatMul's outputs get."""
    w1, w2 = _weights(1, (WIDTH, 128), 1.0), _weights(2, (128, 8), 0.1)

    @tf.function
    def mlp(x: tf.Tensor) -> tf.Tensor:
        hidden = tf.nn.relu(tf.matmul(x * scale, w1, name="matmul1"), name="relu1")
        return tf.matmul(hidden, w2, name="matmul2")

    return mlp.get_concrete_function(tf.TensorSpec([None, WIDTH], tf.float32)).graph.as_graph_def()


def inputs(seed: int, rows: int = 16) -> dict[str, np.ndarray]:
    return {"x": _weights(100 + seed, (rows, WIDTH), 1.0)}


def _graph_model(graph_def: graph_pb2.GraphDef) -> Model:
    return Model(Path("<GraphDef>"), "graphdef", graph_def, graph_sinks(graph_def), (), fetches_are_sinks=True)


def _expected(value: np.ndarray) -> tuple[float, int, int, float]:
    a = np.abs(value.astype(np.float64)).ravel()
    nonzero = a[a > 0]
    return float(a.max(initial=0.0)), int(nonzero.size), int(np.count_nonzero(nonzero < TINY)), \
        float(nonzero[nonzero < TINY].sum())


def test_statistics_equal_numpy_for_every_main_graph_tensor() -> None:
    """Every float tensor of a frozen graph: largest |x|, non-zero count, small count and
    element count over two feeds equal NumPy's on the same tensors fetched directly
    (a constant's, read from its value, counts once)."""
    graph_def = mlp_graph_def()
    model = _graph_model(graph_def)
    feeds = {validate.GRAPH: [inputs(0), inputs(1, rows=3)]}
    keys = statistics.float_tensors(model.program)
    run = statistics.collect(model, model.program, feeds, keys, TINY)
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as session:
        values = {key: [session.run(f"{key[1]}:{key[2]}", {"x:0": feed["x"]}) for feed in feeds[validate.GRAPH]]
                  for key in keys}
    assert {k[1] for k in keys} >= {"x", "matmul1", "relu1", "matmul2"}
    constants = {n.name for n in graph_def.node if n.op == "Const"}  # read from the graph, once
    for key in keys:
        if key[1] in constants:
            values[key] = values[key][:1]
        largest, nonzero, small, small_abs = zip(*(_expected(v) for v in values[key]))
        stats = run.stats[key]
        assert stats.max_abs == pytest.approx(max(largest), rel=1e-6), key
        assert (stats.nonzero, stats.small, stats.nonfinite) == (sum(nonzero), sum(small), 0), key
        assert stats.count == sum(v.size for v in values[key]), key
        assert stats.small_abs == pytest.approx(sum(small_abs), rel=1e-6, abs=1e-30), key
        assert stats.rms == pytest.approx(math.sqrt(sum(float(np.square(v.astype(np.float64)).sum())
                                                        for v in values[key]) / stats.count), rel=1e-6), key


def test_statistics_reach_function_bodies_and_every_loop_iteration() -> None:
    """A called function's tensors and a While body's: the body's MatMul doubles its
    input three times, so its largest |x| is 8 × the input's, seen only on the last iteration."""
    @tf.function
    def tripled(v: tf.Tensor) -> tf.Tensor:
        return tf.multiply(v, 3.0, name="tripled")

    @tf.function
    def model(x: tf.Tensor) -> tf.Tensor:
        _, y = tf.while_loop(lambda i, y: i < 3, lambda i, y: (i + 1, tf.matmul(y, 2.0 * tf.eye(4), name="doubled")),
                             [0, x])
        return tripled(y)

    graph_def = model.get_concrete_function(tf.TensorSpec([2, 4], tf.float32)).graph.as_graph_def()
    x = np.arange(8, dtype=np.float32).reshape(2, 4) - 3.0
    model = _graph_model(graph_def)
    keys = statistics.float_tensors(model.program)
    run = statistics.collect(model, model.program, {validate.GRAPH: [{"x": x}]}, keys, TINY)
    by_node = {(k[1]): (k, s) for k, s in run.stats.items() if k[0]}
    (doubled_key, doubled), (tripled_key, tripled_stats) = by_node["while/doubled"], by_node["tripled"]
    assert doubled_key[0] != tripled_key[0]  # two different function bodies
    assert doubled.max_abs == 8 * np.abs(x).max() and doubled.count == 3 * x.size
    assert tripled_stats.max_abs == 24 * np.abs(x).max() and tripled_stats.count == x.size


def test_a_keras_3_model_saved_in_a_module_runs_with_its_weights(tmp_path: Path) -> None:
    """A Keras 3 model saved inside a ``tf.Module`` (as a causal LM's ``generate_step`` is
    exported): its function reads each weight by a handle TensorFlow's v1 loader leaves
    empty, and the run fills it from the checkpoint: the outputs are
    ``tf.saved_model.load``'s, and the Dense layer's output has statistics."""
    import keras

    keras.utils.set_random_seed(0)
    dense = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, name="dense")])

    class Served(tf.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = dense
            self.call = tf.function(self._call, input_signature=[tf.TensorSpec([None, 4], tf.float32, name="x")])

        def _call(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"y": self.dense(x)}

    served = Served()
    tf.saved_model.save(served, str(tmp_path / "served"), signatures={"serving_default": served.call})
    model = read_model(tmp_path / "served")
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    keys = statistics.model_tensors(model)
    run = statistics.collect(model, model.program, {"serving_default": [{"x": x}]}, keys, TINY)
    expected = dense(x).numpy()
    np.testing.assert_allclose(run.outputs["serving_default"][0]["y"], expected, rtol=1e-6)
    assert np.abs(expected).max() > 0
    matmuls = [s for k, s in run.stats.items() if k.node.endswith("MatMul") and k.function]
    assert matmuls and all(s.count == expected.size for s in matmuls)


def test_large_tensors_are_bucketed_on_a_sample_and_their_largest_value_is_exact() -> None:
    """A tensor known to hold 32768 elements per batch item is bucketed on every 32nd
    element (1024 per item), while its largest |x| comes from all of them: an outlier off
    the sampled grid is still its max, a NaN off the grid still makes it non-finite, and
    its RMS is the sample's, within 2% of NumPy's over every element."""
    @tf.function
    def double(x: tf.Tensor) -> tf.Tensor:
        return tf.reduce_sum(tf.multiply(x, 2.0, name="double"), axis=[1, 2], name="total")

    graph_def = double.get_concrete_function(tf.TensorSpec([None, 64, 512])).graph.as_graph_def(add_shapes=True)
    assert statistics.sampling_stride([-1, 64, 512]) == 32 and statistics.sampling_stride([-1, 8, 8]) == 1
    x = np.random.default_rng(0).standard_normal((4, 64, 512)).astype(np.float32)
    x[1, 7, 300] = 10.0  # flat index 36140: 36140 % 32 == 12, off the sampled grid
    key = ("", "double", 0)
    model = _graph_model(graph_def)
    stats = statistics.collect(model, model.program, {validate.GRAPH: [{"x": x}]}, [key], TINY).stats[key]
    assert stats.max_abs == 20.0 and stats.nonfinite == 0 and stats.count == x.size
    assert stats.rms == pytest.approx(float(np.sqrt(np.mean(np.square(2.0 * x.astype(np.float64))))), rel=0.02)
    x[2, 3, 5] = np.nan  # flat index 67077, off the grid too
    broken = statistics.collect(model, model.program, {validate.GRAPH: [{"x": x}]}, [key], TINY).stats[key]
    assert broken.nonfinite >= 1


def tf1_loop_graph_def() -> graph_pb2.GraphDef:
    """x → a TF1 while loop (3 × MatMul → Tanh) → MatMul: control flow v1, whose frames
    (Enter … Exit) are in the main graph."""
    w1, w2 = _weights(1, (WIDTH, WIDTH), 0.1), _weights(2, (WIDTH, 8), 0.1)
    was_v2 = tf.compat.v1.control_flow_v2_enabled()
    tf.compat.v1.disable_control_flow_v2()
    try:
        graph = tf.Graph()
        with graph.as_default():
            x = tf.compat.v1.placeholder(tf.float32, [None, WIDTH], name="x")
            _, looped = tf.compat.v1.while_loop(
                lambda i, a: i < 3, lambda i, a: (i + 1, tf.tanh(tf.matmul(a, w1, name="loop_matmul"))),
                [tf.constant(0), x])
            tf.matmul(looped, w2, name="after")
    finally:
        if was_v2:
            tf.compat.v1.enable_control_flow_v2()
    return graph.as_graph_def()


def test_tensors_in_tf1_loop_frames_are_not_measured_and_the_rest_calibrates() -> None:
    """Rule: a TF1 while loop's tensors live in its frame, which the statistics' nodes
    cannot join (TensorFlow refuses the run: "has inputs from different frames"): they are
    left unmeasured (a constant's statistics come from its value, without a run), the
    tensors outside the loop (its Exit's included) are measured, and calibration runs to
    the end."""
    graph_def = tf1_loop_graph_def()
    ops = {n.name: n.op for n in graph_def.node}
    result = amp_rewrite.calibrate(graph_def, inputs(0))
    assert result.ok and result.compared
    measured = {key[1] for key in result.stats}
    assert {"x", "after", "while/Exit_1"} <= measured
    run_in_loop = {name for name in measured if name.startswith("while/") and ops[name] not in ("Exit", "Const")}
    assert not run_in_loop and "while/loop_matmul" in ops


def test_range_rules_keep_the_overflowing_matmul_and_what_reads_it() -> None:
    """matmul1's outputs reach ~1.3e5 on inputs × 5000, over float16's 65504: it and relu1,
    which reads them, stay float32 with the measurement as reason; matmul2, fed by relu1's
    float32 output, too; only the range rule (not repair) decided, in one validation run."""
    graph_def = mlp_graph_def(scale=5000.0)
    result = amp_rewrite.calibrate(graph_def, inputs(0))
    assert set(result.keep) == {"matmul1", "relu1", "matmul2"}
    assert result.range_kept == 3 and result.validation_runs == 1 and result.ok
    assert re.fullmatch(r"calibration: output 0 reached 1\.\d\de\+05, over the format's largest value 6\.55e\+04",
                        result.keep["matmul1"])
    decisions = {d.node: d for d in result.result.report.decisions}
    assert decisions["matmul1"].rule == "keep-nodes" and not decisions["matmul1"].converted


def test_values_between_the_safe_magnitude_and_the_limit_are_tried_and_kept_only_if_validation_needs_it() -> None:
    """Inputs × 1000: matmul1 peaks at ~2.6e4, over the safe magnitude 16384 and far under
    65504: tried in float16, it stays converted (nothing kept, the plain rewrite's graph).
    Inputs × 2200: it peaks at ~5.6e4, within 1.25x of 65504 in the validation run: kept,
    with the run's measurement as reason."""
    lines: list[str] = []
    graph_def = mlp_graph_def(scale=1000.0)
    model = _graph_model(graph_def)
    feeds, _ = validate.plan_feeds(model, inputs(0), 1)
    tried = calibrate.run_calibration(model, feeds, calibrate.Options(
        target=lookup_target("float16"), lists=amp_rewrite.load_lists("float16"), say=lines.append))
    assert tried.keep == {} and tried.ok and tried.validation_runs == 1
    assert "3 node(s) over the safe magnitude 1.64e+04 are tried in float16" in "\n".join(lines)
    plain = amp_rewrite.rewrite_graph_def(graph_def, fetches=graph_sinks(graph_def))
    assert tried.result.graph_def.SerializeToString(deterministic=True) == \
        plain.graph_def.SerializeToString(deterministic=True)
    close = amp_rewrite.calibrate(mlp_graph_def(scale=2200.0), inputs(0))
    assert set(close.keep) == {"matmul1", "relu1", "matmul2"} and close.range_kept == 0 and close.ok
    assert re.fullmatch(r"calibration: output 0 reached 5\.\d\de\+04 in low precision, within 1\.25x of the"
                        r" format's largest value 6\.55e\+04 \(float32: 5\.\d\de\+04\)", close.keep["matmul1"])


def test_range_rules_keep_nothing_on_a_well_scaled_model() -> None:
    """Inputs of unit scale: every tensor is far inside float16's range; the calibrated
    rewrite equals the plain one."""
    graph_def = mlp_graph_def()
    result = amp_rewrite.calibrate(graph_def, inputs(0))
    plain = amp_rewrite.rewrite_graph_def(graph_def, fetches=graph_sinks(graph_def))
    assert result.keep == {} and result.ok
    assert result.result.graph_def.SerializeToString(deterministic=True) == \
        plain.graph_def.SerializeToString(deterministic=True)


def test_small_share_rule_keeps_a_matmul_whose_inputs_are_subnormal_in_float16() -> None:
    """Inputs × 1e-6: all of matmul1's inputs are below float16's smallest normal (6.1e-5),
    so it stays float32 by the small-share rule; bfloat16 (float32's exponent range) keeps nothing."""
    graph_def = mlp_graph_def(scale=1e-6)
    result = amp_rewrite.calibrate(graph_def, inputs(0))
    assert "matmul1" in result.keep
    assert "has 100% of its magnitude in values below the smallest normal 6.1e-05 (100% of its non-zero values)" \
        in result.keep["matmul1"]
    assert amp_rewrite.calibrate(graph_def, inputs(0), target="bfloat16").keep == {}


def test_repair_finds_an_overflow_the_range_rules_were_told_not_to_see() -> None:
    """With the safe magnitude at infinity, inputs × 5000 overflow matmul1 in float16: the
    first validation run fails, repair blames the node whose own output turned non-finite,
    and the outputs end within tolerance in at most 5 runs."""
    graph_def = mlp_graph_def(scale=5000.0)
    thresholds = calibrate.Thresholds(math.inf, TINY)
    result = amp_rewrite.calibrate(graph_def, inputs(0), thresholds=thresholds)
    assert result.ok and 2 <= result.validation_runs <= 5 and result.range_kept == 0
    assert "matmul1" in result.keep and "turned non-finite in float16" in result.keep["matmul1"]
    assert not result.rounds[0].checks[0].within(lookup_target("float16").tolerance)  # the plain rewrite failed


def test_the_cap_on_runs_is_reported() -> None:
    """One run allowed and the range rules blind: calibration stops over tolerance and says why."""
    graph_def = mlp_graph_def(scale=5000.0)
    lines: list[str] = []
    model = _graph_model(graph_def)
    feeds, _ = validate.plan_feeds(model, inputs(0), 1)
    result = calibrate.run_calibration(model, feeds, calibrate.Options(
        target=lookup_target("float16"), lists=amp_rewrite.load_lists("float16"), max_rounds=1,
        thresholds=calibrate.Thresholds(math.inf, TINY), say=lines.append))
    assert not result.ok and result.validation_runs == 1
    assert "the cap of 1 validation run(s) (--max-rounds) was reached" in lines[-1]


def test_repair_is_monotonic_a_worse_run_never_stands() -> None:
    """Rule: the result is the best run's decisions. A metric that reports 0.03, then 0.05,
    then 0.06 (each repair round worse than the first): run 1's decisions stand (nothing
    kept, the plain rewrite), each later run says so, and repair stops after two runs in
    a row no better."""
    errors = iter([0.03, 0.05, 0.06, 0.07, 0.08])

    def scripted(reference: np.ndarray, candidate: np.ndarray) -> float:
        return next(errors)

    graph_def = mlp_graph_def()
    model = _graph_model(graph_def)
    feeds, _ = validate.plan_feeds(model, inputs(0), 1)
    lines: list[str] = []
    lists = amp_rewrite.load_lists("float16")
    result = calibrate.run_calibration(model, feeds, calibrate.Options(
        target=lookup_target("float16"), lists=lists, metric=scripted, say=lines.append))
    runs = [line for line in lines if line.startswith("calibration: validation run")]
    assert len(runs) == 3 and "keeping" in runs[0], "\n".join(lines)
    assert all("(no better than run 1: its decisions stand)" in line for line in runs[1:]), "\n".join(runs)
    assert "2 run(s) in a row no better: repair stops" in runs[2]
    assert result.best == 0 and result.kept == {} and result.keep == {} and not result.ok
    plain = calibrate.rewrite_model(model, target="float16", lists=lists)
    assert result.result.graph_def.SerializeToString(deterministic=True) == \
        plain.graph_def.SerializeToString(deterministic=True)


def test_overlay_reproduces_the_calibrated_rewrite_without_data(tmp_path: Path) -> None:
    """The overlay's keep_nodes, loaded as lists, give the calibrated GraphDef byte for byte;
    each entry carries its measurement."""
    graph_def = mlp_graph_def(scale=5000.0)
    result = amp_rewrite.calibrate(graph_def, inputs(0))
    overlay = tmp_path / "keep.yaml"
    overlay.write_text(result.overlay(), encoding="utf-8")
    assert yaml.safe_load(overlay.read_text())["keep_nodes"] == dict(result.keep)
    again = amp_rewrite.rewrite_graph_def(graph_def, fetches=graph_sinks(graph_def), lists=overlay)
    assert again.graph_def.SerializeToString(deterministic=True) == \
        result.result.graph_def.SerializeToString(deterministic=True)


# --------------------------------------------------------------------------------------
# The CLI on a SavedModel whose compute is in function bodies


class Dense(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = tf.Variable(_weights(1, (WIDTH, 128), 1.0))
        self.w2 = tf.Variable(_weights(2, (128, 8), 0.1))

    @tf.function(input_signature=[tf.TensorSpec([None, WIDTH], tf.float32, name="x")])
    def __call__(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": tf.matmul(tf.nn.relu(tf.matmul(x, self.w1)), self.w2)}


def _saved(module: tf.Module, path: Path) -> Path:
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.__call__})
    return path


@pytest.fixture(scope="module")
def dense_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved(Dense(), tmp_path_factory.mktemp("calibration") / "dense")


def _npz(path: Path, scale: float, seed: int) -> Path:
    np.savez(path, x=inputs(seed)["x"] * scale)
    return path


def test_cli_convert_calibrate_is_finite_on_held_out_inputs_and_matches_calibrate_out(
        tmp_path: Path, dense_model: Path) -> None:
    """Inputs × 5000: the plain conversion fails validation on held-out inputs (non-finite);
    with --calibrate on other inputs it passes, and `calibrate --out` + `convert --lists`
    writes the same graph without data."""
    calib, held = _npz(tmp_path / "calib.npz", 5000.0, 0), _npz(tmp_path / "held.npz", 5000.0, 1)
    plain = run_cli("convert", dense_model, tmp_path / "plain", "--inputs", held)
    assert plain.code == 1 and "FAIL serving_default/y" in plain.out
    calibrated = run_cli("convert", dense_model, tmp_path / "calibrated", "--calibrate", calib, "--inputs", held,
                         "--dump", tmp_path / "dump")
    assert_ok(calibrated)
    report = (tmp_path / "dump" / "report.html").read_text(encoding="utf-8")
    assert "keep-nodes" in report and re.search(r"calibration: (output 0|input '[^']+') reached", report)
    assert "calibration: range rules keep" in calibrated.out and "ok   serving_default/y" in calibrated.out
    # The keep decisions come before the weights are stored: a kept MatMul reads its weight float32.
    assert "Weights: 2 of 2 float32 variable(s) stored as float16" in plain.out
    assert "Weights: 0 of 2 float32 variable(s) stored as float16" in calibrated.out
    assert calibrated.out.count(": read as float32 by MatMul 'MatMul") == 2
    assert_ok(run_cli("calibrate", dense_model, "--inputs", calib, "--out", tmp_path / "keep.yaml"))
    assert "keep_nodes" in (tmp_path / "keep.yaml").read_text()
    assert_ok(run_cli("convert", dense_model, tmp_path / "replayed", "--lists", tmp_path / "keep.yaml"))
    graphs = [read_model(tmp_path / name).graph_def.SerializeToString(deterministic=True)
              for name in ("calibrated", "replayed")]
    assert graphs[0] == graphs[1]
    inspected = run_cli("inspect", dense_model, "--lists", tmp_path / "keep.yaml")
    assert re.search(r"Stayed float32 \(model\): .*keep-nodes \d", inspected.out) or "keep-nodes" in inspected.out
    explained = run_cli("explain", dense_model, "MatMul", "--lists", tmp_path / "keep.yaml")
    assert "rule: keep-nodes" in explained.out and re.search(r"why: +calibration: .* reached [\d.e+]+, over", explained.out)


def test_cli_calibrate_without_data_warns_that_real_data_is_better(tmp_path: Path, dense_model: Path) -> None:
    run = run_cli("calibrate", dense_model, "--out", tmp_path / "keep.yaml")
    assert_ok(run)
    assert "calibrating on random inputs" in run.err and "real data is better" in run.err
    assert "from random inputs" in (tmp_path / "keep.yaml").read_text()


@pytest.mark.parametrize("args, expected", [
    (("--max-rounds", "11"), "--max-rounds: '11': use a whole number from 1 to 10"),
    (("--inputs", "{missing}"), "no array for input(s) of signature 'serving_default': x"),
    (("--out", "{src}/keep.yaml"), "choose a overlay file outside it"),
])
def test_cli_calibrate_bad_input_is_one_line_exit_2(
        tmp_path: Path, dense_model: Path, args: tuple[str, ...], expected: str) -> None:
    missing = tmp_path / "other.npz"
    np.savez(missing, y=np.zeros((2, WIDTH), np.float32))
    filled = [a.format(missing=missing, src=dense_model) for a in args]
    out = [] if "--out" in args else ["--out", str(tmp_path / "keep.yaml")]
    line = error_line(run_cli("calibrate", dense_model, *out, *filled))
    assert expected in line
    assert not (tmp_path / "keep.yaml").exists() and not (dense_model / "keep.yaml").exists()


def cancelling_graph_def() -> graph_pb2.GraphDef:
    """MatMul → +1000 → −1000 → MatMul: the add and subtract sit between allow ops, so the
    rewrite converts them, and bfloat16 (8-bit mantissa: steps of 8 near 1000) wipes out
    the O(1) values they carry: a precision loss no range rule sees."""
    w1, w2 = _weights(1, (WIDTH, 32), 0.2), _weights(2, (32, 4), 0.2)

    @tf.function
    def cancelling(x: tf.Tensor) -> tf.Tensor:
        hidden = tf.matmul(x, w1, name="matmul1")
        shifted = tf.subtract(tf.add(hidden, 1000.0, name="shift"), 1000.0, name="unshift")
        return tf.matmul(shifted, w2, name="matmul2")

    return cancelling.get_concrete_function(tf.TensorSpec([None, WIDTH], tf.float32)).graph.as_graph_def()


def test_repair_keeps_the_cancelling_ops_float32_for_bfloat16() -> None:
    """bfloat16: the plain rewrite's output is far over 5e-2; repair keeps the ops whose own
    output drifts (the shift and unshift, not the matmuls) and ends within tolerance on
    held-out inputs too."""
    graph_def = cancelling_graph_def()
    result = amp_rewrite.calibrate(graph_def, inputs(0), target="bfloat16")
    assert not result.rounds[0].checks[0].within(lookup_target("bfloat16").tolerance)
    assert result.ok and result.range_kept == 0 and 2 <= result.validation_runs <= 5
    assert "unshift" in result.keep and "drifted" in result.keep["unshift"]
    assert "matmul1" not in result.keep and "matmul2" not in result.keep
    held_out = inputs(1)
    plain = amp_rewrite.rewrite_graph_def(graph_def, target="bfloat16", fetches=graph_sinks(graph_def))
    errors = {}
    for name, rewritten in (("plain", plain.graph_def), ("calibrated", result.result.graph_def)):
        outputs = []
        for graph in (graph_def, rewritten):
            with tf.Graph().as_default() as g:
                tf.graph_util.import_graph_def(graph, name="")
            with tf.compat.v1.Session(graph=g) as session:
                outputs.append(session.run("matmul2:0", {"x:0": held_out["x"]}).astype(np.float64))
        errors[name] = np.abs(outputs[1] - outputs[0]).max() / np.abs(outputs[0]).max()
    assert errors["plain"] > 5e-2 >= errors["calibrated"], errors


def test_cli_random_calibration_inputs_the_model_rejects_ask_for_real_ones(tmp_path: Path) -> None:
    """A gather whose indices random ids (0-9, as no shape in the graph bounds them: the
    gathered width is the batch's) overrun: exit 2 naming the signature and the random inputs, and how to
    pass real ones; nothing written."""
    class Gather(tf.Module):
        @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32), tf.TensorSpec([None], tf.int32)])
        def pick(self, x: tf.Tensor, ids: tf.Tensor) -> dict[str, tf.Tensor]:
            return {"out": tf.gather(tf.matmul(x, x, transpose_b=True), ids, axis=1)}  # batch × batch

    module = Gather()
    tf.saved_model.save(module, str(tmp_path / "gather"), signatures={"pick": module.pick})
    run = run_cli("calibrate", tmp_path / "gather", "--out", tmp_path / "keep.yaml")
    assert run.code == 2 and "Traceback" not in run.err
    line = run.err.strip().splitlines()[-1]
    assert line.startswith("amp-rewrite: error: ") and "signature 'pick': the model fails on random inputs" in line
    assert line.endswith("pass real ones: --calibrate DATA.npz (convert) or --inputs DATA.npz (calibrate)")
    assert not (tmp_path / "keep.yaml").exists()


def test_an_overlay_names_a_traced_function_by_its_stable_name() -> None:
    """Rule: ``FUNCTION::node`` with a traced function's stable name (TensorFlow's counter
    dropped) keeps that node whatever counter this trace got, and nothing in another
    function; calibration writes the stable name where a node name is in several functions."""
    w = _weights(1, (WIDTH, WIDTH), 1.0)

    @tf.function
    def inner(x: tf.Tensor) -> tf.Tensor:
        return tf.matmul(x, w, name="matmul")

    @tf.function
    def other(x: tf.Tensor) -> tf.Tensor:
        return tf.matmul(x, w, name="matmul")

    @tf.function
    def outer(x: tf.Tensor) -> tf.Tensor:
        return tf.nn.relu(inner(x)) + other(x)

    graph_def = outer.get_concrete_function(tf.TensorSpec([None, WIDTH], tf.float32)).graph.as_graph_def()
    traced = {f.signature.name.split("_")[3]: f.signature.name for f in graph_def.library.function}
    assert re.fullmatch(r"__inference_inner_\d+", traced["inner"]), traced
    lists = amp_rewrite.load_lists("float16").keeping({"__inference_inner::matmul": ""})
    assert lists.unmatched_keep_nodes(graph_def) == []
    decisions = amp_rewrite.rewrite_graph_def(graph_def, lists=lists).report.decisions
    kept = {(d.function, d.node) for d in decisions if d.rule == "keep-nodes"}
    assert kept == {(traced["inner"], "matmul")}, kept
    where = calibrate.node_items(program_of(graph_def))
    assert calibrate.keep_entries({(traced["inner"], "matmul"): ""}, where) == {"__inference_inner::matmul": ""}


def test_overlay_works_in_the_live_rewrite_without_data(tmp_path: Path) -> None:
    """The overlay calibration writes for a tf.function's graph keeps the live rewrite of
    that function finite too: plain node names match the live trace's nodes."""
    w1, w2 = _weights(1, (WIDTH, 128), 1.0), _weights(2, (128, 8), 0.1)

    def mlp(x: tf.Tensor) -> tf.Tensor:
        hidden = tf.nn.relu(tf.matmul(x, w1, name="matmul1"), name="relu1")
        return tf.matmul(hidden, w2, name="matmul2")

    spec = tf.TensorSpec([None, WIDTH], tf.float32)
    graph_def = tf.function(mlp).get_concrete_function(spec).graph.as_graph_def()
    x = inputs(0)["x"] * 5000.0
    overlay = tmp_path / "keep.yaml"
    overlay.write_text(amp_rewrite.calibrate(graph_def, {"x": x}).overlay(), encoding="utf-8")
    expected = mlp(tf.constant(x)).numpy()
    outputs = {}
    for name, lists in (("plain", None), ("overlay", overlay)):
        with amp_rewrite.mixed_precision("float16", lists=lists):
            outputs[name] = tf.function(mlp)(tf.constant(x)).numpy()  # a new trace, rewritten live
    assert not np.all(np.isfinite(outputs["plain"]))
    assert np.all(np.isfinite(outputs["overlay"]))
    assert np.abs(outputs["overlay"] - expected).max() <= 1e-2 * np.abs(expected).max()


# --------------------------------------------------------------------------------------
# Nothing to compare; what the loaded session cannot take in


class Text(tf.Module):
    """A dense layer whose only output is its values as strings."""

    def __init__(self) -> None:
        super().__init__()
        self.w = tf.Variable(_weights(1, (WIDTH, 8), 0.1))

    @tf.function(input_signature=[tf.TensorSpec([None, WIDTH], tf.float32, name="x")])
    def __call__(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"text": tf.strings.as_string(tf.matmul(x, self.w))}


@pytest.fixture(scope="module")
def text_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _saved(Text(), tmp_path_factory.mktemp("calibration") / "text")


@pytest.mark.parametrize("target", ["float16", pytest.param("float8", marks=NEEDS_FLOAT8)])
def test_a_model_without_a_numeric_output_has_nothing_to_compare(text_model: Path, dense_model: Path,
                                                                 target: str) -> None:
    """Rule: with no output that is a number, no run can check the rewrite: calibration
    says "nothing to compare" and is neither ok nor over tolerance (``compared`` False,
    its run's score NaN); a model with a numeric output is compared and ok."""
    lines: list[str] = []
    model = read_model(text_model)
    feeds, _ = validate.plan_feeds(model, inputs(0), 1)
    found = calibrate.run_calibration(model, feeds, calibrate.Options(
        target=lookup_target(target, quantized=True), lists=load_lists("float16"), say=lines.append))
    assert not found.compared and not found.ok and not found.reached_goal, "\n".join(lines)
    assert math.isnan(found.rounds[found.best].score(1.0))
    assert "calibration: validation run 1: nothing to compare (no output of the model is a number)" in lines
    assert not any("tolerance" in line or "goal" in line for line in lines), "\n".join(lines)
    numeric = amp_rewrite.calibrate(dense_model, inputs(0), target=target)
    assert numeric.compared and numeric.ok


def test_cli_nothing_to_compare_is_a_warning_and_the_result_is_written(tmp_path: Path, text_model: Path) -> None:
    """Rule: ``calibrate`` and ``convert --calibrate`` on a model without a numeric output
    warn that calibration had nothing to compare, and write their result (exit 0): the
    range rules' decisions stand, no output failed."""
    data = _npz(tmp_path / "calib.npz", 1.0, 0)
    overlay = tmp_path / "keep.yaml"
    calibrated = run_cli("calibrate", text_model, "--inputs", data, "--out", overlay)
    assert_ok(calibrated)
    warning = "warning: calibration had nothing to compare: no output of"
    assert warning in calibrated.err and overlay.exists(), calibrated.err
    converted = run_cli("convert", text_model, tmp_path / "converted", "--calibrate", data)
    assert_ok(converted)
    assert warning in converted.err and (tmp_path / "converted" / "saved_model.pb").exists()
    assert "over tolerance" not in converted.err + converted.out


def _collect_twice(model: Model, feeds: validate.Feeds) -> dict[statistics.TensorKey, statistics.TensorStats]:
    keys = statistics.float_tensors(model.program)
    with statistics.Runner(model, feeds) as runner:
        runner.collect(model.program, keys, TINY)
        return runner.collect(model.program, keys, TINY).stats  # added to the loaded session, where it can be


def test_a_run_the_session_cannot_take_in_is_loaded_afresh_and_said(monkeypatch: pytest.MonkeyPatch,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    """Rule: when a later run cannot be added to the loaded session (``import_graph_def``'s
    ValueError, a graph lookup's KeyError), the model is loaded afresh for it, a warning
    says why, and its statistics are the same; any other error is not hidden."""
    graph_def = mlp_graph_def()
    model, feeds = _graph_model(graph_def), {validate.GRAPH: [inputs(0)]}
    expected = _collect_twice(model, feeds)

    def refuse(*args: object) -> None:
        raise ValueError("Node 'x' is refused")

    monkeypatch.setattr(statistics, "_add", refuse)
    with caplog.at_level(logging.WARNING, logger=statistics.__name__):
        assert _collect_twice(model, feeds) == expected
    assert "calibration: run 2 cannot be added to the loaded session (Node 'x' is refused); the model is loaded" \
           " afresh for it" in caplog.text

    def broken(*args: object) -> None:
        raise TypeError("a bug")

    monkeypatch.setattr(statistics, "_add", broken)
    with pytest.raises(TypeError, match="a bug"):
        _collect_twice(model, feeds)


def test_the_caller_stays_eager_between_runs() -> None:
    """Rule: the session a calibration runs in is not made the default, nor its graph: the
    caller's code between runs (``say``, here) runs as eagerly as it was called."""
    eager: list[bool] = []
    model = _graph_model(mlp_graph_def(scale=5000.0))
    calibrate.run_calibration(model, {validate.GRAPH: [inputs(0)]}, calibrate.Options(
        target=lookup_target("float16"), lists=load_lists("float16"),
        say=lambda line: eager.append(tf.executing_eagerly())))
    assert len(eager) >= 3 and all(eager), eager
