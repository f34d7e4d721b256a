"""The models users serve: keras_hub backbones, each converted to every target and served.

Shared by the corpus's two test modules, ``test_hub_corpus_text.py`` (BERT, DistilBERT,
GPT-2, Whisper, ViT, ResNet) and ``test_hub_corpus_decoders.py`` (Llama, Gemma, Qwen3,
Mistral), split so that ``--dist loadfile`` runs them on both workers.

Each backbone is built from a tiny config (2 layers, 32 wide, a 100-row vocabulary, 32x32
images) with random weights, nothing downloaded, and exported as users do
(``model.export``), once per module. Each target's conversion is ``amp-rewrite convert
--validate 1`` in this process (float8 calibrated on the random batches validation feeds:
without ``--calibrate`` convert refuses float8, which needs each matmul input's amax); the result is reloaded with
``tf.saved_model.load`` and serves the batch validation drew (integer inputs within the
tables they index, ``core/bounds.py``; BERT's segment ids within its 2-row table) through
``serving_default``. Each output must be finite and within the target's tolerance of
float32, and its error must be the one the validation line printed.

keras_hub is in the ``test`` extra: without it the corpus fails to import, unless
``tools/matrix.py`` says it deselected the corpus (``AMP_HUB_CORPUS=deselected``) for a
TensorFlow release keras-hub cannot be installed beside.
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

if os.environ.get("AMP_HUB_CORPUS") == "deselected":
    pytest.skip("tools/matrix.py deselected the keras_hub corpus for this TensorFlow release",
                allow_module_level=True)
try:
    import keras_hub  # noqa: F401  (imported here to fail early; testing.hub builds the backbones)
except ImportError as error:
    raise ImportError("the keras_hub corpus needs keras-hub, which the test extra installs:"
                      " pip install -e '.[test]'") from error
import keras
import tensorflow as tf

from amp_rewrite.calibration import validate
from amp_rewrite.calibration.savedmodel import read_model
from amp_rewrite.core.target import FLOAT8, TARGETS, lookup_target
from amp_rewrite.testing import hub

from conftest import NEEDS_FLOAT8
from test_cli import assert_ok, run_cli

SIGNATURE = "serving_default"
# the corpus's two test modules, one per xdist worker (``--dist loadfile``): float8's
# calibration dominates, and costs most on the decoder-only LLMs
HALVES: dict[str, tuple[str, ...]] = {
    "text": ("bert", "distil_bert", "gpt2", "whisper", "vit", "resnet"),
    "decoders": ("llama", "gemma", "qwen3", "mistral"),
}


@dataclass(frozen=True)
class Source:
    """A backbone exported once: its folder, the batch validation draws (``--validate 1``)
    for ``serving_default``, the calibration file, and float32's outputs on the batch."""
    path: Path
    batch: dict[str, np.ndarray]
    calibration: Path
    float32: dict[str, np.ndarray]


def _export(name: str, folder: Path) -> Source:
    keras.utils.set_random_seed(0)
    backbone = hub.backbone(name)  # the tiny defaults
    backbone.export(str(folder / name), verbose=False)
    feeds, _ = validate.plan_feeds(read_model(folder / name), None, 1)
    batch = feeds[SIGNATURE][0]
    # float8 is calibrated on every batch validation feeds (one per signature: ``serve`` and
    # ``serving_default``), so the corpus checks conversion, not how one batch of two 2-long
    # sequences generalizes
    np.savez(folder / f"{name}.npz", **{key: np.concatenate([runs[0][key] for runs in feeds.values()
                                                             if runs and key in runs[0]])
                                        for key in batch})
    # float32's outputs from the Keras model itself (what the export traced), named as the signature names them
    outputs = backbone(batch if len(batch) > 1 else next(iter(batch.values())))
    float32 = {key: np.asarray(value) for key, value in (outputs if isinstance(outputs, dict) else
                                                         {"output_0": outputs}).items()}
    del backbone
    keras.backend.clear_session()
    return Source(folder / name, batch, folder / f"{name}.npz", float32)


def _serve(path: Path, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    loaded = tf.saved_model.load(str(path))
    outputs = loaded.signatures[SIGNATURE](**{key: tf.constant(value) for key, value in batch.items()})
    return {key: value.numpy() for key, value in outputs.items()}


def exporter(folder: Path) -> Callable[[str], Source]:
    """Each backbone exported on first use; the tests run model by model, so one is kept."""
    kept: dict[str, Source] = {}

    def source(name: str) -> Source:
        if name not in kept:
            kept.clear()
            kept[name] = _export(name, folder)
        return kept[name]

    return source


def _validation_errors(out: str) -> dict[str, tuple[str, float]]:
    """``serving_default``'s outputs in the validation lines: output -> (status, p99-rel)."""
    found = re.findall(rf"^  (\w+) +{SIGNATURE}/(\S+): .*p99-rel ([0-9.e+-]+)", out, re.MULTILINE)
    return {output: (status, float(error)) for status, output, error in found}


def _convert(source: Source, name: str, target: str, destination: Path) -> Any:
    calibration = ("--calibrate", source.calibration) if target == FLOAT8.name else ()
    return run_cli("convert", source.path, destination, "--target", target, "--validate", 1, *calibration)


def targets() -> list[Any]:
    """Every target a backbone converts to: float16, bfloat16 and (where TensorFlow has it) float8."""
    return [*TARGETS, pytest.param(FLOAT8.name, marks=NEEDS_FLOAT8)]


def check_backbone(source: Source, name: str, target: str, destination: Path) -> None:
    """A keras_hub backbone converts (nodes converted), validates on random inputs it
    accepts (p99-rel within the target's tolerance), and its reloaded result serves that
    batch with the error validation printed."""
    run = _convert(source, name, target, destination)
    assert_ok(run)
    converted = re.search(r"^Model: converted (\d+)/\d+ nodes", run.out, re.MULTILINE)
    assert converted and int(converted.group(1)) > 0, run.out
    tolerance = lookup_target(target, quantized=True).tolerance
    assert f"p99-rel, tolerance {tolerance:g}):" in run.out, run.out
    assert "a guess" not in run.out, run.out  # every integer input bounded by a table, or a mask
    printed = _validation_errors(run.out)
    assert set(printed) == set(source.float32), run.out
    served = _serve(destination, source.batch)
    for output, want in source.float32.items():
        got = served[output]
        assert got.dtype == want.dtype and got.shape == want.shape, output
        assert np.all(np.isfinite(got)), f"{name} {target} {output}: not finite"
        error = validate.p99_rel(want, got)
        status, shown = printed[output]
        assert status == "ok" and error <= tolerance, f"{name} {target} {output}: p99-rel {error:.3g}\n{run.out}"
        assert error == pytest.approx(shown, rel=0.01, abs=1e-6), f"{output}: served {error:.3g}, validation {shown}"


def half(which: str) -> tuple[Callable[..., Any], Callable[..., None]]:
    """One test module's fixture and test for the backbones of ``HALVES[which]``: each module
    assigns them (``sources, test_... = half("text")``), so pytest collects them there."""
    @pytest.fixture(scope="module")
    def sources(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Source]:
        return exporter(tmp_path_factory.mktemp(f"hub_corpus_{which}"))

    @pytest.mark.parametrize("target", targets())
    @pytest.mark.parametrize("name", HALVES[which])
    def test(sources: Callable[[str], Source], tmp_path: Path, name: str, target: str) -> None:
        """Rule: a keras_hub backbone converts (nodes converted), validates on random inputs it
        accepts (p99-rel within the target's tolerance), and its reloaded result serves that
        batch with the error validation printed."""
        check_backbone(sources(name), name, target, tmp_path / "converted")
    return sources, test
