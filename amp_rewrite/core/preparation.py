"""Steps 4-5 of the rewrite (``amp_rewrite.core.rewrite``; spec §2.1 steps 4-5) on one
item: which nodes the pass may paint (spec §1.5) and which ones keep_nodes keeps, and the
batch-norm upgrade that comes before any colouring.

Both read the item's working node graph; the upgrade is the one change made to it before
colouring, as grappler makes it (even when nothing is converted afterwards).
"""
from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping

from tensorflow.core.framework import types_pb2

from amp_rewrite.core.graph_io import WorkingGraph
from amp_rewrite.core.lists import OpLists
from amp_rewrite.core.program import MAIN_GRAPH
from amp_rewrite.core.rules import Reason, keep_rule
from amp_rewrite.core.target import Target

# Grappler feeds every placeholder, and feeds are preserved: inputs keep their dtype.
GRAPH_INPUTS = frozenset({"Placeholder", "PlaceholderV2", "PlaceholderWithDefault"})


def device_type(device: str) -> str | None:
    """``/job:w/replica:0/task:0/device:GPU:0`` → ``GPU``; legacy ``/cpu:0`` → ``CPU``; else None."""
    for part in reversed(device.split("/")):
        if part.startswith("device:"):
            kind = part[len("device:"):].split(":")[0]
            return kind or None
        kind, sep, index = part.partition(":")
        if sep and kind and kind not in ("job", "replica", "task") and (index.isdigit() or index == "*"):
            return kind.upper()
    return None


def find_processed_nodes(
    nodes: WorkingGraph, target: Target, fetches: Iterable[str], lists: OpLists, function: str = MAIN_GRAPH,
    reasons: Mapping[str, str] | None = None,
) -> tuple[dict[str, str], dict[str, str], dict[str, Reason]]:
    """Nodes the pass may paint (→ kernel device type), for the others why not, and of
    those the kept ones (→ their reason).

    Not painted: fetched nodes, placeholders and ``_grappler_do_not_remove`` nodes
    (grappler's preserved set; ``reasons``: why a fetch keeps its dtypes where it is not an
    output), nodes a keep_nodes entry keeps in ``function`` (the item;
    MAIN_GRAPH for the main graph), and nodes placed on another device type. An empty
    device means the target's device. Kept nodes are not grappler's: they also act as deny
    ops (``colouring.propagate_deny_forward``).
    """
    wanted = target.device_type
    preserved = set(fetches)
    keep_entry = lists.keep_entry if lists.keep_nodes else None
    entry_to_reason: dict[str, Reason] = {}
    device_to_kind: dict[str, str | None] = {}  # a graph has few device strings; None: another device type
    processed: dict[str, str] = {}
    skipped: dict[str, str] = {}
    kept: dict[str, Reason] = {}
    for name, node_def in nodes.node_defs.items():
        entry = keep_entry(name, function) if keep_entry is not None else None
        if name in preserved:
            skipped[name] = (reasons or {}).get(name, "fetched: its outputs keep their dtype")
        elif node_def.op in GRAPH_INPUTS:
            skipped[name] = "a graph input (feed): keeps its dtype"
        elif "_grappler_do_not_remove" in node_def.attr and node_def.attr["_grappler_do_not_remove"].b:
            skipped[name] = "marked _grappler_do_not_remove"
        elif entry is not None:
            if entry not in entry_to_reason:
                text = lists.keep_reasons.get(entry) or f"matches keep_nodes entry {entry!r}"
                entry_to_reason[entry] = Reason(keep_rule(text), text, entry)
            kept[name] = entry_to_reason[entry]
            skipped[name] = kept[name].text
        else:
            device = node_def.device
            if device not in device_to_kind:
                kind = device_type(device) if device else wanted
                device_to_kind[device] = kind if kind is not None and wanted.lower() in kind.lower() else None
            kind = device_to_kind[device]
            if kind is not None:
                processed[name] = kind
            else:
                skipped[name] = f"placed on '{device}', not a {wanted} device"
    return processed, skipped, kept


def upgrade_batch_norm_ops(nodes: WorkingGraph, processed: Collection[str]) -> int:
    """FusedBatchNorm(Grad) → V2 with ``U=float32`` so ``T`` can change alone (spec §2.1
    step 5), in the working copy; returns how many nodes changed."""
    upgraded = 0
    for name, node_def in nodes.node_defs.items():
        if node_def.op in ("FusedBatchNorm", "FusedBatchNormGrad") and name in processed:
            node_def.op += "V2"
            node_def.attr["U"].type = types_pb2.DT_FLOAT
            upgraded += 1
    return upgraded
