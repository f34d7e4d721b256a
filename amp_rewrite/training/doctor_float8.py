"""The training doctor for FP8: which matmul's amax history no longer fits what it quantizes.

Delayed scaling quantizes a step's operand with a scale set from the amax of the steps before
it (``core.float8.training``). When the operand jumps far above that history's largest amax,
the E4M3 (E5M2 for a gradient) cast clips it at the format's largest value, silently: the
values stay finite, so no step is skipped, but the matmul computes with clipped operands.
When it falls far below it, the scale the history keeps is too small for it and its values
sink into float8's subnormals and zero. Both read straight off the state the wrapper keeps
(``opt.float8_state``): each history entry against the older ones it still holds, no replay.
Non-finite gradients in an FP8 step are ``diagnose_step``'s, which replays FP8 steps too.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from amp_rewrite.core.float8.formats import E4M3, E5M2, Format
from amp_rewrite.errors import AmpRewriteError
from amp_rewrite.training.float8_state import HISTORY, Float8State

# A step's amax "far above" its history: the cast clipped values to less than half of what they were
# (amax * scale above twice the format's largest). A rise within 2x clips a few of the largest values
# by less than that, which delayed scaling accepts by design (the next step's scale takes it in).
SATURATION_FACTOR = 2.0
# An operand whose newest amax, at the scale its history now gives, reaches less than this
# fraction of its format's largest value has lost this many binades of float8's range to a
# stale, larger amax: 2**-10, about the 1000x a spike that has since passed leaves behind.
UNDERFLOW_FRACTION = 2.0**-10


@dataclass(frozen=True)
class Float8Finding:
    """One quantized operand whose amax history does not fit its values."""

    key: str           # its state key in ``opt.float8_state`` (``v<i>_<variable>/<operand>``)
    matmul: str        # the forward matmul node it was last traced for
    operand: str       # ``input``, ``weight``, ``output_grad`` (``input_0``/``input_1`` without a weight)
    kind: str          # "saturated" (above the history: clipped) or "underflow" (far below it)
    amax: float        # the step's amax
    history_max: float  # the largest amax of the history it was (saturated) or is (underflow) scaled by
    steps_ago: int     # how many steps before the last one (0: the last one)
    history_length: int

    @property
    def keep(self) -> tuple[str, ...]:
        """keep= entries that take the matmul out of FP8 (and out of the base precision)."""
        return (re.escape(self.matmul).replace("\\/", "/"),)

    def line(self) -> str:
        """The finding in one line, with the fix to paste."""
        fmt = _format_of(self.operand)
        where = (f"amp_rewrite doctor: FP8 matmul {self.matmul}, operand {self.operand} ({fmt.name}, state"
                 f" {self.key!r})")
        when = "in the last step" if self.steps_ago == 0 else f"{self.steps_ago} step(s) before the last"
        if self.kind == "saturated":
            keep = ", ".join(repr(entry) for entry in self.keep)
            return (f"{where}: its amax {self.amax:.4g} {when} is {self.amax / self.history_max:.4g}x its history's"
                    f" largest ({self.history_max:.4g}), so the cast clipped its scaled values at {fmt.max:g}: the history is"
                    f" stale; keep it out of FP8 — enable_mixed_precision_graph_rewrite(opt, target='float8', ...,"
                    f" keep=[{keep}]), or --keep {' --keep '.join(self.keep)}")
        return (f"{where}: its amax {self.amax:.4g} {when} is {self.history_max / self.amax:.4g}x below its"
                f" history's largest ({self.history_max:.4g}), which sets the scale for the next"
                f" {self.history_length - self.steps_ago - 1} step(s): its values fall into {fmt.name}'s"
                f" subnormals; pass a shorter amax_history_length (now {self.history_length}) to"
                " enable_mixed_precision_graph_rewrite, or keep it out of FP8 (keep=[...])")


def diagnose_float8(optimizer: Any) -> tuple[Float8Finding, ...]:
    """The operands of ``optimizer``'s FP8 training (the wrapper
    ``enable_mixed_precision_graph_rewrite(..., target="float8")`` returned) whose amax history is
    stale, from the state it holds now: a step whose amax rose far above what its scale allowed
    (``SATURATION_FACTOR``; judged against the older entries the history still holds: with a full history the
    dropped ones are not seen), and the newest amax far below the history's largest
    (``UNDERFLOW_FRACTION``). Empty where every history fits; raises ``AmpRewriteError`` in one
    line where there is no FP8 state to read."""
    state = getattr(optimizer, "float8_state", None)
    if not isinstance(state, Float8State):
        raise AmpRewriteError(f"this {type(optimizer).__name__} has no FP8 training state: pass the optimizer that"
                              " enable_mixed_precision_graph_rewrite(opt, target='float8') returned")
    keys = [name[: -len(HISTORY) - 1] for name, _ in state.items() if name.endswith(f"/{HISTORY}")]
    if not keys:
        raise AmpRewriteError("no FP8 training step has been traced with this optimizer yet: its amax histories are"
                              " made by the first step; run some steps, then diagnose")
    findings = []
    for key in keys:
        history = np.asarray(state.lookup(key)[0].numpy(), np.float64)
        finding = _finding(key, state.matmul_of(key) or key.rpartition("/")[0], history)
        if finding is not None:
            findings.append(finding)
    return tuple(findings)


def _finding(key: str, matmul: str, history: np.ndarray) -> Float8Finding | None:
    """What is wrong with one operand's ``history`` (newest first), or None."""
    operand = key.rpartition("/")[2]
    fmt = _format_of(operand)
    recorded = history > 0  # zeros: steps not taken yet (a non-finite amax is not recorded)
    for index in np.flatnonzero(recorded):
        older = history[index + 1:]
        if not np.any(older > 0):
            break  # the first step scales by its own amax
        if history[index] * _scale(float(older.max()), fmt) > SATURATION_FACTOR * fmt.max:
            return Float8Finding(key, matmul, operand, "saturated", float(history[index]), float(older.max()),
                                 int(index), len(history))
    largest = float(history.max())
    if recorded[0] and history[0] * _scale(largest, fmt) < fmt.max * UNDERFLOW_FRACTION:
        return Float8Finding(key, matmul, operand, "underflow", float(history[0]), largest, 0, len(history))
    return None


def _scale(largest: float, fmt: Format) -> float:
    """Delayed scaling's scale for a history whose largest amax is ``largest``."""
    return 2.0 ** math.floor(math.log2(fmt.max / largest))


def _format_of(operand: str) -> Format:
    return E5M2 if operand == "output_grad" else E4M3
