"""The keras_hub corpus's decoder-only LLM backbones (``hub_corpus.py`` says how
each is built, converted and served); the other half is ``test_hub_corpus_text.py``."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from hub_corpus import HALVES, Source, check_backbone, exporter, targets


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Source]:
    return exporter(tmp_path_factory.mktemp("hub_corpus_decoders"))


@pytest.mark.parametrize("target", targets())
@pytest.mark.parametrize("name", HALVES["decoders"])
def test_backbone_converts_validates_reloads_and_serves(sources, tmp_path: Path, name: str, target: str) -> None:
    """Rule: a keras_hub backbone converts (nodes converted), validates on random inputs it
    accepts (p99-rel within the target's tolerance), and its reloaded result serves that
    batch with the error validation printed."""
    check_backbone(sources(name), name, target, tmp_path / "converted")
