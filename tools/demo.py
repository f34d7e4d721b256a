"""`make demo`: export a small Keras CNN as a SavedModel and convert it end to end.

For each target it runs ``amp-rewrite convert`` with ``--dump`` and ``--validate``: the
summary, why vertices stayed float32, the errors on random inputs against the float32
model, and where the HTML report is. Everything goes under ``out/demo/`` (``--smoke``: under
a temporary directory, removed at the end).
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

from amp_rewrite._quiet import silence_native_stderr

silence_native_stderr()

import keras  # noqa: E402

from amp_rewrite import cli  # noqa: E402

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="the same, under a temporary directory")
    if parser.parse_args(argv).smoke:
        with tempfile.TemporaryDirectory(prefix="amp-rewrite-demo-") as directory:
            return demo(Path(directory))
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    return demo(OUT)


def demo(out: Path) -> int:
    source = out / "cnn_float32"
    export_model(source)
    print(f"Exported a small Keras CNN to {source}")
    status = 0
    for target in ("float16", "bfloat16"):
        print(f"\n== amp-rewrite convert --target {target} ==")
        status |= cli.main(["convert", str(source), str(out / f"cnn_{target}"), "--target", target,
                            "--dump", str(out / f"report_{target}"), "--validate", "4"])
    print(f"\nOpen {out / 'report_float16' / 'report.html'} in a browser to see every decision.")
    return status


if __name__ == "__main__":
    sys.exit(main())
