"""The training doctor for TF1 graphs run by a Session: the step's feed replayed in the mirror.

A TF1 graph has no loss function to trace again, but a Session created while the rewrite is
on runs a rewritten mirror of it (``training.session``), and the v1 wrapper records, as it
builds ``apply_gradients``, which tensors are the step's gradients (``optimizers.GraphStep``).
So a skipped step is replayed by running the mirror once more on the same feed, fetching
every numeric tensor the gradients are computed from — forward, backward and the rewrite's
casts, and nothing that updates a variable — and the first non-finite one in execution order
is named as ``diagnose_step`` names it in TF2 (``doctor.diagnose_values``). A step whose
gradients depend on an op that gives a new value at each run (an iterator, a queue, a random
op) cannot be replayed without changing training: that is said in one line, and nothing runs.

``DoctorHook`` does it in a ``MonitoredTrainingSession`` (the hook is that loop's callback, as
``Doctor`` is ``fit``'s), ``diagnose_session_step`` in a plain Session loop.
"""
from __future__ import annotations

import re
import warnings
from typing import Any, Mapping

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2

from amp_rewrite.core import support
from amp_rewrite.core.casts import VARIABLE_OPS
from amp_rewrite.core.functions import called_functions
from amp_rewrite.core.graph_io import tensor_name
from amp_rewrite.core.instrument import ancestors
from amp_rewrite.errors import AmpRewriteError
from amp_rewrite.training import doctor, live, optimizers, session

# Stateful ops that only read, or give a resource's handle (a table, an iterator: the op that reads
# the iterator is what gives a new value): running them once more changes nothing the step computes next.
READ_ONLY = VARIABLE_OPS | {"VarIsInitializedOp", "ResourceGather", "ResourceGatherNd", "HashTableV2",
                            "MutableHashTableV2", "MutableHashTableOfTensorsV2", "LookupTableFindV2",
                            "LookupTableSizeV2", "OneShotIterator", "Iterator", "IteratorV2", "FIFOQueueV2",
                            "PaddingFIFOQueueV2", "RandomShuffleQueueV2"}
TF1_GRADIENTS = re.compile(r"(.*/)?gradients(_\d+)?/")  # tf.gradients' scope, as v1 compute_gradients names it


def diagnose_session_step(sess: Any, feed_dict: Mapping[Any, Any] | None, *, optimizer: Any) -> doctor.Diagnosis:
    """Replay a skipped step of ``sess`` (a Session created after enabling) on its ``feed_dict``
    once and name the first op whose output is not finite. ``optimizer``: the v1 wrapper
    ``enable_mixed_precision_graph_rewrite`` returned, whose ``apply_gradients`` built the step."""
    mirror, target = _mirror_of(sess)
    step = _graph_step(optimizer, sess.graph)
    with live.INSTALLER.paused():  # the doctor's own runs (the op alone in float32) run as they are
        return _replay(mirror, target, step, feed_dict or {})


def _replay(mirror: session.Mirror, target: str, step: optimizers.GraphStep, feed_dict: Mapping[Any, Any]
            ) -> doctor.Diagnosis:
    """One run of ``mirror`` on ``feed_dict``, fetching every numeric tensor ``step``'s gradients
    are computed from, and the first non-finite op."""
    missing = [t for t in (*step.gradients, step.loss_scale) if t.partition(":")[0] not in mirror.nodes]
    if missing:
        raise AmpRewriteError(f"this Session has not run the training step yet (no '{missing[0]}'): call it after a"
                              " run of the train op that was skipped")
    feeds = _feeds(mirror.graph, feed_dict)
    fed = {name.partition(":")[0] for name in feeds}
    names = _replay_nodes(mirror.result.graph_def, [*step.gradients, step.loss_scale], fed)
    fetches = {tensor_name(op.name, i): t for op in map(mirror.graph.get_operation_by_name, names)
               if op.name not in fed for i, t in enumerate(op.outputs) if t.dtype in doctor.FETCHED}
    values = dict(zip(fetches, mirror.session.run(list(fetches.values()), {mirror.graph.get_tensor_by_name(n): v
                                                                         for n, v in feeds.items()})))
    values.update(feeds)
    scale = float(values[step.loss_scale])
    replayed = doctor.Step(mirror.result.graph_def, set(mirror.sources), target, TF1_GRADIENTS)
    return doctor.diagnose_values(replayed, values, scale)


def _mirror_of(sess: Any) -> tuple[session.Mirror, str]:
    raw = sess.raw_session() if hasattr(sess, "raw_session") else sess  # SingularMonitoredSession
    if isinstance(raw, tf.compat.v1.train.MonitoredSession):
        raise AmpRewriteError("a MonitoredSession runs its hooks at every run: add amp_rewrite.DoctorHook(opt) to"
                              " its hooks to diagnose its skipped steps")
    if not isinstance(raw, (tf.compat.v1.Session, tf.compat.v1.InteractiveSession)):
        raise AmpRewriteError(f"diagnose_session_step takes the tf.compat.v1.Session that ran the step, not a"
                              f" {type(raw).__name__} (in TF2, call diagnose_step with the step's loss function)")
    found = session.running_mirror(raw)
    if found is None:
        raise AmpRewriteError("this Session does not run the rewrite (created before enable_mixed_precision_graph_"
                              "rewrite, or it has run nothing yet): nothing of it is in low precision to diagnose")
    return found


def _graph_step(optimizer: Any, graph: tf.Graph) -> optimizers.GraphStep:
    step = getattr(optimizer, "graph_step", None)
    if not isinstance(step, optimizers.GraphStep) or step.graph() is not graph:
        raise AmpRewriteError("pass optimizer= the v1 wrapper enable_mixed_precision_graph_rewrite returned, whose"
                              " minimize() or apply_gradients() built this Session's training step")
    if step.distributed:
        raise AmpRewriteError("the doctor cannot diagnose a Session's step built under a tf.distribute strategy (its"
                              " gradients are per replica): replay the batch without the strategy to name the op")
    return step


def _feeds(graph: tf.Graph, feed_dict: Mapping[Any, Any]) -> dict[str, np.ndarray]:
    """``feed_dict`` (keys: tensors, placeholders' operations or names) by the mirror's tensor
    names, each value in the mirror's dtype."""
    feeds = {}
    for key, value in feed_dict.items():
        name = getattr(key, "name", key)
        if not isinstance(name, str) or isinstance(key, tf.SparseTensor):
            raise AmpRewriteError(f"cannot replay a feed keyed by a {type(key).__name__}: feed dense tensors"
                                  " (placeholders) to diagnose the step")
        name = name if ":" in name else f"{name}:0"
        tensor = graph.get_tensor_by_name(name)
        feeds[name] = np.asarray(value).astype(tensor.dtype.as_numpy_dtype)
    return feeds


def _replay_nodes(graph_def: graph_pb2.GraphDef, fetches: list[str], fed: set[str]) -> list[str]:
    """The nodes a run of ``fetches`` (fed ``fed``) executes, in the GraphDef's order; refused in
    one line when one of them gives a new value at each run."""
    library = {f.signature.name: f for f in graph_def.library.function}
    run = ancestors(graph_def, fetches, fed=fed)
    for node in graph_def.node:
        if node.name in run and node.name not in fed:
            _check_replayable(node, library, node.name)
    return [node.name for node in graph_def.node if node.name in run]


def _check_replayable(node: Any, library: Mapping[str, Any], where: str) -> None:
    """Refuse a node (or an op of a function it calls) that gives a new value at each run."""
    if node.op in READ_ONLY:  # an iterator's dataset function runs once, when it is made
        return
    called = [name for name in called_functions(node) if name in library]
    for name in called:
        for inner in library[name].node_def:
            _check_replayable(inner, library, where)
    op_def = support.registered_op_def(node.op)
    if called or op_def is None or not op_def.is_stateful:
        return
    raise AmpRewriteError(f"cannot replay this step: its gradients depend on '{where}' ({node.op}), which gives a"
                          " new value at each run (an iterator, a queue, a random op); feed the step's batch through"
                          " a placeholder (feed_dict) so the doctor can run it again")


class DoctorHook(tf.compat.v1.train.SessionRunHook):
    """For a ``MonitoredTrainingSession`` whose ``train_op`` the v1 wrapper built: when training is
    stuck (the wrapper's stuck line), replay that run's ``feed_dict`` once
    (``diagnose_session_step``) and warn once, with the op and the keep that fixes it;
    ``first_skip=True`` diagnoses the first skipped step too (then each run until it also fetches
    ``opt.skipped_steps``, one scalar read alongside the step, unordered with its update: the
    first skip is seen at its run or the next). ``diagnoses``: what it found, in order."""

    def __init__(self, optimizer: Any, *, first_skip: bool = False) -> None:
        if not isinstance(getattr(optimizer, "graph_step", False), (optimizers.GraphStep, type(None))):
            raise AmpRewriteError(f"amp_rewrite.DoctorHook needs the v1 optimizer enable_mixed_precision_graph_rewrite"
                                  f" returned, not a {type(optimizer).__name__}")
        self.optimizer, self.first_skip = optimizer, first_skip
        self.diagnoses: list[doctor.Diagnosis] = []
        self._stuck: str | None = None
        self._skipped: Any = None
        self._before = 0

    def begin(self) -> None:
        object.__setattr__(self.optimizer, "doctor", self)
        self._skipped = self.optimizer.skipped_steps if self.first_skip else None

    def stuck(self, message: str) -> None:
        """The wrapper's call, from inside the run: training is stuck; said after the run, with the diagnosis."""
        self._stuck = message

    def before_run(self, run_context: Any) -> Any:
        return tf.compat.v1.train.SessionRunArgs(self._skipped) if self._skipped is not None else None

    def after_run(self, run_context: Any, run_values: Any) -> None:
        first = self._skipped is not None and int(run_values.results) > self._before
        if first:
            self._skipped = None  # the first skip is diagnosed once; later runs fetch nothing more
        if self._stuck is None and not first:
            return
        message, self._stuck = self._stuck, None
        try:
            diagnosis = diagnose_session_step(run_context.session, run_context.original_args.feed_dict,
                                              optimizer=self.optimizer)
            self.diagnoses.append(diagnosis)
            line = diagnosis.line()
        except AmpRewriteError as error:
            line = f"amp_rewrite doctor: {error}"
        warnings.warn(f"{message} {line}" if message else line, stacklevel=2)

    def end(self, session: Any) -> None:
        object.__setattr__(self.optimizer, "doctor", None)
