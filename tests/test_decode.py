"""Decode loops: a converted greedy decode loop carries its KV cache low from one iteration to the next.

Grappler paints a loop body alone, so each loop value stays float32 and the body casts the
cache down and up on every iteration (spec §2.7, §6). ``amp-rewrite convert`` links loop
boundaries by default (``cross_function="loops"``), and there an in-place update of the
cache (``TensorScatterUpdate``, keras' ``XlaDynamicUpdateSlice``) is a clear op, so:

1. the cache the ``While`` carries is in the target dtype, and an iteration runs fewer
   casts than grappler's (none at all in the plain-TensorFlow loop once its weights are
   stored low);
2. the Python API's default still equals grappler (loop values float32);
3. the converted SavedModel reloads, serves, and generates float32's tokens (prefix agreement).

Checked on :mod:`amp_rewrite.testing.decode`'s plain-TensorFlow loop, and on keras_hub's
GPT-2 ``generate_step`` where keras_hub is installed.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.framework.graph_pb2 import GraphDef

import amp_rewrite
from amp_rewrite.calibration import validate
from amp_rewrite.calibration.savedmodel import effective_lists, read_model, rewrite_model
from amp_rewrite.calibration.validate import identical_prefixes
from amp_rewrite.errors import AmpRewriteError, ModelError
from amp_rewrite.testing.decode import CausalLMShape, DecodeShape, prompt_feeds, save_causal_lm, save_decode_loop
from amp_rewrite.testing.loops import LOOP_OPS, casts_per_iteration

from test_cli import assert_ok, run_cli

SHAPE = DecodeShape(vocab=64, width=32, prompt=4, length=16)
LM_SHAPE = CausalLMShape(vocab=64, width=32, layers=2, heads=2, length=16)


def loop_dtypes(graph_def: GraphDef) -> list[int]:
    """The loop values' dtypes (``T``) of the graph's one functional While."""
    loops = [node for f in graph_def.library.function for node in f.node_def if node.op in LOOP_OPS]
    assert len(loops) == 1, f"expected one loop, found {len(loops)}"
    return list(loops[0].attr["T"].list.type)


def float_loop_values(source: GraphDef, converted: GraphDef) -> list[int]:
    """The converted dtypes of the loop values that were float32 in ``source``."""
    return [after for before, after in zip(loop_dtypes(source), loop_dtypes(converted)) if before == types_pb2.DT_FLOAT]


@pytest.fixture(scope="module")
def decode_loop(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_decode_loop(tmp_path_factory.mktemp("decode") / "model", SHAPE)


def test_linked_loops_keep_the_cache_low_and_cast_less_per_iteration(decode_loop: Path) -> None:
    """Loops linked: both caches are carried in bfloat16, and an iteration runs fewer casts
    than with grappler's boundaries, which keep them float32. (float16 is a GPU target, and
    the GPU kernel registry this rewrite reads has no float16 TensorScatterUpdate.)"""
    target = "bfloat16"
    model = read_model(decode_loop)
    lists = effective_lists(target)
    grappler = rewrite_model(model, target=target, lists=lists).graph_def
    linked = rewrite_model(model, target=target, lists=lists, cross_function="loops").graph_def
    assert float_loop_values(model.graph_def, grappler) == [types_pb2.DT_FLOAT] * 2
    assert float_loop_values(model.graph_def, linked) == [types_pb2.DT_BFLOAT16] * 2
    (grappler_casts,), (linked_casts,) = casts_per_iteration(grappler).values(), casts_per_iteration(linked).values()
    assert linked_casts < grappler_casts


def test_python_api_default_keeps_grappler_loop_boundaries(decode_loop: Path) -> None:
    """``rewrite_graph_def``'s default is grappler's: no loop value changes dtype."""
    model = read_model(decode_loop)
    result = amp_rewrite.rewrite_graph_def(model.graph_def, target="bfloat16", fetches=model.fetches,
                                           entry_functions=model.entry_functions, roots=model.entry_functions)
    assert loop_dtypes(result.graph_def) == loop_dtypes(model.graph_def)


def test_cross_function_value_is_checked(decode_loop: Path) -> None:
    model = read_model(decode_loop)
    with pytest.raises(AmpRewriteError, match=r"cross_function='loop': choose False .* or 'loops'"):
        amp_rewrite.rewrite_graph_def(model.graph_def, target="bfloat16", cross_function="loop")


def serve(path: Path, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """The first output of ``serving_default`` of the SavedModel at ``path``."""
    signature = tf.saved_model.load(str(path)).signatures["serving_default"]
    return next(iter(signature(**{name: tf.constant(value) for name, value in feeds.items()}).values())).numpy()


def mean_identical_prefix(path: Path, converted: Path, feeds: dict[str, np.ndarray]) -> float:
    reference, candidate = serve(path, feeds), serve(converted, feeds)
    assert reference.shape == candidate.shape and candidate.dtype == np.int32
    prefixes, length = identical_prefixes(reference, candidate)
    return float(np.mean(prefixes)) / length


def test_convert_runs_no_cast_per_iteration_and_serves_float32s_tokens(decode_loop: Path, tmp_path: Path) -> None:
    """``convert``'s default: the caches low, the weights stored low, so an iteration casts
    nothing; the copy reloads and generates what float32 generates."""
    run = run_cli("convert", decode_loop, tmp_path / "out", "--target", "bfloat16")
    assert_ok(run)
    assert "Loops: 2 of 2 float32 loop value(s) carried in bfloat16 across iterations" in run.out
    converted = read_model(tmp_path / "out").graph_def
    assert list(casts_per_iteration(converted).values()) == [0]
    feeds = {"token_ids": np.random.default_rng(1).integers(0, SHAPE.vocab, (2, SHAPE.prompt), dtype=np.int32)}
    assert mean_identical_prefix(decode_loop, tmp_path / "out", feeds) >= 0.75


def test_keras_hub_gpt2_decode_loop_carries_its_cache_low(tmp_path: Path) -> None:
    """keras_hub's GPT-2 ``generate_step`` (greedy, cache updated by ``XlaDynamicUpdateSlice``):
    converted, its cache is carried in bfloat16 and an iteration casts less than grappler's."""
    pytest.importorskip("keras_hub")
    source = save_causal_lm(tmp_path / "gpt2", "gpt2", LM_SHAPE)
    run = run_cli("convert", source, tmp_path / "out", "--target", "bfloat16")
    assert_ok(run)
    model = read_model(source)
    converted = read_model(tmp_path / "out").graph_def
    assert float_loop_values(model.graph_def, converted) == [types_pb2.DT_BFLOAT16]
    grappler = rewrite_model(model, target="bfloat16", lists=effective_lists("bfloat16")).graph_def
    assert list(casts_per_iteration(converted).values())[0] < list(casts_per_iteration(grappler).values())[0]
    feeds = prompt_feeds(LM_SHAPE, batch=2, prompt=4)
    assert mean_identical_prefix(source, tmp_path / "out", feeds) >= 0.5


def test_a_data_dependent_stop_that_changes_the_length_is_compared_not_crashed(tmp_path: Path) -> None:
    """Rule: sequences of another length after conversion (a loop that stops at an end token)
    are compared by prefix agreement, the missing tokens counting as differences, and the
    line says so; a floating output whose shape changed is refused in one line."""
    prompt = {"token_ids": np.array([[1, 2, 3, 4]], np.int32)}
    full = save_decode_loop(tmp_path / "full", replace(SHAPE, trim=True))
    tokens = serve(full, prompt)[0]
    stop = int(tokens[SHAPE.prompt + 2])  # the third generated token ends the other loop
    assert stop not in tokens[SHAPE.prompt:SHAPE.prompt + 2], "pick a prompt whose stop token comes third"
    stopped = save_decode_loop(tmp_path / "stopped", replace(SHAPE, stop_token=stop, trim=True))
    (error,) = validate.validate_saved_models(read_model(full), stopped, {"serving_default": [prompt]}, random=False)
    assert error.metric == "prefix-agreement"
    assert error.error == pytest.approx(1 - (SHAPE.prompt + 3) / SHAPE.length)
    assert (f"differs in length (float32 {SHAPE.length} vs converted {SHAPE.prompt + 3} tokens): a data-dependent"
            " stop; the missing tokens count as differences") in error.describe()
    pairs = {("serving_default", "logits"): [(np.zeros((1, 4), np.float32), np.zeros((1, 3), np.float32))]}
    with pytest.raises(ModelError, match=r"output 'logits': float32 gives shape \(1, 4\), the conversion \(1, 3\)"):
        validate._errors("p99-rel", pairs)


def test_a_read_only_weights_cast_runs_once_before_the_loop(decode_loop: Path, tmp_path: Path) -> None:
    """Rule: with loops linked, a weight the body only reads, kept float32 (here by
    --float32-weights), is read and cast once before the loop and enters it as a loop
    value; the body casts no weight, and the tokens are those of the cast in the body."""
    assert_ok(run_cli("convert", decode_loop, tmp_path / "out", "--target", "bfloat16", "--float32-weights"))
    converted = read_model(tmp_path / "out").graph_def
    nodes = {f.signature.name: {n.name: n for n in f.node_def} for f in converted.library.function}
    (body,) = casts_per_iteration(converted)
    weight_casts = [n for n in nodes[body].values() if n.op == "Cast" and nodes[body].get(
        n.input[0].split(":")[0], n).op == "ReadVariableOp"]
    assert weight_casts == []
    hoisted = [n for f in nodes.values() for n in f.values() if "/hoisted/" in n.name and n.op == "Cast"]
    assert len(hoisted) == 5  # query, key, value, mix and unembedding; the embedding is gathered
    assert loop_dtypes(converted)[-5:] == [types_pb2.DT_BFLOAT16] * 5
    model = read_model(decode_loop)
    in_body = rewrite_model(model, target="bfloat16", lists=effective_lists("bfloat16")).graph_def
    assert list(casts_per_iteration(converted).values())[0] < list(casts_per_iteration(in_body).values())[0]
    feeds = {"token_ids": np.random.default_rng(2).integers(0, SHAPE.vocab, (2, SHAPE.prompt), dtype=np.int32)}
    stored_low = tmp_path / "low"
    assert_ok(run_cli("convert", decode_loop, stored_low, "--target", "bfloat16"))
    np.testing.assert_array_equal(serve(tmp_path / "out", feeds), serve(stored_low, feeds))


def test_a_weight_the_loop_writes_is_cast_inside_it_every_iteration(tmp_path: Path) -> None:
    """Rule: only a weight the body merely reads is cast once before the loop; one the body
    also writes (here halved each iteration) changes between iterations, so its read and
    cast stay in the body, and the result equals float32's at the target's tolerance."""
    module = tf.Module()
    module.weight = tf.Variable(np.eye(8, dtype=np.float32) * 1.5)

    @tf.function(input_signature=[tf.TensorSpec([None, 8], tf.float32, name="x")])
    def decay(x: tf.Tensor) -> dict[str, tf.Tensor]:
        def body(step: tf.Tensor, value: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
            value = tf.matmul(value, module.weight)
            module.weight.assign(module.weight * 0.5)
            return step + 1, value
        return {"y": tf.while_loop(lambda step, _: step < 4, body, (tf.constant(0), x))[1]}

    tf.saved_model.save(module, str(tmp_path / "source"), signatures={"serving_default": decay})
    assert_ok(run_cli("convert", tmp_path / "source", tmp_path / "out", "--target", "bfloat16"))
    converted = read_model(tmp_path / "out").graph_def
    assert not [n for f in converted.library.function for n in f.node_def if "/hoisted/" in n.name]
    feeds = {"x": np.random.default_rng(3).standard_normal((2, 8)).astype(np.float32)}
    np.testing.assert_allclose(serve(tmp_path / "out", feeds), serve(tmp_path / "source", feeds), rtol=0.05, atol=0.02)
