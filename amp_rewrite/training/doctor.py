"""The training doctor: which op made a skipped step's gradients non-finite, and the keep that fixes it.

A loss-scale optimizer skips a step whose gradients hold Inf or NaN; that alone cannot tell
an op that overflows in float16 (keep it float32) from a loss-scale problem or bad data. The
doctor replays the step's batch once: the loss and the gradients of the scaled loss, traced
as the step is and rewritten with the wrapper's own settings (target, lists, keeps), run
with every numeric tensor of the step's graph fetched. It then walks the graph in execution
order to the first op whose output is not finite, and runs that op alone in float32 on the
same inputs. Variables the replay writes (BatchNormalization's moving statistics, the
random-seed state of Dropout) are put back, so training is the same with the doctor as
without it. ``diagnose_step`` is the call for a custom loop; ``Doctor`` does it inside
``model.fit`` (Keras 3), replaying the batch of the first skipped step and of the step at
which training is stuck (``skips.STUCK_STEPS``), and nothing else.
"""
from __future__ import annotations

import collections.abc
import re
import sys
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, types_pb2

from amp_rewrite import _tf
from amp_rewrite.core.graph_io import data_inputs, make_node_def, parse_tensor_name, tensor_name
from amp_rewrite.core.instrument import first_nonfinite, is_float, is_nonfinite, largest_finite, topological_order
from amp_rewrite.core.rewrite import rewrite_graph_def
from amp_rewrite.core.target import LOW_DTYPES, lookup_target
from amp_rewrite.errors import AmpRewriteError
from amp_rewrite.training import doctor_float8, live, optimizers

FETCHED = (tf.float16, tf.bfloat16, tf.float32, tf.float64, tf.int32, tf.int64, tf.bool)
_SCOPE = "amp_rewrite_doctor"
GRADIENT_SCOPE = "gradient_tape/"  # where a GradientTape puts the backward pass's ops


@dataclass(frozen=True)
class Diagnosis:
    """The first op of a replayed step whose output is not finite, and what to do about it."""

    node: str                 # its name in the step's graph (``gradient_tape/…`` for the backward pass)
    op: str                   # its type
    dtype: str                # its output's dtype in the rewritten step
    largest_input: float      # the largest finite |x| among its float inputs
    float32_finite: bool | None  # its output, computed in float32 from the same inputs, is finite (None: unknown)
    float32_largest: float | None  # ... and its largest |x| there
    keep: tuple[str, ...]     # keep= entries that keep it float32 (empty: precision is not the cause)
    loss_scale: float
    cause: str                # "precision", "cast", "scale", "data" or "weights"
    source: str = ""          # cause "cast": the node whose float32 output the rewrite's cast reads

    @property
    def scope(self) -> str:
        """The layer / name scope the op sits in."""
        return self.node.rpartition("/")[0] or "(top level)"

    def line(self) -> str:
        """The diagnosis in one line, with the fix to paste."""
        where = f"{self.node} ({self.op}, {self.dtype}, in {self.scope})"
        if self.cause == "data":
            return f"amp_rewrite doctor: the batch itself holds Inf or NaN ({where}): bad data, not precision; filter it out"
        if self.cause == "weights":
            return (f"amp_rewrite doctor: a weight is already Inf or NaN ({where}); restore a checkpoint from before"
                    " it went bad")
        head = (f"amp_rewrite doctor: first non-finite op of the step: {where}; largest finite input"
                f" {self.largest_input:.4g}, loss scale {self.loss_scale:g}; ")
        if self.cause == "scale" and not self.float32_finite:
            return head + "also non-finite in float32: not the op's precision; check the model and the loss"
        if self.cause == "scale":
            return head + (f"in float32 it reaches {self.float32_largest:.4g}, within range at a smaller loss scale:"
                           " a dynamic loss scale comes down to it by itself")
        keep = ", ".join(repr(entry) for entry in self.keep)
        what = (f"the rewrite's cast of {self.source}'s float32 output down to {self.dtype} overflows: keep its"
                " readers float32" if self.cause == "cast" else f"in float32 it is finite (largest {self.float32_largest:.4g}): keep it"
                " float32" + (" and its readers" if len(self.keep) > 1 else ""))
        return (head + f"{what} —"
                f" enable_mixed_precision_graph_rewrite(opt, ..., keep=[{keep}]), or --keep"
                f" {' --keep '.join(self.keep)}, or an overlay's keep_nodes: [{keep}]")


def diagnose_step(loss_fn: Callable[..., Any], *batch: Any, optimizer: Any,
                  variables: Sequence[Any] | None = None) -> Diagnosis:
    """Replay one step's ``batch`` once, rewritten as the step is, and name the first op whose
    output is not finite (``Diagnosis.line()``). ``loss_fn(*batch)`` returns the loss, as in
    the step; ``optimizer``: the wrapper ``enable_mixed_precision_graph_rewrite`` returned (its
    settings and loss scale are the step's); ``variables``: those differentiated (default: the
    optimizer's). Raises ``AmpRewriteError`` in one line where there is nothing to diagnose."""
    settings = _settings_of(optimizer)
    flat = replayable(batch)
    variables = list(variables) if variables is not None else _variables_of(optimizer)
    scale = float(optimizer.loss_scale)
    with live.INSTALLER.paused():  # the replay is rewritten here, once, with the wrapper's settings
        # autograph off: an error of ours reaches the caller as it is, not as a StagingError
        probe = tf.function(_probe(loss_fn, batch, variables, scale), autograph=False).get_concrete_function(*flat)
        graph_def = probe.graph.as_graph_def()
        outputs = [t.op.name for t in probe.outputs]
        rewritten = rewrite_graph_def(graph_def, target=settings.target, fetches=outputs, lists=settings.lists,
                                      cross_function=settings.cross_function).graph_def
        with _restored(probe.graph.variables):
            values = _run_all(rewritten, probe, flat)
        step = Step(rewritten, {n.name for n in graph_def.node} - set(outputs), settings.target)
        return diagnose_values(step, values, scale)


def replayable(batch: Sequence[Any]) -> list[tf.Tensor]:
    """The batch (any nest of arrays and tensors) as a flat list of tensors, or one line saying why
    it cannot be replayed."""
    if not batch:
        raise AmpRewriteError("diagnose_step needs the step's batch: pass its tensors after loss_fn")
    flat = tf.nest.flatten(list(batch))
    for item in flat:
        if isinstance(item, (tf.data.Dataset, collections.abc.Iterator)) or hasattr(item, "get_next"):
            raise AmpRewriteError(f"cannot replay a batch given as a {type(item).__name__}: it yields each batch once;"
                                  " pass the batch's tensors (e.g. x, y = next(iterator)) so the step can run again")
    return [tf.convert_to_tensor(item) for item in flat]


def _model_classes() -> tuple[type, ...]:
    """The model classes whose ``fit`` calls ``Doctor``: Keras 3's, and tf_keras' where it is loaded."""
    tf_keras = sys.modules.get("tf_keras")
    return (keras.Model,) if tf_keras is None else (keras.Model, tf_keras.Model)


def _settings_of(optimizer: Any) -> live.LiveRewrite:
    enablement = optimizers.enablement_of(optimizer)
    if enablement is None or not enablement.active:
        raise AmpRewriteError(f"this {type(optimizer).__name__} has no enabled rewrite: pass the optimizer that"
                              " enable_mixed_precision_graph_rewrite returned, while it is enabled")
    # FP8 training replays in its base precision: the float8 casts keep Inf and NaN as they are and clip
    # finite values, so a non-finite value starts at an op of the base precision (doctor_float8: the clipping).
    return enablement.settings


def _variables_of(optimizer: Any) -> list[Any]:
    variables = getattr(optimizer, _tf.KERAS_TRAINABLE_VARIABLES, None)
    if not variables:
        raise AmpRewriteError("pass variables= (the variables the step differentiates): this optimizer has not"
                              " applied a step yet, or does not list them")
    return list(variables)


def _probe(loss_fn: Callable[..., Any], batch: Sequence[Any], variables: list[Any], scale: float
           ) -> Callable[..., Any]:
    """The step without its update, on ``batch``'s flattened tensors: the loss and the gradients
    of the scaled loss."""
    def probe(*flat: tf.Tensor) -> list[tf.Tensor]:
        with tf.GradientTape() as tape:
            loss = loss_fn(*tf.nest.pack_sequence_as(list(batch), list(flat)))
            if not isinstance(loss, (tf.Tensor, tf.Variable)) or not loss.dtype.is_floating:
                what = f"a {loss.dtype.name} tensor" if hasattr(loss, "dtype") else type(loss).__name__
                raise AmpRewriteError(f"loss_fn returned {what}, not a float tensor: the doctor differentiates the"
                                      " loss the step minimizes")
            scaled = tf.reduce_sum(tf.cast(loss, tf.float32)) * scale
        gradients = [g for g in tape.gradient(scaled, variables) if g is not None]
        if not gradients:
            raise AmpRewriteError("loss_fn's loss depends on none of the variables: pass the loss the step"
                                  " differentiates, and variables= the step updates")
        # Read through Identity, as the update reads them: a fetched node keeps its dtype in the
        # rewrite, and a gradient the step computes in the target must be computed so here too.
        return [tf.identity(t) for t in [loss, *gradients]]

    return probe


class _restored:
    """Put back every variable the replay may write (moving statistics, seed states)."""

    def __init__(self, variables: Sequence[tf.Variable]) -> None:
        self.saved = [(v, tf.identity(v)) for v in variables if v.dtype != tf.resource]

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        for variable, value in self.saved:
            variable.assign(value)


def _run_all(graph_def: graph_pb2.GraphDef, probe: Any, batch: list[tf.Tensor]) -> dict[str, np.ndarray]:
    """One run of ``graph_def`` (``probe``'s graph, rewritten) on ``batch``, every numeric tensor fetched."""
    inputs, captured = probe.inputs, probe.captured_inputs
    names: list[str] = []

    def body(*args: tf.Tensor) -> list[tf.Tensor]:
        graph = tf.compat.v1.get_default_graph()
        handles = [graph.capture(handle) for handle in captured]  # the variables, read where the step reads them
        input_map = {t.name: a for t, a in zip(inputs, [*args, *handles])}
        tf.graph_util.import_graph_def(graph_def, input_map=input_map, name=_SCOPE)
        fetched = []
        for node in graph_def.node:
            mapped = input_map.get(tensor_name(node.name, 0))  # a fed placeholder: the value fed
            for tensor in [mapped] if mapped is not None else graph.get_operation_by_name(f"{_SCOPE}/{node.name}").outputs:
                if tensor.dtype in FETCHED:
                    names.append(tensor_name(node.name, 0 if mapped is not None else tensor.value_index))
                    fetched.append(tensor)
        return fetched

    run = tf.compat.v1.wrap_function(body, [tf.TensorSpec.from_tensor(t) for t in batch])
    return {name: value.numpy() for name, value in zip(names, run(*batch))}


@dataclass(frozen=True)
class Step:
    """The replayed step's rewritten graph, the names of its original nodes, and its target."""

    rewritten: graph_pb2.GraphDef
    original: set[str]  # the step's own nodes (not the rewrite's casts, nor the replay's outputs)
    target: str
    backward: re.Pattern = re.compile(re.escape(GRADIENT_SCOPE))  # matches the names of the backward pass's ops

    @property
    def largest(self) -> float:
        """The target's largest finite value."""
        return float(tf.as_dtype(lookup_target(self.target).dtype).max)

    def low_readers(self, name: str) -> tuple[str, ...]:
        """keep= entries for the original nodes that read ``name`` in the target, directly or through
        a cast the rewrite added."""
        readers = [n for n in self.rewritten.node if any(parse_tensor_name(t).node == name for t in n.input)]
        found = []
        for reader in readers:
            if reader.name not in self.original and reader.op == "Cast":
                found += [n.name for n in self.rewritten.node if any(parse_tensor_name(t).node == reader.name
                                                                     for t in n.input)]
            elif _dtype_of(reader) != "float32":
                found.append(reader.name)
        return tuple(_keep_entry(n) for n in dict.fromkeys(found) if n in self.original)


def diagnose_values(step: Step, values: Mapping[str, np.ndarray], scale: float) -> Diagnosis:
    """The first op of ``step`` (in execution order) whose output in ``values`` is not finite, and why."""
    rewritten = step.rewritten
    nodes = {node.name: node for node in rewritten.node}
    first = first_nonfinite(topological_order(rewritten), values)
    if first is None:
        raise AmpRewriteError(f"no value of this step is Inf or NaN at loss scale {scale:g}: nothing to diagnose (the"
                              " step was not skipped on this batch); call it for the batch of a skipped step")
    node = nodes[first]
    if node.op in ("Placeholder", "ReadVariableOp"):
        return Diagnosis(first, node.op, _dtype_of(node), 0.0, None, None, (), scale,
                         "data" if node.op == "Placeholder" else "weights")
    inputs = _input_values(node, values)
    if first not in step.original and node.op == "Cast":  # the rewrite's cast overflows: keep its readers
        largest = largest_finite(inputs)
        return Diagnosis(first, "Cast", _dtype_of(node), largest, True, largest, step.low_readers(first), scale,
                         "cast", parse_tensor_name(node.input[0]).node)
    finite, largest = _in_float32(node, rewritten, values)
    if not finite:
        cause, keep = "scale", ()
    elif step.backward.match(first) and scale > 1 and largest / scale <= step.largest:
        cause, keep = "scale", ()  # fits at a smaller scale: a dynamic scale gets there by itself
    else:  # out of the target's range in float32 too: its readers would get it cast down, keep them too
        cause = "precision"
        keep = (_keep_entry(first),) + (step.low_readers(first) if largest > step.largest else ())
    return Diagnosis(first, node.op, _dtype_of(node), largest_finite(inputs), finite, largest, keep, scale, cause)


def _input_values(node: Any, values: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    """The fetched values of ``node``'s data inputs (None where one was not fetched: a resource)."""
    return [values.get(tensor_name(ref.node, ref.port)) for ref in map(parse_tensor_name, data_inputs(node))]


def _keep_entry(node: str) -> str:
    return re.escape(node).replace("\\/", "/")


def _dtype_of(node: Any) -> str:
    for key in ("T", "DstT", "dtype"):
        if key in node.attr and node.attr[key].type:
            return tf.as_dtype(node.attr[key].type).name
    return "?"


def _in_float32(node: Any, graph_def: graph_pb2.GraphDef, values: Mapping[str, np.ndarray]
                ) -> tuple[bool | None, float | None]:
    """Run ``node`` alone in float32 on the inputs it had: is its output finite, and how large."""
    one = graph_pb2.GraphDef()
    one.library.CopyFrom(graph_def.library)
    inputs = []
    for index, value in enumerate(_input_values(node, values)):
        if value is None:
            return None, None
        if is_float(value) and value.dtype != np.float64:
            value = value.astype(np.float32)
        inputs.append(make_node_def("Const", f"input_{index}", into=one.node,
                                    dtype=tf.as_dtype(value.dtype).as_datatype_enum, value=value).name)
    copy = one.node.add()
    copy.CopyFrom(node)
    copy.name, copy.device = "op", ""
    del copy.input[:]
    copy.input.extend(inputs)
    for attr in copy.attr.values():
        if attr.type in LOW_DTYPES:
            attr.type = types_pb2.DT_FLOAT
    try:  # a Session of its own graph: runs alike eagerly, in a TF1 graph, and in a finalized one
        graph = tf.Graph()
        with graph.as_default():
            op = tf.graph_util.import_graph_def(one, return_elements=["op"], name="")[0]
        with tf.compat.v1.Session(graph=graph) as sess:  # the callers pause the rewrite: it runs as it is
            outputs = [np.asarray(v) for v in sess.run(op.outputs)]
    except (tf.errors.OpError, ValueError, TypeError):
        return None, None
    floats = [v for v in outputs if is_float(v)]
    return not any(is_nonfinite(v) for v in floats), largest_finite(floats)


class Doctor(keras.callbacks.Callback):
    """For ``model.fit`` (Keras 3 and tf_keras): when training is stuck (``skips.STUCK_STEPS``
    skipped steps in a row at the loss scale's floor), replay that step's batch once
    (``diagnose_step``) and warn once, with the op and the keep that fixes it; ``first_skip=True``
    diagnoses the first skipped step too. With FP8 training it also warns once per operand whose amax
    history went stale, at each epoch's end (``diagnose_float8``, ``float8_findings``). Adds
    ``loss_scale`` and ``skipped_steps`` to the epoch's logs (list it before ``TensorBoard`` to see
    them there). ``diagnoses``: what it found, in order.

    While on, each step keeps its batch when it is skipped (a copy, on skipped steps only), and
    ``fit`` traces its step again at the start; off (not in ``callbacks``), nothing runs. One class
    for both families: tf_keras' ``CallbackList`` asks a callback which batch hooks it implements
    (``_implements_*_batch_hooks``), the only calls Keras 3's ``Callback`` lacks."""

    def __init__(self, *, first_skip: bool = False) -> None:
        super().__init__()
        self.first_skip = first_skip
        self.diagnoses: list[Diagnosis] = []
        self._batch: list[np.ndarray] | None = None
        self._structure: Any = None
        self._skipped_before = True  # a step was skipped before (first_skip: nothing to do)
        self._first = False  # the first skipped step's batch is kept: diagnose it at the batch's end
        self._stuck: str | None = None
        self.float8_findings: list[doctor_float8.Float8Finding] = []  # FP8 training: stale amax histories
        self._float8_said: set[tuple[str, str]] = set()

    def _implements_train_batch_hooks(self) -> bool:  # tf_keras' CallbackList: call on_train_batch_end
        return True

    def _implements_test_batch_hooks(self) -> bool:
        return False

    def _implements_predict_batch_hooks(self) -> bool:
        return False

    def set_model(self, model: Any) -> None:
        if not isinstance(model, _model_classes()):
            raise AmpRewriteError(f"amp_rewrite.Doctor is a callback for model.fit of a Keras 3 or tf_keras model,"
                                  f" not of a {type(model).__name__}: in another loop call"
                                  " amp_rewrite.diagnose_step(loss_fn, *batch, optimizer=opt,"
                                  " variables=model.trainable_variables) with a skipped step's batch")
        super().set_model(model)

    def on_train_begin(self, logs: Mapping[str, Any] | None = None) -> None:
        optimizer = self.model.optimizer
        if not isinstance(optimizer, optimizers.loss_scale_classes()):
            raise AmpRewriteError(f"amp_rewrite.Doctor needs the optimizer enable_mixed_precision_graph_rewrite"
                                  f" returned, not a {type(optimizer).__name__}; compile the model with it")
        _settings_of(optimizer)
        if getattr(self.model, "jit_compile", False):
            raise AmpRewriteError("amp_rewrite.Doctor cannot keep a batch inside an XLA-compiled step: compile with"
                                  " jit_compile=False while diagnosing (XLA cannot call back into Python)")
        object.__setattr__(optimizer, "doctor", self)
        self._skipped_before = int(optimizer.skipped_steps) > 0
        original = self.model.train_step

        def train_step(data: Any) -> Any:
            before = tf.convert_to_tensor(optimizer.skipped_steps)  # tf_keras: the variable, read here
            logs = original(data)
            self._structure = tf.nest.map_structure(lambda _: None, data)

            def keep() -> None:
                tf.py_function(self._keep_batch, tf.nest.flatten(data), [])

            tf.cond(tf.convert_to_tensor(optimizer.skipped_steps) > before, keep, lambda: None)
            return logs

        self.model.train_step = train_step
        self.model.make_train_function(force=True)

    def _keep_batch(self, *flat: tf.Tensor) -> None:
        """A skipped step's batch (called from the step, on skipped steps only)."""
        self._batch = [t.numpy() for t in flat]
        if self.first_skip and not self._skipped_before:
            self._skipped_before = self._first = True

    def stuck(self, message: str) -> None:
        """The wrapper's call: training is stuck; say so at the batch's end, with the diagnosis."""
        self._stuck = message

    def on_train_batch_end(self, batch: int, logs: Mapping[str, Any] | None = None) -> None:
        """Python flags only: reading the step's counters here would wait for each step."""
        if self._stuck is not None or self._first:
            message, self._stuck, self._first = self._stuck, None, False
            line = self._diagnose()
            warnings.warn(f"{message} {line}" if message else line, stacklevel=2)

    def _diagnose(self) -> str:
        if self._batch is None:
            return "amp_rewrite doctor: no skipped batch was kept to replay"
        model = self.model
        data = tf.nest.pack_sequence_as(self._structure, self._batch)

        def loss_fn(data: Any) -> tf.Tensor:
            x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
            return model.compute_loss(x, y, model(x, training=True), sample_weight)

        try:
            diagnosis = diagnose_step(loss_fn, data, optimizer=model.optimizer, variables=model.trainable_variables)
        except AmpRewriteError as error:
            return f"amp_rewrite doctor: {error}"
        self.diagnoses.append(diagnosis)
        return diagnosis.line()

    def on_epoch_end(self, epoch: int, logs: dict[str, Any] | None = None) -> None:
        if getattr(self.model.optimizer, "float8_state", None) is not None:
            self._warn_float8()
        if logs is not None:
            logs["loss_scale"] = float(self.model.optimizer.loss_scale)
            logs["skipped_steps"] = int(self.model.optimizer.skipped_steps)

    def _warn_float8(self) -> None:
        """FP8 training: each operand whose amax history went stale (``diagnose_float8``), said once."""
        try:
            findings = doctor_float8.diagnose_float8(self.model.optimizer)
        except AmpRewriteError:
            return  # no step traced yet
        for finding in findings:
            if (finding.key, finding.kind) not in self._float8_said:
                self._float8_said.add((finding.key, finding.kind))
                self.float8_findings.append(finding)
                warnings.warn(finding.line(), stacklevel=2)

    def on_train_end(self, logs: Mapping[str, Any] | None = None) -> None:
        object.__setattr__(self.model.optimizer, "doctor", None)
        del self.model.train_step  # the class's own again; the next fit traces it afresh
        self.model.train_function = None
