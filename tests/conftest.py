"""Shared helpers for tests that hold amp_rewrite against TensorFlow's grappler pass.

A conformance test builds a small float32 graph, then
``check_against_grappler`` rewrites it with ``amp_rewrite.rewrite_graph_def`` and
with grappler itself (``amp_rewrite.testing.reference.run_grappler``, spec §8) and
asserts both agree; ``assert_colours`` checks the spec's expectations on both
results, and ``assert_numerics_match`` runs the original and our rewrite on CPU.

Vertex notation used by ``assert_colours`` and ``dtype_of``: ``"allow1"`` is attr
``T`` of node allow1, ``"deny2:Ta"`` another attr, ``"clr1:T[2]"`` element 2 of a
``list(type)`` attr. ``assert_colours(..., function="f")`` looks inside library
function ``f`` instead, as grappler's item for it sees the body (spec §1.2).
"""
from __future__ import annotations

import collections
import os
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

# Hypothesis keeps a cache of the source's constants under .hypothesis/ in the working
# directory; a test must not write into the checkout (test_tools checks the tools' runs).
os.environ.setdefault("HYPOTHESIS_STORAGE_DIRECTORY", os.path.join(tempfile.gettempdir(), "amp-rewrite-hypothesis"))
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.framework.graph_pb2 import GraphDef

import amp_rewrite
import recorded_grappler
from amp_rewrite.core.float8.inference import MIN_TENSORFLOW as FLOAT8_MIN_TENSORFLOW
from amp_rewrite.core.target import NAME_TO_TARGET, TARGETS
from amp_rewrite._tf import tensorflow_version
from amp_rewrite.testing.models import LEARNING_RATE, GraphRun, ModelGraph, run_model_graph
from amp_rewrite.testing.reference import Agreement, compare_rewrites, count_amp_casts, function_body

TARGET_TO_DTYPE = {name: target.dtype for name, target in NAME_TO_TARGET.items()}
# Relative tolerance of a mixed-precision result against float32 (11 vs 8 mantissa bits).
TARGET_TO_TOLERANCE = {name: target.tolerance for name, target in NAME_TO_TARGET.items()}


def within_points(accuracy: float, other: float, points: float) -> bool:
    """Two accuracies at most ``points`` percentage points apart. They are float32 fractions of
    a test set, so exactly the bound can come out above it (6 of 300 samples: 0.0200000405)."""
    return abs(accuracy - other) <= points / 100 + 1e-6


# The float8 target and FP8 training need TensorFlow 2.18+ (amp_rewrite.core.float8.inference.MIN_TENSORFLOW).
FLOAT8_SUPPORTED = tensorflow_version() >= FLOAT8_MIN_TENSORFLOW
NEEDS_FLOAT8 = pytest.mark.skipif(not FLOAT8_SUPPORTED, reason=f"float8 needs TensorFlow 2.18+ (XLA before it drops a"
                                                               f" float8 round trip); this is {tf.version.VERSION}")
_ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"


@pytest.fixture
def no_live_rewrite() -> Iterator[None]:
    """The test starts and ends with no live rewrite and Keras' float32 policy (training
    tests name it in their ``pytestmark``)."""
    import keras

    from amp_rewrite.training import live

    live.stop()
    keras.config.set_dtype_policy("float32")
    yield
    live.stop()
    keras.config.set_dtype_policy("float32")


@pytest.fixture(autouse=True)
def _no_amp_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Both implementations read TF_AUTO_MIXED_PRECISION_* (spec §4); start every test clean."""
    for key in [key for key in os.environ if key.startswith(_ENV_PREFIX)]:
        monkeypatch.delenv(key)


def graph_def_of(build: Callable[[], object]) -> GraphDef:
    """Run ``build`` in a fresh ``tf.Graph`` and return its GraphDef."""
    graph = tf.Graph()
    with graph.as_default():
        build()
    return graph.as_graph_def()


@dataclass(frozen=True)
class Rewrites:
    """One graph rewritten by us and by grappler for the same target and fetches.

    ``grappler`` and ``agreement`` are None on a TensorFlow release that builds the graph
    otherwise than the recording's (``recorded_grappler.rewrite``): then only our side is
    checked.
    """

    target: str
    original: GraphDef
    ours: GraphDef
    grappler: GraphDef | None
    agreement: Agreement | None  # covers the main graph and every library function grappler rewrites
    summary: str  # our report's summary line
    report: amp_rewrite.Report  # ours, with per-function counts (``report.summary(function=...)``)

    def results(self) -> list[tuple[str, GraphDef]]:
        """("amp_rewrite", ours) and, where there is one, ("grappler", grappler's)."""
        return [("amp_rewrite", self.ours)] + ([("grappler", self.grappler)] if self.grappler is not None else [])


def rewrite_both(graph_def: GraphDef, target: str, fetches: Sequence[str] = ()) -> Rewrites:
    """Rewrite ``graph_def`` both ways and compare, asserting nothing but that our input is
    untouched (tests that model a deviation from grappler judge the agreement themselves)."""
    before = graph_def.SerializeToString(deterministic=True)
    result = amp_rewrite.rewrite_graph_def(graph_def, target=target, fetches=tuple(fetches))
    assert graph_def.SerializeToString(deterministic=True) == before, "rewrite_graph_def modified its input GraphDef"
    grappler = recorded_grappler.rewrite(graph_def, target=target, fetches=fetches)
    agreement = None if grappler is None else compare_rewrites(graph_def, result.graph_def, grappler)
    return Rewrites(target, graph_def, result.graph_def, grappler, agreement, result.report.summary(), result.report)


def check_against_grappler(graph_def: GraphDef, target: str, fetches: Sequence[str] = ()) -> Rewrites:
    """Rewrite ``graph_def`` both ways; assert our input is untouched and the results agree
    (where there is a grappler answer: ``Rewrites``)."""
    rewrites = rewrite_both(graph_def, target, fetches)
    if rewrites.agreement is not None:
        assert rewrites.agreement.ok, (
            f"amp_rewrite and grappler disagree for target={target}:\n{rewrites.agreement.explain()}")
    return rewrites


def _parse_vertex(vertex: str) -> tuple[str, str, int | None]:
    """``"n"`` -> (n, T, None); ``"n:Ta"`` -> (n, Ta, None); ``"n:T[2]"`` -> (n, T, 2)."""
    node, _, attr = vertex.partition(":")
    attr = attr or "T"
    if attr.endswith("]"):
        name, _, index = attr[:-1].partition("[")
        return node, name, int(index)
    return node, attr, None


def dtype_of(graph_def: GraphDef, node: str, attr: str = "T", index: int | None = None) -> int:
    """The dtype enum of ``node``'s type attr (or of element ``index`` of a list attr)."""
    matches = [candidate for candidate in graph_def.node if candidate.name == node]
    assert matches, f"node {node!r} is not in the graph"
    assert attr in matches[0].attr, f"node {node!r} ({matches[0].op}) has no attr {attr!r}"
    value = matches[0].attr[attr]
    return value.type if index is None else value.list.type[index]


def op_of(graph_def: GraphDef, node: str) -> str:
    """The op of ``node``."""
    return next(candidate.op for candidate in graph_def.node if candidate.name == node)


def count_casts(graph_def: GraphDef) -> int:
    """Number of AMP cast nodes (named ``<src>-<port>-CastTo*-<id>-AutoMixedPrecision``)."""
    return count_amp_casts(graph_def)


def count_casts_by_kind(graph_def: GraphDef) -> dict[str, int]:
    """AMP casts per kind: ``{"CastToFp16": 3, "CastToFp32": 1}``."""
    kind_to_count: dict[str, int] = {}
    for node in graph_def.node:
        for kind in ("CastToFp16", "CastToBf16", "CastToFp32"):
            if f"-{kind}-" in node.name and node.name.endswith("-AutoMixedPrecision"):
                kind_to_count[kind] = kind_to_count.get(kind, 0) + 1
    return kind_to_count


def assert_colours(
    rewrites: Rewrites,
    *,
    lowered: Iterable[str] = (),
    kept: Iterable[str] = (),
    casts: int | None = None,
    function: str = "",
    grappler: bool = True,
) -> None:
    """Assert the spec's expectation on our result and (unless ``grappler=False``) on grappler's.

    ``lowered`` vertices must hold the target dtype, ``kept`` vertices DT_FLOAT, and
    the result must have exactly ``casts`` more nodes than the input, all AMP casts.
    With ``function``, all of this is about that library function's body instead of
    the main graph.
    """
    low = TARGET_TO_DTYPE[rewrites.target]
    lowered, kept = list(lowered), list(kept)
    where = f" in function '{function}'" if function else ""
    original = function_body(rewrites.original, function) if function else rewrites.original
    results = rewrites.results() if grappler else rewrites.results()[:1]
    for label, result in results:
        graph_def = function_body(result, function) if function else result
        problems = []
        for vertices, expected in ((lowered, low), (kept, types_pb2.DT_FLOAT)):
            for vertex in vertices:
                actual = dtype_of(graph_def, *_parse_vertex(vertex))
                if actual != expected:
                    problems.append(
                        f"{vertex}: {types_pb2.DataType.Name(actual)}, expected {types_pb2.DataType.Name(expected)}"
                    )
        if casts is not None:
            added = len(graph_def.node) - len(original.node)
            if (added, count_casts(graph_def)) != (casts, casts):
                problems.append(f"{added} nodes added ({count_casts(graph_def)} AMP casts), expected {casts} casts")
        assert not problems, f"{label} ({rewrites.target}){where}: " + "; ".join(problems)


def assert_unchanged(rewrites: Rewrites) -> None:
    """Both results hold exactly the input's nodes (order aside): no cast, no retyping."""
    expected = {node.name: node for node in rewrites.original.node}
    for label, graph_def in rewrites.results():
        actual = {node.name: node for node in graph_def.node}
        added_or_removed = sorted(set(actual) ^ set(expected))
        assert not added_or_removed, f"{label} added or removed nodes: {added_or_removed}"
        changed = sorted(name for name in expected if actual[name] != expected[name])
        assert not changed, f"{label} changed nodes {changed}"


# --------------------------------------------------------------------------------------
# Numerics on CPU


def run_on_cpu(
    graph_def: GraphDef, fetches: Sequence[str], feeds: Mapping[str, np.ndarray] | None = None
) -> list[np.ndarray]:
    """Import ``graph_def`` with devices cleared, initialise variables, return fetched values as float32.

    ``fetches`` and feed keys are tensor names; a bare node name means output 0.
    """
    cpu_graph_def = GraphDef()
    cpu_graph_def.CopyFrom(graph_def)
    for node in cpu_graph_def.node:
        node.device = ""
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(cpu_graph_def, name="")
    config = tf.compat.v1.ConfigProto(device_count={"GPU": 0}, allow_soft_placement=True)
    initializers = _initializers(cpu_graph_def)
    feed_dict = {_tensor_name(name): value for name, value in (feeds or {}).items()}
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        if initializers:
            session.run(initializers)
        values = session.run([_tensor_name(name) for name in fetches], feed_dict=feed_dict)
    return [np.asarray(value, dtype=np.float32) for value in values]


_VARIABLE_OPS = frozenset({"VariableV2", "Variable", "VarHandleOp"})


def _initializers(graph_def: GraphDef) -> list[str]:
    """Assignments straight to a variable node: its initializer. An assignment inside a
    v1 loop reaches the variable through ``Enter``/``RefEnter`` and is an update, which
    cannot run on its own."""
    name_to_op = {node.name: node.op for node in graph_def.node}
    return [
        node.name
        for node in graph_def.node
        if node.op in ("AssignVariableOp", "Assign") and name_to_op.get(node.input[0].split(":")[0]) in _VARIABLE_OPS
    ]


def _tensor_name(name: str) -> str:
    return name if ":" in name else f"{name}:0"


def assert_numerics_match(
    rewrites: Rewrites, fetches: Sequence[str], feeds: Mapping[str, np.ndarray] | None = None
) -> None:
    """Our rewrite computes the float32 original's outputs within the target's tolerance.

    The tolerance is relative, with an absolute floor scaled to each output's magnitude
    so near-zero elements of a large output do not dominate.
    """
    tolerance = TARGET_TO_TOLERANCE[rewrites.target]
    expected = run_on_cpu(rewrites.original, fetches, feeds)
    actual = run_on_cpu(rewrites.ours, fetches, feeds)
    for name, want, got in zip(fetches, expected, actual):
        assert np.all(np.isfinite(want)), f"float32 reference of {name} is not finite; pick other inputs"
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        np.testing.assert_allclose(
            got, want, rtol=tolerance, atol=tolerance * scale, err_msg=f"{name} ({rewrites.target})"
        )


# Relative L2 error of all weight updates (-learning rate x gradient) of a training step
# together, against float32's: measured <= 1e-2 float16, 3e-2 bfloat16 on the models of
# tests/test_models.py (BatchNormalization over batch 2 amplifies rounding of the batch
# variance), with a margin of 5x.
TARGET_TO_UPDATE_TOLERANCE = {"float16": 5e-2, "bfloat16": 1.5e-1}


def relative_error(actual: np.ndarray, expected: np.ndarray) -> float:
    """Largest absolute difference over the largest expected magnitude."""
    scale = float(np.max(np.abs(expected))) if expected.size else 0.0
    return float(np.max(np.abs(actual.astype(np.float64) - expected))) / max(scale, 1e-12)


def assert_model_close_to_float32(model: ModelGraph, float32: GraphRun, graph_def: GraphDef, target: str) -> None:
    """Run ``graph_def`` on CPU: each output (a training step: the loss) within the target's
    tolerance of float32's, relative to its largest magnitude (``relative_error``), and the
    weight updates within ``TARGET_TO_UPDATE_TOLERANCE``."""
    run = run_model_graph(model, graph_def)
    tolerance = TARGET_TO_TOLERANCE[target]
    for fetch in model.fetches:
        error = relative_error(run.outputs[fetch], float32.outputs[fetch])
        assert error <= tolerance, f"{fetch}: relative error {error:.3g} > {tolerance} ({target})"
    if not model.trainable:
        return
    expected, actual = (
        np.concatenate([(r.variables[t] - model.variables[t]).ravel() for t in sorted(model.trainable)])
        for r in (float32, run)
    )
    error = float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))
    limit = TARGET_TO_UPDATE_TOLERANCE[target]
    assert error <= limit, f"weight updates: relative L2 error {error:.3g} > {limit} (learning rate {LEARNING_RATE})"


# --------------------------------------------------------------------------------------
# Grappler's recorded answers (tests/recorded_grappler.py)


_TESTS = Path(__file__).resolve().parent
# What this run saw: whether tests were deselected, and the tests that made no grappler
# comparison for lack of an answer on this release: node id -> (outcome, why).
_RUN: dict = {"deselected": False, "without_answer": {}}
_NO_ANSWER = "amp_no_grappler_answer"  # the report's user property that carries why, to xdist's controller too
_SHOWN = 12  # test ids the summary names per reason


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Tests left out (``-k``, ``-m``, ``--lf``...): the run is not the whole suite."""
    if items:
        _RUN["deselected"] = True


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """A test that made no grappler comparison on this release says so, and why, on its
    report: the report is what a pytest-xdist worker hands to the controller."""
    outcome = yield
    why = recorded_grappler.tests_without_answer.get(item.nodeid)
    if call.when == "call" and why is not None:
        outcome.get_result().user_properties.append((_NO_ANSWER, why))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Keep how the tests that made no grappler comparison on this release ended, and why."""
    for name, why in report.user_properties:
        if name == _NO_ANSWER:
            _RUN["without_answer"][report.nodeid] = (report.outcome, why)


def _whole_suite(session: pytest.Session) -> bool:
    """Whether every test of tests/ was collected and run (no paths, node ids or filters)."""
    paths = {Path(str(arg).split("::")[0]).resolve() for arg in session.config.args}
    return paths == {_TESTS} and not _RUN["deselected"] and not session.shouldstop


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """In a recording run (tools/record_grappler.py) a green suite writes the answers it
    asked for: replacing the recording after the whole suite, merged into it after a part.
    A pytest-xdist worker (``make test`` runs two) hands its comparison counts to the
    controller, which prints the summary."""
    workeroutput = getattr(session.config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput["amp_comparisons"] = [[*key, count] for key, count in recorded_grappler.comparisons.items()]
    if not recorded_grappler.recording():
        return
    if workeroutput is not None:
        pytest.exit("record grappler's answers in one process: tools/record_grappler.py runs pytest without -n", 2)
    whole = _whole_suite(session)
    if exitstatus != 0:
        session.config._amp_recorded = "not written: the run failed, so the recording was left as it was"
        return
    written, kept = recorded_grappler.write_recording(whole_suite=whole)
    name = recorded_grappler.ANSWERS.name
    session.config._amp_recorded = (
        f"recorded {written} into {name}, replacing it (the whole suite ran)" if whole else
        f"merged {written - kept} into {name}, which keeps {kept} earlier answers (a part of the suite ran;"
        " run tools/record_grappler.py to record the whole suite and drop answers no test asks for)"
    )


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """pytest-xdist's controller: add a finished worker's comparison counts to its own."""
    for target, kind, count in getattr(node, "workeroutput", {}).get("amp_comparisons", ()):
        recorded_grappler.comparisons[(target, kind)] += count


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """How many comparisons with grappler ran per target, how many live grappler confirmed,
    and how the tests ended that made none on this release."""
    recorded = getattr(config, "_amp_recorded", None)
    if recorded is not None:
        terminalreporter.write_line(f"grappler answers: {recorded}")
        return
    counts = recorded_grappler.comparisons
    if not counts:
        return
    terminalreporter.write_sep("-", f"comparisons with grappler ({recorded_grappler.recorded_by()})")
    for target in TARGETS:
        total, live = counts[(target, "recorded")], counts[(target, "live")]
        why = recorded_grappler.live_unavailable(target)
        checked = f"{live} of them also asked live" + ("" if why is None else f" ({why})")
        otherwise = counts[(target, "built otherwise")]
        skipped = f"; {otherwise} not made: this TensorFlow builds their graphs otherwise" if otherwise else ""
        terminalreporter.write_line(f"{target}: {total} recorded answers compared; {checked}{skipped}")
    _write_tests_without_answer(terminalreporter)


def _write_tests_without_answer(terminalreporter) -> None:
    """How the tests ended that made no comparison on this release, by why, naming them."""
    without = _RUN["without_answer"]
    if not without:
        return
    outcomes = collections.Counter(outcome for outcome, _ in without.values())
    ended = ", ".join(f"{count} {outcome}" for outcome, count in sorted(outcomes.items()))
    terminalreporter.write_line(f"tests that made no comparison for lack of an answer ({ended}; the passed and"
                                " failed ones still ran their own assertions):")
    for why in sorted({why for _, why in without.values()}):
        tests = sorted(test for test, (_, reason) in without.items() if reason == why)
        shown = ", ".join(tests[:_SHOWN]) + (f" and {len(tests) - _SHOWN} more" if len(tests) > _SHOWN else "")
        terminalreporter.write_line(f"  {why}: {shown}")

