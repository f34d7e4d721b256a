"""The keras_hub corpus's decoder-only LLM backbones (``hub_corpus.py`` says how
each is built, converted and served); the other half is ``test_hub_corpus_text.py``."""
from hub_corpus import half

sources, test_backbone_converts_validates_reloads_and_serves = half("decoders")
