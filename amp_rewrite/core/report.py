"""What a rewrite did and why: counts in grappler's words, and one decision per vertex."""
from __future__ import annotations

import collections
import functools
from collections.abc import Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from tensorflow.core.framework import types_pb2

from amp_rewrite.core.program import MAIN_GRAPH
from amp_rewrite.core.target import FLOAT32_NAME, FLOAT_DTYPES, lookup_target

if TYPE_CHECKING:
    from amp_rewrite.core.rules import Reason
    from amp_rewrite.core.typegraph import Vertex


def dtype_name(dtype: int) -> str:
    """``DT_HALF`` → ``float16``: the Python names users know (``FLOAT_DTYPES``, else TensorFlow's)."""
    found = FLOAT_DTYPES.get(dtype)
    return found.name if found is not None else types_pb2.DataType.Name(dtype).removeprefix("DT_").lower()


class Decision(NamedTuple):
    """The fate of one float32 (node, type attribute) vertex (a tuple: thousands per graph)."""

    function: str  # MAIN_GRAPH or the library function the node lives in
    node: str
    op: str
    attr: str
    before: str
    after: str
    rule: str    # the value of the Rule that decided, e.g. "deny-propagation" (rules.Rule has its meaning)
    reason: str  # one line for people, naming the neighbour that decided where there is one
    source: str = ""  # that neighbour's node name (the deny op, the allow op, ...), if any

    @property
    def converted(self) -> bool:
        return self.after != self.before


@dataclass(frozen=True)
class ItemStats:
    """Grappler's counters for one item: the main graph or one function body."""

    function: str
    nodes_before: int
    vertices_converted: int
    casts_added: int
    casts_to_target: int  # excluding casts of Const and variable outputs, as grappler counts
    float8_matmuls: int = 0  # matmuls whose operands became float8 (target float8, or FP8 training)


@dataclass(frozen=True)
class PendingDecisions:
    """What one item's decisions are made from, kept until they are first asked for: a
    large graph has thousands of float32 vertices, and most callers want only the graph."""

    function: str
    target: str                          # the target's dtype name, e.g. "float16"
    vertices: Iterable[Vertex]           # the float32 vertices, in graph order
    ops: Mapping[str, str]               # node -> op
    converted: Collection[Vertex]        # the vertices that became the target
    reasons: Mapping[Vertex, Reason]     # a reason for every float32 vertex with a type attr
    # (node, attr) -> the reason replacing the colouring's, e.g. a float8 matmul's scales
    overrides: Mapping[tuple[str, str], Reason] = field(default_factory=dict)

    def decisions(self) -> Iterator[Decision]:
        attr_names: dict[object, str] = {}
        for vertex in self.vertices:
            node, attr = vertex
            if not attr.name:  # a fixed float32 port: no attr to report
                continue
            attr_name = attr_names.get(attr)
            if attr_name is None:
                attr_name = attr_names[attr] = str(attr)
            override = self.overrides.get((node, attr_name)) if self.overrides else None
            rule, text, source = self.reasons[vertex] if override is None else override
            rule = rule.value
            after = self.target if vertex in self.converted else "float32"
            # tuple.__new__ skips Decision's Python-level constructor: thousands per graph.
            yield _new_tuple(Decision, (self.function, node, self.ops[node], attr_name, "float32", after, rule, text,
                                        source))


_new_tuple = tuple.__new__


@dataclass(frozen=True, eq=False)
class Report:
    """Counts per item (grappler's definitions) plus the per-vertex decisions.

    The decisions are made from ``pending`` when first read; reports compare by target,
    counts and decisions.
    """

    target: str
    items: tuple[ItemStats, ...]
    pending: tuple[PendingDecisions, ...] = field(default=(), repr=False)

    @functools.cached_property
    def decisions(self) -> tuple[Decision, ...]:
        """One per float32 vertex, item by item in graph order; made on first use."""
        return tuple(decision for item in self.pending for decision in item.decisions())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Report):
            return NotImplemented
        return (self.target, self.items, self.decisions) == (other.target, other.items, other.decisions)

    __hash__ = None  # type: ignore[assignment]  # decisions are compared, not hashed

    def _total(self, field: str, function: str | None) -> int:
        return sum(getattr(i, field) for i in self.items if function is None or i.function == function)

    @property
    def nodes_before(self) -> int:
        return self._total("nodes_before", None)

    @property
    def vertices_converted(self) -> int:
        return self._total("vertices_converted", None)

    @property
    def casts_added(self) -> int:
        return self._total("casts_added", None)

    @property
    def casts_to_target(self) -> int:
        return self._total("casts_to_target", None)

    @property
    def float8_matmuls(self) -> int:
        return self._total("float8_matmuls", None)

    @property
    def painted(self) -> str:
        """The dtype converted vertices got: the target's, or float16 for float8 (its colouring)."""
        if self.target == FLOAT32_NAME:  # back to float32 (core/canonical.py): nothing painted
            return self.target
        return lookup_target(self.target, quantized=True).colouring

    def summary(self, function: str | None = None) -> str:
        """Grappler's log line, word for word, for one item or (None) all of them."""
        converted, nodes = self._total("vertices_converted", function), self._total("nodes_before", function)
        casts = self._total("casts_to_target", function)
        painted = self.painted
        line = (
            f"Converted {converted}/{nodes} nodes to {painted} precision"
            f" using {casts} cast(s) to {painted} (excluding Const and Variable casts)"
        )
        if painted != self.target:
            line += f"; {self._total('float8_matmuls', function)} matmul(s) on float8_e4m3fn operands"
        elif self._total("float8_matmuls", function):  # FP8 training (core/float8/training.py)
            line += (f"; {self._total('float8_matmuls', function)} matmul(s) on float8 operands"
                     " (E4M3, gradients E5M2)")
        return line

    def kept_float32(self) -> dict[str, int]:
        """How many vertices stayed float32, by rule, most common first."""
        counts = collections.Counter(d.rule for d in self.decisions if not d.converted)
        return dict(counts.most_common())

    def decision(self, node: str, attr: str = "T", function: str = MAIN_GRAPH) -> Decision:
        for d in self.decisions:
            if d.node == node and d.attr == attr and d.function == function:
                return d
        raise KeyError(f"no float32 vertex '{node}:{attr}' in {function or 'the main graph'}")
