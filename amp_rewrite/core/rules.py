"""The rules that decide a vertex's dtype, each with its one-line meaning, and a vertex's reason.

A rule's value is the short key users see in reports, ``amp-rewrite explain`` and the
dump (``deny-propagation``); its ``meaning`` is the sentence the report shows for it. The
colouring passes, the orchestrator and the dump all read them from here.
"""
from __future__ import annotations

import enum
from typing import NamedTuple


class Rule(enum.Enum):
    """A list or pass that decides whether a vertex becomes the target; ``.value`` is its key."""

    meaning: str

    def __new__(cls, value: str, meaning: str) -> Rule:
        rule = object.__new__(cls)
        rule._value_ = value
        rule.meaning = meaning
        return rule

    # Converted (spec §2.3 passes 1, 4, 5, 6, 10) ...
    ALLOW_LIST = "allow-list", "op is on the allow list"
    FORCE_ALL = "force-all", "every op forced by TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL=UNSAFE_FORCE_ALL"
    BETWEEN_ALLOW = "between-allow", "infer or clear op on a path between allow ops"
    INFER_AFTER_ALLOW = "infer-after-allow", "infer op fed directly by an allow op"
    CLEAR_PROPAGATION = "clear-propagation", "clear op connected to an allow op through clear ops"
    EXISTING_CAST = "existing-cast", "a Cast already in the graph whose consumers are all converted"
    # ... and, target float8 only, what the float8 step did to a converted matmul (core/float8/inference.py) ...
    FLOAT8_MATMUL = "float8-matmul", "matmul whose operands are quantized to float8_e4m3fn with per-tensor scales"
    FLOAT8_NO_AMAX = (
        "float8-no-amax", "allowed matmul kept float16: no calibration amax for an activation operand"
    )
    FLOAT8_LOSSY = "float8-lossy", "allowed matmul kept float16: calibration measured too large an FP8 error at it"
    FLOAT8_CONST_OPERAND = (
        "float8-const-operand", "allowed matmul kept float16: a Const operand is folded to float16 before XLA, so no FP8 GEMM"
    )
    # ... and, FP8 training (core/float8/training.py), a converted matmul of a training step ...
    FLOAT8_TRAINING = (
        "float8-training", "matmul on float8 operands with delayed scaling: E4M3 inputs, an E5M2 incoming gradient"
    )
    # ... either way (spec §2.3 passes 0, 3, 8, 9; cross_function) ...
    CROSS_FUNCTION = "cross-function", "shares its type with the other side of a function or loop boundary"
    TENSOR_LIST = "tensor-list", "a TensorList and its users share one element type"
    RECURRENT_EDGE = "recurrent-edge", "a loop's NextIteration follows the Merge it feeds"
    FROZEN = "frozen", "a running Session already runs the node so: ops added later are painted around it"
    # ... or kept float32 (spec §2.3 passes 2 and 7; the rest explain what no pass touched).
    DENY_LIST = "deny-list", "op is on the deny list (numerically unsafe in low precision)"
    DENY_PROPAGATION = "deny-propagation", "clear or infer op downstream of a deny op or a kept node"
    KEEP_NODES = (
        "keep-nodes", "kept float32 by a keep_nodes entry, a user's choice or calibration's measurement; acts as a deny op"
    )
    MEASURED_SLOWER = (
        "measured-slower", "kept float32 by --tune speed: timed on this machine, the target with its casts is slower;"
                           " acts as a deny op"
    )
    UNCONVERTIBLE = "unconvertible", "the type attribute cannot take the target type"
    INFER_ISOLATED = "infer-isolated", "infer op neither between allow ops nor directly after one"
    CLEAR_ISOLATED = "clear-isolated", "clear op not connected to an allow op through clear ops"
    UNLISTED = "unlisted", "op is in no list, so it is never converted"
    SLOWER_CONVERTED = (
        "slower-converted", "op taken off grappler's lists: its low-precision kernel is slower than float32's"
    )
    NOT_PROCESSED = (
        "not-processed", "the pass may not touch the node: fetched, a graph input, do-not-remove, or another device"
    )
    NO_KERNEL = "no-kernel", "TensorFlow has no low-precision kernel for the op on that device"
    LOOP_VALUE = "loop-value", "loop value of a functional While whose body and cond keep float32"
    NO_ALLOW_OPS = "no-allow-ops", "the item has no allow op, so nothing in it is converted"


# A keep_nodes reason that starts so was written by the timing step (amp_rewrite/tuning): its
# rule is MEASURED_SLOWER, in the rewrite that timed it and in any rewrite of its overlay.
MEASURED_PREFIX = "measured: "


def keep_rule(reason: str) -> Rule:
    """The rule of a node a keep_nodes entry with ``reason`` keeps."""
    return Rule.MEASURED_SLOWER if reason.startswith(MEASURED_PREFIX) else Rule.KEEP_NODES


class Reason(NamedTuple):
    """Why a vertex got its colour: the rule, one line for people naming what decided, and
    the node that decided it where there is one (the deny op, the allow op, the feeder)."""

    rule: Rule
    text: str
    source: str = ""
