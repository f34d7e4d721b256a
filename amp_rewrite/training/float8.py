"""FP8 training in the live rewrite: whose state each matmul records into, then its float8 chains.

A trace's FunctionDef, built from its FuncGraph, fixes the function's inputs, so the state
variables a training step reads must be captured before it exists. Three moments:

1. While a step is traced, each optimizer wrapper's ``apply``/``apply_gradients``/``minimize``
   records, for the FuncGraph being traced, which variables it updates (``record_apply``).
2. ``prepare_trace`` (a ``FUNC_GRAPH_TRANSFORMS`` hook, after the Python function is traced,
   before its FunctionDef): the base rewrite's decisions on the FuncGraph's GraphDef say
   which matmuls it converts; ``core.float8.training.find_matmuls`` pairs them with their
   backward matmuls. Each forward matmul's weight operand (``ReadVariableOp`` ← captured
   resource ← variable) names the wrapper that updates that variable: the matmul's state is
   made (or found, for a retrace) in *that* wrapper's ``Float8State``, under a key that
   survives a rebuild (the variable's place in the wrapper's list and its short name), and
   read in the FuncGraph, which captures the variables. A matmul without such a variable
   belongs to the step's only wrapper when there is one; otherwise it is said so. A function
   without gradients (``evaluate``, ``predict``, an export) gets no state: it scales each
   operand by its own amax in each call.
3. ``quantize`` (from the trace callback, after the base rewrite of the FunctionDef):
   ``core.float8.training`` adds the chains and the updates, reading and writing the state
   through those reads' captured handles.

Where FP8 does not happen in a training step — no matmul, a matmul without a paired
backward one, a Const operand, a matmul in a loop body, no owner — one warning per trace
names the ops. A TF1 graph (a ``tf.compat.v1.Session``'s) has no captures: the v1 wrapper's
``apply_gradients`` adds the state as global variables of the user's graph
(``add_graph_state``), which ``Saver`` and ``MonitoredTrainingSession`` save and restore, and
the Session's mirror reads them (``session_step``).
"""
from __future__ import annotations

import logging
import os
import re
import threading
import warnings
import weakref
from dataclasses import dataclass, replace
from typing import Any, Iterable, Mapping, Sequence

import keras
import tensorflow as tf
from tensorflow.core.framework import graph_pb2
from tensorflow.core.protobuf import config_pb2

from amp_rewrite import _tf
from amp_rewrite.core import functions
from amp_rewrite.core.float8 import loops as float8_loops, training as float8_training
from amp_rewrite.core.float8.formats import MATMUL_OPS
from amp_rewrite.core.float8.training import (HISTORY, SCALE, STATE_SCOPE, SUMMARY_AMAX, Plan, State,
                                              in_gradient_scope)
from amp_rewrite.core.graph_io import parse_tensor_name
from amp_rewrite.core.lists import OpLists
from amp_rewrite.core.program import MAIN_GRAPH, program_of
from amp_rewrite.core.rewrite import RewriteResult, rewrite_graph_def
from amp_rewrite.training.float8_state import Float8State, workers

log = logging.getLogger(__name__)

BASE_PRECISIONS = ("bfloat16", "float16")
_REPLICA = re.compile(r"^replica_\d+/")  # MirroredStrategy's prefix on the ops of replicas after the first
_LOOPS = functions.LOOP_OPS
_CONTROL_FLOW = _LOOPS | {"If", "StatelessIf", "Case", "StatelessCase"}
SUMMARY_AMAX_PREFIX = "amp_rewrite/amax"  # tf.summary scalars amp_rewrite/amax/<forward matmul>/<operand>


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
    bases: dict[str, str]    # forward matmul -> its key base (``Matmul.base``); those without one have no state
    under_xla: bool          # traced inside a function XLA compiles (its own jit_compile is on the FunctionDef)
    workers: float8_training.Workers | None = None  # several workers run the step: amax reduced across them


class _Traces:
    """What happened in each FuncGraph being traced: the wrappers' applies (``record_apply``) and
    ``prepare_trace``'s findings. Weakly keyed: a graph's entries go with it."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._applied: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._steps: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._instance_keys = 0  # the collectives' instance keys, in trace order (alike on every worker)

    def record(self, graph: Any, state: Float8State, variables: tuple[Any, ...]) -> None:
        with self._lock:
            direct = True
            while hasattr(graph, "outer_graph"):  # an apply in a nested function updates in its callers too
                records = self._applied.setdefault(graph, [])
                if all(recorded is not state for recorded, _, _ in records):
                    records.append((state, variables, direct))
                graph, direct = graph.outer_graph, False

    def applied(self, graph: Any, direct: bool = False) -> list[tuple[Float8State, tuple[Any, ...]]]:
        """The applies traced in ``graph`` (``direct``: in it, not in a function it calls)."""
        with self._lock:
            return [(state, variables) for state, variables, here in self._applied.get(graph, ()) if here or not direct]

    def set_step(self, graph: Any, step: TraceStep) -> None:
        with self._lock:
            self._steps[graph] = step

    def step(self, graph: Any) -> TraceStep:
        with self._lock:
            return self._steps.get(graph, TraceStep({}, {}, False))

    def next_instance_key(self) -> int:
        with self._lock:
            self._instance_keys += 1
            return self._instance_keys


TRACES = _Traces()
# The collective group of FP8 training's amax reductions across workers: far above the group keys
# TensorFlow's own CollectiveKeys hands out (counting from 1), so they never meet.
WORKERS_GROUP_KEY = 2**31 - 8


def _workers(owners: Iterable[Float8State]) -> float8_training.Workers | None:
    """Where the owners' state was made under a strategy of several workers (MultiWorkerMirroredStrategy),
    the collective that reduces the step's amaxes across them."""
    for owner in owners:
        count = workers(owner.strategy)
        if count > 1:
            return float8_training.Workers(count, WORKERS_GROUP_KEY, TRACES.next_instance_key())
    return None


def record_apply(state: Float8State | None, variables: Iterable[Any]) -> None:
    """A wrapper with ``state`` updates ``variables`` in the function being traced (if any): its
    matmuls' state goes to ``state`` (``prepare_trace``)."""
    if state is None:
        return
    variables = tuple(variables)
    if variables:
        state.updates(variables)
    graph = tf.compat.v1.get_default_graph()
    if hasattr(graph, "outer_graph"):  # a FuncGraph being traced
        TRACES.record(graph, state, variables)


def trace_step(func_graph: Any) -> TraceStep:
    """What ``prepare_trace`` found in ``func_graph`` (nothing, for a graph it left alone)."""
    return TRACES.step(func_graph)


def prepare_trace(func_graph: Any, target: str, lists: OpLists, states: Sequence[Float8State]) -> None:
    """``FUNC_GRAPH_TRANSFORMS`` hook (module doc, 2): in a training step, make or look up the
    state of its matmuls' operands in their owners' ``Float8State`` and read it in
    ``func_graph``. ``states``: the active enablements' states, newest last. Loop bodies and
    branches of ``tf.cond``/``tf.while_loop`` are left alone (their captures are fixed when the
    transform runs): the matmuls of a step's loops are planned here, with the step's
    (``core.float8.loops``), and their state read in the step."""
    if isinstance(func_graph, _tf.CONTROL_FLOW_FUNC_GRAPH.get()):
        return
    applied = TRACES.applied(func_graph)
    if not applied and not any(op.type in MATMUL_OPS or op.type in _LOOPS for op in func_graph.get_operations()):
        return
    under_xla = _tf.CONTROL_FLOW_UTIL.get()(func_graph)
    graph_def = func_graph.as_graph_def()
    step_plan, loops = _plan(graph_def, target, lists)
    plan = _with_loops(step_plan, loops)
    if not plan.trains:
        if TRACES.applied(func_graph, direct=True):
            _warn_untrained(func_graph.name, plan, graph_def)
        TRACES.set_step(func_graph, TraceStep({}, {}, under_xla))
        return
    nodes = {node.name: node for node in graph_def.node}
    sources = {m.node: name for m in step_plan.matmuls for _, name in float8_training.weight_of(nodes, m.inputs)[:1]}
    sources.update({loop.name(m): loop.sources[m.node] for loop in loops for m in loop.matmuls
                    if m.node in loop.sources})
    owners = _owners(func_graph, plan, sources, applied, states)
    state = _read_state(func_graph, plan, owners)
    if not under_xla:  # XLA cannot write summaries
        _summarize_amax(func_graph, plan, owners, state)
    workers = _workers({id(owner): owner for owner, _ in owners.values()}.values())
    TRACES.set_step(func_graph, TraceStep(state, {node: base for node, (_, base) in owners.items()}, under_xla,
                                          workers))
    sinks = [tensor.op.name for tensor in func_graph.outputs] + [op.name for op in func_graph.control_outputs]
    _warn_where_float8_does_not_happen(func_graph.name, plan, owners, graph_def, loops, _live(graph_def, sinks))
    for owner in {id(owner): owner for owner, _ in owners.values()}.values():
        report = owner.restore_report(_owner_keys(plan, owners, owner))
        if report is not None:
            warnings.warn(report, stacklevel=2)
    log.debug("amp_rewrite: %s: float8 state for %d operand(s)", func_graph.name, len(state))


def _plan(graph_def: graph_pb2.GraphDef, target: str, lists: OpLists,
          function: str = MAIN_GRAPH) -> tuple[Plan, tuple[float8_loops.Loop, ...]]:
    """The forward matmuls the base rewrite of ``graph_def`` converts in item ``function`` and in
    its loops, paired with their backward ones."""
    program = program_of(graph_def)
    report = rewrite_graph_def(graph_def, target=target, lists=lists).report
    return _planned(program, function, report)


def _planned(program: Any, function: str, report: Any) -> tuple[Plan, tuple[float8_loops.Loop, ...]]:
    """Item ``function``'s plan and loops, by the base rewrite's ``report`` of ``program``."""
    plan = float8_training.find_matmuls(program.item(function), float8_training.converted_nodes(report, function))
    return plan, float8_loops.find_loops(program, function, lambda item: float8_training.converted_nodes(report, item))


def _with_loops(plan: Plan, loops: tuple[float8_loops.Loop, ...]) -> Plan:
    """``plan`` with the loops' forward matmuls too, each named as the step's keys name it (``Loop.name``)."""
    inside = tuple(replace(m, node=loop.name(m)) for loop in loops for m in loop.matmuls)
    return replace(plan, matmuls=plan.matmuls + inside)


def _owners(func_graph: Any, plan: Plan, sources: Mapping[str, str],
            applied: list[tuple[Float8State, tuple[Any, ...]]],
            states: Sequence[Float8State]) -> dict[str, tuple[Float8State, str]]:
    """Forward matmul -> (the state it records into, its key base). By its weight's variable
    (``sources``: matmul -> the node its handle comes from in ``func_graph``): the wrapper that
    updates it, keyed ``v<index>_<name>``; else the step's only wrapper (those that applied in
    it, or else the only active one), keyed ``m<k>`` in the step's order, the replicas of one op
    sharing a key; else none."""
    handle_to_owner: dict[int, tuple[Float8State, str]] = {}
    for state, variables in [*applied, *((s, s.variables_updated) for s in states)]:
        for index, variable in enumerate(variables):
            for handle in _handles(variable):
                handle_to_owner.setdefault(id(handle), (state, f"v{index}_{_short_name(variable)}"))
    candidates = list({id(s): s for s, _ in applied}.values()) or list(states)
    owners: dict[str, tuple[Float8State, str]] = {}
    ordinals: dict[tuple[int, str], str] = {}
    for matmul in plan.matmuls:
        source = sources.get(matmul.node)
        found = handle_to_owner.get(id(_eager_handle(func_graph, source))) if source is not None else None
        if found is None and len(candidates) == 1:
            owner = candidates[0]
            replica_free = _REPLICA.sub("", matmul.node)
            index = sum(1 for state_id, _ in ordinals if state_id == id(owner))
            base = ordinals.setdefault((id(owner), replica_free), f"m{index}")
            found = (owner, base)
        if found is not None:
            owners[matmul.node] = found
    tags = {id(owner): f"o{index}_" for index, owner in enumerate({id(o): o for o, _ in owners.values()}.values())}
    if len(tags) > 1:  # two owners' keys may be alike: the graph's names tell them apart
        owners = {node: (owner, tags[id(owner)] + base) for node, (owner, base) in owners.items()}
    return owners


def _owner_keys(plan: Plan, owners: dict[str, tuple[Float8State, str]], owner: Float8State) -> list[str]:
    """The keys ``owner``'s state holds for ``plan``, without the graph's owner tag."""
    keys = []
    for matmul in plan.with_bases({node: base for node, (_, base) in owners.items()}).matmuls:
        if matmul.node in owners and owners[matmul.node][0] is owner:
            tag_free = re.sub(r"^o\d+_", "", matmul.base)
            keys += [tag_free + key[len(matmul.base):] for key, _ in matmul.keys()]
    return list(dict.fromkeys(keys))


def _read_state(func_graph: Any, plan: Plan, owners: dict[str, tuple[Float8State, str]]) -> dict[str, State]:
    """Make or find each owned key's variables in its owner's state and read them in ``func_graph``
    (so it captures them); returns graph key -> its reads."""
    owned = plan.with_bases({node: base for node, (_, base) in owners.items()})
    state: dict[str, State] = {}
    with func_graph.as_default(), func_graph.name_scope(None):
        for matmul in owned.matmuls:
            if matmul.node not in owners:
                continue
            owner = owners[matmul.node][0]
            tag_free = re.sub(r"^o\d+_", "", matmul.base)
            for key, _ in matmul.keys():
                if key not in state:
                    history, scale = owner.create(tag_free + key[len(matmul.base):])
                    state[key] = _reads(key, history, scale)
                    owner.traced(tag_free + key[len(matmul.base):], _REPLICA.sub("", matmul.node))
    _inputs_in_call_order(func_graph)
    return state


def _summarize_amax(func_graph: Any, plan: Plan, owners: dict[str, tuple[Float8State, str]],
                    state: Mapping[str, State]) -> None:
    """Where a default ``tf.summary`` writer is set while the step is traced, each operand's amax
    of each step as a scalar ``amp_rewrite/amax/<forward matmul>/<operand>`` (``input``,
    ``weight``, ``output_grad``; ``input_0``/``input_1`` without a weight), at ``tf.summary``'s
    step or else the Keras 3 wrapper's ``iterations`` (read unordered with its update: set a step for
    exact numbering); the value is wired to the step's amax when the
    step is quantized (``core.float8.training.SUMMARY_AMAX``). Without a writer, nothing is written
    and the few nodes left unread are pruned when the function runs."""
    owned = plan.with_bases({node: base for node, (_, base) in owners.items()})
    written: set[str] = set()
    with func_graph.as_default(), func_graph.name_scope(None):
        for matmul in owned.matmuls:
            given = tf.summary.experimental.get_step()
            step = owners[matmul.node][0].summary_step if given is None and matmul.node in owners else given
            for key, _ in matmul.keys() if step is not None else ():
                if key in written or key not in state:
                    continue
                written.add(key)
                history = func_graph.get_tensor_by_name(f"{state[key].history}:0")
                amax = tf.identity(history[0], name=f"{STATE_SCOPE}/{key}/{SUMMARY_AMAX}")
                tag = f"{SUMMARY_AMAX_PREFIX}/{_REPLICA.sub('', matmul.node)}/{key.rpartition('/')[2]}"
                recorded = tf.summary.scalar(tag, amax, step=step)
                if isinstance(recorded, tf.Tensor) and recorded.op.type != "Const":
                    func_graph.control_outputs.append(recorded.op)
    _inputs_in_call_order(func_graph)


def _reads(key: str, history: Any, scale: Any) -> State:
    """``ReadVariableOp`` of each component of ``history`` and ``scale`` (one, unless mirrored)."""
    def read(variable: Any, kind: str) -> str:
        return tf.raw_ops.ReadVariableOp(resource=variable.handle, dtype=tf.float32,
                                         name=f"{STATE_SCOPE}/{key}/{kind}").op.name

    reads = [State(read(s, SCALE), read(h, HISTORY)) for h, s in zip(_components(history), _components(scale))]
    return State(reads[0].scale, reads[0].history, tuple(reads[1:]))


def _inputs_in_call_order(func_graph: Any) -> None:
    """The captures just made are inputs of ``func_graph``; a call passes its call-time
    (deferred) captures last, so they stay last (MirroredStrategy's steps have some)."""
    deferred = tf.nest.flatten(func_graph.deferred_internal_captures, expand_composites=True)
    deferred_ids = {id(tensor) for tensor in deferred}
    func_graph.inputs = [tensor for tensor in func_graph.inputs if id(tensor) not in deferred_ids] + deferred


def _components(variable: Any) -> tuple[Any, ...]:
    """A variable's per-device components (a distributed variable's), or itself."""
    values = getattr(variable, "values", None)
    return tuple(values) if isinstance(values, (tuple, list)) else (variable,)


def _handles(variable: Any) -> list[Any]:
    """The resource handles a step's reads of ``variable`` capture (one per component)."""
    value = variable.value if isinstance(variable, keras.Variable) else variable
    return [component.handle for component in _components(value) if hasattr(type(component), "handle")]


def _short_name(variable: Any) -> str:
    """``kernel`` for Keras' ``dense/kernel`` or TensorFlow's ``dense/kernel:0``, as a key may hold it."""
    name = str(getattr(variable, "name", "variable")).rpartition("/")[2].partition(":")[0]
    return re.sub(r"[^A-Za-z0-9_]", "_", name) or "variable"


def _eager_handle(func_graph: Any, node: str) -> Any:
    """The tensor outside every function that ``func_graph``'s captured input ``node`` stands for
    (a variable's handle), following captures out through enclosing FuncGraphs; None if none."""
    try:
        tensor = func_graph.get_operation_by_name(node).outputs[0]
    except (KeyError, ValueError):
        return None
    graph = func_graph
    while tf.is_symbolic_tensor(tensor):
        external = next((outer for outer, inner in getattr(graph, "captures", ()) if inner is tensor), None)
        if external is None:
            return None
        tensor = external
        graph = getattr(external, "graph", None) if tf.is_symbolic_tensor(external) else None
    return tensor


def _warn_untrained(name: str, plan: Plan, graph_def: graph_pb2.GraphDef) -> None:
    """A float8 wrapper applied gradients in ``name``, but no converted matmul of it has a gradient."""
    matmuls = [node.name for node in graph_def.node if node.op in MATMUL_OPS]
    what = (f"its matmul(s) ({_some(matmuls)}) get no gradient matmul in it" if matmuls
            else "it has no matmul (MatMul, BatchMatMul, Einsum or Conv2D) in the step itself")
    warnings.warn(f"amp_rewrite: {name} applies a float8 optimizer, but {what}, so nothing of it trains on float8"
                  f"{_loop_note(graph_def)}", stacklevel=4)


def _warn_where_float8_does_not_happen(name: str, plan: Plan, owners: dict[str, tuple[Float8State, str]],
                                       graph_def: graph_pb2.GraphDef, loops: tuple[float8_loops.Loop, ...],
                                       live: set[str]) -> None:
    """One warning naming the converted matmuls of training step ``name`` that miss part of FP8
    (``live``: the step's nodes that its outputs depend on; a loop's matmuls count as live)."""
    problems = []
    inside = {loop.name(m) for loop in loops for m in loop.matmuls}
    unpaired = [m.node for m in plan.matmuls if not m.backward and (m.node in live or m.node in inside)]
    if unpaired:
        problems.append(f"{len(unpaired)} matmul(s) have no paired gradient matmul: their gradients, if the step takes"
                        f" any, stay in the base precision ({_some(unpaired)})")
    unowned = [m.node for m in plan.matmuls if m.node not in owners]
    if unowned:
        problems.append(f"{len(unowned)} matmul(s) read no variable of the float8 wrappers and the step has several,"
                        f" so they scale from each call's amax ({_some(unowned)})")
    if plan.kept:
        problems.append(f"{len(plan.kept)} matmul(s) stay in the base precision: a Const operand ({_some(plan.kept)})")
    unreached = _loop_note(graph_def, loops)
    if problems or unreached:
        warnings.warn(f"amp_rewrite: {name}: " + "; ".join(problems) + unreached, stacklevel=4)


def _live(graph_def: graph_pb2.GraphDef, sinks: Iterable[str]) -> set[str]:
    """The nodes that ``sinks`` (a function's outputs and control outputs) depend on: a matmul
    outside it does nothing the step keeps (Keras' RNNs run their first time step outside the loop
    for its shapes alone), so it has nothing to miss."""
    nodes = {node.name: node for node in graph_def.node}
    live, todo = set(), [sink for sink in sinks if sink in nodes]
    while todo:
        name = todo.pop()
        if name not in live:
            live.add(name)
            todo += [parse_tensor_name(tensor).node for tensor in nodes[name].input
                     if parse_tensor_name(tensor).node in nodes]
    return live


def _loop_note(graph_def: graph_pb2.GraphDef, loops: tuple[float8_loops.Loop, ...] = ()) -> str:
    """The matmuls in the step's control-flow bodies that FP8 training does not reach (branches of a
    ``tf.cond``, loops within loops: ``core.float8.loops`` quantizes the step's own loops), as a
    clause (or "")."""
    reached = {loop.body for loop in loops} | {loop.gradient_body for loop in loops}
    bodies = {name for node in graph_def.node if node.op in _CONTROL_FLOW
              for name in functions.called_functions(node)} - reached
    inside = [f"{function.signature.name}/{node.name}" for function in graph_def.library.function
              if function.signature.name in bodies for node in function.node_def if node.op in MATMUL_OPS
              and not in_gradient_scope(node.name)]
    if not inside:
        return ""
    return (f"; {len(inside)} matmul(s) inside the step's control flow stay in the base precision"
            f" ({_some(inside)}): FP8 training reaches the step's own matmuls and its while loops' bodies, not"
            " tf.cond branches nor loops within loops")


def _some(names: Iterable[str], count: int = 3) -> str:
    names = sorted(names)
    return ", ".join(names[:count]) + (f", … ({len(names) - count} more)" if len(names) > count else "")


def quantize(source: graph_pb2.GraphDef, result: RewriteResult, function: str, step: TraceStep,
             training: Float8Training) -> RewriteResult:
    """The base rewrite ``result`` of ``source`` with ``function``'s matmuls, and its loops', on
    float8 (module doc, 3)."""
    plan, loops = _planned(program_of(source), function, result.report)
    graph_def, report = float8_loops.training_step_rewritten(
        result.graph_def, result.report, function, plan.with_bases(step.bases), step.state,
        training.amax_history_length, workers=step.workers, loops=tuple(loop.with_bases(step.bases) for loop in loops))
    return RewriteResult(graph_def, report)


def add_graph_state(graph: Any, training: Float8Training, target: str, lists: OpLists) -> None:
    """In a TF1 graph being built (the v1 wrapper's ``apply_gradients``): the state of its training
    step's matmuls as global variables ``STATE_SCOPE/<variable name>/...`` of ``graph``, made now,
    so a ``Saver``, ``CheckpointSaverHook`` or ``MonitoredTrainingSession`` built afterwards
    saves and restores them, and the Session's mirror reads them (``session_step``)."""
    plan = _graph_plan(graph.as_graph_def(), target, lists)
    with graph.as_default(), tf.compat.v1.name_scope(f"{STATE_SCOPE}/"):
        for key, _ in plan.keys():
            training.state.create(key)


def _graph_plan(graph_def: graph_pb2.GraphDef, target: str, lists: OpLists) -> Plan:
    """A TF1 graph's plan, keyed by each matmul's weight variable's name (stable in a graph built
    afresh), or its own name where it reads no variable."""
    plan, _ = _plan(graph_def, target, lists)  # a TF1 graph's loops are v1 control flow: not looked into
    nodes = {node.name: node for node in graph_def.node}
    return plan.with_bases({m.node: next((name for _, name in float8_training.weight_of(nodes, m.inputs)), m.node)
                            for m in plan.matmuls})


def session_step(source: graph_pb2.GraphDef, result: RewriteResult, training: Float8Training,
                 target: str, lists: OpLists) -> tuple[RewriteResult, list[str]]:
    """A Session's rewrite ``result`` of ``source`` with its matmuls on float8 — in a graph that
    trains, reading the state variables the v1 wrapper added to it (``add_graph_state``), or, for
    keys it lacks, new variables of the mirror alone, with a warning — and the initializers of
    those to run once."""
    plan = _graph_plan(source, target, lists)
    graph_def, state, initializers = result.graph_def, {}, []
    if plan.trains:
        state = _graph_state(source, plan)
        missing = [(key, fmt) for key, fmt in plan.keys() if key not in state]
        if missing:
            graph_def, added, initializers = float8_training.add_state(graph_def, missing,
                                                                       training.amax_history_length)
            state.update(added)
            warnings.warn(f"amp_rewrite: this Session's graph has no FP8 state variables for {len(missing)} operand(s)"
                          f" (e.g. {missing[0][0]!r}): they live in the Session alone, so a checkpoint does not hold"
                          " them; build the train op with the optimizer enable_mixed_precision_graph_rewrite returned",
                          stacklevel=6)
    graph_def, report = float8_loops.training_step_rewritten(graph_def, result.report, MAIN_GRAPH, plan, state,
                                                                training.amax_history_length)
    return RewriteResult(graph_def, report), initializers


def _graph_state(graph_def: graph_pb2.GraphDef, plan: Plan) -> dict[str, State]:
    """The keys of ``plan`` whose variables (``add_graph_state``) ``graph_def`` holds, with their reads."""
    reads = {parse_tensor_name(node.input[0]).node: node.name for node in graph_def.node
             if node.op == "ReadVariableOp" and node.input}
    state = {}
    for key, _ in plan.keys():
        scale, history = (reads.get(f"{STATE_SCOPE}/{key}/{kind}") for kind in (SCALE, HISTORY))
        if scale is not None and history is not None:
            state[key] = State(scale, history)
    return state


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
