"""Helpers for the float8 target's tests and GPU check, until calibration is in the package.

``tensor_amax`` runs a float32 GraphDef and takes each float32 tensor's largest finite |x|,
keyed ``(function, node, port)`` as calibration will hand them over (main graph only).
``xla_function`` turns a GraphDef into one ``tf.function(jit_compile=True)``: a plain
GraphDef's main graph is no function, so this is how its float8 matmuls reach XLA.
``hlo_instructions`` and ``scaled_float8_type`` read HLO text as XLA prints it (its dumps,
``experimental_get_compiler_ir``): which float8 type a dot's operand is dequantized from.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf
from tensorflow.core.framework.graph_pb2 import GraphDef

NO_VARIABLES: Mapping[str, np.ndarray] = MappingProxyType({})


def tensor_amax(graph_def: GraphDef, batches: Sequence[Mapping[str, np.ndarray]],
                variables: Mapping[str, np.ndarray] = NO_VARIABLES) -> dict[tuple[str, str, int], float]:
    """Largest finite |x| of every float32 tensor of ``graph_def``'s main graph over ``batches``
    (``{"x:0": array}`` feeds); ``variables`` binds resource placeholders as ``run_graph`` does."""
    graph = tf.Graph()
    with graph.as_default():
        handles = {tensor: tf.Variable(value).handle for tensor, value in variables.items()}
        tf.graph_util.import_graph_def(graph_def, input_map=handles, name="m")
        init = tf.compat.v1.global_variables_initializer()
    tensors = {("", op.name[2:], port): out for op in graph.get_operations() if op.name.startswith("m/")
               for port, out in enumerate(op.outputs) if out.dtype == tf.float32}
    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    amax: dict[tuple[str, str, int], float] = {}
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run(init)
        for batch in batches:
            values = session.run(tensors, {graph.get_tensor_by_name(f"m/{k}"): v for k, v in batch.items()})
            for key, value in values.items():
                finite = np.abs(value[np.isfinite(value)])
                amax[key] = max(amax.get(key, 0.0), float(finite.max()) if finite.size else 0.0)
    return amax


def xla_function(graph_def: GraphDef, inputs: Sequence[str], fetches: Sequence[str],
                 variables: Mapping[str, np.ndarray] = NO_VARIABLES) -> Callable[..., Any]:
    """``graph_def`` as a ``tf.function(jit_compile=True)`` taking ``inputs`` (placeholder
    tensors, in order) and returning the port-0 outputs of the ``fetches`` nodes; each
    resource placeholder in ``variables`` is bound to a fresh variable with that value."""
    bound = {tensor: tf.Variable(value) for tensor, value in variables.items()}

    def imported() -> Any:
        graph = tf.compat.v1.get_default_graph()
        return tf.graph_util.import_graph_def(
            graph_def, input_map={t: graph.capture(v.handle) for t, v in bound.items()},
            return_elements=[f"{f}:0" for f in fetches], name="")

    pruned = tf.compat.v1.wrap_function(imported, []).prune(list(inputs), [f"{f}:0" for f in fetches])
    function = tf.function(lambda *xs: pruned(*xs), jit_compile=True)
    function.keep_alive = bound  # the variables live as long as the function
    return function


class HloInstruction(NamedTuple):
    type: str                   # its shape, e.g. "bf16[8,32]{1,0}"
    opcode: str
    operands: tuple[str, ...]   # the instructions it reads, by name
    op_name: str                # the TensorFlow op it came from (metadata), "" if none


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(\S+)\s+([\w\-]+)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# What may sit between the dequantizing multiply and the dot: MatchFp8Param's list (no
# collectives), and reverse, which a convolution's input gradient applies to the filter.
MATCH_FP8_COMMUTING = frozenset({"bitcast", "broadcast", "copy", "dynamic-slice", "pad", "reshape", "reverse",
                                 "select", "slice", "transpose"})


def hlo_instructions(hlo: str) -> dict[str, HloInstruction]:
    """Every instruction of ``hlo`` (all computations), by name."""
    found = {}
    for line in hlo.splitlines():
        match = _INSTRUCTION.match(line)
        if match:
            name, shape, opcode, rest = match.groups()
            depth, end = 1, 0
            for end, char in enumerate(rest):
                depth += {"(": 1, ")": -1}.get(char, 0)
                if depth == 0:
                    break
            op_name = _OP_NAME.search(rest[end:])
            found[name] = HloInstruction(shape, opcode, tuple(re.findall(r"%([\w.\-]+)", rest[:end])),
                                         op_name.group(1) if op_name else "")
    return found


def scaled_float8_type(instructions: Mapping[str, HloInstruction], name: str) -> str | None:
    """The float8 type (``"f8e4m3fn"``, ``"f8e5m2"``) if ``name`` is, up to ops ``MatchFp8Param``
    lets through, ``multiply(convert(float8 x), broadcast(scalar))``: the form XLA's GEMM
    rewriter fuses into an FP8 GEMM. None otherwise."""
    instruction = instructions[name]
    while instruction.opcode in MATCH_FP8_COMMUTING:
        instruction = instructions[instruction.operands[0]]
    if instruction.opcode != "multiply":
        return None
    a, b = (instructions[operand] for operand in instruction.operands)
    for convert, broadcast in ((a, b), (b, a)):
        source = instructions[convert.operands[0]].type if convert.opcode == "convert" else ""
        if source.startswith("f8") and broadcast.opcode == "broadcast" \
                and instructions[broadcast.operands[0]].type.split("{")[0].endswith("[]"):
            return source.split("[")[0]
    return None
