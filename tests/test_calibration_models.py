"""The models calibration must repair (``calibration_models``) do break the plain rewrite.

Each model is checked two ways: float32 is well-behaved (finite outputs below 10 on the
calibration and the held-out inputs), and the plain float16 rewrite — ``amp-rewrite
convert --target float16``, op lists only — is not, on held-out inputs, by the model's
own mechanism: non-finite outputs where a value overflows, finite outputs over the
tolerance where values lose their precision. The errors are measured here (max |new −
old| / max |old|) and the CLI's verdict (its default metric, p99-rel) must agree.
"""
from __future__ import annotations

import contextlib
import io
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf

from amp_rewrite import cli

import calibration_models
from calibration_models import HELD_OUT_SEED, MODEL_NAMES, inputs, save_inputs, save_model
from conftest import TARGET_TO_TOLERANCE

COUNT = 8               # inputs per batch, as tools/calibration_models_report.py uses
FLOAT32_OUTPUT_BOUND = 10.0  # every model ends in a normalization: its outputs are O(1)
OVERFLOWING = ("overflow_mlp", "overflow_cnn", "residual_sum")
LOSING_PRECISION = ("small_magnitude",)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("calibration-models")


@pytest.fixture(scope="module")
def saved(workspace: Path) -> dict[str, Path]:
    return {name: save_model(name, workspace / name) for name in MODEL_NAMES}


def serve(path: Path, feed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    function = tf.saved_model.load(str(path)).signatures["serving_default"]
    return {name: value.numpy() for name, value in function(**{k: tf.constant(v) for k, v in feed.items()}).items()}


def relative_error(old: np.ndarray, new: np.ndarray) -> float:
    old, new = old.astype(np.float64), new.astype(np.float64)
    return float(np.max(np.abs(new - old)) / np.max(np.abs(old)))


def convert_float16(source: Path, destination: Path, npz: Path) -> tuple[int, str]:
    """``amp-rewrite convert SRC DST --target float16 --inputs NPZ --validate 1 --keep-failed``, in-process."""
    out = io.StringIO()
    args = ["convert", source, destination, "--target", "float16", "--inputs", npz, "--validate", 1, "--keep-failed"]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main([str(a) for a in args])
    return code, out.getvalue()


def test_the_mechanisms_cover_every_model() -> None:
    assert sorted(OVERFLOWING + LOSING_PRECISION) == sorted(MODEL_NAMES)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_inputs_are_seeded_batches_of_the_signature_inputs(name: str, saved: dict[str, Path]) -> None:
    """Same seed, same batch; seed 0 (calibration) and seed 1 (held out) differ; the names
    and shapes are the signature's."""
    first, again, held_out = inputs(name, 3, 0), inputs(name, 3, 0), inputs(name, 3, HELD_OUT_SEED)
    signature = tf.saved_model.load(str(saved[name])).signatures["serving_default"]
    specs = signature.structured_input_signature[1]
    assert sorted(first) == sorted(specs)
    for key, array in first.items():
        assert array.dtype == np.float32 and array.shape[0] == 3
        assert specs[key].shape.is_compatible_with(array.shape)
        np.testing.assert_array_equal(array, again[key])
        assert not np.array_equal(array, held_out[key])


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_float32_outputs_are_finite_and_small(name: str, saved: dict[str, Path]) -> None:
    for seed in (calibration_models.CALIBRATION_SEED, HELD_OUT_SEED):
        for output, value in serve(saved[name], inputs(name, COUNT, seed)).items():
            assert np.all(np.isfinite(value)), f"{name} seed {seed}: {output} is not finite in float32"
            assert np.max(np.abs(value)) < FLOAT32_OUTPUT_BOUND, f"{name} seed {seed}: {output} max {np.abs(value).max()}"


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_plain_float16_rewrite_fails_on_held_out_inputs(name: str, saved: dict[str, Path], workspace: Path) -> None:
    """Overflow models give non-finite outputs; the small-magnitude model stays finite and
    exceeds the float16 tolerance. The CLI's validation fails every output too."""
    npz = save_inputs(name, COUNT, HELD_OUT_SEED, workspace / f"{name}-held-out.npz")
    destination = workspace / f"{name}-float16"
    code, out = convert_float16(saved[name], destination, npz)
    feed = inputs(name, COUNT, HELD_OUT_SEED)
    old, new = serve(saved[name], feed), serve(destination, feed)
    for output in old:
        finite = bool(np.all(np.isfinite(new[output])))
        if name in OVERFLOWING:
            assert not finite, f"{name}: float16 {output} is finite (error {relative_error(old[output], new[output]):.3g})"
        else:
            assert finite, f"{name}: float16 {output} is not finite; expected precision loss, not overflow"
            error = relative_error(old[output], new[output])
            assert error > TARGET_TO_TOLERANCE["float16"], f"{name}: float16 {output} error {error:.3g} is in tolerance"
    assert code == 1, f"{name}: the CLI's validation passed: {out}"
    assert all(any(l.split()[:2] == ["FAIL", f"{sig}/{output}:"] for l in out.splitlines())
               for sig in ("serving_default",) for output in old), out


MATMUL_OPS = ("MatMul", "BatchMatMulV2", "Conv2D", "Einsum")


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_calibrated_float16_rewrite_is_finite_and_in_tolerance_on_held_out_inputs(
        name: str, saved: dict[str, Path], workspace: Path) -> None:
    """``convert --calibrate CALIB.npz --inputs HELD_OUT.npz``: calibrated on seed 0, every
    output finite and within tolerance on seed 1 (checked here and by the CLI), in at most
    5 validation runs; most MatMul/Conv stay converted (the remedy of keeping each
    affected layer wholly float32 would keep at least one per model)."""
    from amp_rewrite.calibration import calibrate

    calibration = save_inputs(name, COUNT, calibration_models.CALIBRATION_SEED, workspace / f"{name}-calib.npz")
    held_out = save_inputs(name, COUNT, HELD_OUT_SEED, workspace / f"{name}-held.npz")
    destination = workspace / f"{name}-calibrated"
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = cli.main([str(a) for a in ["convert", saved[name], destination, "--calibrate", calibration,
                                          "--inputs", held_out]])
    assert code == 0, out.getvalue()
    runs = [line for line in out.getvalue().splitlines() if line.startswith("calibration: validation run")]
    assert 1 <= len(runs) <= 5, out.getvalue()
    feed = inputs(name, COUNT, HELD_OUT_SEED)
    old, new = serve(saved[name], feed), serve(destination, feed)
    for output in old:
        assert np.all(np.isfinite(new[output])), f"{name}: {output} not finite after calibration"
        assert relative_error(old[output], new[output]) <= TARGET_TO_TOLERANCE["float16"]
    result = calibrate.calibrate(saved[name], calibration)
    matmuls = {(d.function, d.node) for d in result.result.report.decisions if d.op in MATMUL_OPS}
    converted = calibrate.converted_nodes(result.result) & matmuls
    print(f"{name}: {len(result.keep)} node(s) kept float32 by calibration ({result.range_kept} by range rules);"
          f" {len(converted)} of {len(matmuls)} MatMul/Conv still float16; {result.validation_runs} validation run(s)")
    assert converted, f"{name}: calibration kept every MatMul/Conv float32"
