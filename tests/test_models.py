"""Built-in Keras models: our rewrite equals grappler's, vertex for vertex, and still computes the model.

Every model (mlp, cnn, resnet50, transformer) is checked as an inference graph and as a
training step, for both targets, three ways:

1. decisions: each float32 vertex gets the dtype grappler gives it, with the same casts;
2. numbers vs float32: the rewritten graph runs on CPU and stays close to the float32 graph;
3. numbers vs grappler: it computes exactly what grappler's rewrite computes.

Each model is built once per module; the float32 run, our rewrite and grappler's are
cached per case.
"""
from __future__ import annotations

import numpy as np
import pytest
from tensorflow.core.framework.graph_pb2 import GraphDef

import amp_rewrite
import recorded_grappler
from amp_rewrite.testing.models import LEARNING_RATE, MODEL_NAMES, GraphRun, ModelGraph, build_model_graph, run_model_graph
from amp_rewrite.testing.reference import compare_rewrites

from conftest import TARGET_TO_TOLERANCE, TARGET_TO_UPDATE_TOLERANCE, relative_error

TARGETS = amp_rewrite.TARGETS
CASES = [(name, training) for name in MODEL_NAMES for training in (False, True)]
# ResNet50 at a test size. The training step uses 64x64 and batch 4: at 32x32/batch 2
# the last stages normalise over 2 values per channel and even float32 is chaotic (a
# 1e-5 change of the input moves the loss from 4.9 to 7.2).
CASE_TO_BUILD_ARGS = {
    ("resnet50", False): {"image_size": 32},
    ("resnet50", True): {"image_size": 64, "batch": 4},
}
# Largest error vs float32 relative to the float32 magnitude (conftest's TARGET_TO_TOLERANCE)
# applies to outputs and loss, and to the BatchNormalization statistics a training step
# updates; the gradients, as the weight updates they make, to TARGET_TO_UPDATE_TOLERANCE.
# A randomly initialised ResNet50 in training mode amplifies low-precision rounding of
# the batch statistics through 50 layers: grappler's own rewrite moves the loss by 4-5%
# and its gradients are nearly uncorrelated with float32's. Only the loss is compared.
LOSS_ONLY = {("resnet50", True): 0.1}


class Case:
    """One model graph with its float32 run and, per target, both rewrites and their runs."""

    def __init__(self, name: str, training: bool) -> None:
        build_args = CASE_TO_BUILD_ARGS.get((name, training), {})
        self.model: ModelGraph = build_model_graph(name, training=training, **build_args)
        self.float32: GraphRun = run_model_graph(self.model)
        self._target_to_ours: dict[str, amp_rewrite.RewriteResult] = {}
        self._target_to_grappler: dict[str, GraphDef] = {}
        self._runs: dict[tuple[str, str], GraphRun] = {}

    def ours(self, target: str) -> amp_rewrite.RewriteResult:
        if target not in self._target_to_ours:
            self._target_to_ours[target] = amp_rewrite.rewrite_graph_def(
                self.model.graph_def, target=target, fetches=self.model.fetches
            )
        return self._target_to_ours[target]

    def grappler(self, target: str) -> GraphDef | None:
        """Grappler's rewrite; None without a recorded answer on this release."""
        if target not in self._target_to_grappler:
            self._target_to_grappler[target] = recorded_grappler.rewrite(
                self.model.graph_def, target=target, fetches=self.model.fetches
            )
        return self._target_to_grappler[target]

    def run(self, who: str, target: str) -> GraphRun:
        """Run ``who``'s rewrite ("ours" or "grappler") once; later calls reuse the result."""
        if (who, target) not in self._runs:
            graph_def = self.ours(target).graph_def if who == "ours" else self.grappler(target)
            self._runs[(who, target)] = run_model_graph(self.model, graph_def)
        return self._runs[(who, target)]


@pytest.fixture(
    scope="module", params=CASES, ids=[f"{name}-{'training' if training else 'inference'}" for name, training in CASES]
)
def case(request: pytest.FixtureRequest) -> Case:
    return Case(*request.param)


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> str:
    return request.param


def _updates(run: GraphRun, model: ModelGraph) -> np.ndarray:
    """All trainable-variable updates of a training step, flattened: -LEARNING_RATE * gradients."""
    return np.concatenate([(run.variables[t] - model.variables[t]).ravel() for t in sorted(model.trainable)])


# --- the models themselves --------------------------------------------------------------


def test_models_are_inline_and_name_their_inputs(case: Case) -> None:
    """No function library; every placeholder is a feed or a captured variable."""
    model = case.model
    assert not model.graph_def.library.function
    placeholders = {f"{node.name}:0" for node in model.graph_def.node if node.op == "Placeholder"}
    assert placeholders == set(model.feeds) | set(model.variables)
    assert model.trainable <= set(model.variables)
    assert set(model.fetches) <= {node.name for node in model.graph_def.node}
    assert all(np.all(np.isfinite(value)) for value in case.float32.outputs.values())


@pytest.mark.parametrize("name", ["mlp", "transformer"])
def test_building_twice_gives_identical_graph_defs(name: str) -> None:
    """Keras name counters and custom-gradient ids are reset: same arguments, same bytes."""
    first = build_model_graph(name, training=True)
    second = build_model_graph(name, training=True)
    assert first.graph_def.SerializeToString(deterministic=True) == second.graph_def.SerializeToString(
        deterministic=True
    )
    for tensor, value in first.variables.items():
        np.testing.assert_array_equal(value, second.variables[tensor])


def test_training_step_applies_the_update() -> None:
    """Fetching the loss runs the SGD update: every weight moves, the iteration counter counts."""
    model = build_model_graph("mlp", training=True)
    run = run_model_graph(model)
    for tensor in model.trainable:
        assert np.any(run.variables[tensor] != model.variables[tensor]), tensor
    (counter,) = [t for t, v in model.variables.items() if v.dtype == np.int64]
    assert run.variables[counter] == model.variables[counter] + 1
    # Running again starts from the initial values: runs are independent.
    np.testing.assert_array_equal(run_model_graph(model).outputs[model.fetches[0]], run.outputs[model.fetches[0]])


def test_unknown_model_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="mlp, cnn, resnet50, transformer"):
        build_model_graph("vgg", training=False)


# --- the rewrite on them ----------------------------------------------------------------


def test_decisions_equal_grapplers(case: Case, target: str) -> None:
    """Every float32 vertex gets grappler's dtype and every cast is grappler's cast."""
    grappler = case.grappler(target)
    if grappler is None:
        recorded_grappler.skip_comparison()
    agreement = compare_rewrites(case.model.graph_def, case.ours(target).graph_def, grappler)
    assert agreement.judged > 0
    assert agreement.ok, agreement.explain()


def test_rewrite_converts_something(case: Case, target: str) -> None:
    """Each model has matmuls or convolutions, so some vertices become low precision."""
    report = case.ours(target).report
    assert report.vertices_converted > 0, report.summary()
    assert report.nodes_before == len(case.model.graph_def.node)


def test_rewritten_graph_stays_close_to_float32(case: Case, target: str) -> None:
    """Outputs (inference) or loss, gradients and updated statistics (training) match float32."""
    model, float32, ours = case.model, case.float32, case.run("ours", target)
    tolerance = TARGET_TO_TOLERANCE[target]
    for fetch in model.fetches:
        limit = LOSS_ONLY.get((model.name, model.training), tolerance)
        error = relative_error(ours.outputs[fetch], float32.outputs[fetch])
        assert error <= limit, f"{fetch}: relative error {error:.3g} > {limit}"
    if not model.training:
        return
    for tensor, value in ours.variables.items():
        assert np.all(np.isfinite(value)), f"{tensor} is not finite after the step"
    if (model.name, model.training) in LOSS_ONLY:
        return
    expected, actual = _updates(float32, model), _updates(ours, model)
    gradient_error = float(np.linalg.norm(actual - expected) / np.linalg.norm(expected))
    assert gradient_error <= TARGET_TO_UPDATE_TOLERANCE[target], (
        f"gradients: relative L2 error {gradient_error:.3g} (learning rate {LEARNING_RATE})"
    )
    for tensor in sorted(set(model.variables) - model.trainable):
        error = relative_error(ours.variables[tensor], float32.variables[tensor])
        assert error <= tolerance, f"{tensor}: relative error {error:.3g} > {tolerance}"


def test_rewritten_graph_computes_what_grapplers_computes(case: Case, target: str) -> None:
    """Same dtypes and casts mean the same kernels on the same values: equal numbers."""
    if case.grappler(target) is None:
        recorded_grappler.skip_comparison()
    ours, grappler = case.run("ours", target), case.run("grappler", target)
    for fetch in case.model.fetches:
        np.testing.assert_allclose(ours.outputs[fetch], grappler.outputs[fetch], rtol=1e-5, atol=1e-6, err_msg=fetch)
    for tensor in ours.variables:
        np.testing.assert_allclose(
            ours.variables[tensor], grappler.variables[tensor], rtol=1e-5, atol=1e-6, err_msg=tensor
        )
