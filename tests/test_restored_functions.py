"""Every function a SavedModel restores is rewritten, and ``convert`` says where it did not
time a result the lists are known to make slower.

``tf.saved_model.load`` calls the object graph's functions by name (``loaded.serve``, a
module's ``@tf.function`` attributes), and no node of the main graph calls them: the
rewrite reaches them as roots (``functions.reachable_functions(roots=)``), so they compute
in the target dtype and a weight they read through a cast is stored low with the rest. A
TF1 Builder SavedModel, with no object graph, converts as before (``test_weights.py``).
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite.calibration import savedmodel
from amp_rewrite.calibration.calibrate import keep_entries, node_items
from amp_rewrite.calibration.savedmodel import effective_lists
from amp_rewrite.training import live

from test_cli import Run, assert_ok, run_cli

OBJECT_GRAPH_KEY = "_CHECKPOINTABLE_OBJECT_GRAPH"
NO_AMX = {"avx512f", "avx512_bf16"}
SPEED_LINE = "Speed: not measured: "


class _Module(tf.Module):
    """A signature (``serve``) and an attribute no signature calls (``generate``), both reading ``w`` and ``v``."""

    def __init__(self) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.w = tf.Variable(rng.normal(size=(8, 16)).astype(np.float32), name="w")
        self.v = tf.Variable(rng.normal(size=(16, 4)).astype(np.float32), name="v")

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": tf.matmul(tf.nn.relu(tf.matmul(x, self.w)), self.v)}

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32)])
    def generate(self, x: tf.Tensor) -> tf.Tensor:
        return tf.matmul(tf.matmul(x, self.w), self.v) * 2.0


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The module saved with one signature, and a Keras model's ``model.export`` (``serve``)."""
    import keras

    root = tmp_path_factory.mktemp("restored")
    module = _Module()
    tf.saved_model.save(module, str(root / "module"), signatures={"serving_default": module.serve})
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, activation="relu")(inputs)
    keras.Model(inputs, keras.layers.Dense(4)(hidden)).export(str(root / "keras"), verbose=False)
    return {"module": root / "module", "keras": root / "keras"}


def _feed() -> np.ndarray:
    return np.random.default_rng(1).normal(size=(5, 8)).astype(np.float32)


def _matmul_dtypes(function: tf.types.experimental.ConcreteFunction) -> list[str]:
    """The dtype of each MatMul in a restored function's own graph."""
    return [op.outputs[0].dtype.name for op in function.graph.get_operations() if op.type == "MatMul"]


def _relative_error(ours: np.ndarray, reference: np.ndarray) -> float:
    return float(np.max(np.abs(ours - reference)) / np.max(np.abs(reference)))


def _checkpoint_dtypes(saved_model: Path) -> dict[str, str]:
    """Each variable's dtype in the checkpoint (the object graph's own entry left out)."""
    reader = tf.train.load_checkpoint(str(saved_model / "variables" / "variables"))
    return {key: dtype.name for key, dtype in reader.get_variable_to_dtype_map().items() if key != OBJECT_GRAPH_KEY}


def test_an_attribute_no_signature_calls_runs_converted_and_its_weights_are_stored_low(
        sources: dict[str, Path], tmp_path: Path) -> None:
    """Rule: ``generate``, a ``@tf.function`` attribute that only the object graph calls, is
    rewritten as the signature is: its matmuls compute in bfloat16, its outputs stay float32
    and close to the source's, and ``w`` and ``v``, read through casts by both functions, are
    stored as bfloat16 (before, the attribute read them float32, so both stayed float32)."""
    out = tmp_path / "out"
    run = run_cli("convert", sources["module"], out, "--target", "bfloat16")
    assert_ok(run)
    assert "Weights: 2 of 2 float32 variable(s) stored as bfloat16" in run.out, run.out
    source, converted = tf.saved_model.load(str(sources["module"])), tf.saved_model.load(str(out))
    (generate,) = converted.generate.concrete_functions
    assert _matmul_dtypes(generate) == ["bfloat16", "bfloat16"]
    x = _feed()
    ours, reference = converted.generate(x), source.generate(x).numpy()
    assert ours.dtype == tf.float32 and _relative_error(ours.numpy(), reference) < 0.05
    served = converted.signatures["serving_default"](x=tf.constant(x))["y"].numpy()
    assert _relative_error(served, source.serve(x)["y"].numpy()) < 0.05
    assert _checkpoint_dtypes(out) == {"w/.ATTRIBUTES/VARIABLE_VALUE": "bfloat16",
                                       "v/.ATTRIBUTES/VARIABLE_VALUE": "bfloat16"}


def test_a_check_that_runs_the_signatures_names_what_it_does_not_run(sources: dict[str, Path], tmp_path: Path) -> None:
    """Rule: --validate runs the signatures, not ``generate``: one note names it; a Keras
    export, whose ``serve`` the signatures call, gets none, and neither does a run without checks."""
    run = run_cli("convert", sources["module"], tmp_path / "module", "--target", "bfloat16", "--validate", "1")
    assert_ok(run)
    notes = [line for line in run.out.splitlines() if "no signature calls" in line]
    assert len(notes) == 1 and re.fullmatch(
        r"Note: 1 restored function\(s\) that no signature calls \(e\.g\. __inference_generate_\d+\) are converted by"
        r" the lists alone, unchecked: --validate runs the signatures only", notes[0]), notes
    for source, args in ((sources["keras"], ("--validate", "1")), (sources["module"], ())):
        quiet = run_cli("convert", source, tmp_path / f"{source.name}_{len(args)}", "--target", "bfloat16", *args)
        assert_ok(quiet)
        assert "no signature calls" not in quiet.out, quiet.out


def test_a_keras_export_serves_converted_with_its_weights_low(sources: dict[str, Path], tmp_path: Path) -> None:
    """Rule: ``model.export``'s restored ``serve`` computes in bfloat16 and stays close to
    float32; every kernel and bias is stored as bfloat16, read so by every function."""
    out = tmp_path / "out"
    assert_ok(run_cli("convert", sources["keras"], out, "--target", "bfloat16"))
    source, converted = tf.saved_model.load(str(sources["keras"])), tf.saved_model.load(str(out))
    assert all(_matmul_dtypes(function) == ["bfloat16", "bfloat16"] for function in converted.serve.concrete_functions)
    x = _feed()
    assert _relative_error(converted.serve(x).numpy(), source.serve(x).numpy()) < 0.05
    before, after = _checkpoint_dtypes(sources["keras"]), _checkpoint_dtypes(out)
    assert set(before.values()) == {"float32"} and after == dict.fromkeys(before, "bfloat16"), after


def test_a_keep_written_for_a_signatures_node_leaves_the_restored_namesake_converted(sources: dict[str, Path]) -> None:
    """Rule: calibration and --tune write a kept node by its plain name only where every item
    the rewrite meets that name in keeps it (``keep_entries``); the restored functions are
    among those items, so a keep of ``serve``'s MatMul is scoped to ``serve`` and
    ``generate``'s MatMul of the same name stays converted."""
    model = savedmodel.read_model(sources["module"])
    where = node_items(model.program, model.entry_functions)
    serve, generate = (next(n for n in model.program.library if n.startswith(prefix))
                       for prefix in ("__inference_serve_", "__inference_generate_"))
    assert {serve, generate} <= where["MatMul"]
    entries = keep_entries({(serve, "MatMul"): "kept by a test"}, where)
    assert list(entries) == ["__inference_serve::MatMul"]
    lists = effective_lists("bfloat16").keeping(entries)
    decisions = savedmodel.rewrite_model(model, target="bfloat16", lists=lists).report.decisions
    converted = {(d.function, d.node): d.converted for d in decisions if d.attr == "T"}
    assert converted[(serve, "MatMul")] is False and converted[(generate, "MatMul")] is True


# --------------------------------------------------------------------------------------
# No silent slowdown: without --tune, where the lists are known to lose, one line says so


def _fake_gpu(monkeypatch: pytest.MonkeyPatch, present: bool) -> None:
    real = tf.config.list_physical_devices
    gpus = [tf.config.PhysicalDevice(name="/physical_device:GPU:0", device_type="GPU")] if present else []
    monkeypatch.setattr(tf.config, "list_physical_devices", lambda kind=None: gpus if kind == "GPU" else real(kind))


def _speed_lines(run: Run) -> list[str]:
    assert_ok(run)
    return [line for line in run.out.splitlines() if line.startswith("Speed:")]


def test_bfloat16_without_amx_says_speed_was_not_measured(sources: dict[str, Path], tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: ``convert --target bfloat16`` on a CPU without AMX (AVX512-BF16 alone) times
    nothing and bfloat16 is often slower there: one line says so and names --tune speed."""
    monkeypatch.setattr(live, "cpu_flags", lambda: set(NO_AMX))
    lines = _speed_lines(run_cli("convert", sources["module"], tmp_path / "out", "--target", "bfloat16"))
    assert lines == [f"{SPEED_LINE}bfloat16 on a CPU without AMX is often slower than float32; run with --tune"
                     " speed to time each converted op here and keep float32 what is slower"]


def test_bfloat16_with_amx_says_nothing_about_speed(sources: dict[str, Path], tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: with AMX the lists pay: no speed line."""
    monkeypatch.setattr(live, "cpu_flags", lambda: NO_AMX | {"amx_tile", "amx_bf16"})
    assert _speed_lines(run_cli("convert", sources["module"], tmp_path / "out", "--target", "bfloat16")) == []


def test_tune_speed_measures_so_no_line_says_it_did_not(sources: dict[str, Path], tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Rule: with --tune speed the result is timed (its own lines say how it did): no "not measured" line."""
    monkeypatch.setattr(live, "cpu_flags", lambda: set(NO_AMX))
    run = run_cli("convert", sources["module"], tmp_path / "out", "--target", "bfloat16", "--tune", "speed",
                  "--tune-budget", "2", "--tune-cache", tmp_path / "cache.json")
    assert not [line for line in _speed_lines(run) if line.startswith(SPEED_LINE)], run.out
    assert "Timing: " in run.out


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_float16_on_a_cpu_says_speed_was_not_measured(sources: dict[str, Path], tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch, gpu: bool) -> None:
    """Rule: float16 without a GPU (its kernels on a CPU are float32 ones with conversions)
    gets the line, pointing to a GPU; with one, none."""
    _fake_gpu(monkeypatch, gpu)
    lines = _speed_lines(run_cli("convert", sources["module"], tmp_path / "out", "--target", "float16"))
    assert lines == ([] if gpu else [f"{SPEED_LINE}float16 on a CPU (TensorFlow sees no GPU here) is often slower"
                                     " than float32; serve it on a GPU, and time it there with --tune speed"])
