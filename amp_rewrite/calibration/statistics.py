"""Statistics of a model's tensors over calibration inputs, from one instrumented run per feed.

Every float tensor asked for — in the main graph and inside library function bodies,
where a SavedModel's and a ``tf.function``'s compute lives — is reduced in the graph by a
few plain nodes (``_add_folds``): each element's magnitude goes to one of four buckets
(zero, non-zero below the target's smallest normal, finite, non-finite) and a segment sum
and max per bucket give its counts, sums and largest value, folded into two resource
variables shared by name (``ResourceScatterAdd``, ``ResourceScatterMax``). A function body
lists its folds as control outputs, so TensorFlow runs them, and stateless control flow
and calls become their stateful forms, so nothing prunes them. The model then runs in a
TF1 Session (a SavedModel through TensorFlow's own loader, which restores variables and
runs init ops) once per feed, and the variables are read back; a calibration's runs share
one session at a time (``Runner``). Constants need no run:
their statistics come from their values. Signatures that compute the same outputs from
the same inputs (a Keras export's ``serve`` and ``serving_default``) run once.

A tensor is named by its ``TensorKey``: ``(function, node, port)``, with function ``""``
for the main graph and a function body's arguments named like its ``_Arg`` nodes.
"""
from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import attr_value_pb2, function_pb2, graph_pb2, node_def_pb2, op_def_pb2, types_pb2
from tensorflow.core.protobuf import rewriter_config_pb2, saved_model_pb2, trackable_object_graph_pb2

from amp_rewrite.calibration import staging
from amp_rewrite.calibration.savedmodel import GRAPH, Model, ModelError, Signature, plumbing_kinds
from amp_rewrite.calibration.validate import Feeds
from amp_rewrite.core import functions, graph_io
from amp_rewrite.core.graph_io import copy_graph_def, parse_tensor_name, tensor_name
from amp_rewrite.core.instrument import TensorStats, ancestors, tensor_stats
from amp_rewrite.core.program import MAIN_GRAPH, Program
from amp_rewrite.core.typegraph import output_dtypes
from amp_rewrite.errors import tensorflow_cause

log = logging.getLogger(__name__)



class TensorKey(NamedTuple):
    """A tensor of a model: an output ``port`` of ``node`` in ``function`` (``MAIN_GRAPH``,
    "", for the main graph). Equal to the plain tuple of its fields, as the rewrite's
    ``amax`` keys are."""

    function: str
    node: str
    port: int


PREFIX = "amp_rewrite_statistics"
_MAXIMA, _SUMS, _PEAKS = "maxima", "sums", "peaks"  # the variables, shared by name as PREFIX_<name>
# A tensor whose batch items each hold more than this many elements is bucketed on a sample
# of about _SAMPLES_PER_ITEM elements per item (its largest |x| still over all of them).
_SAMPLE_ABOVE = 16384
_SAMPLES_PER_ITEM = 1024
# A Runner's session takes this many graphs after the one it loaded, then the next run loads
# afresh: each run's executor copies the session's whole function library, which every added
# graph grows (MobileNetV2's five float8 runs took about 7 s each in a session that kept
# taking them, 3 to 4 s otherwise).
_ADDED_PER_SESSION = 1
# Each element's |x| falls in one bucket; per bucket, its count, sum of |x| and sum of x².
_ZERO, _SMALL, _FINITE, _NONFINITE = range(4)
_BUCKETS = 4
_MOMENTS = 3  # count, sum of |x|, sum of x²
FLOAT_DTYPES = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16})
_NO_GRAPPLER = tf.compat.v1.ConfigProto(graph_options=tf.compat.v1.GraphOptions(
    rewrite_options=rewriter_config_pb2.RewriterConfig(disable_meta_optimizer=True),
    optimizer_options=tf.compat.v1.OptimizerOptions(opt_level=tf.compat.v1.OptimizerOptions.L0))).SerializeToString()
_STATEFUL_FORM = {"StatelessWhile": "While", "StatelessIf": "If", "StatelessCase": "Case",
                  "PartitionedCall": "StatefulPartitionedCall"}


@dataclass(frozen=True)
class Run:
    """Statistics per tensor, and each signature's outputs per feed (for validation)."""

    stats: Mapping[TensorKey, TensorStats]
    outputs: Mapping[str, Sequence[Mapping[str, np.ndarray]]]


def float_tensors(program: Program, skip_functions: Iterable[str] = ()) -> list[TensorKey]:
    """Every float output the pass may convert: in the main graph and in each function
    the rewrite reaches (``functions.reachable_functions``), but ``skip_functions``, and
    but the unread outputs of a node whose other outputs are read (a batch norm's reserve
    spaces): nothing they hold reaches anything."""
    skip = set(skip_functions)
    names = [MAIN_GRAPH] + [n for n in functions.reachable_functions(program.graph_def, program.library)
                            if n not in skip]
    keys = []
    for name in names:
        body = program.item(name)
        read: dict[str, set[int]] = {}
        for node_def in body.node:
            for tensor in node_def.input:
                ref = parse_tensor_name(tensor)
                if not ref.is_control:
                    read.setdefault(ref.node, set()).add(ref.port)
        for node_def in body.node:
            if node_def.op == "_Retval":
                continue
            ports = read.get(node_def.name)
            for port, dtype in enumerate(output_dtypes(node_def, program.op_defs)):
                if dtype == types_pb2.DT_FLOAT and (ports is None or port in ports):
                    keys.append(TensorKey(name, node_def.name, port))
    return keys


def constant_stats(program: Program, keys: Iterable[TensorKey], small_below: float) -> dict[TensorKey, TensorStats]:
    """Statistics of the keys that are float constants, from their values."""
    by_item: dict[str, list[TensorKey]] = {}
    for key in map(TensorKey._make, keys):
        by_item.setdefault(key.function, []).append(key)
    found = {}
    for item, item_keys in by_item.items():
        nodes = {n.name: n for n in program.item(item).node}
        for key in item_keys:
            node_def = nodes.get(key.node)
            if node_def is not None and node_def.op == "Const" and key.port == 0:
                found[key] = tensor_stats(tf.make_ndarray(node_def.attr["value"].tensor), small_below)
    return found


class _Body:
    """Adds nodes to one item's body, each named under ``prefix``."""

    def __init__(self, body: graph_pb2.GraphDef, prefix: str) -> None:
        self.body, self.prefix = body, prefix
        self.consts: dict[str, str] = {}

    def node(self, name: str, op: str, inputs: Sequence[str] = (), **attrs: object) -> str:
        """A node of the body under the prefix, its attrs typed by the op's definition."""
        return graph_io.make_node_def(op, f"{self.prefix}/{name}", inputs, into=self.body.node, **attrs).name

    def const(self, name: str, value: np.ndarray) -> str:
        """A Const named ``name``, made once: a second call with the name returns the first's."""
        if name not in self.consts:
            self.consts[name] = self.node(name, "Const", dtype=tf.as_dtype(value.dtype).as_datatype_enum, value=value)
        return self.consts[name]


_F32, _F64, _I32 = types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_INT32
_SMALLEST_POSITIVE = float(np.finfo(np.float32).tiny)  # below it, |x| counts as 0: TensorFlow flushes subnormals


class _Fold(NamedTuple):
    """A tensor ``instrument`` folds into the statistics variables: its index there (its
    position in the keys), its name in the body, its dtype, its ``sampling_stride``, and its
    node (which main-graph run computes it)."""

    index: int
    tensor: str
    dtype: int
    stride: int
    node: str


def _add_folds(body: graph_pb2.GraphDef, scope: str, found: Sequence[_Fold], size: int,
               small_below: float, prefix: str = PREFIX) -> list[str]:
    """Nodes in ``body`` that reduce each tensor of ``found`` and fold it into the
    statistics variables at its index; returns the stateful nodes, which
    a run (or a body's control outputs) must reach. Plain nodes, no function: TensorFlow
    instantiates nothing new, and each tensor is reduced as soon as it exists, so no more
    of it is kept alive.

    |x| is bucketed (``Bucketize``: zero, small, finite, non-finite: NaN and ±Inf sort
    last); per bucket, ``UnsortedSegmentMax`` gives the largest |x|, ``Bincount`` the count
    and ``UnsortedSegmentSum`` the sums of |x| and x² (float64). Those kernels are serial
    and ten times slower per element than a reduction, so a large tensor (``stride`` > 1)
    is bucketed on every ``stride``-th element only, and its largest |x| comes from a
    ``Max`` over all of it (non-finite if any element is: ``Max`` propagates NaN). The nodes
    are named under ``scope``; the variables are shared by ``prefix`` (``_shared``)."""
    b = _Body(body, scope)
    buckets, none = b.const("buckets", np.array(_BUCKETS, np.int32)), b.const("no_weights", np.zeros(0, np.float64))
    flat, axis = b.const("flat", np.array([-1], np.int32)), b.const("axis", np.array([0], np.int32))
    start, infinity = axis, b.const("infinity", np.array(np.inf, np.float32))
    boundaries = [_SMALLEST_POSITIVE, max(small_below, _SMALLEST_POSITIVE), math.inf]
    rows, maxima, peaks, peaked = [], [], [], []
    for index, tensor, dtype, stride, _ in found:
        n = f"t{index}"
        if dtype != _F32:  # Bucketize takes no half or bfloat16
            tensor = b.node(f"{n}/float32", "Cast", [tensor], SrcT=dtype, DstT=_F32, Truncate=False)
        magnitude = b.node(f"{n}/abs", "Abs", [tensor], T=_F32)
        if stride > 1:
            values = b.node(f"{n}/flat", "Reshape", [magnitude, flat], T=_F32, Tshape=_I32)
            peak = b.node(f"{n}/peak", "Max", [values, axis], T=_F32, Tidx=_I32, keep_dims=False)
            nan = b.node(f"{n}/nan", "IsNan", [peak], T=_F32)  # ScatterMax would drop a NaN: fold it as +Inf
            peaks.append(b.node(f"{n}/flagged", "SelectV2", [nan, infinity, peak], T=_F32))
            peaked.append(index)
            magnitude = b.node(f"{n}/sample", "StridedSlice",
                               [values, start, start, b.const(f"stride{stride}", np.array([stride], np.int32))],
                               T=_F32, Index=_I32, begin_mask=0, end_mask=1, ellipsis_mask=0, new_axis_mask=0,
                               shrink_axis_mask=0)
        bucket = b.node(f"{n}/bucket", "Bucketize", [magnitude], T=_F32, boundaries=boundaries)
        maxima.append(b.node(f"{n}/max", "UnsortedSegmentMax", [magnitude, bucket, buckets], T=_F32, Tindices=_I32,
                             Tnumsegments=_I32))
        wide = b.node(f"{n}/wide", "Cast", [magnitude], SrcT=_F32, DstT=_F64, Truncate=False)
        row = [b.node(f"{n}/count", "Bincount", [bucket, buckets, none], T=_F64),
               b.node(f"{n}/sum_abs", "UnsortedSegmentSum", [wide, bucket, buckets], T=_F64, Tindices=_I32,
                      Tnumsegments=_I32),
               b.node(f"{n}/sum_sq", "UnsortedSegmentSum", [b.node(f"{n}/square", "Square", [wide], T=_F64), bucket,
                                                            buckets], T=_F64, Tindices=_I32, Tnumsegments=_I32)]
        rows.append(b.node(f"{n}/row", "Pack", row, N=len(row), T=_F64, axis=1))

    def fold(op: str, name: str, indices: Sequence[int], values: Sequence[str], dtype: int, shape: list[int]) -> str:
        variable = b.node(name, "VarHandleOp", dtype=dtype, shape=tf.TensorShape([size, *shape]),
                          shared_name=_shared(prefix, name), container="")
        updates = b.node(f"{name}/updates", "Pack", values, N=len(values), T=dtype, axis=0)
        at = b.const(f"{name}/indices", np.array(indices, np.int32))
        return b.node(f"fold_{name}", op, [variable, at, updates], dtype=dtype, Tindices=_I32)

    indices = [f.index for f in found]
    folds = [fold("ResourceScatterMax", _MAXIMA, indices, maxima, _F32, [_BUCKETS]),
             fold("ResourceScatterAdd", _SUMS, indices, rows, _F64, [_BUCKETS, _MOMENTS])]
    if peaks:
        folds.append(fold("ResourceScatterMax", _PEAKS, peaked, peaks, _F32, []))
    return folds


def _stats_from(largest: np.ndarray, sums: np.ndarray, peak: float, stride: int) -> TensorStats:
    """``TensorStats`` from one tensor's per-bucket maxima and (count, sum |x|, sum x²), on
    every ``stride``-th element (scaled up by it), and its largest |x| over all elements
    (``peak``, for ``stride`` > 1: exact where finite, else at least one element is not)."""
    counts, sum_abs, sum_sq = sums[:, 0] * stride, sums[:, 1] * stride, sums[:, 2] * stride
    finite = [_ZERO, _SMALL, _FINITE]
    largest_finite = max(0.0, float(largest[finite].max()))
    nonfinite = int(counts[_NONFINITE])
    if stride > 1:
        if math.isfinite(peak):
            largest_finite = max(largest_finite, peak)
        else:
            nonfinite = max(nonfinite, 1)
    return TensorStats(largest_finite, nonfinite, int(counts[_SMALL] + counts[_FINITE]), int(counts[_SMALL]),
                       float(sum_abs[finite].sum()), float(sum_abs[_SMALL]), float(sum_sq[finite].sum()),
                       int(counts.sum()))


def sampling_stride(shape: Sequence[int] | None) -> int:
    """Every how many elements a tensor of ``shape`` (-1: an unknown dim; None: unknown
    rank) is bucketed: 1 (all of it) unless it is known to hold more than ``_SAMPLE_ABOVE``
    elements per batch item (the first dim, where unknown; the whole tensor, a weight's,
    where every dim is known), then as many as leave ``_SAMPLES_PER_ITEM`` per item."""
    if not shape or any(d < 0 for d in shape[1:]):
        return 1
    per_item = int(np.prod(shape[1:] if shape[0] < 0 else shape))
    return per_item // _SAMPLES_PER_ITEM if per_item > _SAMPLE_ABOVE else 1


def _static_shape(node_def, port: int) -> list[int] | None:
    shapes = node_def.attr["_output_shapes"].list.shape if "_output_shapes" in node_def.attr else ()
    if port >= len(shapes) or shapes[port].unknown_rank:
        return None
    return [d.size for d in shapes[port].dim]


def instrument(program: Program, keys: Sequence[TensorKey], small_below: float,
               main_groups: Sequence[Collection[str]] = (), prefix: str = PREFIX,
               ) -> tuple[graph_pb2.GraphDef, list[str], dict[int, int]]:
    """A copy of ``program``'s graph that folds each of ``keys`` (float tensors; others are left
    out) into the statistics variables, at its position in ``keys``: in each function body
    (its control outputs), and in the main graph once per group of ``main_groups`` (node
    names: what one run computes, e.g. a signature's ancestors; a key in none is left out,
    as is one inside a TF1 while loop's frame: ``_in_loop_frames``).
    Returns the copy, per group the main graph's node a run must ask for, and per key
    index its ``sampling_stride``. ``prefix`` names the nodes added and the variables they
    share: one per run of a ``Runner``."""
    by_item: dict[str, list[tuple[int, TensorKey]]] = {MAIN_GRAPH: []}  # the main graph has the runs' targets
    for index, key in enumerate(map(TensorKey._make, keys)):
        by_item.setdefault(key.function, []).append((index, key))
    output = copy_graph_def(program.graph_def)
    main_calls: list[str] = []
    strides: dict[int, int] = {}
    for item, entries in by_item.items():
        body = copy_graph_def(program.item(item))
        found = _folds(body, entries, program.op_defs, _in_loop_frames(body) if item == MAIN_GRAPH else set())
        strides.update((fold.index, fold.stride) for fold in found)
        if item == MAIN_GRAPH:
            main_calls = _fold_main_graph(body, found, main_groups, len(keys), small_below, prefix)
            program.put(output, item, body)
        elif found:
            folds = _add_folds(body, prefix, found, len(keys), small_below, prefix)
            program.put(output, item, body, control_outputs=folds)  # nothing reads them: TensorFlow runs them
    _make_stateful(output)
    return output, main_calls, strides


def _folds(body: graph_pb2.GraphDef, entries: Sequence[tuple[int, TensorKey]], op_defs: Mapping[str, op_def_pb2.OpDef],
           looped: Collection[str]) -> list[_Fold]:
    """The tensors of ``entries`` (index, key) in one item's ``body`` that are floats of
    any width, but those ``looped`` nodes output."""
    nodes = {n.name: n for n in body.node}
    found = []
    for index, key in entries:
        node_def = nodes.get(key.node) if key.node not in looped else None
        dtypes = output_dtypes(node_def, op_defs) if node_def is not None else []
        if key.port < len(dtypes) and dtypes[key.port] in FLOAT_DTYPES:
            stride = sampling_stride(_static_shape(node_def, key.port))
            found.append(_Fold(index, tensor_name(key.node, key.port), dtypes[key.port], stride, key.node))
    return found


def _fold_main_graph(body: graph_pb2.GraphDef, found: Sequence[_Fold], groups: Sequence[Collection[str]], size: int,
                     small_below: float, prefix: str) -> list[str]:
    """The main graph's folds, once per group of ``groups`` (a tensor in the first group
    that computes it), each group's under a NoOp a run asks for, and the nodes that zero
    and read the variables (where there are any). Returns the NoOps."""
    taken: set[int] = set()
    calls = []
    for number, group in enumerate(groups):
        chosen = [fold for fold in found if fold.node in group and fold.index not in taken]
        taken.update(fold.index for fold in chosen)
        name = f"{prefix}/main_{number}"
        folds = _add_folds(body, name, chosen, size, small_below, prefix) if chosen else []
        body.node.add(name=name, op="NoOp", input=[f"^{fold}" for fold in folds])
        calls.append(name)
    if size:
        _add_access(body, size, prefix)
    return calls


def _in_loop_frames(graph_def: graph_pb2.GraphDef) -> set[str]:
    """The main-graph nodes whose outputs are inside a TF1 while loop's frame (after an
    ``Enter``, before its ``Exit``). Only nodes of the same frame may read such a tensor, and
    the folds' constants and variables are outside it, so these tensors are not measured
    (TensorFlow refuses the run: "has inputs from different frames")."""
    ops = {node_def.name: node_def.op for node_def in graph_def.node}
    readers: dict[str, list[str]] = {}
    for node_def in graph_def.node:
        for tensor in node_def.input:
            readers.setdefault(parse_tensor_name(tensor).node, []).append(node_def.name)
    depth: dict[str, int] = {}
    pending = [(name, 1) for name, op in ops.items() if op in _ENTER]
    while pending:
        name, level = pending.pop()
        if depth.get(name, 0) >= level:
            continue
        depth[name] = level
        for reader in readers.get(name, ()):
            op = ops[reader]
            pending.append((reader, level + 1 if op in _ENTER else level - 1 if op in _EXIT else level))
    return {name for name, level in depth.items() if level > 0}


_ENTER, _EXIT = frozenset({"Enter", "RefEnter"}), frozenset({"Exit", "RefExit"})
_VARIABLES = ((_MAXIMA, _F32, [_BUCKETS]), (_SUMS, _F64, [_BUCKETS, _MOMENTS]), (_PEAKS, _F32, []))
def _shared(prefix: str, name: str) -> str:
    """The name a statistics variable is shared by, in function bodies and the main graph."""
    return f"{prefix}_{name}"


def _initialize(prefix: str) -> str:
    """The main graph's NoOp that zeroes the statistics variables."""
    return f"{prefix}/initialize"


def _read(prefix: str, name: str) -> str:
    return f"{prefix}/read_{name}:0"


def _add_access(body: graph_pb2.GraphDef, size: int, prefix: str) -> None:
    """The main graph's nodes that zero the statistics variables (``_initialize``) and read
    them (``_read``): in the graph the session loads, so no run extends it afterwards."""
    b = _Body(body, prefix)
    assigns = []
    for name, dtype, shape in _VARIABLES:
        handle = b.node(f"handle_{name}", "VarHandleOp", dtype=dtype, shape=tf.TensorShape([size, *shape]),
                        shared_name=_shared(prefix, name), container="")
        zeros = b.const(f"zeros_{name}", np.zeros([size, *shape], tf.as_dtype(dtype).as_numpy_dtype))
        assigns.append(b.node(f"assign_{name}", "AssignVariableOp", [handle, zeros], dtype=dtype))
        b.node(f"read_{name}", "ReadVariableOp", [handle], dtype=dtype)
    body.node.add(name=_initialize(prefix), op="NoOp", input=[f"^{assign}" for assign in assigns])


def _make_stateful(graph_def: graph_pb2.GraphDef) -> None:
    """Stateless control flow and calls → stateful (their bodies now have side effects);
    no XLA compilation (the folds use resource variables XLA cannot place), and no grappler
    on the bodies a call instantiates (its config_proto): the graph runs as it is written,
    and grappler takes seconds per thousand nodes the statistics add."""
    node_lists = [graph_def.node] + [f.node_def for f in graph_def.library.function]
    for nodes in node_lists:
        for node_def in nodes:
            node_def.op = _STATEFUL_FORM.get(node_def.op, node_def.op)
            if "config_proto" in node_def.attr:
                node_def.attr["config_proto"].s = _NO_GRAPPLER
            for attr in ("_XlaMustCompile", "_XlaCompile"):
                if attr in node_def.attr:
                    del node_def.attr[attr]
    for function_def in graph_def.library.function:
        if "_XlaMustCompile" in function_def.attr:
            del function_def.attr["_XlaMustCompile"]


RANDOM_INPUTS = "random inputs"


class _Computations:
    """Keys of what main-graph nodes compute, equal for the nodes of two signatures that
    compute the same from the same inputs: a node by its op, device, attrs (a called
    function by its body, not its name) and its inputs' keys; a signature input by its
    input name; a node that reads no signature input by its own name (every signature
    shares it)."""

    def __init__(self, program: Program) -> None:
        self.graph_def = program.graph_def
        self.nodes = {node.name: node for node in program.graph_def.node}
        self.bodies = program.library
        self._body_keys: dict[str, bytes] = {}

    def body_key(self, name: str) -> bytes:
        """A function's body without its name and argument labels."""
        if name not in self._body_keys:
            body = function_pb2.FunctionDef()
            body.CopyFrom(self.bodies[name])
            body.signature.name = ""
            body.ClearField("arg_attr")
            self._body_keys[name] = body.SerializeToString(deterministic=True)
        return self._body_keys[name]

    def node_key(self, node_def: node_def_pb2.NodeDef, inputs_key: tuple) -> tuple:
        attrs = []
        for name, value in sorted(node_def.attr.items()):
            if value.HasField("func") and value.func.name in self.bodies:
                called = attr_value_pb2.AttrValue()
                called.CopyFrom(value)
                called.func.name = ""
                attrs.append((name, self.body_key(value.func.name), called.SerializeToString(deterministic=True)))
            else:
                attrs.append((name, value.SerializeToString(deterministic=True)))
        return node_def.op, node_def.device, tuple(attrs), inputs_key

    def signature_key(self, inputs: Mapping[str, str], outputs: Mapping[str, str]) -> tuple | None:
        """The key of a signature's outputs; None where its nodes form a cycle (TF1 control flow)."""
        placeholders = {parse_tensor_name(tensor).node: name for name, tensor in inputs.items()}
        keys: dict[str, tuple] = {}
        expanded: set[str] = set()
        pending = sorted(ancestors(self.graph_def, outputs.values()))
        while pending:  # post-order without recursion: TF1 graphs can be deep
            name = pending.pop()
            if name in keys:
                continue
            node_def = self.nodes[name]
            if name in placeholders:
                keys[name] = ("input", placeholders[name])
                continue
            sources = [parse_tensor_name(t) for t in node_def.input]
            waiting = [ref.node for ref in sources if ref.node not in keys and ref.node in self.nodes]
            if waiting:
                if name in expanded:
                    return None  # a cycle: no key, so no twin
                expanded.add(name)
                pending.extend([name, *waiting])
                continue
            if not any(keys.get(ref.node, ("",))[0] != "shared" for ref in sources):
                keys[name] = ("shared", name)
                continue
            keys[name] = self.node_key(node_def, tuple((keys.get(ref.node), ref.port, ref.is_control)
                                                       for ref in sources))
        return tuple((name, keys.get(parse_tensor_name(t).node), parse_tensor_name(t).port)
                     for name, t in sorted(outputs.items()))


def _same_feeds(feeds: Feeds, a: str, b: str) -> bool:
    first, second = feeds.get(a, [{}]), feeds.get(b, [{}])
    return len(first) == len(second) and all(
        x.keys() == y.keys() and all(np.array_equal(x[k], y[k]) for k in x) for x, y in zip(first, second))


def same_signatures(program: Program, signatures: Mapping[str, Signature], feeds: Feeds) -> dict[str, str]:
    """Signature → an earlier one whose run gives its outputs: the same feeds, and the same
    main-graph computation (``_Computations``: a Keras export's ``serve`` and
    ``serving_default`` call two wrappers that differ only in name and argument labels)."""
    computations = _Computations(program)
    seen: dict[tuple, str] = {}
    same: dict[str, str] = {}
    for key, (inputs, outputs) in signatures.items():
        found = computations.signature_key(inputs, outputs)
        if found is None:
            continue
        twin = seen.get(found)
        if twin is not None and _same_feeds(feeds, twin, key):
            same[key] = twin
        else:
            seen.setdefault(found, key)
    return same


def collect(model: Model, program: Program, feeds: Feeds, keys: Sequence[TensorKey],
            small_below: float, described: str = "the calibration inputs") -> Run:
    """One ``Runner.collect`` in a session of its own."""
    with Runner(model, feeds) as runner:
        return runner.collect(program, keys, small_below, described)


@dataclass
class _Loaded:
    """A session with the model loaded: what it loaded (each function and main-graph node,
    serialized, so that a later graph's changes can be told) and how many graphs were added
    to it since. ``closing`` closes the session, which frees its copy of the variables."""

    session: tf.compat.v1.Session
    library: dict[str, bytes]
    main: dict[str, bytes]
    closing: contextlib.ExitStack
    added: int = 0


class Runner:
    """The TF1 Session for a calibration's runs, one at a time. The first graph is loaded as
    the model would be (a SavedModel through TensorFlow's own loader, which restores
    variables and runs init ops); a later one is added to the same session: the functions
    it changes under new names, the main-graph nodes it changes under a new scope, the rest
    shared (``_add``). A run then pays for what its rewrite changed, not for loading the
    model again. After ``_ADDED_PER_SESSION`` added graphs the session is closed and the
    next run loads afresh, so one copy of the model's variables is alive at any time."""

    def __init__(self, model: Model, feeds: Feeds) -> None:
        self.model, self.feeds = model, feeds
        self.runs = 0
        self._loaded: _Loaded | None = None

    def __enter__(self) -> Runner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the session, freeing the variables it restored."""
        loaded, self._loaded = self._loaded, None
        if loaded is not None:
            loaded.closing.close()

    def collect(self, program: Program, keys: Sequence[TensorKey], small_below: float,
                described: str = "the calibration inputs") -> Run:
        """Run ``program``'s graph (the model's own, or a rewrite of it) on every feed,
        folding ``keys``; returns the statistics and the outputs. ``described`` names the
        feeds in the error a model that fails on them gets (``RANDOM_INPUTS``: made from
        the signatures)."""
        constants = constant_stats(program, keys, small_below)
        run_keys = [k for k in keys if k not in constants]
        signatures = self.model.signatures
        same = same_signatures(program, signatures, self.feeds)
        run = {key: entry for key, entry in signatures.items() if key not in same}
        groups = [ancestors(program.graph_def, outputs.values()) for _, outputs in run.values()]
        prefix = PREFIX if not self.runs else f"{PREFIX}_{self.runs}"
        instrumented, main_calls, strides = instrument(program, run_keys, small_below, groups, prefix)
        scope = self._take(instrumented)
        self.runs += 1

        def named(tensor: str) -> str:  # a main-graph tensor or op as the session has it
            ref = parse_tensor_name(tensor)
            node = scope.get(ref.node, ref.node)
            return f"{node}:{ref.port}" if ":" in tensor else node

        session = self._loaded.session
        if run_keys:
            session.run(named(_initialize(prefix)))
        outputs: dict[str, list[dict[str, np.ndarray]]] = {}
        for (key, (inputs, fetched)), call in zip(run.items(), main_calls):
            if found := self._run_feeds(key, inputs, fetched, call, named, described):
                outputs[key] = found
        read = session.run({name: named(_read(prefix, name)) for name, _, _ in _VARIABLES}) if run_keys else {}
        for key, twin in same.items():
            outputs[key] = outputs[twin]
        stats = dict(constants)
        for index, key in enumerate(run_keys):
            if index in strides and read[_SUMS][index, :, 0].sum() > 0:  # else it never ran: a branch not taken
                stats[key] = _stats_from(read[_MAXIMA][index], read[_SUMS][index], float(read[_PEAKS][index]),
                                         strides[index])
        return Run(stats, outputs)

    def _take(self, graph_def: graph_pb2.GraphDef) -> dict[str, str]:
        """Put ``graph_def`` in the session: added to the loaded one while it takes more
        graphs, else loaded afresh, the old session closed first. Returns main-graph node →
        its name in the session."""
        if self._loaded is not None and self._loaded.added < _ADDED_PER_SESSION:
            try:
                scope = _add(self._loaded, graph_def, f"{PREFIX}_run{self.runs}")
            except (ValueError, KeyError) as error:  # import_graph_def's and the graph's lookups' errors
                log.warning("calibration: run %d cannot be added to the loaded session (%s); the model is loaded"
                            " afresh for it", self.runs + 1, tensorflow_cause(error))
            else:
                self._loaded.added += 1
                return scope
        self.close()  # no reference to the old session may outlive this: its variables go with it
        self._loaded = _load(self.model, graph_def)
        return {}

    def _run_feeds(self, key: str, inputs: Mapping[str, str], fetched: Mapping[str, str], call: str,
                   named: Callable[[str], str], described: str) -> list[dict[str, np.ndarray]]:
        """Signature ``key``'s outputs on each of its feeds, its statistics folded by ``call``."""
        session = self._loaded.session
        target = session.graph.get_operation_by_name(named(call))
        fetches = {name: named(tensor_name(*parse_tensor_name(tensor))) for name, tensor in fetched.items()}
        outputs = []
        for feed in self.feeds.get(key, [{}]):
            fed = {named(inputs[name]): value for name, value in feed.items()}
            try:
                values, _ = session.run((fetches, target), feed_dict=fed)
            except (tf.errors.OpError, ValueError, TypeError) as error:
                where = f"{self.model.path}" + (f": signature '{key}'" if key != GRAPH else "")
                advice = ("; pass real ones: --calibrate DATA.npz (convert) or --inputs DATA.npz (calibrate)"
                          if described == RANDOM_INPUTS else "; check them against the model's inputs")
                what = (f"{RANDOM_INPUTS} (ids within the tables they index, else 0-9; unknown dims 2)"
                        if described == RANDOM_INPUTS else described)
                cause = tensorflow_cause(error)
                raise ModelError(f"{where}: the model fails on {what} ({cause}){advice}") from None
            outputs.append(values)
        return outputs


def _load(model: Model, graph_def: graph_pb2.GraphDef) -> _Loaded:
    """A session with ``graph_def`` loaded as ``model`` would be, with what it loaded."""
    with contextlib.ExitStack() as stack:
        config = tf.compat.v1.ConfigProto.FromString(_NO_GRAPPLER)
        session = stack.enter_context(_loaded(model, graph_def, config))
        return _Loaded(session, {f.signature.name: f.SerializeToString(deterministic=True)
                                 for f in graph_def.library.function},
                       {n.name: n.SerializeToString(deterministic=True) for n in graph_def.node}, stack.pop_all())


def _add(loaded: _Loaded, graph_def: graph_pb2.GraphDef, scope: str) -> dict[str, str]:
    """Import ``graph_def`` into the loaded session's graph: each function that differs
    from the loaded one of its name, and each function calling such a one, as
    ``NAME_<scope>``; each main-graph node that differs from the loaded one (or reads one
    that does) under ``scope/``, reading the rest from the loaded graph. Returns main-graph
    node name → its name in the session."""
    library = {f.signature.name: f for f in graph_def.library.function}
    renamed = {name: f"{name}_{scope}" for name in _changed_functions(library, loaded.library)}
    partial = graph_pb2.GraphDef()
    partial.versions.CopyFrom(graph_def.versions)
    for name in sorted(renamed):
        function = partial.library.function.add()
        function.CopyFrom(library[name])
        function.signature.name = renamed[name]
        for node_def in function.node_def:
            functions.rename_calls(node_def, renamed)
    nodes = {}
    for node_def in graph_def.node:
        copy = node_def_pb2.NodeDef()
        copy.CopyFrom(node_def)
        functions.rename_calls(copy, renamed)
        nodes[copy.name] = copy
    moved = _moved_nodes(nodes, loaded.main)
    graph = loaded.session.graph
    input_map = {}
    for name in sorted(moved):
        node_def = partial.node.add()
        node_def.CopyFrom(nodes[name])
        kept_inputs = []
        for tensor in node_def.input:
            ref = parse_tensor_name(tensor)
            if ref.node in moved:
                kept_inputs.append(tensor)
            elif ref.is_control:
                outputs = graph.get_operation_by_name(ref.node).outputs
                if outputs:  # a control input on an op without outputs cannot be mapped: it ran at load
                    input_map[f"^{ref.node}"] = outputs[0]
                    kept_inputs.append(tensor)
            else:
                input_map[f"{ref.node}:{ref.port}"] = graph.get_tensor_by_name(f"{ref.node}:{ref.port}")
                kept_inputs.append(tensor)
        node_def.input[:] = kept_inputs
    with graph.as_default():
        tf.graph_util.import_graph_def(partial, input_map=input_map, name=scope)
    return {name: f"{scope}/{name}" for name in moved}


def _changed_functions(library: Mapping[str, function_pb2.FunctionDef], loaded: Mapping[str, bytes]) -> set[str]:
    """The functions of ``library`` that differ from the ``loaded`` ones of their names, and
    those that call such a one (directly or not)."""
    changed = {name for name, f in library.items() if loaded.get(name) != f.SerializeToString(deterministic=True)}
    callees = {name: {called for node_def in f.node_def for called in functions.called_functions(node_def)
                      if called in library} for name, f in library.items()}
    while grown := {name for name in library if name not in changed and callees[name] & changed}:
        changed |= grown
    return changed


def _moved_nodes(nodes: Mapping[str, node_def_pb2.NodeDef], loaded: Mapping[str, bytes]) -> set[str]:
    """The main-graph ``nodes`` that differ from the ``loaded`` ones of their names, and
    those that read such a one (directly or not)."""
    moved = {name for name, node_def in nodes.items() if loaded.get(name) != node_def.SerializeToString(deterministic=True)}
    readers: dict[str, set[str]] = {}
    for name, node_def in nodes.items():
        for tensor in node_def.input:
            readers.setdefault(parse_tensor_name(tensor).node, set()).add(name)
    pending = list(moved)
    while pending:
        for reader in readers.get(pending.pop(), ()):
            if reader not in moved:
                moved.add(reader)
                pending.append(reader)
    return moved


class _WithoutDeprecations(logging.Filter):
    """Drops TensorFlow's deprecation warnings: the TF1 loader is what TensorFlow Serving
    uses, and its advice to move to ``tf.saved_model.load`` is none a user can act on."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "is deprecated and will be removed" not in record.getMessage()


@contextlib.contextmanager
def _loaded(model: Model, graph_def: graph_pb2.GraphDef, config: tf.compat.v1.ConfigProto):
    """A Session with ``graph_def`` loaded as ``model`` would be; closed on exit. Neither it
    nor its graph is made the default while it is open: the caller's code between runs
    stays as eager as it was."""
    graph = tf.Graph()
    session = tf.compat.v1.Session(graph=graph, config=config)
    try:
        if model.kind == "graphdef":
            with graph.as_default():
                tf.graph_util.import_graph_def(graph_def, name="")
            yield session
            return
        with staging.temporary_directory("amp-rewrite-calibration-") as directory:
            stage_saved_model(model, graph_def, directory)
            quiet, logger = _WithoutDeprecations(), tf.get_logger()
            logger.addFilter(quiet)
            try:
                tf.compat.v1.saved_model.loader.load(session, list(model.tags), str(directory))
                _restore_captured(session, model)
            except (ValueError, RuntimeError, tf.errors.OpError) as error:
                raise ModelError(f"{model.path}: TensorFlow cannot load it for calibration"
                                 f" ({tensorflow_cause(error)})") from None
            finally:
                logger.removeFilter(quiet)
            yield session
    finally:
        session.close()


def _restore_captured(session: tf.compat.v1.Session, model: Model) -> None:
    """Fill the variables a Keras 3 model's exported functions read and TensorFlow's v1 loader
    leaves empty. Such an export captures each variable in its functions by a handle named
    as the variable (``token_embedding/embeddings``) while its restore op fills handles of
    other names (``Variable_12``); the v2 loader joins the two through the object graph, the
    v1 loader does not. Each handle named as exactly one SavedVariable and left uninitialized
    gets that variable's value from the checkpoint (its key from the checkpoint's object graph)."""
    variables = [(node_id, node.variable.name) for node_id, node in enumerate(model.meta_graph.object_graph_def.nodes)
                 if node.HasField("variable")]
    names = [name for _, name in variables]
    ids = {name: node_id for node_id, name in variables if names.count(name) == 1}
    graph = session.graph
    handles = [op for op in graph.get_operations()
               if op.type == "VarHandleOp" and op.get_attr("shared_name").decode() in ids]
    if not handles:
        return
    with graph.as_default(), tf.name_scope(f"{PREFIX}_restore"):
        ready = session.run([tf.raw_ops.VarIsInitializedOp(resource=op.outputs[0]) for op in handles])
    missing = [op for op, done in zip(handles, ready) if not done]
    if not missing:
        return
    reader = tf.train.load_checkpoint(str(model.path / "variables" / "variables"))
    trackable = trackable_object_graph_pb2.TrackableObjectGraph.FromString(
        reader.get_tensor("_CHECKPOINTABLE_OBJECT_GRAPH"))
    for op in missing:
        node_id = ids[op.get_attr("shared_name").decode()]
        attributes = trackable.nodes[node_id].attributes if node_id < len(trackable.nodes) else ()
        key = next((a.checkpoint_key for a in attributes if a.name == "VARIABLE_VALUE"), None)
        if key is None:
            continue
        with graph.as_default(), tf.name_scope(f"{PREFIX}_restore"):
            value = tf.compat.v1.placeholder(op.get_attr("dtype"))
            assign = tf.raw_ops.AssignVariableOp(resource=op.outputs[0], value=value)
        session.run(assign, {value: reader.get_tensor(key)})


def stage_saved_model(model: Model, graph_def: graph_pb2.GraphDef, directory: Path) -> None:
    """``model`` with ``graph_def`` as its graph, in ``directory``: its variables and assets linked."""
    saved_model = saved_model_pb2.SavedModel()
    saved_model.CopyFrom(model.saved_model)
    del saved_model.meta_graphs[:]
    meta = saved_model.meta_graphs.add()
    meta.CopyFrom(model.meta_graph)
    meta.graph_def.CopyFrom(graph_def)
    (directory / "saved_model.pb").write_bytes(saved_model.SerializeToString())
    for part in ("variables", "assets"):
        if (model.path / part).exists():
            (directory / part).symlink_to((model.path / part).resolve())


def model_tensors(model: Model) -> list[TensorKey]:
    """``float_tensors`` of the model's graph, without TensorFlow's save/restore functions
    (they run before the statistics exist, when the loader restores variables)."""
    skip = [name for name, kind in plumbing_kinds(model).items() if kind == "save/restore"]
    return float_tensors(model.program, skip)

