"""Statistics of a model's tensors over calibration inputs, from one instrumented run per feed.

Every float tensor asked for — in the main graph and inside library function bodies,
where a SavedModel's and a ``tf.function``'s compute lives — gets a call to one small
stateful function that folds the tensor into two resource variables shared by name: the
largest finite magnitude (``ResourceScatterMax``) and counts and sums
(``ResourceScatterAdd``). A function body lists its calls as control outputs, so
TensorFlow runs them, and stateless control flow and calls become their stateful forms,
so nothing prunes them. The model then runs in a TF1 Session (a SavedModel through
TensorFlow's own loader, which restores variables and runs init ops) once per feed, and
the variables are read back. Constants need no run: their statistics come from their values.

A tensor is named by its ``TensorKey``: ``(function, node, port)``, with function ``""``
for the main graph and a function body's arguments named like its ``_Arg`` nodes.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2
from tensorflow.core.protobuf import rewriter_config_pb2, saved_model_pb2
from tensorflow.python.framework import tensor_util
from tensorflow.python.util import deprecation

from amp_rewrite.cli import staging
from amp_rewrite.cli.savedmodel import Model, ModelError, plumbing_kinds
from amp_rewrite.cli.validate import GRAPH, Feeds, compared_outputs
from amp_rewrite.core import functions, support
from amp_rewrite.core.errors import tensorflow_cause
from amp_rewrite.core.graph_io import parse_tensor_name, tensor_name
from amp_rewrite.core.program import MAIN_GRAPH, program_of

TensorKey = tuple[str, str, int]  # (function, "" for the main graph; node; output port)

PREFIX = "amp_rewrite_statistics"
_MAX_VARIABLE = f"{PREFIX}_max"
_SUM_VARIABLE = f"{PREFIX}_sums"
_SUMS = ("nonfinite", "nonzero", "small", "sum_abs", "small_abs", "sum_sq", "count")
FLOAT_DTYPES = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16})
_NO_GRAPPLER = tf.compat.v1.ConfigProto(graph_options=tf.compat.v1.GraphOptions(
    rewrite_options=rewriter_config_pb2.RewriterConfig(disable_meta_optimizer=True),
    optimizer_options=tf.compat.v1.OptimizerOptions(opt_level=tf.compat.v1.OptimizerOptions.L0))).SerializeToString()
_STATEFUL_FORM = {"StatelessWhile": "While", "StatelessIf": "If", "StatelessCase": "Case",
                  "PartitionedCall": "StatefulPartitionedCall"}


@dataclass(frozen=True)
class TensorStats:
    """What the calibration inputs put through one tensor, over every run and loop iteration."""

    max_abs: float   # largest finite |x|
    nonfinite: int   # NaN and ±Inf elements
    nonzero: int     # finite non-zero elements
    small: int       # of those, below the threshold asked for (the target's smallest normal)
    sum_abs: float
    small_abs: float  # the part of sum_abs the small values carry
    sum_sq: float
    count: int       # elements seen

    @property
    def small_share(self) -> float:
        """The share of non-zero values below the threshold."""
        return self.small / self.nonzero if self.nonzero else 0.0

    @property
    def small_mass(self) -> float:
        """The share of the magnitude (sum of |x|) that values below the threshold carry."""
        return self.small_abs / self.sum_abs if self.sum_abs else 0.0

    @property
    def rms(self) -> float:
        finite = self.count - self.nonfinite
        return math.sqrt(self.sum_sq / finite) if finite else 0.0


@dataclass(frozen=True)
class Run:
    """Statistics per tensor, and each signature's outputs per feed (for validation)."""

    stats: Mapping[TensorKey, TensorStats]
    outputs: Mapping[str, Sequence[Mapping[str, np.ndarray]]]


def float_tensors(graph_def: graph_pb2.GraphDef, skip_functions: Iterable[str] = ()) -> list[TensorKey]:
    """Every float output the pass may convert: in the main graph and in each function
    the rewrite reaches (``functions.reachable_functions``), but ``skip_functions``."""
    program = program_of(graph_def)
    skip = set(skip_functions)
    names = [MAIN_GRAPH] + [n for n in functions.reachable_functions(graph_def, program.library) if n not in skip]
    keys = []
    for name in names:
        for node_def in program.item(name).node:
            if node_def.op == "_Retval":
                continue
            for port, dtype in enumerate(output_dtypes(node_def, program.op_defs)):
                if dtype == types_pb2.DT_FLOAT:
                    keys.append((name, node_def.name, port))
    return keys


def output_dtypes(node_def: node_def_pb2.NodeDef, op_defs: Mapping) -> list[int]:
    """The dtype of each output port, attrs left out taking their defaults; [] for an unknown op."""
    op_def = support.resolve_op_def(node_def, op_defs)
    if op_def is None:
        return []
    defaults = {a.name: a.default_value for a in op_def.attr if a.HasField("default_value")}

    def attr(name: str):
        return node_def.attr[name] if name in node_def.attr else defaults.get(name)

    dtypes: list[int] = []
    for arg in op_def.output_arg:
        if arg.type_list_attr:
            value = attr(arg.type_list_attr)
            dtypes.extend(value.list.type if value is not None else ())
            continue
        count = attr(arg.number_attr).i if arg.number_attr and attr(arg.number_attr) is not None else 1
        value = attr(arg.type_attr) if arg.type_attr else None
        dtype = arg.type if not arg.type_attr else (value.type if value is not None else types_pb2.DT_INVALID)
        dtypes.extend([dtype] * count)
    return dtypes


def constant_stats(graph_def: graph_pb2.GraphDef, keys: Iterable[TensorKey],
                   small_below: float) -> dict[TensorKey, TensorStats]:
    """Statistics of the keys that are float constants, from their values."""
    program = program_of(graph_def)
    by_item: dict[str, list[TensorKey]] = {}
    for key in keys:
        by_item.setdefault(key[0], []).append(key)
    found = {}
    for item, item_keys in by_item.items():
        nodes = {n.name: n for n in program.item(item).node}
        for key in item_keys:
            node_def = nodes.get(key[1])
            if node_def is not None and node_def.op == "Const" and key[2] == 0:
                found[key] = _stats_of(tensor_util.MakeNdarray(node_def.attr["value"].tensor), small_below)
    return found


def _stats_of(value: np.ndarray, small_below: float) -> TensorStats:
    a = np.abs(np.asarray(value, dtype=np.float64)).ravel()
    finite = a[np.isfinite(a)]
    nonzero = finite[finite > 0]
    small = nonzero[nonzero < small_below]
    return TensorStats(float(finite.max(initial=0.0)), int(a.size - finite.size), int(nonzero.size), int(small.size),
                       float(finite.sum()), float(small.sum()), float(np.square(finite).sum()), int(a.size))


class _Body:
    """Adds nodes to one item's body, each named under ``prefix``."""

    def __init__(self, body: graph_pb2.GraphDef, prefix: str) -> None:
        self.body, self.prefix = body, prefix

    def node(self, name: str, op: str, inputs: Sequence[str] = (), **attrs: object) -> str:
        node = self.body.node.add(name=f"{self.prefix}/{name}", op=op, input=list(inputs))
        for key, value in attrs.items():
            if isinstance(value, bool):
                node.attr[key].b = value
            elif isinstance(value, int) and key in ("N", "axis"):
                node.attr[key].i = value
            elif isinstance(value, int):
                node.attr[key].type = value
            elif isinstance(value, np.ndarray):
                node.attr[key].tensor.CopyFrom(tensor_util.make_tensor_proto(value))
            elif isinstance(value, tf.TensorShape):
                node.attr[key].shape.CopyFrom(value.as_proto())
            else:
                node.attr[key].s = str(value).encode()
        return node.name

    def const(self, name: str, value: np.ndarray) -> str:
        return self.node(name, "Const", dtype=tf.as_dtype(value.dtype).as_datatype_enum, value=value)


_F32, _F64, _I32, _BOOL = types_pb2.DT_FLOAT, types_pb2.DT_DOUBLE, types_pb2.DT_INT32, types_pb2.DT_BOOL


def _add_folds(body: graph_pb2.GraphDef, prefix: str, found: Sequence[tuple[int, str, int]], size: int,
               small_below: float) -> list[str]:
    """Nodes in ``body`` that reduce each (index, tensor, dtype) of ``found`` to its largest
    finite |x| and its counts and sums, and fold them into the statistics variables at
    their indices; returns the two stateful nodes, which a run (or a body's control
    outputs) must reach. Plain nodes, no function: TensorFlow instantiates nothing new, and
    each tensor is reduced as soon as it exists, so no more of it is kept alive."""
    b = _Body(body, prefix)
    flat, axis = b.const("flat", np.array([-1], np.int32)), b.const("axis", np.array([0], np.int32))
    zero, small = b.const("zero", np.array(0.0, np.float32)), b.const("small", np.array(small_below, np.float32))
    zero64 = b.const("zero64", np.array(0.0, np.float64))
    largest, rows = [], []
    for index, tensor, dtype in found:
        n = f"t{index}"
        if dtype != _F32:
            tensor = b.node(f"{n}/cast", "Cast", [tensor], SrcT=dtype, DstT=_F32, Truncate=False)
        values = b.node(f"{n}/flat", "Reshape", [tensor, flat], T=_F32, Tshape=_I32)
        magnitude = b.node(f"{n}/abs", "Abs", [values], T=_F32)
        finite = b.node(f"{n}/finite", "IsFinite", [magnitude], T=_F32)
        kept = b.node(f"{n}/kept", "SelectV2", [finite, magnitude, zero], T=_F32)
        nonzero = b.node(f"{n}/nonzero", "Greater", [kept, zero], T=_F32)
        tiny = b.node(f"{n}/small", "LogicalAnd", [nonzero, b.node(f"{n}/below", "Less", [kept, small], T=_F32)])
        wide = b.node(f"{n}/wide", "Cast", [kept], SrcT=_F32, DstT=_F64, Truncate=False)

        def total(name: str, value: str, dtype: int = _F64) -> str:
            if dtype == _BOOL:
                value = b.node(f"{n}/{name}/f64", "Cast", [value], SrcT=_BOOL, DstT=_F64, Truncate=False)
            return b.node(f"{n}/{name}", "Sum", [value, axis], T=_F64, Tidx=_I32, keep_dims=False)

        count = b.node(f"{n}/count", "Cast", [b.node(f"{n}/size", "Size", [values], T=_F32, out_type=_I32)],
                       SrcT=_I32, DstT=_F64, Truncate=False)
        row = [total("nonfinite", b.node(f"{n}/infinite", "LogicalNot", [finite]), _BOOL),
               total("nonzeros", nonzero, _BOOL), total("smalls", tiny, _BOOL), total("sum_abs", wide),
               total("small_abs", b.node(f"{n}/small_values", "SelectV2", [tiny, wide, zero64], T=_F64)),
               total("sum_sq", b.node(f"{n}/square", "Square", [wide], T=_F64)), count]
        rows.append(b.node(f"{n}/row", "Pack", row, N=len(row), T=_F64, axis=0))
        peak = b.node(f"{n}/max", "Max", [kept, axis], T=_F32, Tidx=_I32, keep_dims=False)
        largest.append(b.node(f"{n}/largest", "Maximum", [peak, zero], T=_F32))  # the max of nothing is -inf
    indices = b.const("indices", np.array([i for i, _, _ in found], np.int32))
    maxima = b.node("maxima", "VarHandleOp", dtype=_F32, shape=tf.TensorShape([size]), shared_name=_MAX_VARIABLE,
                    container="")
    sums = b.node("sums", "VarHandleOp", dtype=_F64, shape=tf.TensorShape([size, len(_SUMS)]),
                  shared_name=_SUM_VARIABLE, container="")
    return [b.node("fold_max", "ResourceScatterMax",
                   [maxima, indices, b.node("largest", "Pack", largest, N=len(largest), T=_F32, axis=0)],
                   dtype=_F32, Tindices=_I32),
            b.node("fold_sums", "ResourceScatterAdd",
                   [sums, indices, b.node("rows", "Pack", rows, N=len(rows), T=_F64, axis=0)],
                   dtype=_F64, Tindices=_I32)]


def instrument(graph_def: graph_pb2.GraphDef, keys: Sequence[TensorKey], small_below: float,
               main_groups: Sequence[Collection[str]] = ()) -> tuple[graph_pb2.GraphDef, list[str]]:
    """A copy of ``graph_def`` that folds each of ``keys`` (float tensors; others are left
    out) into the statistics variables, at its position in ``keys``: in each function body
    (its control outputs), and in the main graph once per group of ``main_groups`` (node
    names: what one run computes, e.g. a signature's ancestors; a key in none is left out).
    Returns the copy and, per group, the main graph's node a run must ask for."""
    program = program_of(graph_def)
    by_item: dict[str, list[tuple[int, TensorKey]]] = {}
    for index, key in enumerate(keys):
        by_item.setdefault(key[0], []).append((index, key))
    output = graph_pb2.GraphDef()
    output.CopyFrom(graph_def)
    main_calls: list[str] = []
    for item, entries in by_item.items():
        body = graph_pb2.GraphDef()
        body.CopyFrom(program.item(item))
        nodes = {n.name: n for n in body.node}
        found = []  # (index, tensor, dtype)
        for index, key in entries:
            node_def = nodes.get(key[1])
            dtypes = output_dtypes(node_def, program.op_defs) if node_def is not None else []
            if key[2] < len(dtypes) and dtypes[key[2]] in FLOAT_DTYPES:
                found.append((index, tensor_name(key[1], key[2]), dtypes[key[2]], key[1]))
        if item == MAIN_GRAPH:
            taken: set[int] = set()
            for group_number, group in enumerate(main_groups):
                chosen = [f[:3] for f in found if f[3] in group and f[0] not in taken]
                taken.update(f[0] for f in chosen)
                name = f"{PREFIX}/main_{group_number}"
                folds = _add_folds(body, name, chosen, len(keys), small_below) if chosen else []
                body.node.add(name=name, op="NoOp", input=[f"^{fold}" for fold in folds])
                main_calls.append(name)
            del output.node[:]
            output.node.extend(body.node)
            continue
        if not found:
            continue
        folds = _add_folds(body, PREFIX, [f[:3] for f in found], len(keys), small_below)
        function_def = functions.to_function_def(body, program.library[item], program.op_defs)
        for fold in folds:
            function_def.signature.control_output.append(fold)
            function_def.control_ret[fold] = fold
        output.library.function[program.positions[item]].CopyFrom(function_def)
    _make_stateful(output)
    return output, main_calls


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


def _ancestors(graph_def: graph_pb2.GraphDef, outputs: Iterable[str]) -> set[str]:
    """The main-graph nodes ``outputs`` depend on, control inputs included."""
    inputs = {n.name: [parse_tensor_name(t).node for t in n.input] for n in graph_def.node}
    seen: set[str] = set()
    stack = [parse_tensor_name(t).node for t in outputs]
    while stack:
        name = stack.pop()
        if name in seen or name not in inputs:
            continue
        seen.add(name)
        stack.extend(inputs[name])
    return seen


def signatures_of(model: Model) -> dict[str, tuple[dict[str, str], dict[str, str]]]:
    """Per signature (a GraphDef file's is ``GRAPH``): its inputs and outputs, name → tensor."""
    if model.kind == "graphdef":
        placeholders = [n.name for n in model.graph_def.node if n.op == "Placeholder"]
        return {GRAPH: ({name: f"{name}:0" for name in placeholders},
                        {name: tensor_name(*parse_tensor_name(name)) for name in compared_outputs(model)})}
    return {key: ({name: info.name for name, info in signature.inputs.items()},
                  {name: info.name for name, info in signature.outputs.items()})
            for key, signature in sorted(model.meta_graph.signature_def.items()) if not key.startswith("__")}


RANDOM_INPUTS = "random inputs"


def collect(model: Model, graph_def: graph_pb2.GraphDef, feeds: Feeds, keys: Sequence[TensorKey],
            small_below: float, described: str = "the calibration inputs") -> Run:
    """Run ``graph_def`` (the model's own graph, or a rewrite of it) on every feed, folding
    ``keys``; returns the statistics and the outputs. ``feeds``: ``validate.plan_feeds``;
    ``described`` names them in the error a model that fails on them gets (``RANDOM_INPUTS``:
    made from the signatures)."""
    constants = constant_stats(graph_def, keys, small_below)
    run_keys = [k for k in keys if k not in constants]
    signatures = signatures_of(model)
    groups = [_ancestors(graph_def, outputs.values()) for _, outputs in signatures.values()]
    instrumented, main_calls = instrument(graph_def, run_keys, small_below, groups)
    config = tf.compat.v1.ConfigProto.FromString(_NO_GRAPPLER)
    with _loaded(model, instrumented, config) as session:
        graph = session.graph
        with graph.as_default():
            maxima = tf.raw_ops.VarHandleOp(dtype=tf.float32, shape=[len(run_keys)], shared_name=_MAX_VARIABLE)
            sums = tf.raw_ops.VarHandleOp(dtype=tf.float64, shape=[len(run_keys), len(_SUMS)],
                                          shared_name=_SUM_VARIABLE)
            initialize = tf.group(
                tf.raw_ops.AssignVariableOp(resource=maxima, value=tf.zeros([len(run_keys)])),
                tf.raw_ops.AssignVariableOp(resource=sums, value=tf.zeros([len(run_keys), len(_SUMS)], tf.float64)))
            read = (tf.raw_ops.ReadVariableOp(resource=maxima, dtype=tf.float32),
                    tf.raw_ops.ReadVariableOp(resource=sums, dtype=tf.float64))
        session.run(initialize)
        outputs: dict[str, list[dict[str, np.ndarray]]] = {}
        for (key, (inputs, fetched)), call in zip(signatures.items(), main_calls):
            target = graph.get_operation_by_name(call)
            for feed in feeds.get(key, [{}]):
                fed = {inputs[name]: value for name, value in feed.items()}
                try:
                    values, _ = session.run((dict(fetched), target), feed_dict=fed)
                except (tf.errors.OpError, ValueError, TypeError) as error:
                    where = f"{model.path}" + (f": signature '{key}'" if key != GRAPH else "")
                    advice = ("; pass real ones: --calibrate DATA.npz (convert) or --inputs DATA.npz (calibrate)"
                              if described == RANDOM_INPUTS else "; check them against the model's inputs")
                    what = (f"{RANDOM_INPUTS} (ids 0-9 for integer inputs, unknown dims 2)"
                            if described == RANDOM_INPUTS else described)
                    cause = tensorflow_cause(error)
                    raise ModelError(f"{where}: the model fails on {what} ({cause}){advice}") from None
                outputs.setdefault(key, []).append(values)
        largest, totals = session.run(read)
    stats = dict(constants)
    for index, key in enumerate(run_keys):
        row = totals[index]
        if row[-1] == 0:
            continue  # never ran: a branch not taken, a loop that did not iterate
        stats[key] = TensorStats(float(largest[index]), *(int(v) for v in row[:3]), *(float(v) for v in row[3:6]),
                                 int(row[6]))
    return Run(stats, outputs)


@contextlib.contextmanager
def _loaded(model: Model, graph_def: graph_pb2.GraphDef, config: tf.compat.v1.ConfigProto):
    """A Session with ``graph_def`` loaded as ``model`` would be."""
    if model.kind == "graphdef":
        graph = tf.Graph()
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            yield session
        return
    with staging.temporary_directory("amp-rewrite-calibration-") as directory:
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
        with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph, config=config) as session:
            try:
                with deprecation.silence():  # the TF1 loader is what TensorFlow Serving uses: no advice wanted
                    tf.compat.v1.saved_model.loader.load(session, list(model.tags), str(directory))
            except (ValueError, RuntimeError, tf.errors.OpError) as error:
                raise ModelError(f"{model.path}: TensorFlow cannot load it for calibration"
                                 f" ({tensorflow_cause(error)})") from None
            yield session


def model_tensors(model: Model) -> list[TensorKey]:
    """``float_tensors`` of the model's graph, without TensorFlow's save/restore functions
    (they run before the statistics exist, when the loader restores variables)."""
    skip = [name for name, kind in plumbing_kinds(model).items() if kind == "save/restore"]
    return float_tensors(model.graph_def, skip)
