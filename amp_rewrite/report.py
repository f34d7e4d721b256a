"""What a rewrite did and why: counts in grappler's words, and one decision per vertex."""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import NamedTuple

from tensorflow.core.framework import types_pb2

TARGET_DTYPES = {"float16": types_pb2.DT_HALF, "bfloat16": types_pb2.DT_BFLOAT16}
MAIN_GRAPH = ""  # the ``function`` of decisions and items that belong to the main graph


_FLOAT_NAMES = {types_pb2.DT_FLOAT: "float32", types_pb2.DT_HALF: "float16", types_pb2.DT_BFLOAT16: "bfloat16"}


def dtype_name(dtype: int) -> str:
    """``DT_HALF`` → ``float16``: the Python names users know."""
    name = _FLOAT_NAMES.get(dtype)
    return name if name is not None else types_pb2.DataType.Name(dtype).removeprefix("DT_").lower()


class Decision(NamedTuple):
    """The fate of one float32 (node, type attribute) vertex (a tuple: thousands per graph)."""

    function: str  # MAIN_GRAPH or the library function the node lives in
    node: str
    op: str
    attr: str
    before: str
    after: str
    rule: str    # short key of the list or pass that decided, e.g. "deny-propagation"
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


@dataclass(frozen=True)
class Report:
    """Counts per item (grappler's definitions) plus the per-vertex decisions."""

    target: str
    items: tuple[ItemStats, ...]
    decisions: tuple[Decision, ...]

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

    def summary(self, function: str | None = None) -> str:
        """Grappler's log line, word for word, for one item or (None) all of them."""
        converted, nodes = self._total("vertices_converted", function), self._total("nodes_before", function)
        casts = self._total("casts_to_target", function)
        return (
            f"Converted {converted}/{nodes} nodes to {self.target} precision"
            f" using {casts} cast(s) to {self.target} (excluding Const and Variable casts)"
        )

    def kept_float32(self) -> dict[str, int]:
        """How many vertices stayed float32, by rule, most common first."""
        counts = collections.Counter(d.rule for d in self.decisions if not d.converted)
        return dict(counts.most_common())

    def decision(self, node: str, attr: str = "T", function: str = MAIN_GRAPH) -> Decision:
        for d in self.decisions:
            if d.node == node and d.attr == attr and d.function == function:
                return d
        raise KeyError(f"no float32 vertex '{node}:{attr}' in {function or 'the main graph'}")
