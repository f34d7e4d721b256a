"""What a rewrite did and why: counts in grappler's words, and one decision per vertex."""
from __future__ import annotations

import collections
from dataclasses import dataclass

from tensorflow.core.framework import types_pb2

TARGET_DTYPES = {"float16": types_pb2.DT_HALF, "bfloat16": types_pb2.DT_BFLOAT16}


def dtype_name(dtype: int) -> str:
    """``DT_HALF`` → ``float16``: the Python names users know."""
    return {
        types_pb2.DT_FLOAT: "float32", types_pb2.DT_HALF: "float16", types_pb2.DT_BFLOAT16: "bfloat16",
    }.get(dtype, types_pb2.DataType.Name(dtype).removeprefix("DT_").lower())


@dataclass(frozen=True)
class Decision:
    """The fate of one float32 (node, type attribute) vertex."""

    node: str
    op: str
    attr: str
    before: str
    after: str
    rule: str    # short key of the list or pass that decided, e.g. "deny-propagation"
    reason: str  # one line for people, naming the neighbour that decided where there is one

    @property
    def converted(self) -> bool:
        return self.after != self.before


@dataclass(frozen=True)
class Report:
    """Counts (grappler's definitions) plus the per-vertex decisions."""

    target: str
    nodes_before: int
    vertices_converted: int
    casts_added: int
    casts_to_target: int  # excluding casts of Const and variable outputs, as grappler counts
    decisions: tuple[Decision, ...]

    def summary(self) -> str:
        """Grappler's log line, word for word."""
        return (
            f"Converted {self.vertices_converted}/{self.nodes_before} nodes to {self.target} precision"
            f" using {self.casts_to_target} cast(s) to {self.target} (excluding Const and Variable casts)"
        )

    def kept_float32(self) -> dict[str, int]:
        """How many vertices stayed float32, by rule, most common first."""
        counts = collections.Counter(d.rule for d in self.decisions if not d.converted)
        return dict(counts.most_common())

    def decision(self, node: str, attr: str = "T") -> Decision:
        for d in self.decisions:
            if d.node == node and d.attr == attr:
                return d
        raise KeyError(f"no float32 vertex '{node}:{attr}' in the report")
