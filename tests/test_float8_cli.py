"""``amp-rewrite --target float8`` end to end on a Keras MLP written with ``model.export``
(weights in variables, as a SavedModel holds them): calibration gives each matmul input's
amax, the float8 rewrite is validated on the calibration inputs, a matmul whose FP8 error is
too large stays float16, and the overlay ``calibrate`` writes reproduces the result without data.

The MLP's first Dense ignores input feature 0 (its kernel row is zero). The ``outlier``
data put 1e4 there and N(0, 0.01) elsewhere: per-tensor E4M3 scaling of that input (scale
2**-5) flushes every other value to zero, so FP8 loses the whole first layer, though
float16 holds it (1e4 is within its range, and times zero it is zero).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
import yaml

from amp_rewrite.core.target import FLOAT8

from test_cli import error_line, run_cli

from conftest import NEEDS_FLOAT8

pytestmark = NEEDS_FLOAT8

# The model is named: its scope is the same whichever models the process built before.
FIRST, SECOND = "mlp_1/dense_a_1/MatMul", "mlp_1/dense_b_1/MatMul"
XLA_MUST_COMPILE = "_XlaMustCompile"


def _export_mlp(path: Path) -> None:
    """Dense 32→64 (ReLU) → Dense 64→64 (ReLU) → Dense 64→8, feature 0 ignored."""
    import keras

    keras.utils.set_random_seed(0)
    x = keras.Input((32,), name="x")
    first = keras.layers.Dense(64, activation="relu", name="dense_a")
    h = keras.layers.Dense(64, activation="relu", name="dense_b")(first(x))
    model = keras.Model(x, keras.layers.Dense(8, name="logits")(h), name="mlp")
    kernel = first.kernel.numpy()
    kernel[0] = 0.0
    first.kernel.assign(kernel)
    model.export(str(path), verbose=False)


def _inputs(seed: int, *, outlier: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if not outlier:
        return rng.standard_normal((64, 32)).astype(np.float32)
    x = rng.normal(0.0, 0.01, (64, 32)).astype(np.float32)
    x[:, 0] = 1e4
    return x


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("float8_cli")
    _export_mlp(root / "mlp")
    found = {"mlp": root / "mlp", "root": root}
    for name, seed, outlier in (("calib", 0, False), ("heldout", 1, False), ("outlier_calib", 2, True),
                                ("outlier_heldout", 3, True)):
        found[name] = root / f"{name}.npz"
        np.savez(found[name], x=_inputs(seed, outlier=outlier))
    return found


@pytest.fixture(scope="module")
def converted(files: dict[str, Path]):
    """convert --target float8 --calibrate calib.npz --inputs heldout.npz --dump DIR."""
    out, dump = files["root"] / "mlp_fp8", files["root"] / "dump"
    run = run_cli("convert", files["mlp"], out, "--target", "float8", "--calibrate", files["calib"],
                  "--inputs", files["heldout"], "--dump", dump)
    return run, out, dump


@pytest.fixture(scope="module")
def overlay(files: dict[str, Path]) -> Path:
    """calibrate --target float8 on the same data as ``converted``."""
    path = files["root"] / "fp8.yaml"
    run = run_cli("calibrate", files["mlp"], "--target", "float8", "--inputs", files["calib"], "--out", path)
    assert run.code == 0, run.err
    return path


def _relative_error(new: np.ndarray, old: np.ndarray) -> float:
    return float(np.max(np.abs(new - old)) / np.max(np.abs(old)))


def _outputs(model_dir: Path, x: np.ndarray) -> np.ndarray:
    return tf.saved_model.load(str(model_dir)).signatures["serving_default"](x=tf.constant(x))["output_0"].numpy()


def test_convert_calibrates_quantizes_and_writes_a_model_within_float8_tolerance(files, converted):
    """Rule: every matmul of the MLP is float8; the written SavedModel's function holding them
    is marked for XLA, and on held-out inputs its outputs are within FLOAT8.tolerance of
    float32's, with FP8's error (far above float16's) actually there."""
    run, out, _ = converted
    assert run.code == 0, run.err
    assert re.search(r"calibration: float8 validation run 1: 3 matmul\(s\) on float8; worst serve\w*/output_0 p99-rel"
                     r" [\d.e-]+ \(within the goal; goal 0.05, tolerance 0.1\)", run.out), run.out
    assert "3 matmul(s) on float8_e4m3fn operands, 0 kept float16 as too lossy" in run.out
    assert "ok   serving_default/output_0" in run.out
    loaded = tf.saved_model.load(str(out))
    marked = [f for f in loaded.signatures["serving_default"].graph.as_graph_def().library.function
              if f.attr[XLA_MUST_COMPILE].b]
    assert any(n.op == "Cast" and n.attr["DstT"].type == tf.dtypes.experimental.float8_e4m3fn.as_datatype_enum
               for f in marked for n in f.node_def)
    x = np.load(files["heldout"])["x"]
    error = _relative_error(_outputs(out, x), _outputs(files["mlp"], x))
    print(f"float8 MLP, held-out: max relative error {error:.4f}")
    assert 5e-3 < error <= FLOAT8.tolerance


def test_explain_and_the_report_show_amax_and_scale(files, converted, overlay):
    """Rule: explain and report.html give a float8 matmul's rule and each operand's amax and scale."""
    run = run_cli("explain", files["mlp"], SECOND, "--target", "float8", "--lists", overlay)
    assert run.code == 0, run.err
    assert "attribute T: float32 -> float16" in run.out and "rule: float8-matmul" in run.out
    assert "mlp_1/dense_a_1/Relu:0 (activation) amax" in run.out and " scale 128;" in run.out
    page = (converted[2] / "report.html").read_text(encoding="utf-8")
    assert page.count("float8_e4m3fn operands: ") == 3 and "(activation) amax" in page
    assert "matmul whose operands are quantized to float8_e4m3fn with per-tensor scales" in page


def test_the_overlay_reproduces_the_calibrated_graph_without_data(files, converted, overlay):
    """Rule: convert --target float8 --lists OVERLAY writes the same GraphDef, byte for byte,
    as convert --calibrate on the data the overlay came from."""
    data = yaml.safe_load(overlay.read_text(encoding="utf-8"))
    assert len(data["amax"]) == 3 and data["lossy"] == {}
    out = files["root"] / "mlp_fp8_from_overlay"
    run = run_cli("convert", files["mlp"], out, "--target", "float8", "--lists", overlay)
    assert run.code == 0, run.err
    assert (out / "saved_model.pb").read_bytes() == (converted[1] / "saved_model.pb").read_bytes()


@pytest.mark.parametrize("command", ["convert", "inspect"])
def test_float8_without_calibration_is_exit_2_saying_what_to_pass(files, command: str):
    """Rule: float8 needs amax; without --calibrate or an overlay holding them it is one error line."""
    args = [files["root"] / "never"] if command == "convert" else []
    line = error_line(run_cli(command, files["mlp"], *args, "--target", "float8"))
    assert "--target float8 needs the amax of each matmul input" in line
    assert ("pass --calibrate DATA.npz" in line) == (command == "convert")
    assert "--lists OVERLAY.yaml written by amp-rewrite calibrate" in line
    assert not (files["root"] / "never").exists()


def test_a_matmul_fp8_loses_stays_float16_as_lossy(files):
    """Rule: the first Dense's input has an outlier that flushes the rest to zero in E4M3: its
    own FP8 error (the float8 run against a float16 copy of it, element by element) is 100% of
    its output, the worst, so it stays float16 (float8-lossy, with the error measured) and the
    others stay float8; each run prints the model's error; the result is within tolerance on
    held-out inputs, where quantizing it too fails."""
    path = files["root"] / "lossy.yaml"
    run = run_cli("calibrate", files["mlp"], "--target", "float8", "--inputs", files["outlier_calib"], "--out", path)
    assert run.code == 0, run.err
    assert re.search(r"calibration: float8 validation run 1: 3 matmul\(s\) on float8; worst \S+ p99-rel 0\.\d+"
                     r" \(over tolerance; goal 0.05, tolerance 0.1\); own FP8 error of each, of its output's RMS: 1"
                     rf" \(worst, {FIRST}\) to [\d.e-]+; keeping the 1 worst float16", run.out), run.out
    assert re.search(r"calibration: float8 validation run 2: 2 matmul\(s\) on float8; worst \S+ p99-rel [\d.e-]+"
                     r" \(within the goal", run.out), run.out
    data = yaml.safe_load(path.read_text(encoding="utf-8"))
    ((entry, why),) = data["lossy"].items()
    assert entry == FIRST and why.startswith("calibration: own float8 error 1 of its output's RMS")

    explained = run_cli("explain", files["mlp"], FIRST, "--target", "float8", "--lists", path)
    assert "rule: float8-lossy" in explained.out and "stays float16: calibration: own float8 error" in explained.out
    kept = run_cli("convert", files["mlp"], files["root"] / "lossy_ok", "--target", "float8", "--lists", path,
                   "--inputs", files["outlier_heldout"])
    assert kept.code == 0, kept.out + kept.err
    data["lossy"] = {}
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    quantized = run_cli("convert", files["mlp"], files["root"] / "lossy_bad", "--target", "float8", "--lists", path,
                        "--inputs", files["outlier_heldout"])
    assert quantized.code == 1 and "FAIL serving_default/output_0" in quantized.out


def test_a_frozen_graph_keeps_its_const_weight_matmuls_float16_without_a_float8_run(files):
    """Rule: a GraphDef file's weights are Consts, folded to float16 before XLA: its matmuls stay
    float16 (float8-const-operand, said per node), and no float8 validation run is spent on it."""
    from cli_models import GRAPH_FETCHES, graph_def_with_deny_path, write_graph_def

    source = write_graph_def(graph_def_with_deny_path(), files["root"] / "frozen.pb")
    fetches = [arg for fetch in GRAPH_FETCHES for arg in ("--fetch", fetch)]
    run = run_cli("convert", source, files["root"] / "frozen_fp8.pb", "--target", "float8", "--calibrate", *fetches,
                  "--dump", files["root"] / "frozen_dump")
    assert run.code == 0, run.err
    assert "calibration: float8: no matmul quantized (float8-const-operand 2); no float8 run needed" in run.out
    assert "1 validation run(s)" in run.out
    page = (files["root"] / "frozen_dump" / "report.html").read_text(encoding="utf-8")
    assert page.count("is folded into a float16 constant before XLA sees it") == 2


def test_quantized_matmuls_read_their_weights_stored_as_the_float16_the_chain_quantizes(files, converted, overlay):
    """Rule: the weights of float8 matmuls are stored as the float16 the quantize chain read
    through its cast (the in-graph amax and scale follow the stored values); the chain reads
    the variable directly, and the outputs equal the --float32-weights conversion's."""
    run, out, _ = converted
    assert run.code == 0, run.err
    dtypes = tf.train.load_checkpoint(str(out / "variables" / "variables")).get_variable_to_dtype_map()
    assert {dtype for key, dtype in dtypes.items() if key != "_CHECKPOINTABLE_OBJECT_GRAPH"} == {tf.float16}
    assert "Weights: 6 of 6 float32 variable(s) stored as float16" in run.out
    function = next(f for f in tf.saved_model.load(str(out)).signatures["serving_default"].graph.as_graph_def()
                    .library.function if f.attr[XLA_MUST_COMPILE].b)
    nodes = {node.name: node for node in function.node_def}
    chains = [node for node in function.node_def if node.name.endswith("/scaled")]
    from_variables = [nodes[node.input[0].split(":")[0]] for node in chains
                      if nodes[node.input[0].split(":")[0]].op == "ReadVariableOp"]
    assert len(from_variables) == 3 and all(read.attr["dtype"].type == tf.float16.as_datatype_enum
                                            for read in from_variables)
    float32_weights = files["root"] / "mlp_fp8_float32_weights"
    kept = run_cli("convert", files["mlp"], float32_weights, "--target", "float8", "--lists", overlay,
                   "--float32-weights")
    assert kept.code == 0, kept.err
    x = np.load(files["heldout"])["x"]
    np.testing.assert_array_equal(_outputs(out, x), _outputs(float32_weights, x))
