"""How each error measure varies with the samples it is taken on: the basis of calibration's
goal (half the tolerance) and of ``p99-rel`` as the default metric (README, Calibration).

The trained Transformer of ``tests/trained_models.py`` is rewritten for float8 with every
matmul quantized (amax from its 64 calibration images) and run, with float32, on all 597
images calibration did not train on (calibration and held-out splits). Each metric is
then taken on 200 random subsets of 64 images and on all 597: printed are its median,
95th percentile and largest over the subsets, and its value on all of them. A metric
whose value on all images exceeds its subsets' median grows with the sample count.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/metric_spread.py [--model digits_transformer] [--target float8]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import trained_models  # noqa: E402  tests/ is not a package

from amp_rewrite.calibration import statistics, validate  # noqa: E402
from amp_rewrite.calibration.savedmodel import read_model, rewrite_model  # noqa: E402
from amp_rewrite.core.float8 import inference as float8  # noqa: E402
from amp_rewrite.core.lists import load_lists  # noqa: E402

SUBSETS, SIZE = 200, 64
SMOKE_MODEL, SMOKE_TARGET, SMOKE_SUBSETS = "digits_mlp", "float16", 10  # every release has float16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="digits_transformer")
    parser.add_argument("--target", default="float8", choices=("float16", "bfloat16", "float8"))
    parser.add_argument("--smoke", action="store_true",
                        help=f"checks this script: {SMOKE_MODEL}, {SMOKE_TARGET}, {SMOKE_SUBSETS} subsets")
    args = parser.parse_args(argv)
    subset_count = SUBSETS
    if args.smoke:
        args.model, args.target, subset_count = SMOKE_MODEL, SMOKE_TARGET, SMOKE_SUBSETS
    with tempfile.TemporaryDirectory(prefix="amp-rewrite-spread-") as workdir:
        model = read_model(trained_models.export(args.model, Path(workdir) / args.model))
        splits = [trained_models.data(args.model, split)[0] for split in ("calibration", "held_out")]
        inputs = {key: np.concatenate([split[key] for split in splits]) for key in splits[0]}
        lists = load_lists(args.target)
        extra = {}
        if args.target == "float8":
            feeds, _ = validate.plan_feeds(model, splits[0], 1)
            keys = sorted(float8.activation_operands(model.graph_def))
            stats = statistics.collect(model, model.program, feeds, keys, 0.0).stats
            extra["amax"] = {key: s.max_abs for key, s in stats.items()}
        rewritten = rewrite_model(model, target=args.target, lists=lists, **extra)
        feeds, _ = validate.plan_feeds(model, inputs, 1)
        (reference,), (candidate,) = (statistics.collect(model, program, feeds, [], 0.0).outputs["serving_default"][0]
                                      .values() for program in (model.program, rewritten.program))
    rng = np.random.default_rng(0)
    subsets = [rng.choice(len(reference), SIZE, replace=False) for _ in range(subset_count)]
    print(f"{args.model}, {args.target} ({rewritten.report.float8_matmuls} matmul(s) on float8):"
          if args.target == "float8" else f"{args.model}, {args.target}:")
    print(f"| metric | median over {subset_count} subsets of {SIZE} | 95th percentile | largest | all {len(reference)} |")
    print("|---|---:|---:|---:|---:|")
    for name, metric in validate.METRICS.items():
        if name in validate.AGREEMENTS:  # integer outputs' metrics: equal or not, no spread to measure on floats
            continue
        try:
            values = [metric(reference[index], candidate[index]) for index in subsets]
        except ValueError as error:  # top1-agreement on a regression output: the metric does not apply
            print(f"| {name} | does not apply: {error} | | | |")
            continue
        print(f"| {name} | {np.median(values):.4f} | {np.percentile(values, 95):.4f} | {max(values):.4f} |"
              f" {metric(reference, candidate):.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
