"""The keras_hub corpus's encoders, GPT-2 and vision backbones (``hub_corpus.py`` says how
each is built, converted and served); the other half is ``test_hub_corpus_decoders.py``."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from amp_rewrite.testing.hub import BACKBONES
from hub_corpus import HALVES, Source, check_backbone, exporter, targets


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Source]:
    return exporter(tmp_path_factory.mktemp("hub_corpus_text"))


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("name", HALVES["text"])
def test_backbone_converts_validates_reloads_and_serves(sources, tmp_path: Path, name: str, target: str) -> None:
    """Rule: a keras_hub backbone converts (nodes converted), validates on random inputs it
    accepts (p99-rel within the target's tolerance), and its reloaded result serves that
    batch with the error validation printed."""
    check_backbone(sources(name), name, target, tmp_path / "converted")


def test_the_two_modules_share_every_backbone_once() -> None:
    """Rule: split over two modules, the corpus still converts every backbone, each once."""
    names = [name for half in HALVES.values() for name in half]
    assert sorted(names) == sorted(BACKBONES), names
