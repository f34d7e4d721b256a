"""Property-based fuzzing of rewrite_graph_def against float32 and against grappler.

Random DAGs of real ops from every list (``fuzz_graphs.py``), random fetches and
devices, existing float16/bfloat16 sections. For every example and target:

1. the caller's GraphDef is untouched;
2. the rewrite imports into a ``tf.Graph`` (every edge's dtypes check);
3. it computes what the original computes: exactly, once every float16/bfloat16 type
   is put back to float32 (so a cast on the wrong tensor, port or consumer shows), and
   within the target's tolerance as it stands, on CPU;
4. rewriting it again changes nothing;
5. every float32 vertex and every cast agrees with grappler's own pass.

``make test`` runs a bounded, derandomized search; ``AMP_FUZZ_EXAMPLES=2000`` (``make
fuzz``) runs a long random one. Failures found are kept below as explicit plans.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from tensorflow.core.framework import types_pb2
from tensorflow.core.framework.graph_pb2 import GraphDef

import amp_rewrite
from amp_rewrite.reference import compare_rewrites, run_grappler
from conftest import TARGET_TO_TOLERANCE, TARGETS, run_on_cpu
from fuzz_graphs import FuzzGraph, GraphPlan, Step, build_graph, graph_plans

_LONG_RUN = int(os.environ.get("AMP_FUZZ_EXAMPLES", "0"))
_SETTINGS = settings(
    max_examples=_LONG_RUN or 25,
    derandomize=not _LONG_RUN,  # CI is reproducible; the long run explores
    deadline=None,
    database=None if not _LONG_RUN else settings.default.database,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
_LOW_TYPES = frozenset({types_pb2.DT_HALF, types_pb2.DT_BFLOAT16})


def as_float32(graph_def: GraphDef) -> GraphDef:
    """A copy with every float16/bfloat16 type attr set to float32: casts become no-ops,
    so the copy computes exactly what the original computes if the rewrite is wired right."""
    copy = GraphDef()
    copy.CopyFrom(graph_def)
    for node in copy.node:
        for value in node.attr.values():
            if value.WhichOneof("value") == "type" and value.type in _LOW_TYPES:
                value.type = types_pb2.DT_FLOAT
            elif value.WhichOneof("value") == "list":
                for index, dtype in enumerate(value.list.type):
                    if dtype in _LOW_TYPES:
                        value.list.type[index] = types_pb2.DT_FLOAT
    return copy


def _assert_close(label: str, outputs: tuple[str, ...], want: list[np.ndarray], got: list[np.ndarray],
                  tolerance: float) -> None:
    """Relative tolerance with an absolute floor scaled to each output's magnitude (as
    conftest's assert_numerics_match) but at least to 1, the scale of the graph's inputs:
    an output that cancels to ~0 keeps the rounding error of its O(1) operands."""
    for name, expected, actual in zip(outputs, want, got):
        finite = np.isfinite(expected)
        scale = max(float(np.max(np.abs(expected[finite]), initial=0.0)), 1.0)
        np.testing.assert_allclose(
            actual[finite], expected[finite], rtol=tolerance, atol=tolerance * scale, err_msg=f"{label}: {name}"
        )


def check_rewrite(fuzz: FuzzGraph, target: str) -> None:
    """All five properties of the module docstring for one graph and target."""
    original = fuzz.graph_def
    before = original.SerializeToString(deterministic=True)
    result = amp_rewrite.rewrite_graph_def(original, target=target, fetches=fuzz.fetches)
    ours = result.graph_def
    assert original.SerializeToString(deterministic=True) == before, "rewrite_graph_def modified its input"

    with tf.Graph().as_default():
        tf.graph_util.import_graph_def(ours, name="")

    want = run_on_cpu(original, fuzz.outputs, fuzz.feeds)
    exact = run_on_cpu(as_float32(ours), fuzz.outputs, fuzz.feeds)
    _assert_close("rewrite with float32 types restored", fuzz.outputs, run_on_cpu(as_float32(original), fuzz.outputs,
                  fuzz.feeds), exact, 1e-5)
    got = run_on_cpu(ours, fuzz.outputs, fuzz.feeds)
    _assert_close(f"{target} rewrite", fuzz.outputs, want, got, TARGET_TO_TOLERANCE[target])

    again = amp_rewrite.rewrite_graph_def(ours, target=target, fetches=fuzz.fetches).graph_def
    changed = sorted(
        {n.name for n in again.node} ^ {n.name for n in ours.node}
        | {n.name for n, m in zip(again.node, ours.node) if n != m}
    )
    assert again == ours, f"rewriting twice changed nodes {changed[:10]}"

    grappler = run_grappler(original, target=target, fetches=fuzz.fetches)
    agreement = compare_rewrites(original, ours, grappler)
    assert agreement.ok, f"amp_rewrite and grappler disagree ({target}):\n{agreement.explain()}"


@pytest.mark.parametrize("target", TARGETS)
def test_random_graphs(target: str) -> None:
    """Every property on random graphs of 10–300 nodes."""

    @_SETTINGS
    @given(plan=graph_plans())
    def check(plan: GraphPlan) -> None:
        check_rewrite(build_graph(plan), target)

    check()


# --------------------------------------------------------------------------------------
# Failures found by the fuzzer, shrunk, kept as explicit plans.

REGRESSIONS: dict[str, GraphPlan] = {}


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("name", sorted(REGRESSIONS))
def test_regression(name: str, target: str) -> None:
    check_rewrite(build_graph(REGRESSIONS[name]), target)


def test_generator_builds_every_catalogue_entry() -> None:
    """Each op of the catalogue builds, alone and after a device and control input."""
    from fuzz_graphs import CATALOGUE

    for op in CATALOGUE:
        plan = GraphPlan(seed=0, steps=(Step("MatMul"), Step(op, device="/device:GPU:0", control=1)))
        fuzz = build_graph(plan)
        assert fuzz.fetches and fuzz.outputs is not None, op
