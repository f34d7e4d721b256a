"""Reading a graph's tensors in the order they are computed: the part calibration and the
training doctor share.

Both run a graph with its intermediate tensors read — calibration folds them into statistics
over many inputs (``calibration.statistics``), the doctor fetches one step's values
(``training.doctor``, ``training.doctor_session``) — and both then walk the nodes in
execution order to the first one that goes wrong: over the tolerance (``calibration.diverge``)
or not finite (the doctor). What the walk needs is here, once: the order, the nodes a run of
some outputs executes, and a tensor's statistics (largest finite magnitude, non-finite count).
"""
from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import networkx as nx
import numpy as np
from tensorflow.core.framework import graph_pb2

from amp_rewrite.core import functions
from amp_rewrite.core.graph_io import parse_tensor_name
from amp_rewrite.core.program import MAIN_GRAPH, Program

Node = tuple[str, str]  # (function, node); MAIN_GRAPH "" for the main graph


@dataclass(frozen=True)
class TensorStats:
    """What the inputs put through one tensor, over every run and loop iteration."""

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


def tensor_stats(value: np.ndarray, small_below: float = 0.0) -> TensorStats:
    """``value``'s statistics (a constant's in calibration, a fetched tensor's in the doctor)."""
    a = np.abs(np.asarray(value, dtype=np.float64)).ravel()
    finite = a[np.isfinite(a)]
    nonzero = finite[finite > 0]
    small = nonzero[nonzero < small_below]
    return TensorStats(float(finite.max(initial=0.0)), int(a.size - finite.size), int(nonzero.size), int(small.size),
                       float(finite.sum()), float(small.sum()), float(np.square(finite).sum()), int(a.size))


def is_float(value: np.ndarray) -> bool:
    """A float value: NumPy's kinds, and bfloat16 and the float8 types (ml_dtypes' kind "V")."""
    return value.dtype.kind == "f" or value.dtype.name.startswith(("bfloat16", "float8"))


def is_nonfinite(value: np.ndarray) -> bool:
    """A float value holding Inf or NaN."""
    return is_float(value) and tensor_stats(value).nonfinite > 0


def largest_finite(values: Iterable[np.ndarray | None]) -> float:
    """The largest finite |x| among the float ``values`` (None: not fetched), 0 for none."""
    return max((tensor_stats(v).max_abs for v in values if v is not None and is_float(v)), default=0.0)


def first_nonfinite(order: Sequence[str], values: Mapping[str, np.ndarray]) -> str | None:
    """The first node of ``order`` with an output in ``values`` (by tensor name) that is not finite."""
    bad = {parse_tensor_name(name).node for name, value in values.items() if is_nonfinite(value)}
    return next((name for name in order if name in bad), None)


def topological_order(body: graph_pb2.GraphDef) -> list[str]:
    """``body``'s node names in an order TensorFlow may run them (every node after its data and
    control inputs), GraphDef order among equals; a cyclic body (a TF1 loop) in GraphDef order."""
    position = {node_def.name: index for index, node_def in enumerate(body.node)}
    graph = nx.DiGraph()
    graph.add_nodes_from(position)
    graph.add_edges_from((parse_tensor_name(tensor).node, node_def.name) for node_def in body.node
                         for tensor in node_def.input if parse_tensor_name(tensor).node in position)
    try:
        return list(nx.lexicographical_topological_sort(graph, key=position.__getitem__))
    except nx.NetworkXUnfeasible:  # a cycle: a TF1 while loop
        return list(position)


def execution_order(program: Program) -> list[Node]:
    """Every node of the main graph and of the functions it calls, in an order that runs
    them: each item's nodes in topological order (GraphDef order among equals; a cyclic
    item, a TF1 loop, in GraphDef order), a called function's body (once) before its call."""
    order: list[Node] = []
    seen: set[str] = set()

    def visit(item: str) -> None:
        seen.add(item)
        body = program.item(item)
        nodes = {node_def.name: node_def for node_def in body.node}
        for name in topological_order(body):
            for called in functions.called_functions(nodes[name]):
                if called in program.library and called not in seen:
                    visit(called)
            order.append((item, name))

    visit(MAIN_GRAPH)
    return order


def ancestors(graph_def: graph_pb2.GraphDef, outputs: Iterable[str], *, fed: Iterable[str] = ()) -> set[str]:
    """The main-graph nodes a run of ``outputs`` executes, control inputs included: the
    ``fed`` nodes themselves but not what only they depend on."""
    inputs = {n.name: [parse_tensor_name(t).node for t in n.input] for n in graph_def.node}
    stop = set(fed)
    seen: set[str] = set()
    stack = [parse_tensor_name(t).node for t in outputs]
    while stack:
        name = stack.pop()
        if name in seen or name not in inputs:
            continue
        seen.add(name)
        if name not in stop:
            stack.extend(inputs[name])
    return seen
