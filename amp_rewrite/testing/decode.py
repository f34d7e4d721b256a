"""A greedy decode loop with a KV cache, in plain TensorFlow, saved as a SavedModel.

The shape of an LLM's ``generate_step`` without keras_hub: token ids in, token ids out,
one ``While`` loop whose body embeds the last token, writes its key and value into a cache
preallocated to the full length (``TensorScatterUpdate``), attends over the cache and
picks the next token by argmax. The cache and the token ids are carried across
iterations; the weights are variables read inside the body. With ``stop_token`` the
loop also ends once every sequence has produced it: a data-dependent trip count (and with
``trim`` an output as long as the loop ran).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf


@dataclass(frozen=True)
class DecodeShape:
    vocab: int = 64
    width: int = 32
    prompt: int = 4
    length: int = 16  # prompt and generated tokens together
    stop_token: int | None = None
    trim: bool = False  # tokens only up to where the loop stopped (a data-dependent output length)


class DecodeLoop(tf.Module):
    """Greedy decoding over a one-layer attention model; ``generate`` is the signature."""

    def __init__(self, shape: DecodeShape = DecodeShape(), seed: int = 0) -> None:
        super().__init__()
        self.shape = shape
        rng = np.random.default_rng(seed)

        def weight(name: str, rows: int, columns: int) -> tf.Variable:
            value = rng.normal(0.0, 1.0 / np.sqrt(rows), (rows, columns)).astype(np.float32)
            return tf.Variable(value, name=name)

        self.embedding = weight("embedding", shape.vocab, shape.width)
        self.query, self.key, self.value, self.mix = (weight(name, shape.width, shape.width)
                                                      for name in ("query", "key", "value", "mix"))
        self.unembedding = weight("unembedding", shape.width, shape.vocab)
        self.generate = tf.function(self._generate, input_signature=[
            tf.TensorSpec([None, shape.prompt], tf.int32, name="token_ids")])

    def _generate(self, token_ids: tf.Tensor) -> dict[str, tf.Tensor]:
        shape = self.shape
        batch = tf.shape(token_ids)[0]
        tokens = tf.pad(token_ids, [[0, 0], [0, shape.length - shape.prompt]])
        cache = tf.zeros(tf.stack([batch, shape.length, shape.width]))
        position, tokens, _, _ = tf.while_loop(
            self._running, self._step, (tf.constant(1), tokens, cache, cache), maximum_iterations=shape.length - 1)
        return {"tokens": tokens[:, :position] if shape.trim else tokens}

    def _running(self, position: tf.Tensor, tokens: tf.Tensor, *_: tf.Tensor) -> tf.Tensor:
        if self.shape.stop_token is None:
            return position < self.shape.length
        finished = tf.reduce_all(tf.reduce_any(tokens[:, self.shape.prompt:] == self.shape.stop_token, axis=1))
        return tf.logical_and(position < self.shape.length, tf.logical_not(finished))

    def _step(self, position: tf.Tensor, tokens: tf.Tensor, keys: tf.Tensor, values: tf.Tensor
              ) -> tuple[tf.Tensor, ...]:
        batch = tf.shape(tokens)[0]
        last = tf.gather(self.embedding, tokens[:, position - 1])
        rows = tf.stack([tf.range(batch), tf.fill([batch], position - 1)], axis=1)
        keys = tf.tensor_scatter_nd_update(keys, rows, tf.matmul(last, self.key))
        values = tf.tensor_scatter_nd_update(values, rows, tf.matmul(last, self.value))
        scores = tf.einsum("bw,btw->bt", tf.matmul(last, self.query), keys) / np.sqrt(self.shape.width)
        seen = tf.range(self.shape.length) < position
        weights = tf.nn.softmax(tf.where(seen, scores, -1e9))
        hidden = last + tf.matmul(tf.einsum("bt,btw->bw", weights, values), self.mix)
        chosen = tf.argmax(tf.matmul(hidden, self.unembedding), axis=-1, output_type=tf.int32)
        given = tokens[:, position]
        following = tf.where(position < self.shape.prompt, given, chosen)
        tokens = tf.tensor_scatter_nd_update(tokens, tf.stack([tf.range(batch), tf.fill([batch], position)], axis=1),
                                             following)
        return position + 1, tokens, keys, values


def save_decode_loop(path: str | Path, shape: DecodeShape = DecodeShape(), seed: int = 0) -> Path:
    """Save a :class:`DecodeLoop` with ``generate`` as its ``serving_default`` signature."""
    module = DecodeLoop(shape, seed)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.generate})
    return Path(path)


# --- keras_hub causal LMs ------------------------------------------------------------
# keras_hub is imported inside the functions: it is a test extra, not a dependency.

KERAS_HUB_MODELS: tuple[str, ...] = ("gpt2", "gemma", "llama")


@dataclass(frozen=True)
class CausalLMShape:
    """A causal LM's size: ``width`` wide, ``layers`` deep, ``heads`` heads (Gemma and Llama
    with as many key/value heads), sequences ``length`` long (prompt and generated tokens)."""

    vocab: int = 64
    width: int = 32
    layers: int = 2
    heads: int = 2
    length: int = 16


def build_causal_lm(name: str, shape: CausalLMShape = CausalLMShape(), seed: int = 0, dtype: str | None = None):
    """keras_hub's ``name`` (one of :data:`KERAS_HUB_MODELS`) causal LM with random weights,
    no preprocessor, and the greedy sampler; ``dtype``: a Keras dtype policy, e.g. ``mixed_bfloat16``."""
    import keras
    import keras_hub

    if name not in KERAS_HUB_MODELS:
        raise ValueError(f"unknown causal LM {name!r}; choose one of {', '.join(KERAS_HUB_MODELS)}")
    keras.utils.set_random_seed(seed)
    common = {"vocabulary_size": shape.vocab, "num_layers": shape.layers, "hidden_dim": shape.width,
              "intermediate_dim": 4 * shape.width, "dtype": dtype}
    if name == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(num_heads=shape.heads, max_sequence_length=shape.length,
                                                 dropout=0.0, **common)
        causal_lm = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    elif name == "gemma":
        backbone = keras_hub.models.GemmaBackbone(num_query_heads=shape.heads, num_key_value_heads=shape.heads,
                                                  head_dim=shape.width // shape.heads, **common)
        causal_lm = keras_hub.models.GemmaCausalLM(backbone=backbone, preprocessor=None)
    else:
        backbone = keras_hub.models.LlamaBackbone(num_query_heads=shape.heads, num_key_value_heads=shape.heads,
                                                  **common)
        causal_lm = keras_hub.models.LlamaCausalLM(backbone=backbone, preprocessor=None)
    causal_lm.compile(sampler="greedy")
    return causal_lm


class GenerateStep(tf.Module):
    """``causal_lm.generate_step`` as a signature: token ids and padding mask in, token ids out."""

    def __init__(self, causal_lm, length: int, stop_token: int | None = None) -> None:
        super().__init__()
        self.causal_lm = causal_lm
        stop = None if stop_token is None else (stop_token,)

        def generate(token_ids: tf.Tensor, padding_mask: tf.Tensor) -> dict[str, tf.Tensor]:
            inputs = {"token_ids": token_ids, "padding_mask": padding_mask}
            return {"token_ids": causal_lm.generate_step(inputs, stop_token_ids=stop)["token_ids"]}

        self.generate = tf.function(generate, input_signature=[
            tf.TensorSpec([None, length], tf.int32, name="token_ids"),
            tf.TensorSpec([None, length], tf.bool, name="padding_mask")])


def save_causal_lm(path: str | Path, name: str, shape: CausalLMShape = CausalLMShape(), seed: int = 0,
                   dtype: str | None = None) -> Path:
    """Save :func:`build_causal_lm`'s model's greedy ``generate_step`` as ``serving_default``."""
    module = GenerateStep(build_causal_lm(name, shape, seed, dtype), shape.length)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.generate})
    return Path(path)


def prompt_feeds(shape: CausalLMShape, batch: int, prompt: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Feeds for a saved causal LM: ``prompt`` random tokens, then padding to ``shape.length``."""
    rng = np.random.default_rng(seed)
    token_ids = np.zeros((batch, shape.length), np.int32)
    token_ids[:, :prompt] = rng.integers(1, shape.vocab, (batch, prompt))
    padding_mask = np.zeros((batch, shape.length), bool)
    padding_mask[:, :prompt] = True
    return {"token_ids": token_ids, "padding_mask": padding_mask}
