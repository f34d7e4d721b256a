"""The oracle where grappler cannot answer, and the recording that stands in for it."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import tensorflow as tf
from conftest import assert_colours, check_against_grappler, graph_def_of
from tensorflow.core.framework.graph_pb2 import GraphDef

import conftest
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
    test fails (it is not skipped), naming the tool that records answers and, where the
    recording holds this test's question about something else, what differs."""
    monkeypatch.setattr(recorded_grappler, "_installed_release", lambda: recorded_grappler.LISTS_TENSORFLOW)
    with pytest.raises(recorded_grappler.MissingAnswer, match="re-run tools/record_grappler.py"):
        recorded_grappler.rewrite(_never_recorded(), target="float16", fetches=["fetch"])
    earlier = {"kind": "rewrite", "target": "float16", "fetches": ["other"], "our_lists": True, "environ": {},
               "graph": "0" * 16, "tests": [recorded_grappler._current_test()]}
    monkeypatch.setitem(recorded_grappler._store().index["answers"], "earlier", earlier)
    with pytest.raises(recorded_grappler.MissingAnswer, match="this test's file the same with another fetches, graph;"):
        recorded_grappler.rewrite(_never_recorded(), target="float16", fetches=["fetch"])


def _recorded_for_this_test(monkeypatch: pytest.MonkeyPatch, **question: object) -> None:
    """The recording holds, for the running test, a rewrite question with another graph."""
    earlier = {"kind": "rewrite", "target": "float16", "fetches": ["fetch"], "our_lists": True, "environ": {},
               "graph": "0" * 16, "tests": [recorded_grappler._current_test()], **question}
    monkeypatch.setitem(recorded_grappler._store().index["answers"], "earlier", earlier)


def test_another_release_makes_no_comparison_and_the_test_goes_on(
    replaying: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another TensorFlow release may build a test's graph otherwise (README: conformance on
    older releases): the recording asked this test the same with another graph, so only the
    grappler comparison is left out, and counted with its reason; the test's own
    assertions still run, and still fail when wrong."""
    monkeypatch.setattr(recorded_grappler, "_installed_release", lambda: "2.16")
    monkeypatch.setattr(recorded_grappler, "comparisons", Counter())  # not comparisons the summary counts
    monkeypatch.setattr(recorded_grappler, "tests_without_answer", {})  # nor a test it names
    _recorded_for_this_test(monkeypatch)
    rewrites = check_against_grappler(_never_recorded(), "float16", ["fetch"])
    assert rewrites.grappler is None and rewrites.agreement is None
    assert recorded_grappler.comparisons == Counter({("float16", "built otherwise"): 1})
    assert recorded_grappler.tests_without_answer == {recorded_grappler._current_test(): (
        f"TensorFlow {tf.__version__} builds this rewrite float16 question's graph otherwise than TensorFlow"
        f" {recorded_grappler.LISTS_TENSORFLOW}, whose answers are recorded")}
    assert_colours(rewrites, lowered=["allow1"], casts=2)
    with pytest.raises(AssertionError, match="allow1: DT_HALF, expected DT_FLOAT"):
        assert_colours(rewrites, kept=["allow1"])
    with pytest.raises(pytest.skip.Exception, match="^nothing to compare: TensorFlow .* builds this rewrite float16"):
        recorded_grappler.skip_comparison()
    recorded_grappler.tests_without_answer.clear()  # this run's summary names none of this test's making


@pytest.mark.parametrize("recorded, said", [
    (None, "the recording holds no question of this test's file"),
    ({"fetches": ["other"]}, "the recording asked this test's file the same with another fetches, graph"),
    ({"environ": {"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL": "TREAT_INFER_AS_DENY"}},
     "the recording asked this test's file the same with another environ, graph"),
], ids=["test-never-recorded", "other-fetches", "other-environ"])
def test_a_stale_recording_fails_on_another_release_too(
    replaying: None, monkeypatch: pytest.MonkeyPatch, recorded: dict | None, said: str
) -> None:
    """Another release explains only another graph: a test file the recording never heard
    of, or a question it now asks with other fetches or variables, is a stale recording
    there too, and fails naming what differs, never a silent skip."""
    monkeypatch.setattr(recorded_grappler, "_installed_release", lambda: "2.16")
    monkeypatch.setattr(recorded_grappler, "comparisons", Counter())
    monkeypatch.setattr(recorded_grappler, "tests_without_answer", {})
    if recorded is not None:
        _recorded_for_this_test(monkeypatch, **recorded)
    with pytest.raises(recorded_grappler.MissingAnswer, match=re.escape(f"; {said}; so the recording is stale")):
        recorded_grappler.rewrite(_never_recorded(), target="float16", fetches=["fetch"])
    assert recorded_grappler.comparisons == Counter() and recorded_grappler.tests_without_answer == {}


SUMMARY_PROBE = """
import os
import recorded_grappler


def _no_answer(why):
    recorded_grappler.comparisons[("float16", "built otherwise")] += 1
    recorded_grappler.tests_without_answer[recorded_grappler._current_test()] = why


def test_goes_on():
    _no_answer("built otherwise here")


def test_only_compares():
    _no_answer("built otherwise here")
    recorded_grappler.skip_comparison()


def test_other_reason():
    _no_answer("another reason")
"""


def test_the_summary_counts_and_names_tests_without_an_answer_under_xdist(tmp_path: Path) -> None:
    """``make test`` runs pytest-xdist workers (-n 2; one here is the same path): the tests
    that made no comparison reach the controller's summary, with how each ended and why,
    and the counts per target."""
    (tmp_path / "test_probe.py").write_text(SUMMARY_PROBE, encoding="utf-8")
    process = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "1", "-p", "conftest", "-p", "no:cacheprovider",
         "--rootdir", str(tmp_path), str(tmp_path / "test_probe.py")],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)]),
             recorded_grappler.RECORD: "0"},
    )
    assert process.returncode == 0, process.stdout + process.stderr
    lines = process.stdout.splitlines()
    assert any(line.startswith("float16: 0 recorded answers compared;") and line.endswith(
        "; 3 not made: this TensorFlow builds their graphs otherwise") for line in lines), process.stdout
    start = lines.index("tests that made no comparison for lack of an answer (2 passed, 1 skipped; the passed and"
                        " failed ones still ran their own assertions):")
    assert lines[start + 1:start + 3] == [
        "  another reason: test_probe.py::test_other_reason",
        "  built otherwise here: test_probe.py::test_goes_on, test_probe.py::test_only_compares"], process.stdout


def test_a_changed_oracle_input_fails_naming_it(replaying: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A recorded answer holds the inputs the oracle gave grappler besides the graph; if
    they differ now (here the ops held float32), replaying it fails and says which input
    changed and how, before any answer is compared."""
    graph_def = _matmul_graph()
    names = recorded_grappler._canonical_names(graph_def)
    canonical = recorded_grappler._canonical(graph_def, names).SerializeToString(deterministic=True)
    question = {"kind": "rewrite", "target": "bfloat16", "fetches": ["fetch"], "our_lists": True, "environ": {}}
    key = recorded_grappler._key(question, canonical)
    inputs = {"held_float32": ["Erfc", "Tanh"], "stand_ins": []}
    monkeypatch.setitem(recorded_grappler._store().key_to_answer, key, canonical)
    monkeypatch.setitem(recorded_grappler._store().index["answers"], key, {**question, "oracle_inputs": inputs})
    monkeypatch.setattr(recorded_grappler, "comparisons", Counter())
    held = sorted(reference.held_float32_ops("bfloat16") - {"Erfc"})
    with pytest.raises(recorded_grappler.ChangedInput,
                       match=re.escape(f"held_float32: now adds {[json.dumps(op) for op in held]} and drops ['\"Tanh\"']")):
        recorded_grappler.rewrite(graph_def, target="bfloat16", fetches=["fetch"])


def test_the_oracle_reads_the_held_ops_from_the_yaml_file() -> None:
    """The ops the oracle holds float32 come from lists/<target>.yaml as written, not from
    the loader under test."""
    text = (ROOT / "lists" / "bfloat16.yaml").read_text(encoding="utf-8")
    section = text[text.index("\nfloat32:"):]
    assert reference.held_float32_ops("bfloat16") == set(re.findall(r"^    (\w+):", section, re.MULTILINE))
    assert reference.held_float32_ops("float16") == set()


def _fresh_store(monkeypatch: pytest.MonkeyPatch, path: Path) -> recorded_grappler._Store:
    monkeypatch.setattr(recorded_grappler, "ANSWERS", path)
    monkeypatch.setattr(recorded_grappler, "_STORE", None)
    return recorded_grappler._store()


def test_recording_part_of_the_suite_merges_and_the_whole_suite_replaces(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A recording run of part of the suite adds its answers to the file and keeps the
    rest; one of the whole suite keeps exactly its own; a failed run writes nothing. The
    run's summary line says which happened."""
    path = tmp_path / "answers.zip"
    _fresh_store(monkeypatch, path).put("first", {"kind": "lists", "target": "float16"}, {}, b"1")
    assert recorded_grappler.write_recording(whole_suite=True) == (1, 0)
    _fresh_store(monkeypatch, path).put("second", {"kind": "lists", "target": "float16"}, {}, b"2")
    assert recorded_grappler.write_recording(whole_suite=False) == (2, 1)
    assert set(_fresh_store(monkeypatch, path).key_to_answer) == {"first", "second"}

    monkeypatch.setenv(recorded_grappler.RECORD, "1")
    monkeypatch.setitem(conftest._RUN, "deselected", False)  # as in a run without -k
    tests = str(ROOT / "tests")
    for args, status, said in (
        ([tests + "/test_lists.py"], 1, "not written: the run failed"),
        ([tests + "/test_lists.py"], 0, "merged 0 into answers.zip, which keeps 2 earlier answers (a part of"),
        ([tests], 0, "recorded 0 into answers.zip, replacing it (the whole suite ran)"),
    ):
        _fresh_store(monkeypatch, path)
        session = SimpleNamespace(config=SimpleNamespace(args=args), shouldstop=False)
        conftest.pytest_sessionfinish(session, status)
        assert session.config._amp_recorded.startswith(said), session.config._amp_recorded
    assert _fresh_store(monkeypatch, path).key_to_answer == {}


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
    inputs = {"held_float32": [], "stand_ins": []}
    monkeypatch.setitem(recorded_grappler._store().index["answers"], key, {**question, "oracle_inputs": inputs})
    with pytest.raises(AssertionError, match="differs from live grappler's: re-run tools/record_grappler.py"):
        recorded_grappler.rewrite(graph_def, target="float16", fetches=["fetch"])
