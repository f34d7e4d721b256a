"""A greedy decode loop with a KV cache, in plain TensorFlow, saved as a SavedModel.

The shape of an LLM's ``generate_step`` without keras_hub: token ids in, token ids out,
one ``While`` loop whose body embeds the last token, writes its key and value into a cache
preallocated to the full length (``TensorScatterUpdate``), attends over the cache and
picks the next token by argmax. The cache and the token ids are carried across
iterations; the weights are variables read inside the body. With ``stop_token`` the
loop also ends once every sequence has produced it: a data-dependent trip count.
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
        _, tokens, _, _ = tf.while_loop(
            self._running, self._step, (tf.constant(1), tokens, cache, cache), maximum_iterations=shape.length - 1)
        return {"tokens": tokens}

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
