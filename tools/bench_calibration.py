"""What calibration costs, against one float32 first call, and where the time goes (``make bench``).

Models: the trained MobileNetV2 of ``tests/trained_models.py`` (alpha 0.35, 32×32 digits,
its 64 calibration images) and the BERT-base encoder of ``tools/bench.py`` (12 layers, 128
tokens, random weights, 8 samples of token ids below the vocabulary size); ResNet50 at
224×224 (random weights, 8 N(0,1) images) with ``--models resnet50``. Each is exported as
a SavedModel and calibrated for float16 (``calibrate.run_calibration``, as
``amp-rewrite convert --calibrate DATA.npz`` does). The baseline, measured in the same run:
``tf.saved_model.load`` and then one first call of the signature on the same batch (the
call that traces, optimizes and instantiates the model's functions); its load is printed
beside it. The time of calibration is split into: instrumenting the graphs (Python), the
TF1 loader (graph import and variable restore), the model runs (session.run: function
instantiation and compute), the rewrites, adding a rewrite to the loaded session
(``statistics.Runner``), and the rest (Python: statistics, decisions).

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_calibration.py [--models mobilenet,bert,resnet50]
"""
from __future__ import annotations

import argparse
import collections
import functools
import sys
import tempfile
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))
sys.path.insert(0, str(REPO / "tests"))

import bench  # noqa: E402  (tools/bench.py: the models)
import trained_models  # noqa: E402
from bench_pass import machine_line  # noqa: E402

from amp_rewrite.calibration import calibrate, statistics, validate  # noqa: E402
from amp_rewrite.calibration.savedmodel import read_model  # noqa: E402
from amp_rewrite.core.lists import load_lists  # noqa: E402

SAMPLES = 8  # BERT and ResNet50; MobileNetV2 takes its 64 calibration images
GOAL = 10.0  # calibration at most this many float32 first calls
SPENT: dict[str, float] = collections.defaultdict(float)


def _timed(owner: object, name: str, phase: str) -> None:
    """Wrap ``owner.name`` so its wall time adds to ``SPENT[phase]`` (outermost call only)."""
    function = getattr(owner, name)

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        if SPENT.get("_inside"):
            return function(*args, **kwargs)
        SPENT["_inside"] = 1
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            SPENT[phase] += time.perf_counter() - started
            SPENT["_inside"] = 0

    setattr(owner, name, wrapper)


_timed(statistics, "instrument", "instrumenting (Python)")
_timed(tf.compat.v1.saved_model.loader, "load", "TF1 loader: import and restore")
_timed(tf.compat.v1.Session, "run", "model runs (session.run)")
_timed(calibrate, "rewrite_model", "rewrites")
_timed(statistics.Runner, "_add", "adding a rewrite to the session")


def _export(name: str, workdir: Path) -> tuple[Path, dict[str, np.ndarray]]:
    path = workdir / name
    rng = np.random.default_rng(0)
    if name == "mobilenet":
        trained_models.export("digits_mobilenet", path)
        return path, trained_models.data("digits_mobilenet", "calibration")[0]
    keras.utils.set_random_seed(0)
    sizes = bench.FULL
    model = bench._build_resnet50(sizes) if name == "resnet50" else bench._build_bert(sizes)
    model.export(str(path), verbose=False)
    spec = validate.input_specs(read_model(path))[0]
    if name == "resnet50":
        value = rng.standard_normal((SAMPLES, sizes.image_size, sizes.image_size, 3), dtype=np.float32)
    else:
        value = rng.integers(0, sizes.bert_vocab, size=(SAMPLES, sizes.bert_seq), dtype=np.int32)
    return path, {spec.name: value}


def measure(name: str, workdir: Path) -> str:
    path, data = _export(name, workdir)
    started = time.perf_counter()
    loaded = tf.saved_model.load(str(path))
    load = time.perf_counter() - started
    function = loaded.signatures["serving_default"]
    feed = {key: tf.constant(value) for key, value in data.items()}
    started = time.perf_counter()
    function(**feed)
    first = time.perf_counter() - started
    source = read_model(path)
    SPENT.clear()
    started = time.perf_counter()
    feeds, _ = validate.plan_feeds(source, data, 1)
    result = calibrate.run_calibration(source, feeds, target="float16", lists=load_lists("float16"))
    seconds = time.perf_counter() - started
    SPENT.pop("_inside", None)
    parts = dict(SPENT)
    parts["the rest (Python: statistics, decisions)"] = seconds - sum(parts.values())
    (count,) = {len(value) for value in data.values()}
    split = "; ".join(f"{phase} {spent:.1f} s ({spent / seconds:.0%})" for phase, spent in parts.items())
    verdict = "within" if seconds <= GOAL * first else "over"
    return (f"{name} ({count} samples): calibration {seconds:.1f} s; float32 first call {first:.2f} s"
            f" (load {load:.1f} s before it); ratio {seconds / first:.1f}x ({verdict} the goal of {GOAL:g}x); {result.validation_runs}"
            f" validation run(s), {len(result.kept)} node(s) kept float32; outputs"
            f" {'within' if result.ok else 'OVER'} tolerance\n  where the time goes: {split}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mobilenet,bert", help="comma-separated of mobilenet, bert, resnet50"
                                                                   " (default mobilenet,bert)")
    args = parser.parse_args()
    print(machine_line())
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-bench-calibration-") as workdir:
        for name in args.models.split(","):
            print(measure(name, Path(workdir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
