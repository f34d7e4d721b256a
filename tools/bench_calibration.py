"""What calibration costs and what it changes on ResNet50 and the BERT-base encoder (``make bench``).

Each model (random weights, seed 0) is exported as a SavedModel and calibrated for
float16 on 8 samples (ResNet50: N(0,1) images at 224x224; BERT: token ids below the
vocabulary size), as ``amp-rewrite convert --calibrate DATA.npz`` does. Printed per
model: the wall time of calibration (statistics, range rules, repair) and, as the
baseline measured in the same run, one float32 inference of the same batch through
``tf.saved_model.load``, with their ratio; the validation runs used; and the nodes
calibration kept float32 that the lists alone convert (the goal: none). The goal for
ResNet50 is under 2 minutes on 2 cores.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/bench_calibration.py [--quick]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench  # noqa: E402  (tools/bench.py: the models)
from bench_pass import machine_line  # noqa: E402

from amp_rewrite.calibration import calibrate, validate  # noqa: E402
from amp_rewrite.calibration.savedmodel import read_model  # noqa: E402
from amp_rewrite.core.lists import load_lists  # noqa: E402

SAMPLES = 8
RESNET_GOAL_S = 120.0


def _samples(name: str, sizes: bench.Sizes, model_path: Path) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    spec = validate.input_specs(read_model(model_path))[0]
    if name == "resnet50":
        value = rng.standard_normal((SAMPLES, sizes.image_size, sizes.image_size, 3), dtype=np.float32)
    else:
        value = rng.integers(0, sizes.bert_vocab, size=(SAMPLES, sizes.bert_seq), dtype=np.int32)
    return {spec.name: value}


def measure(name: str, sizes: bench.Sizes, workdir: Path) -> str:
    keras.utils.set_random_seed(0)
    model = bench._build_resnet50(sizes) if name == "resnet50" else bench._build_bert(sizes)
    path = workdir / name
    model.export(str(path), verbose=False)
    data = _samples(name, sizes, path)
    loaded = tf.saved_model.load(str(path))
    function = loaded.signatures["serve"]
    feed = {key: tf.constant(value) for key, value in data.items()}
    function(**feed)  # warm up
    start = time.perf_counter()
    function(**feed)
    inference = time.perf_counter() - start
    source = read_model(path)
    lists = load_lists("float16")
    plain = {(d.function, d.node) for d in calibrate.rewrite_model(source, target="float16", lists=lists)
             .report.decisions if d.converted}
    start = time.perf_counter()
    feeds, _ = validate.plan_feeds(source, data, 1)
    result = calibrate.run_calibration(source, feeds, target="float16", lists=lists)
    seconds = time.perf_counter() - start
    converted = calibrate.converted_nodes(result.result)
    kept = sorted(f"{node} ({function[:40]})" for function, node in plain - converted)
    goal = f" (goal < {RESNET_GOAL_S:.0f} s)" if name == "resnet50" else ""
    lines = [f"{name}: calibrate + repair {seconds:.1f} s{goal}; one float32 inference of the batch {inference:.2f} s;"
             f" ratio {seconds / inference:.0f}x; {result.validation_runs} validation run(s);"
             f" outputs {'within' if result.ok else 'OVER'} tolerance;"
             f" nodes the lists convert that calibration keeps float32: {len(kept)}"]
    lines += [f"  kept: {entry}: {result.keep.get(entry, '')}" for entry in sorted(result.keep)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small shapes (BERT: 2 layers, 32 tokens; 64x64 images)")
    parser.add_argument("--models", default="resnet50,bert", help="comma-separated (default resnet50,bert)")
    args = parser.parse_args()
    sizes = bench.QUICK if args.quick else bench.FULL
    print(machine_line())
    print(f"Calibration for float16 on {SAMPLES} samples{' (--quick sizes)' if args.quick else ''}:")
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-bench-calibration-") as workdir:
        for name in args.models.split(","):
            print(measure(name, sizes, Path(workdir)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
