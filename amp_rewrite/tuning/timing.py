"""Time one op in two forms, interleaved: float32 against the target, or a cast down
against the cast back up, each at the shapes and values the model runs it with.

Each form runs as K copies of the op in one Session call (K chosen so a call takes about
1 ms; the copies read the same inputs, from variables set up once), a Session of its own
per batch of ops, with one inter-op thread so the copies run one after the other, as a
model's chain of ops does, and without grappler and the graph optimizer, which would fold
or merge the copies. The two forms of a pair alternate for several rounds, so a change in
the machine's load hits both alike; the ratio is the median of the per-round ratios, each
form's time in a round the best of a few calls (load only ever adds time), less the best
of as many calls that run nothing, made between them (on a loaded machine an empty call's
time changes from one second to the next: measured once, it could exceed a later round's
calls and leave an op "too small to time").

A node costs the executor some time to schedule whatever it computes (``node_seconds``:
a chain of scalar additions, per node; measured once per machine and cached). An op too
small to time still pays that: a cast the rewrite adds, in a loop body once per iteration.

Results go into the timing cache (``cache``) by each form's key, which names the op, its
inputs' dtypes and shapes and a digest of its attributes: identical ops are timed once,
in this model and the next.
"""
from __future__ import annotations

import hashlib
import math
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2

from amp_rewrite.core.graph_io import make_node_def
from amp_rewrite.core.report import dtype_name
from amp_rewrite.core.support import default_attrs, registered_op_def
from amp_rewrite.tuning.cache import TimingCache
from amp_rewrite.tuning.shapes import TensorInfo

ROUNDS = 4              # interleaved rounds per pair
PASSES = 3              # times each pair is timed while the budget lasts, the median kept
CALLS = 2               # calls per form and round, the best counted
CALL_SECONDS = 1e-3     # what one timed Session call should take: K copies of the op
COPIES = (1, 4, 16)     # copies of an op per timed call: the most that keep it near CALL_SECONDS
CHAIN_COPIES = 4        # at least, for a chain: its first copy's call is taken off
MAX_COPIES = COPIES[-1]
CHUNK = 24              # pairs per timing Session
SESSION_BYTES = 512 << 20  # input variables one timing Session holds before the next one starts
RESOLUTION_S = 1e-9     # a per-op time at or under this is below what a call less the empty call's resolves
TOO_SMALL_S = 0.0       # both forms' seconds for an op too small to time: it costs nothing measurable either way
NODE_KEY = "executor: one node"  # the cache's key of ``node_seconds``
NODE_TRIES = 5          # its measurements, the median kept: it is cached, so one unlucky one would stay
_FLOATS = frozenset({types_pb2.DT_FLOAT, types_pb2.DT_HALF, types_pb2.DT_BFLOAT16, types_pb2.DT_DOUBLE})
_TIMED_WITHOUT_VALUE = _FLOATS | {types_pb2.DT_BOOL}  # a bool of unknown value is timed as all True


@dataclass(frozen=True, eq=False)
class OpRun:
    """One op as it is timed: its NodeDef (named ``op``, reading ``in0:0``, ``in1:0``, ...)
    and the tensors it reads, in this form's dtypes."""

    key: str
    node_def: node_def_pb2.NodeDef
    inputs: tuple[TensorInfo, ...]
    chain: bool = False  # output 0 is input 0's dtype and shape: the copies run one on another's output


@dataclass(frozen=True, eq=False)
class Pair:
    """Two forms timed against each other; ``weight`` (the nodes that share them, their
    size) orders the pairs, largest first, so a short budget goes where the time is."""

    first: OpRun
    second: OpRun
    weight: float = 1.0


def _describe(info: TensorInfo) -> str:
    if info.value is not None:
        return f"{dtype_name(info.dtype)}={info.value.tolist()}"
    return f"{dtype_name(info.dtype)}{list(info.shape or ())}"


def op_run(node_def: node_def_pb2.NodeDef, inputs: Sequence[TensorInfo], chain: bool = False) -> OpRun | None:
    """``node_def`` as a timed op reading ``inputs`` (its data inputs, in order), or None
    where it cannot be timed alone: an input of unknown shape, a non-float input without a
    static value (but a bool mask: a select's time does not depend on it), a function
    attribute. ``chain``: its output 0 has input 0's dtype and shape."""
    for info in inputs:
        if info.shape is None or (info.dtype not in _TIMED_WITHOUT_VALUE and info.value is None):
            return None
    run = node_def_pb2.NodeDef(name="op", op=node_def.op, input=[f"in{i}:0" for i in range(len(inputs))])
    op_def = registered_op_def(node_def.op)
    defaults = dict(default_attrs(node_def.op, op_def)) if op_def else {}
    for name, value in node_def.attr.items():
        if name.startswith("_") or defaults.get(name) == value:
            continue  # a default is left out, as a SavedModel leaves it out: one key with or without it
        if value.HasField("func") or value.list.func:
            return None
        run.attr[name].CopyFrom(value)
    digest = hashlib.sha256(b"".join(name.encode() + run.attr[name].SerializeToString(deterministic=True)
                                     for name in sorted(run.attr))).hexdigest()[:10]
    key = f"{node_def.op}({', '.join(_describe(i) for i in inputs)}) #{digest}"
    return OpRun(key, run, tuple(inputs), chain)


def cast_pair(shape: tuple[int, ...], low: int) -> Pair:
    """The casts the rewrite adds at a boundary of shape ``shape``: down to ``low``, and back."""
    runs = []
    for src, dst in ((types_pb2.DT_FLOAT, low), (low, types_pb2.DT_FLOAT)):
        node_def = make_node_def("Cast", "", SrcT=src, DstT=dst, Truncate=False)
        runs.append(op_run(node_def, [TensorInfo(src, shape)]))
    return Pair(runs[0], runs[1], float(np.prod(shape)))


@dataclass
class Budget:
    """Seconds the timing may take, counted from when it was made while it runs: ``pause``
    stops the count (what a conversion does between timing steps is not timing), ``resume``
    goes on."""

    seconds: float
    used: float = 0.0                      # seconds counted before ``started``
    started: float | None = field(default_factory=time.perf_counter)  # None: paused

    def left(self) -> float:
        return self.seconds - self.spent()

    def spent(self) -> float:
        return self.used + (0.0 if self.started is None else time.perf_counter() - self.started)

    def pause(self) -> None:
        self.used, self.started = self.spent(), None

    def resume(self) -> None:
        if self.started is None:
            self.started = time.perf_counter()


@dataclass
class Timings:
    """Seconds per run by OpRun key, and what it took to know them."""

    seconds: dict[str, float] = field(default_factory=dict)
    timed: int = 0      # pairs measured now
    cached: int = 0     # pairs the cache answered
    failed: int = 0     # pairs TensorFlow could not run alone
    skipped: int = 0    # pairs left when the budget ran out
    node_s: float = 0.0  # what the executor takes to run one more node, however small (``node_seconds``)

    def too_small(self, pair: Pair) -> bool:
        """Whether the op of ``pair`` was too small to time (its two forms ``TOO_SMALL_S``): no ratio means anything."""
        return self.seconds.get(pair.first.key) == TOO_SMALL_S == self.seconds.get(pair.second.key)

    def ratio(self, pair: Pair) -> float | None:
        """The second form's time over the first's, where both are known (an op too small to time has none)."""
        first, second = self.seconds.get(pair.first.key), self.seconds.get(pair.second.key)
        return None if first is None or second is None or first <= 0 else second / first


def time_pairs(pairs: Iterable[Pair], cache: TimingCache, budget: Budget) -> Timings:
    """Both forms of every pair: from the cache where it has both, else measured (largest
    weight first) while the budget lasts, then measured again while it lasts (``PASSES``
    times in all), each form's median kept: on a loaded machine one pass of an op can be
    off by several times. On a GPU a Session call returns when the device is done
    (DirectSession syncs its devices at the end of a run), so the same calls time it."""
    timings = Timings()
    todo: dict[tuple[str, str], Pair] = {}
    for pair in pairs:
        known = [cache.get(run.key) for run in (pair.first, pair.second)]
        if None not in known:
            timings.seconds[pair.first.key], timings.seconds[pair.second.key] = known
            timings.cached += 1
        elif (pair.first.key, pair.second.key) not in todo:
            todo[(pair.first.key, pair.second.key)] = pair
    queue = sorted(todo.values(), key=lambda p: -p.weight)
    found: dict[Pair, list[tuple[float, float]]] = {}
    for index in range(PASSES):
        left, failed = _time_queue(queue, budget, found)
        if index == 0:
            timings.skipped, timings.failed = len(left), failed
        queue = [pair for pair in queue if pair in found]
        if left or not queue:
            break
    for pair, measured in found.items():
        for run, seconds in zip((pair.first, pair.second), zip(*measured)):
            timings.seconds[run.key] = statistics.median(seconds)
            cache.put(run.key, timings.seconds[run.key])
        timings.timed += 1
    timings.node_s = node_seconds(cache, budget)
    return timings


def _time_queue(queue: list[Pair], budget: Budget, found: dict[Pair, list[tuple[float, float]]]
                ) -> tuple[list[Pair], int]:
    """One measurement of each pair of ``queue`` while the budget lasts, added to ``found``;
    the pairs left when it ran out, and how many TensorFlow could not run."""
    queue, failed = list(queue), 0
    while queue and budget.left() > 0:
        chunk = _next_chunk(queue)
        with _TimingSession(chunk) as session:
            for index, pair in enumerate(chunk):
                if budget.left() <= 0:
                    queue[:0] = chunk[index:]
                    break
                measured = session.time_pair(index)
                if measured is None:
                    failed += 1
                else:
                    found.setdefault(pair, []).append(measured)
    return queue, failed


def node_seconds(cache: TimingCache, budget: Budget) -> float:
    """Seconds the executor takes per node of a chain of scalar float32 additions (each
    waits for the one before, as a cast between two ops does): the cache's, else measured
    while the budget lasts (0 where it cannot be)."""
    known = cache.get(NODE_KEY)
    if known is not None or budget.left() <= 0:
        return known or 0.0
    scalar = TensorInfo(types_pb2.DT_FLOAT, ())
    run = op_run(make_node_def("AddV2", "", T=types_pb2.DT_FLOAT), [scalar, scalar], chain=True)
    with _TimingSession([Pair(run, run)]) as session:
        measured = [session.time_pair(0) for _ in range(NODE_TRIES)]
    seconds = statistics.median(found[0] if found else 0.0 for found in measured)
    cache.put(NODE_KEY, seconds)
    return seconds


def _bytes(info: TensorInfo) -> int:
    return 0 if info.value is not None else math.prod(info.shape or ()) * tf.as_dtype(info.dtype).size


def _next_chunk(queue: list[Pair]) -> list[Pair]:
    """The next pairs to build in one Session (taken off ``queue``): up to ``CHUNK`` pairs
    or ``SESSION_BYTES`` of inputs. A Session pays for the size of its graph on each new
    call, so graphs stay small and are built whole before the first call."""
    chunk, size = [], 0
    while queue and len(chunk) < CHUNK and (not chunk or size < SESSION_BYTES):
        pair = queue.pop(0)
        chunk.append(pair)
        size += sum(_bytes(i) for run in (pair.first, pair.second) for i in run.inputs)
    return chunk


class _ChunkGraph:
    """The GraphDef of a chunk of pairs: its inputs (a variable per float dtype and shape,
    set once to values in [0.5, 1.5], where no op meets a NaN or a denormal, which would
    time otherwise; a Const per static value, all True for a bool of unknown value), then
    each form as ``MAX_COPIES`` copies, grouped by the first 1, 4 and 16 (``COPIES``) into NoOps."""

    def __init__(self) -> None:
        self.graph_def = graph_pb2.GraphDef()
        self.inputs: dict[tuple, str] = {}
        self.initializers: list[str] = []

    def node(self, name: str, op: str, inputs: Sequence[str] = (), **attrs: object) -> str:
        """Adds a node (attrs typed by its op's definition: ``make_node_def``); returns its name."""
        make_node_def(op, name, inputs, into=self.graph_def.node, **attrs)
        return name

    def const(self, name: str, value: np.ndarray) -> str:
        return self.node(name, "Const", dtype=tf.as_dtype(value.dtype).as_datatype_enum, value=value)

    def tensor(self, info: TensorInfo) -> str:
        key = (info.dtype, info.shape, None if info.value is None else info.value.tobytes())
        if key not in self.inputs:
            name = f"in{len(self.inputs)}"
            if info.value is not None or info.dtype == types_pb2.DT_BOOL:
                value = np.ones(info.shape, bool) if info.value is None else info.value
                self.inputs[key] = self.const(name, value.astype(tf.as_dtype(info.dtype).as_numpy_dtype))
                return self.inputs[key]
            f32 = types_pb2.DT_FLOAT
            handle = self.node(name, "VarHandleOp", dtype=info.dtype, shape=tf.TensorShape(info.shape),
                               shared_name=name)
            shape = self.const(f"{name}/shape", np.array(info.shape, np.int32))
            uniform = self.node(f"{name}/uniform", "RandomUniform", [shape], dtype=f32, T=types_pb2.DT_INT32)
            low = self.const(f"{name}/low", np.array(0.5, np.float32))
            values = self.node(f"{name}/values", "AddV2", [uniform, low], T=f32)
            if info.dtype != f32:
                values = self.node(f"{name}/cast", "Cast", [values], SrcT=f32, DstT=info.dtype, Truncate=False)
            self.initializers.append(self.node(f"{name}/assign", "AssignVariableOp", [handle, values],
                                               dtype=info.dtype))
            self.inputs[key] = self.node(f"{name}/read", "ReadVariableOp", [handle], dtype=info.dtype)
        return self.inputs[key]

    def form(self, run: OpRun, scope: str) -> dict[int, str]:
        """The copies of ``run``; copies -> the node to run for the first that many."""
        inputs = [self.tensor(info) for info in run.inputs]
        copies: list[str] = []
        for copy in range(MAX_COPIES):
            node_def = self.graph_def.node.add()
            node_def.CopyFrom(run.node_def)
            node_def.name = f"{scope}/op{copy}"
            node_def.input[:] = [f"{copies[-1]}:0", *inputs[1:]] if run.chain and copies else inputs
            copies.append(node_def.name)
        return {n: self.node(f"{scope}/group{n}", "NoOp", [f"^{c}" for c in copies[:n]]) for n in COPIES}


class _TimingSession:
    """A Session running one chunk's graph (``_ChunkGraph``), imported in one piece: a
    Session pays for the size of its graph whenever the graph grows, so it is built whole
    before the first call, and a chunk is small."""

    def __init__(self, pairs: Sequence[Pair]) -> None:
        self.failed: set[int] = set()
        graph = self._import(pairs)
        if graph is None:  # an op TensorFlow refuses with these inputs: find it, build the others
            self.failed = {i for i, pair in enumerate(pairs) if self._import([pair]) is None}
            graph = self._import([pair for i, pair in enumerate(pairs) if i not in self.failed])
            self.groups = iter(self.groups)
            self.groups = [({}, {}) if i in self.failed else next(self.groups) for i in range(len(pairs))]
        self.chains = [pair.first.chain and pair.second.chain for pair in pairs]
        config = tf.compat.v1.ConfigProto(inter_op_parallelism_threads=1)
        config.graph_options.optimizer_options.opt_level = tf.compat.v1.OptimizerOptions.L0
        config.graph_options.rewrite_options.disable_meta_optimizer = True
        self.session = tf.compat.v1.Session(graph=graph, config=config)
        self.session.run("initialize")

    def _import(self, pairs: Sequence[Pair]) -> tf.Graph | None:
        """The graph of ``pairs`` (``groups``: each pair's forms' nodes), or None if TensorFlow refuses it."""
        chunk = _ChunkGraph()
        self.groups = [(chunk.form(pair.first, f"p{i}a"), chunk.form(pair.second, f"p{i}b"))
                       for i, pair in enumerate(pairs)]
        chunk.node("empty", "NoOp")
        chunk.node("initialize", "NoOp", [f"^{name}" for name in chunk.initializers])
        graph = tf.Graph()
        try:
            with graph.as_default():
                tf.graph_util.import_graph_def(chunk.graph_def, name="")
        except (ValueError, TypeError):
            return None
        return graph

    def __enter__(self) -> _TimingSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.session.close()

    def _call(self, fetch: str) -> float:
        start = time.perf_counter()
        self.session.run(fetch)
        return time.perf_counter() - start

    def time_pair(self, index: int) -> tuple[float, float] | None:
        """Seconds per run of pair ``index``'s forms, or None if TensorFlow cannot run one.
        Each round times each form as the best of ``CALLS`` calls (another process can only
        make a call slower), the forms in turn; the first form's time is its best over all
        rounds, the second's that times the median of the rounds' ratios. A round where either
        form is at ``RESOLUTION_S`` (no longer than the empty call) counts for nothing; where
        most are so, the op is too small to time: both ``TOO_SMALL_S``, rather than a ratio of
        two clamped values."""
        if index in self.failed:
            return None
        first_groups, second_groups = self.groups[index]
        chain = self.chains[index]
        try:
            single = [first_groups[1], second_groups[1]]
            for fetch in single:  # the first call creates kernels and their caches
                self._call(fetch)
            alone = max(self._best(fetch) for fetch in single)
            copies = max((c for c in COPIES if c * max(alone, 1e-6) <= CALL_SECONDS), default=1)
            copies = max(copies, CHAIN_COPIES) if chain else copies
            for fetch in (first_groups[copies], second_groups[copies]):
                self._call(fetch)
            firsts, seconds, ratios = [], [], []
            for round_index in range(ROUNDS):
                forms = (first_groups, second_groups) if round_index % 2 == 0 else (second_groups, first_groups)
                best = {id(groups): self._per_op(groups, copies, chain) for groups in forms}
                first, second = best[id(first_groups)], best[id(second_groups)]
                firsts.append(first)
                seconds.append(second)
                ratios.append(second / first)
        except (tf.errors.OpError, ValueError, TypeError):
            return None
        resolved = [(f, r) for f, s, r in zip(firsts, seconds, ratios) if min(f, s) > RESOLUTION_S]
        if len(resolved) * 2 < ROUNDS:  # most rounds could not tell it from an empty call
            return TOO_SMALL_S, TOO_SMALL_S
        first = min(f for f, _ in resolved)
        return first, first * statistics.median(r for _, r in resolved)

    def _per_op(self, groups: dict[int, str], copies: int, chain: bool) -> float:
        """One form's seconds per op: the best of ``CALLS`` calls of ``copies`` copies; for a
        chain, less the first copy's call, so what is left runs on an input it may overwrite,
        as the op does in a model where nothing else reads that input (TensorFlow then gives
        it the input's buffer: no allocation, which for a large tensor means page faults)."""
        many = self._best(groups[copies])
        if not chain:
            return max(many, RESOLUTION_S) / copies
        one = self._best(groups[1])
        return max(many - one, RESOLUTION_S) / (copies - 1)

    def _best(self, fetch: str) -> float:
        """The best of ``CALLS`` calls of ``fetch`` less the best of as many empty calls
        between them: the empty call measured now, under the machine's load of now."""
        calls, empty = [], []
        for _ in range(CALLS):
            empty.append(self._call("empty"))
            calls.append(self._call(fetch))
        return min(calls) - min(empty)
