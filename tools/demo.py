"""`make demo`: export a small Keras CNN as a SavedModel and convert it end to end.

For each target it runs ``amp-rewrite convert`` with ``--dump`` and ``--validate``: the
summary, why vertices stayed float32, the errors on random inputs against the float32
model, and where the HTML report is. Everything goes under ``out/demo/``.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from amp_rewrite._quiet import silence_native_stderr

silence_native_stderr()

import keras  # noqa: E402

from amp_rewrite.cli import command as cli  # noqa: E402

OUT = Path(__file__).resolve().parent.parent / "out" / "demo"


def export_model(path: Path) -> None:
    """A small image classifier (Conv2D, BatchNormalization, Dense) with random weights."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential([
        keras.Input((32, 32, 3)),
        keras.layers.Conv2D(16, 3, padding="same"),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu"),
        keras.layers.GlobalAveragePooling2D(),
        keras.layers.Dense(10, activation="softmax"),
    ])
    model.export(str(path), verbose=False)


def main() -> int:
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    source = OUT / "cnn_float32"
    export_model(source)
    print(f"Exported a small Keras CNN to {source}")
    status = 0
    for target in ("float16", "bfloat16"):
        print(f"\n== amp-rewrite convert --target {target} ==")
        status |= cli.main(["convert", str(source), str(OUT / f"cnn_{target}"), "--target", target,
                            "--dump", str(OUT / f"report_{target}"), "--validate", "4"])
    print(f"\nOpen {OUT / 'report_float16' / 'report.html'} in a browser to see every decision.")
    return status


if __name__ == "__main__":
    sys.exit(main())
