"""``amp_rewrite.testing.hub``: keras_hub backbones by name, sized by arguments.

The corpus (tests/test_hub_corpus.py) and tools/bench_hub_serving.py build their backbones
here; these tests check the sizes reach the model and the Keras policy builds the same
weights. keras_hub is in the ``test`` extra.
"""
from __future__ import annotations

import os

import pytest

if os.environ.get("AMP_HUB_CORPUS") == "deselected":
    pytest.skip("tools/matrix.py deselected the keras_hub corpus for this TensorFlow release",
                allow_module_level=True)
import keras

from amp_rewrite.testing.hub import BACKBONES, IMAGE_BACKBONES, backbone


def _depth_and_width(name: str, model: keras.Model) -> tuple[int, int]:
    config = model.get_config()
    if name == "resnet":
        return len(config["stackwise_num_filters"]), config["stackwise_num_filters"][-1] // 2
    return config["num_layers"], config["hidden_dim"]


@pytest.mark.parametrize("name", BACKBONES)
def test_a_backbone_is_as_deep_and_wide_as_asked(name: str) -> None:
    """Rule: ``layers`` and ``width`` reach the backbone's config, and a bigger size has more weights."""
    keras.utils.set_random_seed(0)
    small = backbone(name)
    big = backbone(name, layers=3, width=64, vocabulary=120, image=(48, 48, 3), sequence=24)
    assert _depth_and_width(name, small) == (2, 32)
    assert _depth_and_width(name, big) == (3, 64)
    assert big.count_params() > small.count_params()
    if name in IMAGE_BACKBONES:
        assert tuple(big.get_config()["image_shape"]) == (48, 48, 3)
    else:
        assert big.get_config()["vocabulary_size"] == 120


def test_the_keras_policy_builds_the_same_weights() -> None:
    """Rule: under ``dtype="mixed_bfloat16"`` the backbone computes in bfloat16 and takes
    float32's weights as they are (what the benchmark's Keras column copies)."""
    keras.utils.set_random_seed(0)
    float32 = backbone("llama")
    policy = backbone("llama", dtype="mixed_bfloat16")
    assert policy.dtype_policy.name == "mixed_bfloat16" and float32.dtype_policy.name == "float32"
    policy.set_weights(float32.get_weights())
    assert [w.shape for w in policy.get_weights()] == [w.shape for w in float32.get_weights()]


def test_an_unknown_backbone_is_named() -> None:
    with pytest.raises(ValueError, match="unknown keras_hub backbone 't5'; choose one of bert,"):
        backbone("t5")
