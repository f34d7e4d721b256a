"""FP8 training side by side with Keras' own: accuracy, loss curves, and which matmuls run in FP8.

Trains each model of ``amp_rewrite.testing.digits`` (an MLP, a CNN, a Transformer block)
on scikit-learn's digits with one seed, one set of initial weights and one batch order,
as float32, as our bfloat16 rewrite, as our FP8 training
(``enable_mixed_precision_graph_rewrite(opt, target="float8")``) and as Keras'
(``model.quantize("float8")`` on a ``mixed_bfloat16`` model: ``QuantizedFloat8DTypePolicy``
on its Dense and EinsumDense layers). It prints two Markdown tables: held-out accuracy with
how many of one training step's dots and convolutions read float8 operands in the HLO XLA
gets (forward: both E4M3; backward: the gradient E5M2, the other operand E4M3), and the
training loss per epoch.

Training runs without XLA unless ``--jit`` (the float8 numbers are the same casts either
way; XLA's CPU compile of each Keras step takes tens of seconds). Takes ~3 minutes on 2 cores.

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/compare_fp8_training.py [--epochs 8] [--models cnn transformer]

``--svg-dir docs/benchmarks`` also draws each model's loss curves, one line per variant,
as ``fp8_loss_<model>.svg`` (tools/plots.py), which the documentation's benchmarks page shows.
"""
from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from amp_rewrite.core.float8.inference import MIN_TENSORFLOW  # noqa: E402
from amp_rewrite.testing import digits  # noqa: E402
from plots import Series, line_chart  # noqa: E402  (tools/, this script's folder)

LABELS = {"float32": "float32", "bfloat16": "bfloat16 (ours)", "float8": "float8 (ours)",
          "keras-float8": "float8 (Keras policy)"}


CANNOT_RUN = 77  # exit status: this TensorFlow cannot do FP8 training (tests/test_tools.py skips, naming why)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=digits.MODELS, default=list(digits.MODELS))
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--jit", action="store_true", help="train under XLA (jit_compile=True): slower to compile")
    parser.add_argument("--svg-dir", type=Path, metavar="DIR", help="draw each model's loss curves into DIR")
    parser.add_argument("--smoke", action="store_true",
                        help="checks this script: the MLP, one epoch, our FP8 only (the variants are digits' code,"
                             " tested with it)")
    args = parser.parse_args(argv)
    variants = digits.VARIANTS
    if args.smoke:
        args.models, args.epochs, variants = ["mlp"], 1, ("float8",)
    import tensorflow as tf

    if tuple(int(part) for part in tf.__version__.split(".")[:2]) < MIN_TENSORFLOW:
        print(f"FP8 training needs TensorFlow {'.'.join(map(str, MIN_TENSORFLOW))}+; this is {tf.__version__}",
              file=sys.stderr)
        return CANNOT_RUN
    warnings.filterwarnings("ignore", message=".*run emulated without XLA.*")
    data = digits.digits()
    accuracy_rows, loss_rows = [], []
    for name in args.models:
        curves = []
        for variant in variants:
            trained = digits.train(name, variant, epochs=args.epochs, jit_compile=args.jit, data=data)
            count = digits.count_float8_matmuls(digits.training_step_hlo(name, variant))
            fp8 = f"{count.forward_float8}/{count.forward} | {count.backward_float8}/{count.backward}"
            accuracy_rows.append(f"| {name} | {LABELS[variant]} | {trained.accuracy:.4f} | {fp8} |")
            loss_rows.append(f"| {name} | {LABELS[variant]} | " + " | ".join(f"{loss:.3f}" for loss in trained.losses)
                             + " |")
            curves.append(Series(LABELS[variant], tuple(enumerate(trained.losses, start=1))))
            print(accuracy_rows[-1], flush=True)
        if args.svg_dir:
            line_chart(args.svg_dir / f"fp8_loss_{name}.svg", f"digits {name}: training loss per epoch",
                       x_label="epoch", y_label="training loss", series=curves)
    print(f"\nHeld-out accuracy after {args.epochs} epochs, and the dots/convolutions of one training step"
          " on float8 operands (forward | backward):\n")
    print("| model | variant | accuracy | FP8 forward | FP8 backward |")
    print("|---|---|---:|---:|---:|")
    print("\n".join(accuracy_rows))
    print("\nTraining loss per epoch:\n")
    print("| model | variant | " + " | ".join(str(epoch + 1) for epoch in range(args.epochs)) + " |")
    print("|---|---|" + "---:|" * args.epochs)
    print("\n".join(loss_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
