"""Models on disk for the CLI tests: two SavedModels, GraphDef files, and broken copies.

Names say what a test expects: in the GraphDef, ``allow1`` (MatMul) converts, ``deny1``
(Exp) is on the deny list and ``deny2`` (Relu) is painted deny from it; ``odd`` is a
converted MatMul whose dims (16×12) are not all multiples of 8. In the ``tf.Module``,
``serve`` multiplies by a 5×3 matrix (a Tensor Core hint) and ``other`` by a 16×16 one
(none); ``weights`` has no inputs and only reads a variable.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.framework import graph_pb2

ASSET_TEXT = "alpha\nbeta\n"
# Fetches of the GraphDef built by ``graph_def_with_deny_path``.
GRAPH_FETCHES = ("Identity", "Identity_1")
OVERFLOW_FETCH = "Identity"


def export_keras_model(path: Path) -> None:
    """A Keras 3 Conv2D → Flatten → Dense model written with ``model.export``."""
    import keras

    keras.utils.set_random_seed(0)
    image = keras.Input((8, 8, 3), name="image")
    x = keras.layers.Conv2D(8, 3, activation="relu")(image)
    x = keras.layers.Flatten()(x)
    logits = keras.layers.Dense(4)(x)
    keras.Model(image, logits).export(str(path), verbose=False)


class _Module(tf.Module):
    def __init__(self, asset: Path) -> None:
        super().__init__()
        rng = np.random.default_rng(0)
        self.w = tf.Variable(rng.standard_normal((5, 3)).astype(np.float32), name="w")
        self.w2 = tf.Variable(rng.standard_normal((16, 16)).astype(np.float32), name="w2")
        self.vocab = tf.saved_model.Asset(str(asset))

    @tf.function(input_signature=[tf.TensorSpec([None, 5], tf.float32, name="x")])
    def serve(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": tf.matmul(x, self.w)}

    @tf.function(input_signature=[tf.TensorSpec([None, 16], tf.float32, name="z")])
    def other(self, z: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"out": tf.nn.relu(tf.matmul(z, self.w2))}

    @tf.function(input_signature=[])
    def weights(self) -> tf.Tensor:
        return self.w.read_value()


def save_module(path: Path) -> None:
    """A ``tf.Module`` with three signatures (one without inputs), two variables and an asset."""
    asset = path.parent / f"{path.name}-vocab.txt"
    asset.write_text(ASSET_TEXT, encoding="utf-8")
    module = _Module(asset)
    signatures = {"serving_default": module.serve, "other": module.other, "weights": module.weights}
    tf.saved_model.save(module, str(path), signatures=signatures)


def graph_def_with_deny_path() -> graph_pb2.GraphDef:
    """allow1 (MatMul) → clr1 (Relu) → deny1 (Exp) → deny2 (Relu) → deny3 (AddV2) → Identity;
    x → odd (MatMul 16×12) → Identity_1. From a ``tf.function``."""

    @tf.function(input_signature=[tf.TensorSpec([4, 16], tf.float32, name="x")])
    def graph(x: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
        allow1 = tf.matmul(x, tf.constant(np.full((16, 16), 0.1, np.float32)), name="allow1")
        clr1 = tf.nn.relu(allow1, name="clr1")
        deny1 = tf.exp(clr1, name="deny1")
        deny2 = tf.nn.relu(deny1, name="deny2")
        deny3 = tf.add(deny2, 1.0, name="deny3")
        odd = tf.matmul(x, tf.constant(np.full((16, 12), 0.1, np.float32)), name="odd")
        return deny3, odd

    return graph.get_concrete_function().graph.as_graph_def()


def overflow_graph_def() -> graph_pb2.GraphDef:
    """sum(exp(x @ w + 12)): the Exp's inputs are all above 11.1, so it overflows float16
    (max 65504) once an overlay allows Exp and Sum; with the built-in lists both stay
    float32 and the output is accurate."""

    @tf.function(input_signature=[tf.TensorSpec([4, 16], tf.float32, name="x")])
    def graph(x: tf.Tensor) -> tf.Tensor:
        w = tf.constant(np.random.default_rng(0).uniform(-0.05, 0.05, (16, 16)).astype(np.float32))
        return tf.reduce_sum(tf.exp(tf.matmul(x, w) + 12.0), name="total")

    return graph.get_concrete_function().graph.as_graph_def()


def two_output_graph_def() -> graph_pb2.GraphDef:
    """``pair`` = split(x @ w) into two float outputs: ``pair:0`` overflows float16 (its
    columns of w are 1e4), ``pair:1`` does not. The MatMul converts, ``pair`` is fetched."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4, 16], name="x")
        w = np.concatenate([np.full((16, 8), 1e4, np.float32),
                            np.random.default_rng(0).uniform(-0.1, 0.1, (16, 8)).astype(np.float32)], axis=1)
        product = tf.raw_ops.MatMul(a=x, b=tf.constant(w), name="allow1")
        tf.raw_ops.Split(axis=tf.constant(1), value=product, num_split=2, name="pair")
    return graph.as_graph_def()


def write_graph_def(graph_def: graph_pb2.GraphDef, path: Path) -> Path:
    """``path`` as a binary (.pb) or text (.pbtxt) GraphDef."""
    if path.suffix == ".pbtxt":
        path.write_text(text_format.MessageToString(graph_def), encoding="utf-8")
    else:
        path.write_bytes(graph_def.SerializeToString(deterministic=True))
    return path


def hash_tree(path: Path) -> dict[str, str]:
    """sha256 of every file under ``path`` (or of ``path`` itself), by relative path; dirs as 'dir'."""
    if path.is_file():
        return {".": hashlib.sha256(path.read_bytes()).hexdigest()}
    return {
        str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
        for p in sorted(path.rglob("*"))
    }


TWO_TAG_SETS = ("train", "serve")


def save_two_tag_model(path: Path, tag_sets: tuple[str, ...] = TWO_TAG_SETS) -> None:
    """A TF1 ``Builder`` SavedModel with two MetaGraphDefs, tagged ``train`` (written first)
    and ``serve``, sharing one variable: ``y = relu(x @ w)`` with a 16×16 ``w``. Both
    MetaGraphDefs hold the same graph, so which one was converted shows in their dtypes.
    ``tag_sets=("serve",)``: one MetaGraphDef only."""
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 16], name="x")
        w = tf.compat.v1.get_variable(
            "w", initializer=np.random.default_rng(0).uniform(-0.3, 0.3, (16, 16)).astype(np.float32),
            use_resource=True)
        y = tf.nn.relu(tf.matmul(x, w, name="allow1"), name="y")
        signature = tf.compat.v1.saved_model.predict_signature_def({"x": x}, {"y": y})
        builder = tf.compat.v1.saved_model.Builder(str(path))
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            builder.add_meta_graph_and_variables(session, [tag_sets[0]], signature_def_map={"serving_default": signature})
            for tags in tag_sets[1:]:
                builder.add_meta_graph([tags], signature_def_map={"serving_default": signature})
        builder.save()


EMBEDDING_ROWS = 3  # fewer rows than the 10 ids (0-9) random integer inputs use where no table bounds them


class _Lookup(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = tf.Variable(np.arange(EMBEDDING_ROWS * 8, dtype=np.float32).reshape(EMBEDDING_ROWS, 8) / 10)
        self.w = tf.Variable(np.full((8, 8), 0.1, np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, 4], tf.int32, name="ids")])
    def serve(self, ids: tf.Tensor) -> dict[str, tf.Tensor]:
        vectors = tf.gather(self.table, ids)  # ids ≥ EMBEDDING_ROWS fail on CPU
        return {"y": tf.reduce_sum(tf.matmul(vectors, self.w), axis=1)}


def save_embedding_module(path: Path) -> None:
    """Integer ids (shape [None, 4]) looked up in a 3-row table, then a MatMul."""
    module = _Lookup()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


class _Pick(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.float32, name="x"),
                                  tf.TensorSpec([None, 4], tf.int32, name="ids")])
    def serve(self, x: tf.Tensor, ids: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"y": tf.reduce_sum(tf.gather(x, ids, axis=1), axis=1)}  # x's width is the caller's


def save_unbounded_gather_module(path: Path) -> None:
    """Integer ids picking columns of ``x``, whose width no shape in the graph says: random
    ids cannot be bounded (random x is 2 wide: unknown dims are 2)."""
    module = _Pick()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


class _Text(tf.Module):
    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def serve(self, text: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"length": tf.cast(tf.strings.length(text), tf.float32)}


def save_string_module(path: Path) -> None:
    """A signature whose only input is a string: random inputs cannot be made for it."""
    module = _Text()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


VOCABULARY = ("the", "cat", "sat", "on", "mat")  # any other token is id len(VOCABULARY): out of vocabulary


class _Vocabulary(tf.Module):
    """Tokens → ids (a StaticHashTable, as a vocabulary layer keeps it) → embedding → Dense."""

    def __init__(self) -> None:
        super().__init__()
        self.table = tf.lookup.StaticHashTable(
            tf.lookup.KeyValueTensorInitializer(tf.constant(VOCABULARY), tf.range(len(VOCABULARY), dtype=tf.int64)),
            default_value=len(VOCABULARY))
        rng = np.random.default_rng(6)
        self.embedding = tf.Variable(rng.standard_normal((len(VOCABULARY) + 1, 16)).astype(np.float32))
        self.w = tf.Variable(rng.uniform(-0.3, 0.3, (16, 8)).astype(np.float32))

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.string, name="tokens")])
    def serve(self, tokens: tf.Tensor) -> dict[str, tf.Tensor]:
        vectors = tf.reduce_mean(tf.gather(self.embedding, self.table.lookup(tokens)), axis=1)
        return {"scores": tf.matmul(vectors, self.w)}


def save_vocabulary_module(path: Path) -> None:
    """A vocabulary model: a [batch, tokens] string input looked up in a hash table."""
    module = _Vocabulary()
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve})


def save_tf1_text_model(path: Path) -> None:
    """A TF1 ``Builder`` text model: sentences (a [batch] string placeholder) split on spaces,
    hashed into 32 buckets, embedded, averaged, then a MatMul."""
    graph = tf.Graph()
    with graph.as_default():
        sentences = tf.compat.v1.placeholder(tf.string, [None], name="sentences")
        tokens = tf.compat.v1.string_split(sentences, " ")
        ids = tf.SparseTensor(tokens.indices, tf.strings.to_hash_bucket_fast(tokens.values, 32), tokens.dense_shape)
        rng = np.random.default_rng(7)
        embedding = tf.compat.v1.get_variable("embedding", initializer=rng.standard_normal((32, 16)).astype(np.float32),
                                              use_resource=True)
        w = tf.compat.v1.get_variable("w", initializer=rng.uniform(-0.3, 0.3, (16, 8)).astype(np.float32),
                                      use_resource=True)
        pooled = tf.nn.embedding_lookup_sparse(embedding, ids, None, combiner="mean")
        scores = tf.identity(tf.matmul(pooled, w, name="dense"), name="scores")
        signature = tf.compat.v1.saved_model.predict_signature_def({"sentences": sentences}, {"scores": scores})
        builder = tf.compat.v1.saved_model.Builder(str(path))
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(tf.compat.v1.global_variables_initializer())
            builder.add_meta_graph_and_variables(session, ["serve"], signature_def_map={"serving_default": signature})
        builder.save()


class _Weights(tf.Module):
    """Variables for the weights tests, named by how they are read: ``shared`` by MatMuls
    of two signatures, ``looped`` by a MatMul in a while loop's body, ``table`` by a
    ResourceGather whose rows a MatMul reads, ``mixed`` by a MatMul and by Exp (deny:
    float32); an asset besides."""

    def __init__(self, asset: Path) -> None:
        super().__init__()
        rng = np.random.default_rng(3)
        self.shared = tf.Variable(rng.standard_normal((8, 8)).astype(np.float32) / 3, name="shared")
        self.looped = tf.Variable(rng.standard_normal((8, 8)).astype(np.float32) / 3, name="looped")
        self.table = tf.Variable(rng.standard_normal((10, 8)).astype(np.float32), name="table")
        self.mixed = tf.Variable(rng.standard_normal((8, 4)).astype(np.float32) / 3, name="mixed")
        self.vocab = tf.saved_model.Asset(str(asset))

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x"),
                                  tf.TensorSpec([None], tf.int32, name="ids")])
    def serve(self, x: tf.Tensor, ids: tf.Tensor) -> dict[str, tf.Tensor]:
        hidden = tf.matmul(x, self.shared) + tf.nn.embedding_lookup(self.table, ids)
        _, hidden = tf.while_loop(lambda i, h: i < 3, lambda i, h: (i + 1, tf.nn.relu(tf.matmul(h, self.looped))),
                                  (tf.constant(0), hidden))
        return {"y": tf.matmul(hidden, self.mixed)}

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")])
    def other(self, x: tf.Tensor) -> dict[str, tf.Tensor]:
        return {"out": tf.nn.relu(tf.matmul(x, self.shared)), "norm": tf.reduce_sum(tf.exp(self.mixed))}


WEIGHTS_LOW = ("shared", "looped", "table")  # _Weights' variables every reader reads through a cast


def save_weights_module(path: Path) -> None:
    """``_Weights`` with two signatures sharing ``shared``."""
    asset = path.parent / f"{path.name}-vocab.txt"
    asset.write_text(ASSET_TEXT, encoding="utf-8")
    module = _Weights(asset)
    tf.saved_model.save(module, str(path), signatures={"serving_default": module.serve, "other": module.other})
