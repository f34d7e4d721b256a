"""How the float8 steps read and add an item's nodes: where a tensor's values come from
(``origin``), and ``NodeWriter``, which adds the quantize/dequantize and scale nodes."""
from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import numpy as np
from tensorflow.core.framework import graph_pb2, node_def_pb2, types_pb2

from amp_rewrite.core.casts import is_amp_cast
from amp_rewrite.core.graph_io import make_node_def, parse_tensor_name

# Ops whose output holds exactly their first input's values: a weight seen through them is still a weight.
_SAME_VALUES = frozenset({"Identity", "Reshape", "Transpose", "ExpandDims", "Squeeze"})


def origin(nodes: Mapping[str, node_def_pb2.NodeDef], name: str) -> node_def_pb2.NodeDef:
    """The node whose values ``name`` passes on, through ops that only move values and the rewrite's casts."""
    found = nodes[name]
    while found.op in _SAME_VALUES or is_amp_cast(found):
        found = nodes[parse_tensor_name(found.input[0]).node]
    return found


class NodeWriter:
    """Adds nodes to one item of the rewrite's output (its GraphDef and a name -> node map of it):
    what the float8 steps build their quantize/dequantize and scale nodes with."""

    def __init__(self, graph_def: graph_pb2.GraphDef, nodes: dict[str, node_def_pb2.NodeDef]) -> None:
        self.graph_def, self.nodes = graph_def, nodes

    def add(self, name: str, op: str, inputs: list[str], device: str, attrs: Mapping[str, object]) -> str:
        """A node ``name``, its attrs typed by the op's definition (``graph_io.make_node_def``)."""
        self.nodes[name] = make_node_def(op, name, inputs, device=device, into=self.graph_def.node, **attrs)
        return name

    def under(self, base: str, device: str) -> Callable[..., str]:
        """``add`` for the steps of one chain, each named ``base/<step>``:
        ``under(base, device)(step, op, inputs, **attrs)``."""
        return lambda step, op, inputs, **attrs: self.add(f"{base}/{step}", op, inputs, device, attrs)

    def const(self, name: str, value: float | list[int] | np.ndarray, dtype: int, device: str) -> str:
        numpy_dtype = {types_pb2.DT_HALF: np.float16, types_pb2.DT_FLOAT: np.float32,
                       types_pb2.DT_INT32: np.int32}[dtype]
        return self.add(name, "Const", [], device, {"dtype": dtype, "value": np.asarray(value, numpy_dtype)})

    def amax(self, base: str, tensor: str, dtype: int, device: str) -> str:
        """``Max(Abs(tensor))`` over all its elements, as a float32 scalar (``dtype``: the tensor's)."""
        f32 = types_pb2.DT_FLOAT
        add = self.under(base, device)
        magnitude = add("abs", "Abs", [tensor], T=dtype)
        flat = add("flat", "Reshape", [magnitude, self.const(f"{base}/flat_shape", [-1], types_pb2.DT_INT32, device)],
                   T=dtype, Tshape=types_pb2.DT_INT32)
        amax = add("amax", "Max", [flat, self.const(f"{base}/axis", 0, types_pb2.DT_INT32, device)],
                   T=dtype, Tidx=types_pb2.DT_INT32, keep_dims=False)
        if dtype != f32:
            amax = add("amax_float32", "Cast", [amax], SrcT=dtype, DstT=f32, Truncate=False)
        return amax

    def exponent(self, base: str, amax: str, format_max: float, exponents: tuple[int, int], device: str) -> str:
        """``floor(log2(format_max / amax))`` clipped to ``exponents``, in float32 (``amax``: a float32
        scalar): the exponent of ``inference.power_of_two_scale``, in the graph (the top of the range for 0)."""
        f32 = types_pb2.DT_FLOAT
        add = self.under(base, device)
        low, high = exponents
        ratio = add("ratio", "RealDiv", [self.const(f"{base}/float8_max", format_max, f32, device), amax], T=f32)
        log2 = add("log2", "Mul", [add("log", "Log", [ratio], T=f32),
                                   self.const(f"{base}/inverse_ln2", 1.0 / math.log(2.0), f32, device)], T=f32)
        return add("exponent", "ClipByValue", [add("floor", "Floor", [log2], T=f32),
                                               self.const(f"{base}/exponent_min", low, f32, device),
                                               self.const(f"{base}/exponent_max", high, f32, device)], T=f32)
