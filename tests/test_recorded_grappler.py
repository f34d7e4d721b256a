"""The oracle where grappler cannot answer, and the recording that stands in for it."""
from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import tensorflow as tf
from conftest import graph_def_of
from tensorflow.core.framework.graph_pb2 import GraphDef

import recorded_grappler
from amp_rewrite.testing import reference

ROOT = Path(__file__).resolve().parent.parent


def _matmul_graph() -> GraphDef:
    def build() -> None:
        x = tf.compat.v1.placeholder(tf.float32, [4, 4], name="x")
        tf.raw_ops.Identity(input=tf.raw_ops.MatMul(a=x, b=x, name="allow1"), name="fetch")

    return graph_def_of(build)


def test_bfloat16_grappler_says_it_cannot_run_without_avx512f(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a CPU without AVX512F run_grappler raises one clear line instead of returning
    the graph unchanged; the float16 pass (a virtual GPU) runs on any CPU."""
    monkeypatch.setenv(reference.SIMULATE_NO_AVX512F, "1")
    with pytest.raises(reference.GrapplerUnavailable, match="^grappler's bfloat16 pass needs a CPU with AVX512F; "):
        reference.run_grappler(_matmul_graph(), target="bfloat16", fetches=["fetch"])
    assert reference.unavailable_reason("float16") is None
    allow1 = next(n for n in reference.run_grappler(_matmul_graph(), target="float16").node if n.name == "allow1")
    assert allow1.attr["T"].type == tf.float16.as_datatype_enum


def test_compare_tool_prints_the_line_and_exits_2(tmp_path: Path) -> None:
    path = tmp_path / "graph.pb"
    path.write_bytes(_matmul_graph().SerializeToString())
    process = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "compare_with_grappler.py"), "--graph", str(path), "--fetch", "fetch",
         "--target", "bfloat16"],
        capture_output=True, text=True,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", reference.SIMULATE_NO_AVX512F: "1"},
    )
    assert process.returncode == 2, process.stderr
    assert process.stderr.strip().splitlines()[-1].startswith(
        "error: grappler's bfloat16 pass needs a CPU with AVX512F"), process.stderr


@pytest.fixture
def replaying(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about replaying; a recording run must not record their questions."""
    monkeypatch.setenv(recorded_grappler.RECORD, "0")


def _never_recorded() -> GraphDef:
    def build() -> None:
        x = tf.compat.v1.placeholder(tf.float32, [3, 5], name="never_recorded")
        tf.raw_ops.Identity(input=tf.raw_ops.MatMul(a=x, b=x, transpose_b=True, name="allow1"), name="fetch")

    return graph_def_of(build)


def test_a_question_nobody_recorded_fails_and_says_how_to_record(
    replaying: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On the release the answers come from, a graph no test recorded has no answer: the
    test fails (it is not skipped), naming the tool that records answers."""
    monkeypatch.setattr(recorded_grappler, "_installed_release", lambda: recorded_grappler.LISTS_TENSORFLOW)
    with pytest.raises(recorded_grappler.MissingAnswer, match="re-run tools/record_grappler.py"):
        recorded_grappler.rewrite(_never_recorded(), target="float16", fetches=["fetch"])


def test_another_release_skips_a_graph_it_builds_otherwise(replaying: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another TensorFlow release may build a test's graph otherwise: that comparison is
    skipped with the reason, not failed (README: conformance on older releases)."""
    monkeypatch.setattr(recorded_grappler, "_installed_release", lambda: "2.16")
    monkeypatch.setattr(recorded_grappler, "comparisons", Counter())  # not a comparison the summary counts
    with pytest.raises(pytest.skip.Exception, match="builds this graph otherwise than TensorFlow 2.21"):
        recorded_grappler.rewrite(_never_recorded(), target="float16", fetches=["fetch"])


def test_function_names_from_tensorflow_counters_do_not_change_the_key() -> None:
    """The same tf.function traced twice gets new ``__inference_..._N`` names; its
    canonical form, and so its key, stays the same, and maps back to the new names."""
    def trace() -> GraphDef:
        @tf.function
        def inner(x):
            return tf.matmul(x, x)

        @tf.function(input_signature=[tf.TensorSpec([2, 2], tf.float32)])
        def outer(x):
            return inner(x) + 1.0

        return outer.get_concrete_function().graph.as_graph_def()

    first, second = trace(), trace()
    assert {f.signature.name for f in first.library.function} != {f.signature.name for f in second.library.function}
    canonical = [
        recorded_grappler._canonical(g, recorded_grappler._canonical_names(g)).SerializeToString(
            deterministic=True)
        for g in (first, second)
    ]
    assert canonical[0] == canonical[1]
    names = recorded_grappler._canonical_names(second)
    back = recorded_grappler._renamed(recorded_grappler._renamed(second, names), {v: k for k, v in names.items()})
    assert back == second


def test_a_stale_recorded_answer_fails_where_grappler_answers(replaying: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recorded answer that differs from live grappler's fails the test asking for it."""
    reason = recorded_grappler.live_unavailable("float16")
    if reason is not None:
        pytest.skip(f"live grappler cannot answer: {reason}")
    graph_def = _matmul_graph()
    names = recorded_grappler._canonical_names(graph_def)
    canonical = recorded_grappler._canonical(graph_def, names)
    question = {"kind": "rewrite", "target": "float16", "fetches": ["fetch"], "our_lists": True, "environ": {}}
    key = recorded_grappler._key(question, canonical.SerializeToString(deterministic=True))
    # A "recording" in which grappler left the graph as it was: allow1 stays float32.
    monkeypatch.setattr(recorded_grappler, "comparisons", Counter())  # not a comparison the summary counts
    monkeypatch.setitem(recorded_grappler._store().key_to_answer, key, canonical.SerializeToString(deterministic=True))
    with pytest.raises(AssertionError, match="differs from live grappler's: re-run tools/record_grappler.py"):
        recorded_grappler.rewrite(graph_def, target="float16", fetches=["fetch"])
