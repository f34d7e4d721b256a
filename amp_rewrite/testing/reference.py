"""TensorFlow's own grappler AMP pass as a live oracle, and a comparison against it.

``run_grappler`` runs the real pass in isolation (spec §8) so tests can ask
TensorFlow what it would do with a graph; ``compare_rewrites`` judges our result
against grappler's vertex by vertex and cast by cast (spec §2.2, §2.6).

What differs from a plain ``tf_optimizer.OptimizeGraph`` call, and why:

* Device choice is pinned by a *virtual* cluster, never the local machine, so the
  answer does not depend on the host: float16 (CUDA mode) sees one GPU
  ``/job:localhost/replica:0/task:0/device:GPU:0`` (architecture 8.0, cuda 12050,
  cudnn 90300: every cuda/cudnn list gate open) plus a CPU; bfloat16 (oneDNN mode)
  sees a CPU only. The virtual placer then puts nodes with an empty device on the
  GPU (float16) or the CPU (bfloat16), which is the contract of
  ``amp_rewrite.rewrite_graph_def`` (spec §1.5). A real SingleMachine would add a
  GPU on a GPU host and silently turn the bfloat16 run into a no-op.
* grappler needs at least one fetch (the item builder refuses a MetaGraphDef with
  an empty ``train_op`` collection). With no ``fetches`` we fetch a disconnected
  ``NoOp`` added for the run and removed from the result; preserving it cannot
  change any colour.
* The item builder turns every ``Placeholder``/``PlaceholderWithDefault`` into a
  feed, i.e. a preserved node, and rejects placeholders whose ``shape`` has
  unknown dimensions. AMP never reads shapes, so unknown dimensions are set to 1
  for the run and the original ``shape`` attr is put back in the result.
  Placeholders are in no op list, so preserving them changes no colour.
* The meta-optimizer re-sorts nodes topologically and canonicalises ``"x:0"`` to
  ``"x"`` in the inputs it rewrites; ``compare_rewrites`` is insensitive to both.
* The meta-optimizer normally logs a failing AMP pass and returns the graph
  unchanged (spec §1.2), which an oracle would mistake for "nothing to convert";
  ``fail_on_optimizer_errors`` is set so the failure raises instead (e.g.
  "Expected Merge node after NextIteration").
* The TFG (MLIR) hook the meta-optimizer adds after the passes is turned off
  (``disable_tfg_optimizer``). Its default pipeline is empty, but importing the graph
  verifies it, and AMP's output is not always valid: in bfloat16 mode ``While`` and
  ``StatelessWhile`` are clear, so their ``T`` elements can be painted while the body
  and cond signatures stay float32 ("cond function argument #3 type ... is not
  compatible"). The oracle must show what AMP did, not that the verifier refused it.
* grappler is given the lists ``amp_rewrite`` uses by default: the ops of the
  ``float32`` section of ``lists/<target>.yaml`` (taken off grappler's infer list) are
  removed from its infer list for the run through
  ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_INFERLIST_REMOVE``, after any value the
  caller set, unless the caller's ``..._INFERLIST_ADD`` names them.
* Our colouring treats a deny-listed ``Exp`` whose argument the graph shows to be
  non-positive as an infer op. grappler's lists are per op, so for the run each such
  node (main graph and function bodies) becomes a ``Tanh``, an infer op on both targets
  with the same signature and kernels, and gets its op back in the result.
* Those two inputs (``oracle_inputs``) are derived here, apart from the code under test:
  the held ops from the YAML file as written (not ``amp_rewrite.lists``), the bounded
  ``Exp`` nodes by this module's own reading of the rule (not
  ``amp_rewrite.colouring.nonpositive_arguments``), so a change there shows as a
  disagreement with grappler instead of moving the oracle with it. Only whether ``Exp``
  is denied at all comes from ``amp_rewrite.lists.load_lists`` (the environment's list
  edits), which tests/test_lists.py holds against grappler's own lists.
* Graphs with a function library are passed whole (``MetaGraphDef.graph_def``
  keeps ``library``); the meta-optimizer then also runs AMP on each reachable
  function body as a separate item (spec §1.2) and returns the rewritten library.
  ``compare_rewrites`` judges each such body as a graph of its own (``_Arg`` and
  ``<output>_RetVal`` nodes, as ``amp_rewrite.functions.body_graph_def`` builds it).
"""
from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import tensorflow as tf
import yaml
from tensorflow.core.framework import types_pb2
from tensorflow.core.framework.function_pb2 import FunctionDef
from tensorflow.core.framework.graph_pb2 import GraphDef
from tensorflow.core.framework.node_def_pb2 import NodeDef
from tensorflow.core.protobuf.config_pb2 import ConfigProto
from tensorflow.core.protobuf.device_properties_pb2 import DeviceProperties, NamedDevice
from tensorflow.core.protobuf.meta_graph_pb2 import MetaGraphDef

from amp_rewrite import _tf
from amp_rewrite.core import functions, lists, support
from amp_rewrite.core.casts import CAST_NAME, is_amp_cast
from amp_rewrite.core.graph_io import copy_graph_def, data_inputs, parse_tensor_name
from amp_rewrite.core.target import BFLOAT16, lookup_target
from amp_rewrite.errors import AmpRewriteError, GraphError, ListsError

GPU_NAME = "/job:localhost/replica:0/task:0/device:GPU:0"
CPU_NAME = "/job:localhost/replica:0/task:0/device:CPU:0"
# A fast-fp16 GPU with recent CUDA/cuDNN, so that every version-gated Fp16 list
# entry (BatchMatMul*, Conv3D*, Depthwise*) is on (spec §1.4, §3.1).
GPU_ENVIRONMENT = {"architecture": "8.0", "cuda": "12050", "cudnn": "90300"}
# Set to 1, the oracle acts as on a CPU without AVX512F, where TensorFlow's bfloat16 pass
# cannot run: lets a machine that has it test what such a machine does.
SIMULATE_NO_AVX512F = "AMP_REWRITE_SIMULATE_NO_AVX512F"
_NO_FETCH_NODE = "amp_rewrite_reference_no_fetch"
_PLACEHOLDER_OPS = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})
_INFER_STAND_IN = "Tanh"  # what grappler sees instead of a bounded Exp


class GrapplerUnavailable(RuntimeError):
    """TensorFlow's pass for the target cannot run on this machine (see ``unavailable_reason``)."""


def unavailable_reason(target: str) -> str | None:
    """Why grappler's pass for ``target`` cannot answer on this machine, or None if it can.

    The float16 pass runs on any CPU (the GPU is virtual). TensorFlow's oneDNN bfloat16
    pass returns the graph unchanged on a CPU without AVX512F
    (``IsDataTypeSupportedByOneDNNOnThisCPU(DT_BFLOAT16)``) and does not exist with
    ``TF_ENABLE_ONEDNN_OPTS=0``; an oracle must not read that as "nothing to convert".
    """
    if lookup_target(target) is not BFLOAT16:
        return None
    if os.environ.get(SIMULATE_NO_AVX512F, "") not in ("", "0"):
        return f"grappler's bfloat16 pass needs a CPU with AVX512F; {SIMULATE_NO_AVX512F} says to act as on a CPU with none"
    _tf.require(_tf.ORACLE)
    if not _tf.ONEDNN_DTYPE_SUPPORTED.get()(types_pb2.DT_BFLOAT16):
        return "grappler's bfloat16 pass needs a CPU with AVX512F; this CPU has none"
    if os.environ.get("TF_ENABLE_ONEDNN_OPTS", "") == "0":
        return "grappler's bfloat16 pass is off with TF_ENABLE_ONEDNN_OPTS=0; unset it"
    return None


def _virtual_cluster(target: str):  # -> tensorflow.python.grappler.cluster.Cluster
    """The devices grappler sees: GPU+CPU for float16, CPU only for bfloat16."""
    cluster = _tf.GRAPPLER_CLUSTER.get()
    cpu = NamedDevice(name=CPU_NAME, properties=DeviceProperties(type="CPU"))
    if target == "bfloat16":
        return cluster(devices=[cpu])
    gpu = NamedDevice(name=GPU_NAME, properties=DeviceProperties(type="GPU", environment=GPU_ENVIRONMENT))
    return cluster(devices=[gpu, cpu])


def _config(target: str) -> ConfigProto:
    """Only the AMP optimizer of ``target``, on graphs of any size, failing loudly, unverified."""
    config = ConfigProto()
    rewrite_options = config.graph_options.rewrite_options
    rewrite_options.optimizers.append(lookup_target(target).grappler_optimizer)
    rewrite_options.min_graph_nodes = -1
    rewrite_options.fail_on_optimizer_errors = True
    rewrite_options.disable_tfg_optimizer = True
    return config


@dataclass(frozen=True)
class OracleInputs:
    """What ``run_grappler`` gives grappler besides the graph, to make its lists ours."""

    held_float32: tuple[str, ...]  # ops taken off grappler's infer list for the run
    # (function name, "" for the main graph; node name) of each Exp run as a Tanh
    stand_ins: tuple[tuple[str, str], ...]


def oracle_inputs(graph_def: GraphDef, target: str, environ: Mapping[str, str]) -> OracleInputs:
    """The inputs ``run_grappler`` derives for ``graph_def`` under ``environ`` (see the module's notes)."""
    held = grappler_environ(target, environ).get(_INFER_REMOVE, "")
    removed = set(held.split(",")) - set(environ.get(_INFER_REMOVE, "").split(","))
    return OracleInputs(tuple(sorted(removed - {""})), tuple(sorted(_bounded_exps(graph_def, target, environ))))


def held_float32_ops(target: str) -> frozenset[str]:
    """The ops of ``lists/<target>.yaml``'s ``float32`` section, read from the file as written."""
    with open(lists.find_builtin(lookup_target(target, quantized=True).colouring), encoding="utf-8") as stream:
        document = yaml.safe_load(stream)
    return frozenset((document.get("float32") or {}).get("ops") or {})


# The bounded-Exp rule as the oracle reads it from a GraphDef, written apart from
# amp_rewrite.colouring: an Exp whose argument is -f(x) or c * f(x) (c a Const with no
# positive element) for an f whose output is never negative, or x - max(x) with the max
# keeping its reduced dimensions.
_BOUNDED = "Exp"
_NEVER_NEGATIVE = frozenset(
    {"Abs", "Exp", "Relu", "Relu6", "Sigmoid", "Softmax", "Softplus", "Sqrt", "Square", "SquaredDifference"}
)


def _bounded_exps(graph_def: GraphDef, target: str, environ: Mapping[str, str]) -> set[tuple[str, str]]:
    """(function, node) of each deny-listed Exp, in the main graph and every function body,
    whose argument the graph shows is never positive. None where the environment's list
    edits are refused: grappler then refuses them too."""
    nodes = [*graph_def.node, *(node for f in graph_def.library.function for node in f.node_def)]
    if not any(node.op == _BOUNDED for node in nodes):
        return set()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the loader's own warnings are tested with the loader
            op_lists = lists.load_lists(target, environ=environ)
    except ListsError:
        return set()
    if _BOUNDED not in op_lists.deny or op_lists.infer_as_deny:
        return set()
    op_defs = support.library_op_defs(graph_def.library)
    items = [("", lambda: graph_def)] + [
        (f.signature.name, lambda f=f: functions.body_graph_def(f, op_defs)) for f in graph_def.library.function
        if any(node.op == _BOUNDED for node in f.node_def)
    ]
    found: set[tuple[str, str]] = set()
    for item, as_graph in items:
        try:
            body = as_graph()
        except GraphError:
            continue  # grappler judges a body we cannot read on its own
        found |= {(item, name) for name in _bounded_in(body)}
    return found


def _bounded_in(graph_def: GraphDef) -> list[str]:
    name_to_node = {node.name: node for node in graph_def.node}

    def argument(node, index: int) -> tuple[str, int] | None:
        data = data_inputs(node)
        if index >= len(data):
            return None
        source, port = parse_tensor_name(data[index])
        return (source, port) if source in name_to_node else None

    def op(tensor: tuple[str, int] | None) -> str:
        return name_to_node[tensor[0]].op if tensor else ""

    def nonpositive_const(tensor: tuple[str, int] | None) -> bool:
        node = name_to_node[tensor[0]] if tensor else None
        if node is None or node.op != "Const" or "value" not in node.attr:
            return False
        values = tf.make_ndarray(node.attr["value"].tensor)
        return values.dtype.kind == "f" and bool((values <= 0).all())

    def nonpositive(tensor: tuple[str, int] | None) -> bool:
        if tensor is None:
            return False
        node = name_to_node[tensor[0]]
        first, second = argument(node, 0), argument(node, 1)
        if node.op == "Neg":
            return op(first) in _NEVER_NEGATIVE
        if node.op == "Mul":
            return (op(first) in _NEVER_NEGATIVE and nonpositive_const(second)) or (
                op(second) in _NEVER_NEGATIVE and nonpositive_const(first))
        if node.op == "Sub" and op(second) == "Max":
            reduced = name_to_node[second[0]]
            keeps = "keep_dims" in reduced.attr and reduced.attr["keep_dims"].b
            return keeps and argument(reduced, 0) == first
        return False

    return [node.name for node in graph_def.node if node.op == _BOUNDED and nonpositive(argument(node, 0))]


def _stand_in_for_bounded(graph: GraphDef, stand_ins: Iterable[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Give the stand-in op, in place, to each (function, node) of ``stand_ins`` ("" for the
    main graph). Returns (function, node) -> the node's op."""
    stand_ins = set(stand_ins)
    items = [("", graph.node)] + [(f.signature.name, f.node_def) for f in graph.library.function]
    swapped: dict[tuple[str, str], str] = {}
    for item, node_defs in items:
        for node_def in node_defs:
            if (item, node_def.name) in stand_ins:
                swapped[(item, node_def.name)] = node_def.op
                node_def.op = _INFER_STAND_IN
    return swapped


def _swap_back(output: GraphDef, swapped: Mapping[tuple[str, str], str]) -> None:
    """Undo ``_stand_in_for_bounded`` on grappler's output, in place."""
    if not swapped:
        return
    items = [("", output.node)] + [(f.signature.name, f.node_def) for f in output.library.function]
    for item, node_defs in items:
        for node_def in node_defs:
            node_def.op = swapped.get((item, node_def.name), node_def.op)


def _prepare_item_graph(graph_def: GraphDef, fetches: Sequence[str]) -> tuple[GraphDef, list[str], dict[str, bytes]]:
    """Copy ``graph_def`` into the form grappler's item builder accepts.

    Returns the copy, the fetch node names and, per placeholder whose shape was
    made concrete, the serialized original ``shape`` attr (b"" if it had none).
    """
    item_graph = copy_graph_def(graph_def)
    name_to_shape: dict[str, bytes] = {}
    for node in item_graph.node:
        if node.op not in _PLACEHOLDER_OPS:
            continue
        if "shape" not in node.attr:
            name_to_shape[node.name] = b""
            node.attr["shape"].shape.unknown_rank = True
            continue
        shape = node.attr["shape"].shape
        if any(dim.size < 0 for dim in shape.dim):
            name_to_shape[node.name] = node.attr["shape"].SerializeToString()
            for dim in shape.dim:
                if dim.size < 0:
                    dim.size = 1
    fetch_names = [parse_tensor_name(fetch).node for fetch in fetches]
    if not fetch_names:
        item_graph.node.add(name=_NO_FETCH_NODE, op="NoOp")
        fetch_names = [_NO_FETCH_NODE]
    return item_graph, fetch_names, name_to_shape


def _restore(output: GraphDef, name_to_shape: Mapping[str, bytes]) -> None:
    """Undo ``_prepare_item_graph`` on grappler's output, in place."""
    kept = [node for node in output.node if node.name != _NO_FETCH_NODE]
    if len(kept) != len(output.node):
        del output.node[:]
        output.node.extend(kept)
    for node in output.node:
        if node.name in name_to_shape:
            original = name_to_shape[node.name]
            if original:
                node.attr["shape"].ParseFromString(original)
            else:
                del node.attr["shape"]


_INFER_ADD, _INFER_REMOVE = (f"{lists.ENV_PREFIX}INFERLIST_{action}" for action in ("ADD", "REMOVE"))


def grappler_environ(target: str, environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` plus the edit that gives grappler our default lists: the ops we hold
    float32 (``held_float32_ops``) off its infer list, unless ``environ`` adds them."""
    held = sorted(held_float32_ops(target) - set(environ.get(_INFER_ADD, "").split(",")))
    if not held:
        return dict(environ)
    return {**environ, _INFER_REMOVE: ",".join(filter(None, (environ.get(_INFER_REMOVE), *held)))}


@contextlib.contextmanager
def _held_float32_removed(target: str) -> Iterator[None]:
    """os.environ as ``grappler_environ`` makes it, while grappler runs."""
    old = os.environ.get(_INFER_REMOVE)
    os.environ.update(grappler_environ(target, os.environ))
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(_INFER_REMOVE, None)
        else:
            os.environ[_INFER_REMOVE] = old


def run_grappler(
    graph_def: GraphDef, *, target: str, fetches: Sequence[str] = (), our_lists: bool = True
) -> GraphDef:
    """Return the GraphDef TensorFlow's grappler AMP pass makes of ``graph_def``.

    ``target`` is "float16" (CUDA mode on a virtual 8.0 GPU) or "bfloat16" (oneDNN
    mode on a CPU); ``fetches`` are node or tensor names grappler must preserve.
    ``our_lists``: give grappler the lists we colour with (held float32 ops, bounded
    ``Exp`` nodes; see the module's notes), as the conformance tests need; False runs
    grappler exactly as a TensorFlow user gets it, as the pass-time benchmarks need.
    Raises ValueError for an unknown target, ``GrapplerUnavailable`` when the pass
    cannot run on this machine (``unavailable_reason``), and RuntimeError, with
    grappler's message, when grappler rejects the graph or the pass fails. The input
    is not modified.
    """
    lookup_target(target)  # an unknown one is refused before any work
    _tf.require(_tf.ORACLE)
    reason = unavailable_reason(target)
    if reason is not None:
        raise GrapplerUnavailable(reason)
    item_graph, fetch_names, name_to_shape = _prepare_item_graph(graph_def, fetches)
    stand_ins = oracle_inputs(graph_def, target, os.environ).stand_ins if our_lists else ()
    swapped = _stand_in_for_bounded(item_graph, stand_ins)
    meta_graph = MetaGraphDef()
    meta_graph.graph_def.CopyFrom(item_graph)
    meta_graph.collection_def["train_op"].node_list.value.extend(fetch_names)
    cluster = _virtual_cluster(target)
    try:
        with _held_float32_removed(target) if our_lists else contextlib.nullcontext():
            output = _tf.OPTIMIZE_GRAPH.get()(
                _config(target), meta_graph, verbose=False, cluster=cluster, strip_default_attributes=False
            )
    except (tf.errors.OpError, RuntimeError, ValueError) as error:  # a TF status, or pybind11's for a bad proto
        raise RuntimeError(f"grappler failed on the graph for {target}: {error}") from error
    finally:
        cluster.Shutdown()
    _restore(output, name_to_shape)
    _swap_back(output, swapped)
    return output


# --------------------------------------------------------------------------------------
# Comparison


@dataclass(frozen=True)
class FunctionAgreement:
    """How far our rewrite of one library function's body agrees with grappler's."""

    name: str
    judged: int  # float32 (node, type-attr) vertices of the original body
    agreed: int
    ours_casts: int
    grappler_casts: int
    mismatches: tuple[str, ...]  # vertices, ops and unexpected nodes, as in Agreement
    cast_mismatches: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return _item_ok(self)

    def explain(self) -> str:
        return "\n".join(_item_lines(self, f"function '{self.name}': "))


def _item_ok(item: FunctionAgreement | Agreement) -> bool:
    """One item (main graph or function) agrees: every vertex and every cast."""
    return not item.mismatches and not item.cast_mismatches and item.judged == item.agreed


def _item_lines(item: FunctionAgreement | Agreement, prefix: str) -> list[str]:
    lines = [f"{prefix}{item.agreed}/{item.judged} float32 vertices agree; "
             f"casts: ours={item.ours_casts} grappler={item.grappler_casts}"]
    lines += [f"  vertex: {line}" for line in item.mismatches]
    lines += [f"  cast: {line}" for line in item.cast_mismatches]
    return lines


@dataclass(frozen=True)
class Agreement:
    """How far our rewrite agrees with grappler's on one graph and its library.

    ``judged``/``agreed``/``mismatches``/casts describe the main graph; ``functions``
    each library function grappler rewrites (or that either result changed);
    ``library_mismatches`` what would break callers: a function missing or added, or
    a signature (or ``ret``/``control_ret`` key set) that differs from the original's.
    """

    judged: int  # float32 (node, type-attr) vertices of the original graph
    agreed: int
    mismatches: tuple[str, ...]  # e.g. "allow1 attr T: ours=DT_HALF grappler=DT_FLOAT"
    ours_casts: int
    grappler_casts: int
    # Casts (named modulo the id) present in one result only, or wired differently.
    cast_mismatches: tuple[str, ...]
    functions: tuple[FunctionAgreement, ...] = ()
    library_mismatches: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return _item_ok(self) and not self.library_mismatches and all(f.ok for f in self.functions)

    def function(self, name: str) -> FunctionAgreement:
        """The breakdown for library function ``name``."""
        for candidate in self.functions:
            if candidate.name == name:
                return candidate
        raise KeyError(f"function {name!r} was not compared; compared: {[f.name for f in self.functions]}")

    def explain(self) -> str:
        """A multi-line report for an assertion message: main graph, library, then each function."""
        lines = _item_lines(self, "")
        lines += [f"  library: {line}" for line in self.library_mismatches]
        lines += [function.explain() for function in self.functions]
        return "\n".join(lines)


def _type_name(dtype: int | None) -> str:
    return "missing" if dtype is None else types_pb2.DataType.Name(dtype)


def vertex_dtypes(graph_def: GraphDef) -> dict[tuple[str, str], int]:
    """Every (node, type-attr) of ``graph_def`` with its dtype enum.

    A ``list(type)`` attr contributes one entry per element, keyed ``"T[i]"``;
    attrs starting with ``_`` are skipped, as grappler skips them (spec §2.2).
    """
    vertex_to_dtype: dict[tuple[str, str], int] = {}
    for node in graph_def.node:
        for attr_name, value in node.attr.items():
            if attr_name.startswith("_"):
                continue
            kind = value.WhichOneof("value")
            if kind == "type":
                vertex_to_dtype[(node.name, attr_name)] = value.type
            elif kind == "list":
                for index, dtype in enumerate(value.list.type):
                    vertex_to_dtype[(node.name, f"{attr_name}[{index}]")] = dtype
    return vertex_to_dtype


def _cast_key(node_def: NodeDef) -> str | None:
    """An AMP cast's name modulo its index (``x-0-CastToFp16-3-AutoMixedPrecision`` ->
    ``x-0-CastToFp16``), as both results name it alike; None for any other node."""
    if not is_amp_cast(node_def):
        return None
    match = CAST_NAME.match(node_def.name)
    return f"{match['src']}-{match['port']}-{match['kind']}"


@dataclass(frozen=True)
class _CastWiring:
    """Where one AMP cast sits: its input tensor, its consumers (node, input index) and its device."""

    source: str
    consumers: frozenset[tuple[str, int]]
    device: str


def _cast_wiring(graph_def: GraphDef) -> dict[str, _CastWiring]:
    """Per AMP cast (``_cast_key``): its wiring, with cast names modulo their index throughout."""
    name_to_key = {node.name: key for node in graph_def.node if (key := _cast_key(node)) is not None}
    key_to_consumers: dict[str, set[tuple[str, int]]] = {key: set() for key in name_to_key.values()}
    for node in graph_def.node:
        for index, tensor in enumerate(node.input):
            producer = parse_tensor_name(tensor).node
            if not tensor.startswith("^") and producer in name_to_key:
                key_to_consumers[name_to_key[producer]].add((name_to_key.get(node.name, node.name), index))
    wiring = {}
    for node in graph_def.node:
        if node.name in name_to_key:
            source, port = parse_tensor_name(node.input[0]) if node.input else ("missing", 0)
            key = name_to_key[node.name]
            wiring[key] = _CastWiring(f"{name_to_key.get(source, source)}:{port}", frozenset(key_to_consumers[key]),
                                      node.device)
    return wiring


def _compare_vertices(original: GraphDef, ours: GraphDef, grappler: GraphDef) -> tuple[int, int, list[str]]:
    """Judge every original float32 vertex, every op name and attrs the pass adds (``U``)."""
    original_vertices = vertex_dtypes(original)
    ours_vertices = vertex_dtypes(ours)
    grappler_vertices = vertex_dtypes(grappler)
    mismatches: list[str] = []
    judged = agreed = 0
    for (node, attr), dtype in original_vertices.items():
        if dtype != types_pb2.DT_FLOAT:
            continue
        judged += 1
        ours_dtype = ours_vertices.get((node, attr))
        grappler_dtype = grappler_vertices.get((node, attr))
        if ours_dtype == grappler_dtype:
            agreed += 1
        else:
            mismatches.append(
                f"{node} attr {attr}: ours={_type_name(ours_dtype)} grappler={_type_name(grappler_dtype)}"
            )
    original_names = {node.name for node in original.node}
    for node, attr in sorted((set(ours_vertices) | set(grappler_vertices)) - set(original_vertices)):
        if node in original_names and ours_vertices.get((node, attr)) != grappler_vertices.get((node, attr)):
            mismatches.append(
                f"{node} new attr {attr}: ours={_type_name(ours_vertices.get((node, attr)))} "
                f"grappler={_type_name(grappler_vertices.get((node, attr)))}"
            )
    ours_ops = {node.name: node.op for node in ours.node}
    grappler_ops = {node.name: node.op for node in grappler.node}
    for node in original.node:
        ours_op, grappler_op = ours_ops.get(node.name), grappler_ops.get(node.name)
        if ours_op != grappler_op:
            mismatches.append(f"{node.name} op: ours={ours_op or 'missing'} grappler={grappler_op or 'missing'}")
    return judged, agreed, mismatches


def _compare_casts(ours: GraphDef, grappler: GraphDef) -> list[str]:
    ours_wiring, grappler_wiring = _cast_wiring(ours), _cast_wiring(grappler)
    mismatches: list[str] = []
    for key in sorted(set(ours_wiring) | set(grappler_wiring)):
        if key not in grappler_wiring:
            mismatches.append(f"{key}: only in ours (consumers {sorted(ours_wiring[key].consumers)})")
            continue
        if key not in ours_wiring:
            mismatches.append(f"{key}: only in grappler (consumers {sorted(grappler_wiring[key].consumers)})")
            continue
        mine, theirs = ours_wiring[key], grappler_wiring[key]
        if mine.source != theirs.source:
            mismatches.append(f"{key}: input ours={mine.source} grappler={theirs.source}")
        if mine.consumers != theirs.consumers:
            mismatches.append(f"{key}: consumers ours={sorted(mine.consumers)} grappler={sorted(theirs.consumers)}")
        if mine.device != theirs.device:
            mismatches.append(f"{key}: device ours={mine.device!r} grappler={theirs.device!r}")
    return mismatches


def _compare_other_nodes(original: GraphDef, ours: GraphDef, grappler: GraphDef) -> list[str]:
    """Nodes that are neither original nor AMP casts must not appear in only one result."""
    original_names = {node.name for node in original.node}
    ours_extra = {n.name for n in ours.node if n.name not in original_names and not is_amp_cast(n)}
    grappler_extra = {n.name for n in grappler.node if n.name not in original_names and not is_amp_cast(n)}
    return [f"{name}: unexpected node in ours only" for name in sorted(ours_extra - grappler_extra)] + [
        f"{name}: unexpected node in grappler only" for name in sorted(grappler_extra - ours_extra)
    ]


def count_amp_casts(graph_def: GraphDef) -> int:
    """Number of casts the rewrite added (``casts.is_amp_cast``, spec §2.6)."""
    return sum(is_amp_cast(node) for node in graph_def.node)


def compare_rewrites(original: GraphDef, ours: GraphDef, grappler: GraphDef) -> Agreement:
    """Compare our rewrite of ``original`` (main graph and library) with grappler's.

    Vertices: each DT_FLOAT ``type`` attr and ``list(type)`` element of each
    original node must have the same dtype in both results, each original node the
    same op (FusedBatchNorm -> V2), and attrs the pass adds (``U``) the same value.
    Casts are matched by name modulo the ``-<id>-`` part, then by input, by the
    set of (consumer, input index) they feed and by device (grappler's is the source's). Node order and ``"x:0"`` vs ``"x"``
    do not matter. The same is done for the body of every function grappler
    rewrites (``amp_rewrite.functions.reachable_functions``) and of every other
    function that either result changed; our library must keep every function's
    signature.
    """
    judged, agreed, mismatches = _compare_vertices(original, ours, grappler)
    mismatches += _compare_other_nodes(original, ours, grappler)
    return Agreement(
        judged=judged,
        agreed=agreed,
        mismatches=tuple(mismatches),
        ours_casts=count_amp_casts(ours),
        grappler_casts=count_amp_casts(grappler),
        cast_mismatches=tuple(_compare_casts(ours, grappler)),
        functions=tuple(_compare_functions(original, ours, grappler)),
        library_mismatches=tuple(_compare_signatures(original, ours, grappler)),
    )


def _functions_by_name(graph_def: GraphDef) -> dict[str, FunctionDef]:
    return {function.signature.name: function for function in graph_def.library.function}


def _compare_signatures(original: GraphDef, ours: GraphDef, grappler: GraphDef) -> list[str]:
    """Our library must hold the original's functions, each callable exactly as before.

    (grappler's need not: its meta-optimizer prunes functions no node reaches.)
    """
    original_functions, ours_functions = _functions_by_name(original), _functions_by_name(ours)
    grappler_names = set(_functions_by_name(grappler))
    missing = sorted(set(original_functions) - set(ours_functions))
    problems = [f"function '{name}': missing from ours" for name in missing]
    problems += [f"function '{name}': only in ours" for name in sorted(set(ours_functions) - set(original_functions))]
    # grappler drops unreachable functions from its library; a reachable one must stay.
    problems += [
        f"function '{name}': reachable but missing from grappler's library"
        for name in functions.reachable_functions(original)
        if name not in grappler_names
    ]
    for name in sorted(set(original_functions) & set(ours_functions)):
        before, after = original_functions[name], ours_functions[name]
        if before.signature != after.signature:
            problems.append(f"function '{name}': our signature differs from the original's")
        if set(before.ret) != set(after.ret) or set(before.control_ret) != set(after.control_ret):
            problems.append(f"function '{name}': our ret/control_ret keys differ from the original's")
    if list(original.library.gradient) != list(ours.library.gradient):
        problems.append("library: our gradient registrations differ from the original's")
    return problems


def _compare_functions(original: GraphDef, ours: GraphDef, grappler: GraphDef) -> list[FunctionAgreement]:
    """One FunctionAgreement per function grappler rewrites or either result changed, in library order."""
    original_functions = _functions_by_name(original)
    ours_functions, grappler_functions = _functions_by_name(ours), _functions_by_name(grappler)
    reachable = set(functions.reachable_functions(original))

    def changed(result: Mapping[str, FunctionDef], name: str) -> bool:
        return name in result and result[name].SerializeToString(
            deterministic=True
        ) != original_functions[name].SerializeToString(deterministic=True)

    return [
        _compare_function(name, original, ours, grappler)
        for name in original_functions
        if name in ours_functions and name in grappler_functions
        and (name in reachable or changed(ours_functions, name) or changed(grappler_functions, name))
    ]


def _compare_function(name: str, original: GraphDef, ours: GraphDef, grappler: GraphDef) -> FunctionAgreement:
    """The main-graph comparison applied to one function's three bodies."""
    try:
        bodies = [_body(graph_def, name) for graph_def in (original, ours, grappler)]
    except AmpRewriteError as error:  # a body we cannot read is a disagreement, not a crash
        return FunctionAgreement(name, 0, 0, 0, 0, (f"cannot compare: {error}",), ())
    body_original, body_ours, body_grappler = bodies
    judged, agreed, mismatches = _compare_vertices(body_original, body_ours, body_grappler)
    mismatches += _compare_other_nodes(body_original, body_ours, body_grappler)
    return FunctionAgreement(
        name=name,
        judged=judged,
        agreed=agreed,
        ours_casts=count_amp_casts(body_ours),
        grappler_casts=count_amp_casts(body_grappler),
        mismatches=tuple(mismatches),
        cast_mismatches=tuple(_compare_casts(body_ours, body_grappler)),
    )


def _body(graph_def: GraphDef, name: str) -> GraphDef:
    """Function ``name`` of ``graph_def``'s library as a graph (its item, spec §1.2)."""
    return functions.body_graph_def(_functions_by_name(graph_def)[name], support.library_op_defs(graph_def.library))


def function_body(graph_def: GraphDef, name: str) -> GraphDef:
    """Library function ``name`` as a GraphDef, as grappler's item sees it (for tests and tools)."""
    if name not in _functions_by_name(graph_def):
        raise KeyError(f"function {name!r} is not in the library; it has {sorted(_functions_by_name(graph_def))}")
    return _body(graph_def, name)
