"""keras_hub backbones by name, sized by arguments, with random weights (nothing downloaded).

``backbone(name, layers=2, width=32, vocabulary=100, image=(32, 32, 3))`` builds one of
:data:`BACKBONES` (BERT, DistilBERT, GPT-2, Llama, Gemma, Qwen3, Mistral, Whisper, ViT,
ResNet): ``layers`` deep, ``width`` wide, ``max(2, width // 64)`` heads (the decoders with
one key/value head per two query heads), feed-forward ``2 * width`` wide; the text models
take ``sequence`` tokens (Whisper's encoder twice that many frames of 16 mels), ViT and
ResNet ``image`` inputs (ViT in 8-pixel patches below 64 pixels, else 16; ResNet one basic
block per layer, the stem and the first block 64 filters as keras_hub requires, the others
``2 * width``, stride 2 from the second). The defaults are the keras_hub corpus' tiny
configs. ``dtype`` is a Keras dtype policy, e.g. ``mixed_bfloat16``.

keras_hub is imported inside :func:`backbone`: it is a test extra, not a dependency.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

BACKBONES: tuple[str, ...] = ("bert", "distil_bert", "gpt2", "llama", "gemma", "qwen3", "mistral", "whisper", "vit",
                              "resnet")
IMAGE_BACKBONES: tuple[str, ...] = ("vit", "resnet")


@dataclass(frozen=True)
class HubSize:
    layers: int = 2
    width: int = 32
    vocabulary: int = 100
    image: tuple[int, int, int] = (32, 32, 3)
    sequence: int = 16

    @property
    def heads(self) -> int:
        return max(2, self.width // 64)


def _text(hub: Any, name: str, size: HubSize, dtype: str | None) -> Any:
    common = {"num_layers": size.layers, "hidden_dim": size.width, "intermediate_dim": 2 * size.width, "dtype": dtype}
    if name in ("bert", "distil_bert", "gpt2"):
        kind = {"bert": hub.BertBackbone, "distil_bert": hub.DistilBertBackbone, "gpt2": hub.GPT2Backbone}[name]
        return kind(vocabulary_size=size.vocabulary, num_heads=size.heads, max_sequence_length=size.sequence, **common)
    if name == "whisper":
        return hub.WhisperBackbone(vocabulary_size=size.vocabulary, num_heads=size.heads, num_mels=16,
                                   max_encoder_sequence_length=2 * size.sequence,
                                   max_decoder_sequence_length=size.sequence, **common)
    decoder = {**common, "vocabulary_size": size.vocabulary, "num_query_heads": size.heads,
               "num_key_value_heads": size.heads // 2}
    if name == "llama":
        return hub.LlamaBackbone(**decoder)
    if name == "mistral":
        return hub.MistralBackbone(sliding_window=size.sequence // 2, **decoder)
    kind = {"gemma": hub.GemmaBackbone, "qwen3": hub.Qwen3Backbone}[name]
    return kind(head_dim=size.width // size.heads, **decoder)


def _image(hub: Any, name: str, size: HubSize, dtype: str | None) -> Any:
    if name == "vit":
        return hub.ViTBackbone(image_shape=size.image, patch_size=8 if size.image[0] < 64 else 16,
                               num_layers=size.layers, num_heads=size.heads, hidden_dim=size.width,
                               mlp_dim=2 * size.width, dtype=dtype)
    filters = 2 * size.width
    return hub.ResNetBackbone(
        input_conv_filters=[64], input_conv_kernel_sizes=[3],
        stackwise_num_filters=[64] + [filters] * (size.layers - 1),
        stackwise_num_blocks=[1] * size.layers, stackwise_num_strides=[1] + [2] * (size.layers - 1),
        block_type="basic_block", use_pre_activation=False, image_shape=size.image, dtype=dtype)


def backbone(name: str, *, layers: int = 2, width: int = 32, vocabulary: int = 100,
             image: tuple[int, int, int] = (32, 32, 3), sequence: int = 16, dtype: str | None = None) -> Any:
    """keras_hub's ``name`` backbone (one of :data:`BACKBONES`) with random weights; see the module."""
    import keras_hub

    if name not in BACKBONES:
        raise ValueError(f"unknown keras_hub backbone {name!r}; choose one of {', '.join(BACKBONES)}")
    size = HubSize(layers, width, vocabulary, tuple(image), sequence)
    build = _image if name in IMAGE_BACKBONES else _text
    return build(keras_hub.models, name, size, dtype)
