"""The keras_hub corpus's encoders, GPT-2 and vision backbones (``hub_corpus.py`` says how
each is built, converted and served); the other half is ``test_hub_corpus_decoders.py``."""
from amp_rewrite.testing.hub import BACKBONES
from hub_corpus import HALVES, half

sources, test_backbone_converts_validates_reloads_and_serves = half("text")


def test_the_two_modules_share_every_backbone_once() -> None:
    """Rule: split over two modules, the corpus still converts every backbone, each once."""
    names = [name for half_ in HALVES.values() for name in half_]
    assert sorted(names) == sorted(BACKBONES), names
