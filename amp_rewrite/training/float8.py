"""FP8 training in the live rewrite: state variables for each new trace, then its float8 chains.

A trace's FunctionDef, built from its FuncGraph, fixes the function's inputs, so the state
variables a training step reads must be captured before it exists. Two moments:

1. ``prepare_trace`` (a ``FUNC_GRAPH_TRANSFORMS`` hook, after the Python function is traced,
   before its FunctionDef): the base rewrite's decisions on the FuncGraph's GraphDef say
   which matmuls it converts; ``core.float8_training.find_matmuls`` pairs them with their
   backward matmuls; in a training step the state of each quantized operand is made (or
   found, for a retrace) and read in the FuncGraph, which captures the variables. A function
   without gradients (``evaluate``, ``predict``, an export) gets no state: it scales each
   operand by its own amax in each call.
2. ``quantize`` (from the live rewrite's trace callback, after the base rewrite of the
   FunctionDef): ``core.float8_training`` adds the chains and the updates, reading and
   writing the state through those reads' captured handles.

A ``tf.compat.v1.Session`` graph has no captures: ``session_step`` adds the state as
variables of the Session's rewritten copy and returns their initializers.
"""
from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2
from tensorflow.python.ops import control_flow_util, control_flow_v2_func_graphs

from amp_rewrite.core import float8_training
from amp_rewrite.core.float8 import MATMUL_OPS
from amp_rewrite.core.float8_training import STATE_SCOPE, HISTORY, SCALE, Plan, State
from amp_rewrite.core.lists import OpLists
from amp_rewrite.core.program import MAIN_GRAPH, program_of
from amp_rewrite.core.rewrite import RewriteResult, rewrite_graph_def
from amp_rewrite.training.float8_state import Float8State

log = logging.getLogger(__name__)

BASE_PRECISIONS = ("bfloat16", "float16")


@dataclass(frozen=True)
class Float8Training:
    """What new traces train in FP8 with: the state they make and read (its history length)."""

    state: Float8State

    @property
    def amax_history_length(self) -> int:
        return self.state.amax_history_length


@dataclass(frozen=True)
class TraceStep:
    """What ``prepare_trace`` found in one FuncGraph, for ``quantize``."""

    state: dict[str, State]  # key -> its read nodes in the FuncGraph; empty without gradients
    under_xla: bool          # traced inside a function XLA compiles (its own jit_compile is on the FunctionDef)


_GRAPH_TO_STEP: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def prepare_trace(func_graph: Any, target: str, lists: OpLists, training: Float8Training) -> None:
    """``FUNC_GRAPH_TRANSFORMS`` hook (module doc, 1): in a training step, make or look up the
    state of its matmuls' operands and read it in ``func_graph``. Loop bodies and branches of
    ``tf.cond``/``tf.while_loop`` are left alone (their captures are fixed when the transform
    runs), as are graphs without a matmul."""
    if isinstance(func_graph, control_flow_v2_func_graphs.ControlFlowFuncGraph):
        return
    if not any(op.type in MATMUL_OPS for op in func_graph.get_operations()):
        return
    under_xla = control_flow_util.GraphOrParentsInXlaContext(func_graph)
    graph_def = func_graph.as_graph_def()
    plan = float8_training.find_matmuls(
        graph_def, float8_training.converted_nodes(rewrite_graph_def(graph_def, target=target, lists=lists).report))
    state = {}
    if plan.trains:
        variables = {key: training.state.create(key) for key, _ in plan.keys()}
        with func_graph.as_default(), func_graph.name_scope(None):
            for key, (history, scale) in variables.items():
                read = lambda variable, kind: tf.raw_ops.ReadVariableOp(
                    resource=variable.handle, dtype=tf.float32, name=f"{STATE_SCOPE}/{key}/{kind}").op.name
                state[key] = State(read(scale, SCALE), read(history, HISTORY))
    _GRAPH_TO_STEP[func_graph] = TraceStep(state, under_xla)
    log.debug("amp_rewrite: %s: float8 state for %d operand(s)", func_graph.name, len(state))


def trace_step(func_graph: Any) -> TraceStep:
    """What ``prepare_trace`` found in ``func_graph`` (nothing, for a graph it left alone)."""
    return _GRAPH_TO_STEP.get(func_graph, TraceStep({}, False))


def quantize(source: graph_pb2.GraphDef, result: RewriteResult, function: str, step: TraceStep,
             training: Float8Training) -> RewriteResult:
    """The base rewrite ``result`` of ``source`` with ``function``'s matmuls on float8 (module doc, 2)."""
    plan = float8_training.find_matmuls(program_of(source).item(function),
                                        float8_training.converted_nodes(result.report, function))
    graph_def, report = float8_training.training_step_rewritten(
        result.graph_def, result.report, function, plan, step.state, training.amax_history_length)
    return RewriteResult(graph_def, report)


def session_step(source: graph_pb2.GraphDef, result: RewriteResult,
                 training: Float8Training) -> tuple[RewriteResult, list[str]]:
    """A Session's rewrite ``result`` of ``source`` with its matmuls on float8 — in a graph
    that trains, with the state as variables of the graph — and the initializers to run once."""
    plan = float8_training.find_matmuls(source, float8_training.converted_nodes(result.report))
    graph_def, state, initializers = result.graph_def, {}, []
    if plan.trains:
        graph_def, state, initializers = float8_training.add_state(graph_def, plan.keys(),
                                                                   training.amax_history_length)
    graph_def, report = float8_training.training_step_rewritten(graph_def, result.report, MAIN_GRAPH, plan, state,
                                                                training.amax_history_length)
    return RewriteResult(graph_def, report), initializers


def xla_jit_enabled(config: config_pb2.ConfigProto | None = None) -> bool:
    """Whether XLA clusters graphs itself: ``TF_XLA_FLAGS=--tf_xla_auto_jit=...`` or a Session
    config's ``global_jit_level``."""
    if "tf_xla_auto_jit" in os.environ.get("TF_XLA_FLAGS", ""):
        return True
    level = config.graph_options.optimizer_options.global_jit_level if config is not None else 0
    return level in (config_pb2.OptimizerOptions.ON_1, config_pb2.OptimizerOptions.ON_2)


def emulated_warning(where: str, matmuls: int) -> str:
    """The one warning when FP8 matmuls run without XLA."""
    return (f"amp_rewrite: {where}'s {matmuls} float8 matmul(s) run emulated without XLA: casts to float8 and back"
            " around bfloat16/float16 matmuls, FP8's error without its speed (FP8 GEMMs need XLA on a GPU of compute"
            " capability 8.9+); compile the step with XLA: tf.function(jit_compile=True), model.compile(...,"
            " jit_compile=True), or TF_XLA_FLAGS=--tf_xla_auto_jit=2. (Shown once while enabled.)")
