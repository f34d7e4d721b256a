"""Ours against Keras' ``model.quantize("float8")`` on the trained models (README, "Peers").

For each model of ``tests/trained_models.py`` (weights trained on scikit-learn's digits
and diabetes): calibrate our float16, bfloat16 and float8 rewrites on the 64-sample
calibration split (``amp_rewrite.calibrate``, default metric p99-rel), then run each on
the held-out split (533 digits, 78 patients) and compare with float32: the largest and
the 99th-percentile error relative to float32's largest |output|, and top-1 (R² for
diabetes). Keras' float8 is the same Keras model after ``model.quantize("float8")``,
which quantizes Dense and EinsumDense layers (not Conv2D) with its initial scales, run
with ``model.predict``. Ours run as calibration runs them: the rewritten graph in a TF1
Session with grappler off (XLA, which float8 marks for, is not on the CPU path here).

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/compare_float8_peers.py [--models NAME,...]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tools"))
import trained_models  # noqa: E402  tests/ is not a package
from bench_pass import machine_line  # noqa: E402

from amp_rewrite.calibration import calibrate, statistics, validate  # noqa: E402
from amp_rewrite.calibration.savedmodel import read_model  # noqa: E402

MODELS = ("digits_mlp", "digits_cnn", "digits_transformer", "digits_mobilenet", "diabetes_mlp")
TARGETS = ("float16", "bfloat16", "float8")
SMOKE_MODEL = "diabetes_mlp"  # the smallest


def _score(name: str, output: np.ndarray, labels: np.ndarray) -> float:
    return trained_models.top1(output, labels) if trained_models.is_classifier(name) else trained_models.r2(output,
                                                                                                          labels)


def _errors(reference: np.ndarray, candidate: np.ndarray) -> str:
    if not np.all(np.isfinite(candidate)):
        return "non-finite | non-finite"
    return f"{validate.max_rel(reference, candidate):.3g} | {validate.p99_rel(reference, candidate):.3g}"




def measure(name: str, workdir: Path, targets: tuple[str, ...] = TARGETS) -> list[str]:
    source = trained_models.export(name, workdir / name)
    model = read_model(source)
    calibration, _ = trained_models.data(name, "calibration")
    held_out, labels = trained_models.data(name, "held_out")
    held_feeds, _ = validate.plan_feeds(model, held_out, 1)
    reference = statistics.collect(model, model.program, held_feeds, [], 0.0).outputs["serving_default"][0]
    (output,) = reference
    rows = [f"| {name} | float32 | | | {_score(name, reference[output], labels):.4f} | |"]
    for target in targets:
        started = time.perf_counter()
        result = calibrate.calibrate(source, calibration, target=target)
        seconds = time.perf_counter() - started
        ours = statistics.collect(model, result.result.program, held_feeds, [], 0.0).outputs["serving_default"][0]
        matmuls = (f"{result.result.report.float8_matmuls} matmul(s) float8, {len(result.float8.lossy)} float16"
                   if result.float8 is not None else f"{len(result.kept)} node(s) kept float32")
        rows.append(f"| {name} | ours, {target} calibrated | {_errors(reference[output], ours[output])} | "
                    f"{_score(name, ours[output], labels):.4f} | {matmuls}; {result.validation_runs} run(s),"
                    f" {seconds:.0f} s |")
    keras_model = trained_models.build(name)
    (array,) = held_out.values()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Layer Add does not have a `quantize` method implemented", per layer
        keras_model.quantize("float8")
    # Each layer Keras quantizes to float8 owns one "inputs_scale" (public variable paths).
    quantized = sum(variable.path.endswith("/inputs_scale") for variable in keras_model.variables)
    theirs = keras_model.predict(array, verbose=0)
    rows.append(f"| {name} | Keras quantize(\"float8\") | {_errors(reference[output], theirs)} | "
                f"{_score(name, theirs, labels):.4f} | {quantized} layer(s) float8 |")
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated (default {','.join(MODELS)})")
    parser.add_argument("--smoke", action="store_true",
                        help=f"checks this script: {SMOKE_MODEL}, ours for float16 only (every release has it)")
    args = parser.parse_args(argv)
    names, targets = ([SMOKE_MODEL], ("float16",)) if args.smoke else (args.models.split(","), TARGETS)
    print(machine_line())
    print("| model | rewrite | max-rel | p99-rel | top-1 (R²) | in low precision; calibration |")
    print("|---|---|---:|---:|---:|---|")
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-peers-") as workdir:
        for name in names:
            print("\n".join(measure(name, Path(workdir), targets)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
