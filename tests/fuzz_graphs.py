"""Random well-formed float32 TensorFlow graphs for fuzzing the AMP pass.

``graph_plans()`` is a hypothesis strategy for a ``GraphPlan``: a list of ``Step``s (an op
from ``CATALOGUE``, small integers that choose its inputs and attributes, a device, an
optional control input), the fetches and edits of the op lists (through TensorFlow's
variables, which both implementations read). ``build_graph(plan)`` interprets the plan in a
``tf.Graph`` with ``tf.raw_ops``; every integer is taken modulo the number of choices, so
every plan is a valid graph and hypothesis can shrink plans freely (a pick of 0 means the
most recent tensor, so shrunk graphs are chains).

Every tensor of the pool is a ``[4, 4]`` matrix ("mat") or a ``[1, 2, 2, 4]`` NHWC image
("img"), both 16 elements so ``Reshape`` joins them. Steps that change shapes
(reductions, ``Split``/``Unpack``/``Slice``) come with the op that restores the shape.
Control flow comes as small v1 loops and conds (Enter/Merge/Switch/NextIteration/Exit)
and functional ``StatelessWhile``/``StatelessIf`` with library functions.
Each value is also computed eagerly in float32 while building, and inputs are chosen
where the op is well conditioned (``Exp`` of small values, ``Log``/``Sqrt`` of values
>= 0.5, divisors away from 0, every result within +-``LIMIT``), so a float16 or bfloat16
rewrite must match float32 within the target's tolerance.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf
from hypothesis import strategies as st
from tensorflow.core.framework.graph_pb2 import GraphDef

MAT = (4, 4)
IMG = (1, 2, 2, 4)
SHAPES = (MAT, IMG)
# Largest magnitude a pool tensor may hold: keeps float16 far from overflow and keeps
# rounding errors small against the tolerance.
LIMIT = 4.0
# Device strings drawn for a step: mostly empty (the target's device), else explicit.
DEVICES = ("", "", "", "", "/device:GPU:0", "/device:CPU:0", "/job:localhost/replica:0/task:0/device:GPU:0")
_ATTEMPTS = 4  # input choices tried before a step falls back to fresh graph inputs


# --------------------------------------------------------------------------------------
# Plans: what hypothesis draws and shrinks


@dataclass(frozen=True)
class Step:
    """One catalogue entry to apply; ``picks`` choose inputs, ``variant`` attributes."""

    op: str
    picks: tuple[int, ...] = (0, 0, 0, 0)
    variant: int = 0
    device: str = ""
    control: int = 0  # 0: none; else a control input on an earlier node (counted back)


@dataclass(frozen=True)
class ListEdit:
    """Move ``op`` to list ``to`` ("allow", "deny", "infer", "clear"), or out of all ("")."""

    op: str
    to: str = ""


@dataclass(frozen=True)
class GraphPlan:
    """A whole graph: values seed, steps in order, fetch choices (the first one a sink),
    and edits of the op lists made through TensorFlow's variables (both implementations
    read them)."""

    seed: int
    steps: tuple[Step, ...]
    fetch_picks: tuple[int, ...] = (0,)
    list_edits: tuple[ListEdit, ...] = ()
    level: str = ""  # TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL


_ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
_LIST_TO_VARIABLE = {"allow": "ALLOWLIST", "deny": "DENYLIST", "infer": "INFERLIST", "clear": "CLEARLIST"}


def list_environment(edits: Sequence[ListEdit], level: str = "") -> dict[str, str]:
    """The variables that make ``edits``: add to the destination and remove from the three
    other lists, so no op ends in two lists (removing an absent op changes nothing)."""
    name_to_ops: dict[str, list[str]] = {}
    for edit in edits:
        for name, variable in _LIST_TO_VARIABLE.items():
            action = "ADD" if name == edit.to else "REMOVE"
            ops = name_to_ops.setdefault(f"{_ENV_PREFIX}{variable}_{action}", [])
            if edit.op not in ops:
                ops.append(edit.op)
    environ = {name: ",".join(ops) for name, ops in name_to_ops.items()}
    if level:
        environ[f"{_ENV_PREFIX}LEVEL"] = level
    return environ


@dataclass(frozen=True)
class FuzzGraph:
    """A built plan: the float32 GraphDef and what a test needs to run it."""

    graph_def: GraphDef
    fetches: tuple[str, ...]  # node names; always at least one sink
    outputs: tuple[str, ...]  # float32 tensors to compare numerically: fetches and sinks
    feeds: dict[str, np.ndarray] = field(default_factory=dict)
    environ: dict[str, str] = field(default_factory=dict)  # list edits for both implementations


# --------------------------------------------------------------------------------------
# Building


@dataclass(frozen=True)
class _Value:
    graph: tf.Tensor | None  # None while a step is only tried eagerly
    eager: tf.Tensor
    is_input: bool = False  # a placeholder or constant: exact in every precision

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.eager.shape)

    @property
    def array(self) -> np.ndarray:
        return self.eager.numpy().astype(np.float32)


Need = Callable[[np.ndarray], bool]


def _any(x: np.ndarray) -> bool:
    return True


def _small(x: np.ndarray) -> bool:
    return float(np.max(np.abs(x))) <= 2.0


def _unit(x: np.ndarray) -> bool:
    return float(np.max(np.abs(x))) <= 1.0


def _positive(x: np.ndarray) -> bool:
    return float(np.min(x)) >= 0.5


def _away_from_zero(x: np.ndarray) -> bool:
    return float(np.min(np.abs(x))) >= 0.5


def _above_minus_half(x: np.ndarray) -> bool:
    return float(np.min(x)) >= -0.5


class _Builder:
    """The graph under construction, its pool of float32 tensors and feed values."""

    def __init__(self, seed: int) -> None:
        self.graph = tf.Graph()
        self.rng = np.random.default_rng(seed)
        self.pool: list[_Value] = []
        self.feeds: dict[str, np.ndarray] = {}
        self.count = itertools.count()
        # Ops outside any v1 loop or cond frame: the only valid control inputs.
        self.top_level: list[tf.Operation] = []
        # Nodes a session may fetch: not inside a v1 loop frame.
        self.fetchable: set[str] = set()

    def name(self, op: str) -> str:
        return f"{op.lower()}{next(self.count)}"

    def fresh(self, shape: tuple[int, ...], need: Need, placeholder: bool, device: str = "") -> _Value:
        """A new graph input whose values satisfy ``need``."""
        if need in (_positive,):
            values = self.rng.uniform(0.5, 1.5, shape)
        elif need is _away_from_zero:
            values = self.rng.uniform(0.5, 1.5, shape) * self.rng.choice([-1.0, 1.0], shape)
        else:
            values = self.rng.uniform(-1.0, 1.0, shape)
        values = values.astype(np.float32)
        with self.graph.as_default(), _device(device):
            if placeholder:
                tensor = tf.compat.v1.placeholder(tf.float32, shape, name=self.name("Placeholder"))
                self.feeds[tensor.name] = values
            else:
                tensor = tf.constant(values, name=self.name("Const"))
        self.top_level.append(tensor.op)
        self.fetchable.add(tensor.op.name)
        value = _Value(tensor, tf.constant(values), is_input=True)
        self.pool.append(value)
        return value


@contextlib.contextmanager
def _device(device: str):
    if device:
        with tf.device(device):
            yield
    else:
        yield


class _Context:
    """One attempt at one step: takes inputs from the pool, adds ops (eagerly only while
    ``trial``), reads attribute choices from the step's ``variant``."""

    def __init__(self, builder: _Builder, step: Step, attempt: int, trial: bool, control: tf.Operation | None):
        self.builder = builder
        self.step = step
        self.attempt = attempt
        self.trial = trial
        self.control = control
        self.slot = 0
        self.variant = step.variant

    # inputs -------------------------------------------------------------------------
    def take(self, shape: tuple[int, ...] = MAT, need: Need = _any, *, inputs_only: bool = False) -> _Value:
        """An existing tensor of ``shape`` satisfying ``need``, or (last attempt, or none
        exists) a fresh placeholder or constant."""
        pick = self.step.picks[self.slot % len(self.step.picks)] + self.slot // len(self.step.picks)
        self.slot += 1
        candidates = [
            value
            for value in self.builder.pool
            if value.shape == shape and (value.is_input or not inputs_only) and need(value.array)
        ]
        if self.attempt < _ATTEMPTS - 1 and candidates:
            value = candidates[-1 - (pick + self.attempt) % len(candidates)]
        elif self.trial:
            # The fresh input is only made if the final, non-trial run asks for it.
            value = _Value(None, tf.constant(self.builder.rng.uniform(0.5, 1.0, shape).astype(np.float32)), True)
        else:
            value = self.builder.fresh(shape, need, placeholder=pick % 2 == 0, device=self.step.device)
        return value

    def take_any_shape(self, need: Need = _any) -> _Value:
        return self.take(self.choice(SHAPES), need)

    def choice(self, options: Sequence):
        index = self.variant % len(options)
        self.variant //= len(options)
        return options[index]

    # ops ----------------------------------------------------------------------------
    def op(self, op: str, **kwargs) -> list[_Value]:
        """Apply ``tf.raw_ops.<op>`` eagerly and (unless trial) in the graph; its outputs."""
        raw = getattr(tf.raw_ops, op)
        eager = raw(**{key: _eager(arg) for key, arg in kwargs.items()})
        eager_outputs = [eager] if isinstance(eager, tf.Tensor) else list(eager)
        if self.trial:
            return [_Value(None, out) for out in eager_outputs]
        builder = self.builder
        with contextlib.ExitStack() as stack:
            stack.enter_context(builder.graph.as_default())
            stack.enter_context(_device(self.step.device))
            if self.control is not None:
                stack.enter_context(builder.graph.control_dependencies([self.control]))
                self.control = None  # the first op of the step carries it
            graph = raw(**{key: _graph(arg) for key, arg in kwargs.items()}, name=builder.name(op))
        graph_outputs = [graph] if isinstance(graph, tf.Tensor) else list(graph)
        builder.top_level.append(graph_outputs[0].op)
        builder.fetchable.add(graph_outputs[0].op.name)
        return [_Value(g, e) for g, e in zip(graph_outputs, eager_outputs)]

    def call(self, name: str, fn: Callable[..., Sequence[tf.Tensor]], *args: _Value,
             control_flow_v2: bool = True) -> list[_Value]:
        """Run ``fn`` (built from ``tf`` functions, e.g. a loop) eagerly and (unless trial) in
        the graph under the name scope ``name``, with v1 or v2 control flow; its outputs.
        No control input: a v1 frame cannot take one from outside."""
        eager_outputs = list(fn(*[arg.eager for arg in args]))
        if self.trial:
            return [_Value(None, out) for out in eager_outputs]
        builder = self.builder
        was_v2 = tf.compat.v1.control_flow_v2_enabled()
        with contextlib.ExitStack() as stack:
            stack.enter_context(builder.graph.as_default())
            stack.enter_context(_device(self.step.device))
            stack.enter_context(tf.name_scope(builder.name(name)))
            if control_flow_v2:
                tf.compat.v1.enable_control_flow_v2()
            else:
                tf.compat.v1.disable_control_flow_v2()
            try:
                graph_outputs = list(fn(*[arg.graph for arg in args]))
            finally:
                if was_v2:
                    tf.compat.v1.enable_control_flow_v2()
                else:
                    tf.compat.v1.disable_control_flow_v2()
        builder.fetchable.update(tensor.op.name for tensor in graph_outputs)
        return [_Value(g, e) for g, e in zip(graph_outputs, eager_outputs)]

    def const(self, values: np.ndarray) -> _Value:
        """A constant not in the pool (filters, biases, shapes)."""
        values = np.asarray(values)
        if self.trial:
            return _Value(None, tf.constant(values), True)
        with self.builder.graph.as_default(), _device(self.step.device):
            tensor = tf.constant(values, name=self.builder.name("Const"))
        return _Value(tensor, tf.constant(values), True)

    def uniform(self, low: float, high: float, shape: tuple[int, ...]) -> np.ndarray:
        # Drawn from the step's own generator, so a trial and the final run agree.
        seed = (self.step.variant, self.slot, len(self.builder.pool))
        self.slot += 1
        return np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32)


def _eager(arg):
    if isinstance(arg, _Value):
        return arg.eager
    if isinstance(arg, list):
        return [_eager(a) for a in arg]
    return arg


def _graph(arg):
    if isinstance(arg, _Value):
        return arg.graph
    if isinstance(arg, list):
        return [_graph(a) for a in arg]
    return arg


# --------------------------------------------------------------------------------------
# The catalogue: one emitter per entry, grouped by the float16 list its main op is in.
# An emitter takes its inputs with ``c.take`` and returns the float32 tensors it adds to
# the pool. Helper ops that restore a shape are clear-list ops.


def _shape_of(c: _Context, value: _Value, shape: tuple[int, ...]) -> _Value:
    """Bring a broadcastable ``value`` back to ``shape``: BroadcastTo or a binary op."""
    how = c.choice(("BroadcastTo", "AddV2", "Mul"))
    if how == "BroadcastTo":
        return c.op("BroadcastTo", input=value, shape=c.const(np.array(shape, np.int32)))[0]
    other = c.take(shape)
    return c.op(how, x=value, y=other)[0]


def _unary(op: str, need: Need = _any, arg: str = "x") -> Callable[[_Context], list[_Value]]:
    def emit(c: _Context) -> list[_Value]:
        return c.op(op, **{arg: c.take_any_shape(need)})[:1]

    emit.__name__ = op
    return emit


def _binary(op: str, need_y: Need = _any) -> Callable[[_Context], list[_Value]]:
    def emit(c: _Context) -> list[_Value]:
        shape = c.choice(SHAPES)
        return c.op(op, x=c.take(shape), y=c.take(shape, need_y))[:1]

    emit.__name__ = op
    return emit


def _reduction(op: str) -> Callable[[_Context], list[_Value]]:
    def emit(c: _Context) -> list[_Value]:
        shape = c.choice(SHAPES)
        axis = c.choice(range(len(shape)))
        reduced = c.op(op, input=c.take(shape), axis=c.const(np.array([axis], np.int32)), keep_dims=True)[0]
        return [_shape_of(c, reduced, shape)]

    emit.__name__ = op
    return emit


# allow ------------------------------------------------------------------------------
def _matmul(c: _Context) -> list[_Value]:
    return c.op("MatMul", a=c.take(), b=c.take(), transpose_a=c.choice((False, True)),
                transpose_b=c.choice((False, True)))


def _batch_matmul(c: _Context) -> list[_Value]:
    return c.op("BatchMatMulV2", x=c.take(), y=c.take(), adj_x=c.choice((False, True)))


def _einsum(c: _Context) -> list[_Value]:
    return c.op("Einsum", inputs=[c.take(), c.take()], equation=c.choice(("ij,jk->ik", "ij,kj->ik")))


def _conv2d(c: _Context) -> list[_Value]:
    image = c.take(IMG)
    if c.choice(("const", "computed")) == "const":
        size = c.choice((1, 2))
        filter_ = c.const(c.uniform(-1.0, 1.0, (size, size, 4, 4)) / (size * size * 2))
    else:  # a filter computed in the graph: [4, 4] -> [1, 1, 4, 4]
        filter_ = c.op("Reshape", tensor=c.take(MAT), shape=c.const(np.array([1, 1, 4, 4], np.int32)))[0]
    return c.op("Conv2D", input=image, filter=filter_, strides=[1, 1, 1, 1], padding="SAME")


def _depthwise_conv2d(c: _Context) -> list[_Value]:
    filter_ = c.const(c.uniform(-0.5, 0.5, (2, 2, 4, 1)))
    return c.op("DepthwiseConv2dNative", input=c.take(IMG), filter=filter_, strides=[1, 1, 1, 1], padding="SAME")


# deny -------------------------------------------------------------------------------
def _pow(c: _Context) -> list[_Value]:
    shape = c.choice(SHAPES)
    return c.op("Pow", x=c.take(shape, _positive), y=c.take(shape, _unit))


def _l2loss(c: _Context) -> list[_Value]:
    shape = c.choice(SHAPES)
    loss = c.op("L2Loss", t=c.take(shape, _unit))[0]
    return [_shape_of(c, loss, shape)]


def _softmax_cross_entropy(c: _Context) -> list[_Value]:
    """Both outputs: the loss [4] broadcast back, and the backprop [4, 4] (output 1)."""
    loss, backprop = c.op("SoftmaxCrossEntropyWithLogits", features=c.take(), labels=c.take(MAT, _unit))
    restored = c.op("Reshape", tensor=loss, shape=c.const(np.array([4, 1], np.int32)))[0]
    return [backprop, _shape_of(c, restored, MAT)]


# infer ------------------------------------------------------------------------------
def _addn(c: _Context) -> list[_Value]:
    shape = c.choice(SHAPES)
    count = c.choice((2, 3, 4))
    return c.op("AddN", inputs=[c.take(shape) for _ in range(count)])


def _bias_add(c: _Context) -> list[_Value]:
    value = c.take_any_shape()
    if c.choice(("const", "computed")) == "const":
        bias = c.const(c.uniform(-1.0, 1.0, (4,)))
    else:  # row 0 of a matrix: Slice and Reshape (both clear)
        row = c.op("Slice", input=c.take(MAT), begin=c.const(np.array([0, 0], np.int32)),
                   size=c.const(np.array([1, 4], np.int32)))[0]
        bias = c.op("Reshape", tensor=row, shape=c.const(np.array([4], np.int32)))[0]
    return c.op("BiasAdd", value=value, bias=bias)


def _leaky_relu(c: _Context) -> list[_Value]:
    return c.op("LeakyRelu", features=c.take_any_shape(), alpha=c.choice((0.2, 0.01)))


def _fused_batch_norm(op: str) -> Callable[[_Context], list[_Value]]:
    def emit(c: _Context) -> list[_Value]:
        x = c.take(IMG)
        scale, offset, mean = (c.const(c.uniform(-1.0, 1.0, (4,))) for _ in range(3))
        variance = c.const(c.uniform(0.5, 1.5, (4,)))
        return c.op(op, x=x, scale=scale, offset=offset, mean=mean, variance=variance, is_training=False)[:1]

    emit.__name__ = op
    return emit


def _pool(op: str) -> Callable[[_Context], list[_Value]]:
    def emit(c: _Context) -> list[_Value]:
        arg = "value" if op == "AvgPool" else "input"
        return c.op(op, **{arg: c.take(IMG)}, ksize=[1, 2, 2, 1], strides=[1, 1, 1, 1], padding="SAME")

    emit.__name__ = op
    return emit


# clear ------------------------------------------------------------------------------
def _identity_n(c: _Context) -> list[_Value]:
    count = c.choice((1, 2, 3))
    return c.op("IdentityN", input=[c.take_any_shape() for _ in range(count)])


def _reshape(c: _Context) -> list[_Value]:
    source, target = c.choice(SHAPES), c.choice(SHAPES)
    return c.op("Reshape", tensor=c.take(source), shape=c.const(np.array(target, np.int32)))


def _transpose(c: _Context) -> list[_Value]:
    shape = c.choice(SHAPES)
    perm = [1, 0] if shape == MAT else [0, 2, 1, 3]
    return c.op("Transpose", x=c.take(shape), perm=c.const(np.array(perm, np.int32)))


def _split_concat(c: _Context) -> list[_Value]:
    """Split two tensors in halves along the last axis and concatenate a mix of halves."""
    shape = c.choice(SHAPES)
    axis = len(shape) - 1
    halves = c.op("Split", axis=c.const(np.array(axis, np.int32)), value=c.take(shape), num_split=2)
    if c.choice(("slice", "split")) == "slice":
        other = c.take(shape)
        begin = [0] * len(shape)
        size = list(shape[:-1]) + [2]
        halves.append(c.op("Slice", input=other, begin=c.const(np.array(begin, np.int32)),
                           size=c.const(np.array(size, np.int32)))[0])
    order = c.choice(((1, 0), (0, 1), (-1, 0), (1, -1)))
    return c.op("ConcatV2", values=[halves[i] for i in order], axis=c.const(np.array(axis, np.int32)))


def _unpack_pack(c: _Context) -> list[_Value]:
    shape = c.choice(SHAPES)
    axis = c.choice((0, 1)) if shape == MAT else 3
    parts = c.op("Unpack", value=c.take(shape), num=4, axis=axis)
    order = c.choice(((0, 1, 2, 3), (3, 2, 1, 0), (1, 0, 3, 2)))
    return c.op("Pack", values=[parts[i] for i in order], axis=axis)


def _squeeze_expand(c: _Context) -> list[_Value]:
    if c.choice(("img", "mat")) == "img":
        squeezed = c.op("Squeeze", input=c.take(IMG), axis=[0])[0]
        return c.op("ExpandDims", input=squeezed, axis=c.const(np.array(0, np.int32)))
    expanded = c.op("ExpandDims", input=c.take(MAT), axis=c.const(np.array(0, np.int32)))[0]
    return c.op("Squeeze", input=expanded, axis=[0])


def _gather(c: _Context) -> list[_Value]:
    shape = c.choice(SHAPES)
    axis = 0 if shape == MAT else 3
    indices = c.choice(((1, 0, 3, 2), (3, 3, 0, 1)))
    return c.op("GatherV2", params=c.take(shape), indices=c.const(np.array(indices, np.int32)),
                axis=c.const(np.array(axis, np.int32)))


def _tile(c: _Context) -> list[_Value]:
    shape = c.choice(SHAPES)
    size = [2, 4] if shape == MAT else [1, 1, 2, 4]
    multiples = [2, 1] if shape == MAT else [1, 2, 1, 1]
    part = c.op("Slice", input=c.take(shape), begin=c.const(np.zeros(len(shape), np.int32)),
                size=c.const(np.array(size, np.int32)))[0]
    return c.op("Tile", input=part, multiples=c.const(np.array(multiples, np.int32)))


def _reverse(c: _Context) -> list[_Value]:
    return c.op("ReverseV2", tensor=c.take_any_shape(), axis=c.const(np.array([0], np.int32)))


def _select(op: str) -> Callable[[_Context], list[_Value]]:
    """The condition compares a graph input with 0 (Greater/Less are clear ops too); a
    graph input is exact in every precision, so the condition never flips."""

    def emit(c: _Context) -> list[_Value]:
        shape = c.choice(SHAPES)
        compare = c.choice(("Greater", "Less", "GreaterEqual"))
        zero = c.const(np.zeros(shape, np.float32))
        condition = c.op(compare, x=c.take(shape, inputs_only=True), y=zero)[0]
        branches = ("t", "e") if op == "SelectV2" else ("x", "y")
        return c.op(op, condition=condition, **{branch: c.take(shape) for branch in branches})

    emit.__name__ = op
    return emit


def _clip(c: _Context) -> list[_Value]:
    low, high = c.choice(((-0.5, 0.5), (0.0, 1.0)))
    return c.op("ClipByValue", t=c.take_any_shape(), clip_value_min=c.const(np.float32(low)),
                clip_value_max=c.const(np.float32(high)))


def _check_numerics(c: _Context) -> list[_Value]:
    return c.op("CheckNumerics", tensor=c.take_any_shape(), message="fuzz")


# unlisted ---------------------------------------------------------------------------
def _cumsum(c: _Context) -> list[_Value]:
    shape = c.choice(SHAPES)
    return c.op("Cumsum", x=c.take(shape, _unit), axis=c.const(np.array(len(shape) - 1, np.int32)),
                exclusive=c.choice((False, True)), reverse=c.choice((False, True)))


def _while_loop(control_flow_v2: bool) -> Callable[[_Context], list[_Value]]:
    """A loop of 2 or 3 iterations whose body is MatMul (allow) with a captured weight,
    then an infer, clear or deny op: v1 (Enter/Merge/Switch/NextIteration/Exit) or a
    functional StatelessWhile whose body and cond are library functions."""

    def emit(c: _Context) -> list[_Value]:
        start, weight = c.take(), c.take(MAT, _unit)
        iterations = c.choice((2, 3))
        after = c.choice(("Tanh", "Sigmoid", "Relu6", "ExpTanh"))

        def loop(x: tf.Tensor, w: tf.Tensor) -> list[tf.Tensor]:
            def body(i: tf.Tensor, h: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
                product = tf.raw_ops.MatMul(a=h, b=w)
                if after == "ExpTanh":
                    return i + 1, tf.raw_ops.Exp(x=tf.raw_ops.Tanh(x=product))
                return i + 1, getattr(tf.raw_ops, after)(**{"features" if after == "Relu6" else "x": product})

            _, result = tf.compat.v1.while_loop(lambda i, h: i < iterations, body, [tf.constant(0), x])
            return [result]

        return c.call("while" if control_flow_v2 else "while_v1", loop, start, weight,
                      control_flow_v2=control_flow_v2)

    emit.__name__ = "While" if control_flow_v2 else "WhileV1"
    return emit


def _cond(control_flow_v2: bool) -> Callable[[_Context], list[_Value]]:
    """A conditional on the sign of a graph input's first element: MatMul (allow) in one
    branch, Tanh (infer) in the other; v1 (Switch/Merge) or a functional StatelessIf."""

    def emit(c: _Context) -> list[_Value]:
        decider, a, b = c.take(MAT, inputs_only=True), c.take(), c.take(MAT, _unit)

        def cond(p: tf.Tensor, x: tf.Tensor, w: tf.Tensor) -> list[tf.Tensor]:
            predicate = tf.raw_ops.Greater(x=tf.reshape(tf.slice(p, [0, 0], [1, 1]), []), y=0.0)
            return [tf.compat.v1.cond(predicate, lambda: tf.raw_ops.MatMul(a=x, b=w), lambda: tf.raw_ops.Tanh(x=x))]

        return c.call("cond" if control_flow_v2 else "cond_v1", cond, decider, a, b, control_flow_v2=control_flow_v2)

    emit.__name__ = "If" if control_flow_v2 else "CondV1"
    return emit


def _zeta(c: _Context) -> list[_Value]:
    """Hurwitz zeta(x, q) with x >= 1.5 and q >= 0.5: finite and moderate."""
    shape = c.choice(SHAPES)
    exponent = c.op("AddV2", x=c.take(shape, _positive), y=c.const(np.float32(1.0)))[0]
    return c.op("Zeta", x=exponent, q=c.take(shape, _positive))


def _float16_section(c: _Context) -> list[_Value]:
    """An existing float16 section: Cast to half -> MatMul (-> Relu/Tanh) -> Cast back.

    Only float16: its rounding steps stay within the float16 tolerance when the inputs
    move by a float16 rounding (a bfloat16 section's do not)."""
    a = c.op("Cast", x=c.take(), DstT=tf.float16)[0]
    b = c.op("Cast", x=c.take(), DstT=tf.float16)[0]
    product = c.op("MatMul", a=a, b=b)[0]
    activation = c.choice((None, "Relu", "Tanh"))
    if activation == "Relu":
        product = c.op("Relu", features=product)[0]
    elif activation == "Tanh":
        product = c.op("Tanh", x=product)[0]
    return c.op("Cast", x=product, DstT=tf.float32)


def _graph_input(placeholder: bool) -> Callable[[_Context], list[_Value]]:
    def emit(c: _Context) -> list[_Value]:
        shape = c.choice(SHAPES)
        if c.trial:
            return [_Value(None, tf.zeros(shape), True)]
        c.builder.fresh(shape, _any, placeholder=placeholder, device=c.step.device)
        return []

    emit.__name__ = "Placeholder" if placeholder else "Const"
    return emit


CATALOGUE: dict[str, Callable[[_Context], list[_Value]]] = {
    # allow (both targets)
    "MatMul": _matmul,
    "BatchMatMulV2": _batch_matmul,
    "Einsum": _einsum,
    "Conv2D": _conv2d,
    "DepthwiseConv2dNative": _depthwise_conv2d,
    # deny (float16); Sum and Mean are infer for bfloat16
    "Exp": _unary("Exp", _small),
    "Expm1": _unary("Expm1", _small),
    "Pow": _pow,
    "Sum": _reduction("Sum"),
    "Mean": _reduction("Mean"),
    "L2Loss": _l2loss,
    "SoftmaxCrossEntropyWithLogits": _softmax_cross_entropy,
    # infer
    "AddN": _addn,
    "AddV2": _binary("AddV2"),
    "Add": _binary("Add"),
    "Sub": _binary("Sub"),
    "Mul": _binary("Mul"),
    "RealDiv": _binary("RealDiv", _away_from_zero),
    "BiasAdd": _bias_add,
    "Tanh": _unary("Tanh"),
    "Sigmoid": _unary("Sigmoid"),
    "Log": _unary("Log", _positive),
    "Log1p": _unary("Log1p", _above_minus_half),
    "Sqrt": _unary("Sqrt", _positive),
    "Reciprocal": _unary("Reciprocal", _away_from_zero),
    "Softmax": _unary("Softmax", arg="logits"),
    "LogSoftmax": _unary("LogSoftmax", arg="logits"),
    "Elu": _unary("Elu", arg="features"),
    "Selu": _unary("Selu", arg="features"),
    "Softplus": _unary("Softplus", arg="features"),
    "Softsign": _unary("Softsign", arg="features"),
    "Erf": _unary("Erf"),
    "LeakyRelu": _leaky_relu,
    "Prod": _reduction("Prod"),
    "FusedBatchNorm": _fused_batch_norm("FusedBatchNorm"),
    "FusedBatchNormV3": _fused_batch_norm("FusedBatchNormV3"),
    "AvgPool": _pool("AvgPool"),
    # infer for bfloat16 only; unlisted for float16
    "Square": _unary("Square", _small),
    "Rsqrt": _unary("Rsqrt", _positive),
    "SquaredDifference": _binary("SquaredDifference"),
    # clear
    "Relu": _unary("Relu", arg="features"),
    "Relu6": _unary("Relu6", arg="features"),
    "Identity": _unary("Identity", arg="input"),
    "IdentityN": _identity_n,
    "Neg": _unary("Neg"),
    "Abs": _unary("Abs"),
    "StopGradient": _unary("StopGradient", arg="input"),
    "Snapshot": _unary("Snapshot", arg="input"),
    "ZerosLike": _unary("ZerosLike"),
    "CheckNumerics": _check_numerics,
    "Maximum": _binary("Maximum"),
    "Minimum": _binary("Minimum"),
    "ClipByValue": _clip,
    "Max": _reduction("Max"),
    "Min": _reduction("Min"),
    "MaxPool": _pool("MaxPool"),
    "Reshape": _reshape,
    "Transpose": _transpose,
    "ConcatV2": _split_concat,
    "Pack": _unpack_pack,
    "ExpandDims": _squeeze_expand,
    "GatherV2": _gather,
    "Tile": _tile,
    "ReverseV2": _reverse,
    "Select": _select("Select"),
    "SelectV2": _select("SelectV2"),
    # unlisted
    "Sin": _unary("Sin"),
    "Cos": _unary("Cos"),
    "Atan": _unary("Atan"),
    "Cumsum": _cumsum,
    # float and double only (op definition): moved to the allow list, the pass drops it again
    "Zeta": _zeta,
    "Float16Section": _float16_section,
    # control flow: v1 loops and conds, functional StatelessWhile and StatelessIf
    "WhileV1": _while_loop(control_flow_v2=False),
    "While": _while_loop(control_flow_v2=True),
    "CondV1": _cond(control_flow_v2=False),
    "If": _cond(control_flow_v2=True),
    "Placeholder": _graph_input(True),
    "Const": _graph_input(False),
}


def _acceptable(outputs: list[_Value]) -> bool:
    for value in outputs:
        array = value.array
        if not np.all(np.isfinite(array)) or float(np.max(np.abs(array), initial=0.0)) > LIMIT:
            return False
    return True


def _apply(builder: _Builder, step: Step, emit: Callable[[_Context], list[_Value]]) -> None:
    """Try the step's input choices eagerly until the result is well conditioned, then
    build it; the last attempt takes fresh graph inputs."""
    control = None
    if step.control and builder.top_level:
        control = builder.top_level[-1 - (step.control - 1) % len(builder.top_level)]
    for attempt in range(_ATTEMPTS):
        trial = emit(_Context(builder, step, attempt, trial=True, control=None))
        if attempt == _ATTEMPTS - 1 or _acceptable(trial):
            break
    outputs = emit(_Context(builder, step, attempt, trial=False, control=control))
    builder.pool.extend(
        value for value in outputs if value.eager.dtype == tf.float32 and value.shape in SHAPES
    )


def build_graph(plan: GraphPlan, max_nodes: int = 300) -> FuzzGraph:
    """The graph a plan describes; steps past ``max_nodes`` nodes are ignored."""
    builder = _Builder(plan.seed)
    builder.fresh(MAT, _any, placeholder=True)
    builder.fresh(IMG, _any, placeholder=True)
    for step in plan.steps:
        if len(builder.graph.get_operations()) >= max_nodes:
            break
        _apply(builder, step, CATALOGUE[step.op])
    graph_def = builder.graph.as_graph_def()
    consumed = {
        tensor.lstrip("^").split(":")[0] for node in graph_def.node for tensor in node.input
    }
    names = [node.name for node in graph_def.node if node.name in builder.fetchable]
    sinks = [
        name for name in names
        if name not in consumed and builder.graph.get_operation_by_name(name).type not in ("Const", "Placeholder")
    ]
    if not sinks:  # only graph inputs: fetch the last one
        sinks = names[-1:]
    fetches = [sinks[plan.fetch_picks[0] % len(sinks)]]
    fetches += [names[-1 - pick % len(names)] for pick in plan.fetch_picks[1:]]
    fetches = list(dict.fromkeys(fetches))
    outputs = [
        f"{name}:0"
        for name in dict.fromkeys(fetches + sinks)
        if builder.graph.get_operation_by_name(name).outputs
        and builder.graph.get_operation_by_name(name).outputs[0].dtype == tf.float32
    ]
    environ = list_environment(plan.list_edits, plan.level)
    return FuzzGraph(graph_def, tuple(fetches), tuple(outputs), dict(builder.feeds), environ)


# --------------------------------------------------------------------------------------
# Strategies

# Allow ops start every conversion, and loops and conds have the most rules of their own:
# both are drawn three times as often as the rest.
_ALLOW = ("MatMul", "BatchMatMulV2", "Einsum", "Conv2D", "DepthwiseConv2dNative")
_CONTROL_FLOW = ("WhileV1", "While", "CondV1", "If")
_OPS = tuple(CATALOGUE) + (_ALLOW + _CONTROL_FLOW) * 2


def steps(ops: Sequence[str] = _OPS) -> st.SearchStrategy[Step]:
    return st.builds(
        Step,
        op=st.sampled_from(ops),
        picks=st.tuples(*[st.integers(0, 63)] * 4),
        variant=st.integers(0, 255),
        device=st.sampled_from(DEVICES),
        control=st.one_of(st.just(0), st.integers(1, 32)),
    )


# Ops whose list a plan may change: the ops steps emit (helpers such as Split included), and Cast.
_STEP_TO_EDITABLE = {
    "ConcatV2": ("ConcatV2", "Split", "Slice"), "Pack": ("Pack", "Unpack"), "ExpandDims": ("ExpandDims", "Squeeze"),
    "Tile": ("Tile", "Slice"), "Sum": ("Sum", "BroadcastTo"), "Select": ("Select", "Greater", "Less"),
    "SelectV2": ("SelectV2", "GreaterEqual"), "Float16Section": ("Cast",), "Placeholder": (), "Const": (),
    "WhileV1": ("Tanh", "Sigmoid", "Relu6", "Exp"), "While": ("Tanh", "Exp"),
    "CondV1": ("Greater",), "If": ("Greater",),
}
EDITABLE_OPS = tuple(sorted({op for step in CATALOGUE for op in _STEP_TO_EDITABLE.get(step, (step,))}))
_LEVELS = ("",) * 8 + ("TREAT_INFER_AS_DENY", "TENSOR_CORES_ONLY")


def list_edits(ops: Sequence[str] = EDITABLE_OPS) -> st.SearchStrategy[tuple[ListEdit, ...]]:
    """Mostly none; else one to three of ``ops`` moved to another list (most often allow,
    which converts the most) or out of all."""
    edit = st.builds(ListEdit, op=st.sampled_from(ops), to=st.sampled_from(("allow", "", *_LIST_TO_VARIABLE)))
    return st.one_of(st.just(()), st.just(()), st.just(()), st.lists(edit, min_size=1, max_size=3).map(tuple))


@st.composite
def graph_plans(draw: st.DrawFn, min_steps: int = 5, max_steps: int = 120) -> GraphPlan:
    """Plans of ``min_steps``..``max_steps`` steps (about 10..300 nodes); list edits
    move ops the plan uses."""
    # A drawn length: hypothesis' own list lengths stay short on average.
    count = draw(st.integers(min_steps, max_steps))
    plan_steps = tuple(draw(st.lists(steps(), min_size=count, max_size=count)))
    used = sorted({op for step in plan_steps for op in _STEP_TO_EDITABLE.get(step.op, (step.op,))})
    return GraphPlan(
        seed=draw(st.integers(0, 2**16)),
        steps=plan_steps,
        fetch_picks=tuple(draw(st.lists(st.integers(0, 255), min_size=1, max_size=4))),
        list_edits=draw(list_edits(used or EDITABLE_OPS)),
        level=draw(st.sampled_from(_LEVELS)),
    )
