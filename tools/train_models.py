"""Train the models of ``tests/trained_models.py`` and write their weights to
``tests/data/trained/NAME.npz`` (committed, so tests never train).

Seeded (``keras.utils.set_random_seed(0)``), on the training split only; prints each
model's float32 accuracy (top-1, or R² for diabetes) on the held-out split, and the
largest activation of each Dense layer on the calibration split (what the rescaled
variants are sized from)::

    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/train_models.py [NAME ...]
    TF_CPP_MIN_LOG_LEVEL=2 .venv/bin/python tools/train_models.py --smoke   # one epoch, into a temporary directory
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))
import trained_models  # noqa: E402  tests/ is not a package

# (epochs, batch size, learning rate) per base model
SCHEDULE = {"digits_mlp": (60, 32, 1e-3), "digits_cnn": (40, 32, 3e-3), "digits_mobilenet": (40, 32, 2e-3),
            "digits_transformer": (60, 32, 1e-3), "diabetes_mlp": (200, 32, 1e-3)}


SMOKE_MODEL = "diabetes_mlp"  # the smallest


def train(name: str, weights: Path = trained_models.WEIGHTS, epochs: int | None = None) -> None:
    """Train ``name`` by its schedule (``epochs``: fewer) and write its weights under ``weights``."""
    import keras

    scheduled, batch, rate = SCHEDULE[name]
    epochs = epochs or scheduled
    model = trained_models.build(name, trained=False)
    classifier = trained_models.is_classifier(name)
    model.compile(optimizer=keras.optimizers.Adam(rate),
                  loss="sparse_categorical_crossentropy" if classifier else "mse")
    (inputs, labels), started = trained_models.data(name, "train"), time.monotonic()
    model.fit(_only(inputs), labels, epochs=epochs, batch_size=batch, verbose=0, shuffle=True)
    weights.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(weights / f"{name}.npz", *model.get_weights())
    held, held_labels = trained_models.data(name, "held_out")
    predicted = model.predict(_only(held), verbose=0)
    score = (f"top-1 {trained_models.top1(predicted, held_labels):.4f}" if classifier
             else f"R² {trained_models.r2(predicted, held_labels):.4f}")
    size = (weights / f"{name}.npz").stat().st_size
    print(f"{name}: held-out {score}; {time.monotonic() - started:.0f} s; {size / 1024:.0f} KiB")
    calibration, _ = trained_models.data(name, "calibration")
    for layer in model.layers:
        if layer.name in ("dense1", "dense2"):
            probe = keras.Model(model.inputs, layer.output)
            peak = np.abs(probe.predict(_only(calibration), verbose=0)).max()
            print(f"  {layer.name}: largest activation {peak:.4g}")


def _only(inputs: dict[str, np.ndarray]) -> np.ndarray:
    """The one input array (Keras warns on a dict for a single-input model)."""
    (array,) = inputs.values()
    return array


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"of {', '.join(trained_models.BASE_MODELS)} (default: all)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"checks this script: {SMOKE_MODEL} for one epoch, written to a temporary directory")
    args = parser.parse_args(argv)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="amp-rewrite-train-") as directory:
            train(SMOKE_MODEL, Path(directory), epochs=1)
        return 0
    names = args.names or trained_models.BASE_MODELS
    unknown = [name for name in names if name not in trained_models.BASE_MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(trained_models.BASE_MODELS)}")
    for name in names:
        train(name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
