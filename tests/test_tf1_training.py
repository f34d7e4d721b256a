"""TF1 training loops with the rewrite, as their users write them (``tests/tf1_training.py``,
run once in a fresh process with ``disable_v2_behavior()``): MonitoredTrainingSession and
SingularMonitoredSession with TensorFlow's hooks, checkpoints restored into a new session,
state that lives on when ops are added after the first run, ``make_callable``, partial runs,
every fetch and feed structure ``Session.run`` takes, tf_keras' graph-mode ``fit``, the
README's TF1 example, and the one-line refusal where a running node would have to change.
Where TensorFlow itself is the reference (the same run without the rewrite, a plain Session
on the same graph), the script asks it in the same process.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import NEEDS_FLOAT8, within_points

ROOT = Path(__file__).resolve().parents[1]
BF16 = "DT_BFLOAT16"
# Six Adam steps in bfloat16 against float32: the weights agree to bfloat16's precision.
WEIGHT_TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "tf1_training.py"), str(tmp_path_factory.mktemp("tf1"))],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, f"the TF1 script failed:\n{done.stderr[-4000:]}"
    return {"stderr": done.stderr, **json.loads(lines[-1][len("RESULT "):])}


def test_monitored_training_session_runs_every_hook_as_without_the_rewrite(report):
    """MonitoredTrainingSession with StopAtStepHook, checkpoints every 3 steps, LoggingTensorHook,
    SummarySaverHook, NanTensorHook and a custom hook whose before_run fetches a dict and asks for
    a trace: the same steps, checkpoints and summaries as the float32 run of the same script;
    every traced step ran its 5 MatMuls (2 forward, 3 gradient) in bfloat16; the weights and
    logged losses track float32's."""
    ours, float32 = report["monitored"], report["float32_monitored"]
    assert (ours["mirrored"], float32["mirrored"]) == (True, False)
    for key in ("hook_steps", "checkpoint", "summary_steps"):
        assert ours[key] == float32[key], key
    assert ours["hook_steps"] == [1, 2, 3, 4, 5, 6] and ours["checkpoint"] == "model.ckpt-6"
    assert ours["summary_steps"] == [1, 3, 5]
    assert ours["hook_executed"] == [[BF16] * 5] * 6
    assert float32["hook_executed"] == [["DT_FLOAT"] * 5] * 6
    assert ours["end"][0] == float32["end"][0] == 6
    np.testing.assert_allclose(ours["end"][1], float32["end"][1], atol=WEIGHT_TOLERANCE)
    np.testing.assert_allclose(ours["checkpoint_w2"], ours["end"][1])
    np.testing.assert_allclose(ours["logged"], float32["logged"], rtol=WEIGHT_TOLERANCE)
    assert ours["logged"][-1] < ours["logged"][0]


def test_a_new_monitored_session_restores_the_checkpoint_and_trains_on(report):
    """A second MonitoredTrainingSession on the same checkpoint directory starts where the
    first stopped (step 6, the saved weights) and trains to its StopAtStepHook's step 9."""
    resumed, saved = report["monitored"]["resumed"], report["monitored"]["checkpoint_w2"]
    assert resumed["start"][0] == 6 and resumed["start"][1] == saved
    assert resumed["end"][0] == 9 and resumed["end"][1] != saved


def test_singular_monitored_session_and_nan_tensor_hook(report):
    """SingularMonitoredSession stops after StopAtStepHook(num_steps=3); a NaN loss makes
    NanTensorHook raise as it does without the rewrite, after the loss-scale optimizer skipped
    the step (the weights did not move)."""
    assert report["singular"] == {"singular_steps": [1, 2, 3], "nan": "NanLossDuringTrainingError",
                                  "nan_step_skipped": True}


@pytest.mark.parametrize("iterator", ["one_shot", "initializable"])
def test_iterators_never_serve_a_batch_again_across_an_added_op(report, iterator):
    """Three steps, then a MatMul added on the iterator's output (painting it afresh would
    convert a node that already runs float32), then two more: batches 0-4, each once."""
    assert report["state"]["batches"][iterator] == [0, 1, 2, 3, 4]


def test_reference_variables_tables_and_queues_keep_their_state_across_an_added_op(report):
    """disable_v2_behavior(): the trained reference variable keeps its value, the lookup table
    its entries, the queue its elements; the added MatMuls run bfloat16."""
    state = report["state"]
    assert "error" not in state, state["error"]
    assert state["is_ref_variable"] and state["w_kept"]
    assert (state["lookup"], state["dequeue"]) == ([1.5, 2.5], 7.0)
    assert state["eval_executed"] == [BF16, BF16]


def test_make_callable_runs_the_mirror_on_every_path(report):
    """make_callable of one op, one tensor, a structure (no feed list: TensorFlow calls the
    C session directly), with options, and with a feed list (through run): the step counter
    each bumps is the one run() reads; a value stored through one is read by another; the
    traced MatMul is bfloat16. _make_callable_from_options (tf_keras' K.function) runs the
    mirror too and returns the user graph's dtypes."""
    callables = report["callables"]
    assert callables["steps"] == [2, 2, 3, 3]
    assert callables["feed_list_total"] == callables["options_total"] == 64.0  # 2 × ones · 0.125, summed
    assert callables["options_executed"] == [BF16]
    assert callables["from_options"] == {"dtypes": ["float32", "float32"], "total": 32.0, "step": 4}
    assert callables["fed_converted"] == 16.0  # a value fed to a tensor the copy computes in bfloat16


def test_partial_run_runs_the_mirror(report):
    """partial_run_setup + two partial_runs: r1 = a + b = 3, then r2 = sum((ones · r1) @ w) = 96;
    every MatMul of the mirror is bfloat16."""
    assert report["callables"]["partial_run"] == [3.0, 96.0]
    assert set(report["callables"]["mirror_matmuls"]) == {BF16}


def test_fetch_and_feed_structures_are_those_of_a_plain_session(report):
    """A dict keyed by a hook object and strings, a namedtuple, nested lists and tuples, ops,
    tensor names, SparseTensor and IndexedSlices fetches; feeds by name and to a sparse
    placeholder: the mirrored Session returns what a plain Session returns on the same graph
    (types, keys, dtypes, shapes; values within bfloat16's precision)."""
    assert report["structures"] == {"same": "", "mirrored": True}


def test_tf_keras_graph_mode_fit_runs_the_mirror(report):
    """tf_keras Model.fit under disable_v2_behavior() (K.function: _make_callable_from_options)
    trains on digits in a mirrored Session with bfloat16 MatMuls, no step skipped, and reaches
    float32's test accuracy within 2 points. bfloat16's default loss scale is 1 (fixed)."""
    ours, float32 = report["tf_keras"]["bfloat16"], report["tf_keras"]["float32"]
    assert (ours["mirrored"], float32["mirrored"]) == (True, False)
    assert ours["mirror_matmuls"] == [BF16] and ours["scale"] == 1.0
    assert float32["accuracy"] >= 0.8 and within_points(ours["accuracy"], float32["accuracy"], 2)


def test_an_op_that_would_change_a_running_node_is_refused_in_one_line(report):
    """cross_function=True: a new caller that feeds a running function from a deny op would
    repaint its signature: the run that needs it is refused in one line naming the new ops and
    what to do; the running ops still run."""
    refused = report["refused"]
    message = refused["refused"]
    assert "\n" not in message and "'exp_input' (Exp)" in message and "'PartitionedCall' (PartitionedCall)" in message
    assert "cross_function=True" in message and "create them before the first run, or run them in a new Session" in message
    assert refused["first_again"] == refused["first"] == [[8.0] * 4] * 2


def test_a_fixed_scale_that_skips_every_step_in_a_session_says_so_once(report):
    """loss_scale=2**20 and an Inf loss in a Session: all 12 steps skipped (global_step and w
    unchanged, the scale fixed, opt.skipped_steps 12), and one warning says training is stuck,
    why and what to pass."""
    stuck = report["fixed_scale"].pop("stuck")
    assert report["fixed_scale"] == {"step": 0, "w": [1.0, 2.0], "scale": 2.0**20, "skipped": 12}
    assert len(stuck) == 1, stuck
    assert 'at the fixed loss scale 1.04858e+06 (pass a smaller loss_scale, or loss_scale="dynamic"' in stuck[0]


def test_readme_tf1_example_runs_as_written(report):
    """The README's MonitoredTrainingSession example, with target= and its checkpoint directory
    replaced: 100 steps, the last checkpointed, the loss falling."""
    readme = report["readme"]
    assert readme["last_checkpoint"] == "model.ckpt-100"
    assert len(readme["losses"]) == 100 and all(math.isfinite(v) for v in readme["losses"])
    assert readme["losses"][-1] < readme["losses"][0]


@NEEDS_FLOAT8
def test_float8_state_is_in_the_monitored_sessions_checkpoints_and_a_restart_resumes_it(report):
    """FP8 training in a MonitoredTrainingSession: the v1 wrapper made the float8 state
    variables of the user's graph, so its checkpoints hold every one (2 matmuls x input, weight,
    gradient x history and scale), keyed by the weight's name; a restarted session starts from
    exactly the saved state and records on from there."""
    float8 = report["float8"]
    keys = [f"amp_rewrite_float8/{w}/{operand}/{kind}" for w in ("w1", "w2")
            for operand in ("input", "output_grad", "weight") for kind in ("amax_history", "scale")]
    assert float8["checkpointed"] == keys
    state = {key: value for key, value in float8["first"].items() if key != "accuracy"}
    assert {f"amp_rewrite_float8/{key}": value for key, value in state.items()} == float8["saved"]
    assert all(np.all(np.array(value) > 0) for value in state.values())  # 30 steps recorded into 4-step histories
    assert {key: value for key, value in float8["resumed_start"].items()} == state
    resumed = {key: value for key, value in float8["resumed_end"].items() if key != "accuracy"}
    assert resumed.keys() == state.keys()
    assert all(resumed[key] != state[key] for key in state if key.endswith("weight/amax_history"))  # Adam moved them


@NEEDS_FLOAT8
def test_float8_monitored_training_reaches_bfloat16s_accuracy(report):
    """The same MonitoredTrainingSession loop, three epochs of digits, in FP8 and in bfloat16:
    held-out accuracy within 2 points."""
    float8, bfloat16 = report["float8"]["float8"], report["float8"]["bfloat16"]
    assert bfloat16["accuracy"] >= 0.9 and within_points(float8["accuracy"], bfloat16["accuracy"], 2)
    assert all(np.all(np.array(value) > 0) for key, value in float8.items() if key.endswith("amax_history"))


@NEEDS_FLOAT8
def test_a_savers_checkpoint_of_float8_training_restores_its_state_into_a_new_graph(report):
    """A plain ``Saver`` made after the train op saves the float8 state with the weights (the
    v1 wrapper made it global variables of the user's graph); restored into a freshly built
    graph's Session, every state variable holds what was saved (5 steps into 4-step histories)."""
    saver = report["float8"]["saver"]
    assert len(saver["saved"]) == 12 and saver["restored"] == saver["saved"]
    assert all(np.all(np.array(value) > 0) for value in saver["saved"].values())
