"""Calibration: precision decisions from data, so a model that overflows or loses precision
under the op lists alone comes out finite and within tolerance.

1. **Statistics**: the float32 model runs once over the calibration inputs with every
   float tensor instrumented, function bodies included (``statistics.collect``): its
   largest magnitude and the share of its non-zero values below the target's smallest
   normal number.
2. **Range rules**: a node the rewrite would convert whose input or output tensors exceed
   the safe magnitude, or carry most of their magnitude in values below the smallest
   normal, is kept float32. Kept
   nodes act as deny ops (``keep_nodes``), so this repeats until no converted node
   touches such a tensor; it needs no further run.
3. **Repair by validation**: the rewrite runs on the calibration inputs, instrumented
   the same way. While an output is over the target's tolerance, the converted nodes
   whose own output drifts most from float32's (its magnitude, RMS or finiteness, beyond
   what its inputs already carried) are kept float32, and it runs again, up to
   ``max_rounds`` runs.

The decisions are ``keep_nodes`` entries with the measurement that made each
(``Calibration.overlay``): an overlay YAML that reproduces the rewrite without data.
"""
from __future__ import annotations

import collections
import math
import os
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml
from tensorflow.core.framework import graph_pb2

from amp_rewrite.calibration import statistics, validate
from amp_rewrite.core import functions
from amp_rewrite.calibration.savedmodel import Model, graph_sinks, read_model, rewrite_model
from amp_rewrite.calibration.statistics import TensorKey, TensorStats
from amp_rewrite.core import float8
from amp_rewrite.core.errors import AmpRewriteError
from amp_rewrite.core.graph_io import parse_tensor_name
from amp_rewrite.core.lists import OpLists, load_lists
from amp_rewrite.core.program import MAIN_GRAPH, program_of
from amp_rewrite.core.rewrite import RewriteResult
from amp_rewrite.core.rules import Rule
from amp_rewrite.core.target import FLOAT16, Target, lookup_target

# float16's largest finite value is 65504; a tensor calibrated above a quarter of it is
# kept float32: held-out inputs may run larger than the calibration ones.
FLOAT16_SAFE_MAGNITUDE = 16384.0
# A tensor whose magnitude (sum of |x|) is mostly carried by values below the target's
# smallest normal loses its precision. By mass, not by count: a sharp softmax has half its
# values below 6.1e-5 (BERT with query kernels x4), but they carry under 0.1% of its mass
# and keeping it float32 changes nothing (tools/calibration_models_report.py).
SMALL_SHARE = 0.5
DEFAULT_MAX_ROUNDS = 5
RANDOM_FEEDS = 2  # random calibration batches when no data is given
MAX_ROUNDS_LIMIT = 10
# Repair keeps, per round, each converted node whose drift is at least this share of the worst one's.
_BLAME_SHARE = 0.5


@dataclass(frozen=True)
class Thresholds:
    """When a tensor is out of the target's range."""

    max_magnitude: float  # safe largest |x|; math.inf: none
    smallest_normal: float
    max_small_share: float = SMALL_SHARE  # of the magnitude: see SMALL_SHARE

    @classmethod
    def for_target(cls, target: Target, max_magnitude: float | None = None,
                   max_small_share: float | None = None) -> Thresholds:
        """float16 (and float8, which colours as float16): 16384 and 6.1e-5. bfloat16 has
        float32's exponent range: no range rule fires for it, and its 8-bit mantissa is left
        to repair by validation."""
        if lookup_target(target.colouring) is FLOAT16:
            default, smallest = FLOAT16_SAFE_MAGNITUDE, float(np.finfo(np.float16).tiny)
        else:
            default, smallest = math.inf, 0.0
        return cls(default if max_magnitude is None else max_magnitude, smallest,
                   SMALL_SHARE if max_small_share is None else max_small_share)

    def violation(self, stats: TensorStats) -> str:
        """Why the tensor is out of range, or ""."""
        if stats.max_abs > self.max_magnitude:
            return f"reached {stats.max_abs:.3g}, over the safe magnitude {self.max_magnitude:.3g}"
        if self.smallest_normal and stats.small_mass > self.max_small_share:
            return (f"has {stats.small_mass:.0%} of its magnitude in values below the smallest normal"
                    f" {self.smallest_normal:.3g} ({stats.small_share:.0%} of its non-zero values)")
        return ""


@dataclass(frozen=True)
class OutputCheck:
    signature: str
    output: str
    error: float  # max |low - float32| / max |float32| over the calibration inputs

    def ok(self, target: Target) -> bool:
        return math.isfinite(self.error) and self.error <= target.tolerance


@dataclass(frozen=True)
class Round:
    """One validation run of the repair: each output's error, and the nodes kept after it."""

    checks: tuple[OutputCheck, ...]
    kept: Mapping[tuple[str, str], str]


@dataclass(frozen=True)
class Calibration:
    """What calibration measured and decided."""

    target: str
    stats: Mapping[TensorKey, TensorStats]  # the float32 model's tensors
    keep: Mapping[str, str]                 # keep_nodes entry → the measurement that decided it
    kept: Mapping[tuple[str, str], str]     # the nodes those entries name, (function, node) → the same
    range_kept: int                         # how many of ``kept`` the range rules decided
    rounds: tuple[Round, ...]
    lists: OpLists                          # the lists the rewrite used, with ``keep``
    result: RewriteResult                   # the calibrated rewrite
    thresholds: Thresholds
    source: str = ""                        # what the statistics came from, for the overlay's header
    float8: float8.Float8Calibration | None = None  # target float8: the amax and lossy matmuls it used
    # the float32 model's outputs on the calibration inputs, signature → one dict per feed
    outputs: Mapping[str, Sequence[Mapping[str, np.ndarray]]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def validation_runs(self) -> int:
        return len(self.rounds)

    @property
    def ok(self) -> bool:
        target = lookup_target(self.target, quantized=True)
        return bool(self.rounds) and all(c.ok(target) for c in self.rounds[-1].checks)

    def overlay(self, base: Mapping | None = None) -> str:
        """An overlay YAML reproducing the calibrated rewrite: ``base`` (the overlay the
        run was given, as loaded) with ``keep`` added to its keep_nodes."""
        data = dict(base or {})
        keep = data.get("keep_nodes") or {}
        keep = dict.fromkeys(keep, "") if isinstance(keep, list) else dict(keep)
        keep.update(self.keep)
        data["keep_nodes"] = keep
        if self.float8 is not None:
            data["amax"] = {float8.key_text(key): value for key, value in sorted(self.float8.amax.items())}
            data["lossy"] = {float8.key_text(key): why for key, why in sorted(self.float8.lossy.items())}
        source = self.source or "calibration data"
        header = (f"# Written by amp-rewrite calibrate for target {self.target}, from {source}.\n"
                  f"# Range rules: safe magnitude {self.thresholds.max_magnitude:.6g}, at most"
                  f" {self.thresholds.max_small_share:.0%} of a tensor's magnitude in values below"
                  f" {self.thresholds.smallest_normal:.3g};"
                  f" {self.range_kept} node(s) kept by them, {len(self.kept) - self.range_kept} by repair"
                  f" ({self.validation_runs} validation run(s)).\n"
                  + (f"# float8: amax of {len(self.float8.amax)} matmul operand(s) (largest |x| in float32);"
                     f" {self.result.report.float8_matmuls} matmul(s) on float8, {len(self.float8.lossy)} kept float16"
                     " as too lossy.\n" if self.float8 is not None else "")
                  + f"# Use it without data: amp-rewrite convert SRC DST --target {self.target} --lists THIS_FILE\n")
        return header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000)


def node_items(graph_def) -> dict[str, set[str]]:
    """Node name → the items the rewrite meets it in (the main graph, reachable functions)."""
    program = program_of(graph_def)
    where: dict[str, set[str]] = {}
    for item in [MAIN_GRAPH, *functions.reachable_functions(graph_def, program.library)]:
        for node_def in program.item(item).node:
            where.setdefault(node_def.name, set()).add(item)
    return where


def keep_entries(kept: Mapping[tuple[str, str], str], where: Mapping[str, set[str]]) -> dict[str, str]:
    """keep_nodes entries (→ reason) naming exactly the ``kept`` (function, node)s, given
    ``node_items``: a node name kept wherever the rewrite meets it is one plain entry (a
    model's functions that share their layers' node names, and also the live rewrite's
    traces); otherwise ``FUNCTION::name`` per function. A main-graph node has no qualified
    form: its plain entry also keeps its namesakes in functions float32, which is safe."""
    by_name: dict[str, dict[str, str]] = {}
    for (function, node), why in kept.items():
        by_name.setdefault(node, {})[function] = why
    entries: dict[str, str] = {}
    for node, functions_kept in sorted(by_name.items()):
        if set(functions_kept) >= where.get(node, set()):
            entries[re.escape(node)] = max(functions_kept.values(), key=len)  # one reason: the copies measure alike
            continue
        for function, why in sorted(functions_kept.items()):
            entries[re.escape(node) if function == MAIN_GRAPH else f"{function}::{re.escape(node)}"] = why
    return entries


def converted_nodes(result: RewriteResult) -> set[tuple[str, str]]:
    """(function, node) of every node with a vertex the rewrite converted."""
    return {(d.function, d.node) for d in result.report.decisions if d.converted}


Touching = Mapping[tuple[str, str], Sequence[TensorKey]]  # (function, node) → the tensors it reads and writes


def tensors_of(graph_def, keys: set[TensorKey]) -> Touching:
    """(function, node) → the float tensors it reads and writes, among ``keys``."""
    program = program_of(graph_def)
    items = sorted({k[0] for k in keys})
    touching: dict[tuple[str, str], list[TensorKey]] = {}
    for item in items:
        for node_def in program.item(item).node:
            touched = touching.setdefault((item, node_def.name), [])
            for tensor in node_def.input:
                ref = parse_tensor_name(tensor)
                key = (item, ref.node, ref.port)
                if not ref.is_control and key in keys:
                    touched.append(key)
    for key in keys:
        touching.setdefault((key[0], key[1]), []).append(key)
    return touching


def range_keeps(result: RewriteResult, touching: Touching, stats: Mapping[TensorKey, TensorStats],
                thresholds: Thresholds) -> dict[tuple[str, str], str]:
    """(function, node) → why, for the converted nodes that read or write an out-of-range
    tensor; ``touching``: ``tensors_of`` the model and ``stats``' keys."""
    out_of_range = {key: why for key, s in stats.items() if (why := thresholds.violation(s))}
    if not out_of_range:
        return {}
    kept = {}
    for function, node in sorted(converted_nodes(result)):
        violations = [key for key in touching.get((function, node), ()) if key in out_of_range]
        if violations:  # the largest tensor decides; the output first where it is out of range too
            key = max(violations, key=lambda k: (stats[k].max_abs, k[:2] == (function, node)))
            side = f"output {key[2]}" if key[:2] == (function, node) else f"input '{key[1]}:{key[2]}'"
            kept[(function, node)] = f"calibration: {side} {out_of_range[key]}"
    return kept


def _drift(low: TensorStats | None, high: TensorStats | None) -> float:
    """How far a tensor of the rewrite is from float32's: relative change of its largest
    magnitude and RMS; infinite where it turned non-finite."""
    if low is None or high is None:
        return 0.0
    if low.nonfinite > high.nonfinite:
        return math.inf
    def rel(a: float, b: float) -> float:
        return abs(a - b) / b if b > 0 else (0.0 if a == 0 else math.inf)
    return max(rel(low.max_abs, high.max_abs), rel(low.rms, high.rms))


def _own_drift(node: tuple[str, str], keys: Sequence[TensorKey], high: Mapping[TensorKey, TensorStats],
               low: Mapping[TensorKey, TensorStats]) -> tuple[float, float]:
    """(own, out): the drift of ``node``'s outputs, less the largest its inputs carried in
    (infinite where only it turned non-finite); ``keys``: the tensors it reads and writes."""
    out = max((_drift(low.get(k), high.get(k)) for k in keys if k[:2] == node), default=0.0)
    carried = max((_drift(low.get(k), high.get(k)) for k in keys if k[:2] != node), default=0.0)
    return (out if math.isinf(out) and not math.isinf(carried) else out - carried), out


def blame(result: RewriteResult, touching: Touching, high: Mapping[TensorKey, TensorStats],
          low: Mapping[TensorKey, TensorStats], already: Collection[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The converted nodes most responsible for the drift, keeping each within
    ``_BLAME_SHARE`` of the worst. A node's own drift is its output's minus the largest its
    inputs carried in. A converted node answers for its own; a float32 node that amplifies
    drift (``(a + 1000) - 1000`` cancelling what low precision rounded off) passes it to
    the converted nodes that feed it, where the error was made."""
    target = result.report.target
    converted = converted_nodes(result) - set(already)
    blamed: dict[tuple[str, str], tuple[float, str]] = {}

    def charge(node: tuple[str, str], own: float, why: str) -> None:
        if node in converted and not own <= blamed.get(node, (-1.0, ""))[0]:
            blamed[node] = (own, why)

    for (function, node), keys in touching.items():
        own, out = _own_drift((function, node), keys, high, low)
        if not own > 0:
            continue
        if math.isinf(out):
            largest = max((high[k].max_abs for k in keys if k[:2] == (function, node) and k in high), default=0.0)
            why = f"output turned non-finite in {target} (float32's largest |x| {largest:.3g})"
        else:
            why = f"output drifted {out:.3g} from float32 in {target}, {own:.3g} of it its own"
        if (function, node) in converted:
            charge((function, node), own, why)
        else:  # an amplifier: the error came in with its inputs
            for key in (k for k in keys if k[:2] != (function, node)):
                charge(key[:2], own, f"{target} rounding that float32 node '{node}' amplifies: its {why}")
    if not blamed:
        return {}
    worst = max(own for own, _ in blamed.values())
    return {node: f"calibration: {why}" for node, (own, why) in sorted(blamed.items())
            if own >= _BLAME_SHARE * worst or math.isinf(own)}


def _checks(high: statistics.Run, low: statistics.Run) -> tuple[OutputCheck, ...]:
    checks = []
    for signature in sorted(high.outputs):
        worst: dict[str, float] = {}
        for old, new in zip(high.outputs[signature], low.outputs[signature]):
            for name in sorted(old):
                error = validate._error(signature, name, old[name], new[name])
                if error is not None and not error.max_rel <= worst.get(name, -1.0):
                    worst[name] = error.max_rel
        checks.extend(OutputCheck(signature, name, error) for name, error in worst.items())
    return tuple(checks)


def calibrate(
    source: str | os.PathLike | graph_pb2.GraphDef,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    *,
    target: str | Target = "float16",
    fetches: Sequence[str] = (),
    tag_set: str | None = None,
    lists: str | os.PathLike | OpLists | None = None,
    cross_function: bool = False,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    thresholds: Thresholds | None = None,
) -> Calibration:
    """Calibrate a SavedModel directory, a GraphDef file or a ``GraphDef`` (a
    ``tf.function``'s: ``fn.get_concrete_function().graph.as_graph_def()``; its outputs are
    ``fetches``, default the nodes nothing reads) on ``inputs``: an ``.npz`` file or arrays
    by input name (SavedModel signature inputs, GraphDef placeholders), all fed as one
    batch; None: random inputs (real data is better). Returns the statistics
    (``.stats``), the decisions (``.keep``; ``.overlay()`` is the YAML for ``lists=``)
    and the calibrated rewrite (``.result``); target float8 also the amax and lossy
    matmuls (``.float8``, for ``rewrite_graph_def(amax=..., lossy=...)``).
    """
    target = lookup_target(target, quantized=True)
    if isinstance(source, graph_pb2.GraphDef):
        names = tuple(dict.fromkeys(fetches)) or graph_sinks(source)
        model = Model(Path("<GraphDef>"), "graphdef", source, names, (), fetches_are_sinks=not fetches)
    else:
        model = read_model(source, fetches, tag_set)
    data = Path(inputs) if isinstance(inputs, (str, os.PathLike)) else inputs
    feeds, _ = validate.plan_feeds(model, data, RANDOM_FEEDS)
    shown = (statistics.RANDOM_INPUTS if inputs is None
             else str(data) if isinstance(data, Path) else "the arrays given")
    return run_calibration(model, feeds, target=target, lists=load_lists(target, lists), cross_function=cross_function,
                           max_rounds=max_rounds, thresholds=thresholds, source=shown)


def check_max_rounds(max_rounds: int) -> None:
    if not 1 <= max_rounds <= MAX_ROUNDS_LIMIT:
        raise AmpRewriteError(f"--max-rounds {max_rounds}: use 1 to {MAX_ROUNDS_LIMIT}")


def run_calibration(model: Model, feeds: validate.Feeds, *, target: str | Target, lists: OpLists,
                    cross_function: bool = False, max_rounds: int = DEFAULT_MAX_ROUNDS,
                    thresholds: Thresholds | None = None, say: Callable[[str], None] = lambda line: None,
                    source: str = "") -> Calibration:
    """Statistics, range rules and repair (module doc) for ``model`` on ``feeds``
    (``validate.plan_feeds``); ``say`` gets one line per step and round. Target float8:
    this for float16, then ``calibrate_float8``."""
    target = lookup_target(target, quantized=True)
    if target.colouring != target.name:
        return calibrate_float8(model, feeds, target=target, lists=lists, cross_function=cross_function,
                                max_rounds=max_rounds, thresholds=thresholds, say=say, source=source)
    check_max_rounds(max_rounds)
    thresholds = thresholds or Thresholds.for_target(target)
    keys = statistics.model_tensors(model)
    say(f"calibration: running the float32 model on the calibration inputs ({len(keys)} tensors instrumented)")
    described = statistics.RANDOM_INPUTS if source == statistics.RANDOM_INPUTS else "the calibration inputs"
    high = statistics.collect(model, model.graph_def, feeds, keys, thresholds.smallest_normal, described)
    result = rewrite_model(model, target=target.name, lists=lists, cross_function=cross_function)
    kept: dict[tuple[str, str], str] = {}
    touching, where = tensors_of(model.graph_def, set(high.stats)), node_items(model.graph_def)  # read once

    def rewrite() -> RewriteResult:
        return rewrite_model(model, target=target.name, lists=lists.keeping(keep_entries(kept, where)),
                             cross_function=cross_function)

    while added := {k: v for k, v in range_keeps(result, touching, high.stats, thresholds).items()
                    if k not in kept}:
        kept.update(added)
        result = rewrite()
    range_kept = len(kept)
    say(f"calibration: range rules keep {range_kept} node(s) float32")
    rounds: list[Round] = []
    while True:
        low = statistics.collect(model, result.graph_def, feeds, keys, thresholds.smallest_normal)
        checks = _checks(high, low)
        failing = [c for c in checks if not c.ok(target)]
        worst = max(checks, key=lambda c: c.error if math.isfinite(c.error) else math.inf, default=None)
        summary = "all outputs within tolerance" if not failing else (
            f"{len(failing)} output(s) over tolerance {target.tolerance:g},"
            f" worst {worst.signature}/{worst.output} {worst.error:.3g}")
        if not failing or len(rounds) + 1 >= max_rounds:
            rounds.append(Round(checks, {}))
            say(f"calibration: validation run {len(rounds)}: {summary}")
            break
        added = blame(result, touching, high.stats, low.stats, kept)
        rounds.append(Round(checks, added))
        say(f"calibration: validation run {len(rounds)}: {summary}; keeping {len(added)} more node(s) float32")
        if not added:
            break
        kept.update(added)
        result = rewrite()
    keep = keep_entries(kept, where)
    calibration = Calibration(target.name, high.stats, keep, kept, range_kept, tuple(rounds), lists.keeping(keep),
                              result, thresholds, source, outputs=high.outputs)
    if not calibration.ok:
        why = (f"the cap of {max_rounds} validation run(s) (--max-rounds) was reached" if len(rounds) >= max_rounds
               else "no converted node drifts from float32 enough to blame")
        say(f"calibration: outputs still over tolerance after {len(rounds)} validation run(s): {why}; keep more"
            f" nodes float32 with --keep REGEX, or allow up to {MAX_ROUNDS_LIMIT} runs with --max-rounds")
    return calibration


def calibrate_float8(model: Model, feeds: validate.Feeds, *, target: Target, lists: OpLists,
                     cross_function: bool = False, max_rounds: int = DEFAULT_MAX_ROUNDS,
                     thresholds: Thresholds | None = None, say: Callable[[str], None] = lambda line: None,
                     source: str = "") -> Calibration:
    """Target float8: calibration for float16 (the colouring float8 builds on), then the
    float8 step with amax from the float32 statistics, validated like the repair: each
    validation run instruments the float8 rewrite (the quantize and dequantize ops are graph
    ops, so it runs as FP8 without XLA), and the quantized matmuls whose own output drifts
    from float32's by more than the float8 tolerance stay float16 (``lossy_matmuls``); then
    it runs again, up to ``max_rounds`` float8 runs."""
    base = run_calibration(model, feeds, target=target.colouring, lists=lists, cross_function=cross_function,
                           max_rounds=max_rounds, thresholds=thresholds, say=say, source=source)
    high = statistics.Run(base.stats, base.outputs)
    keys = statistics.model_tensors(model)
    wanted = float8.activation_operands(model.graph_def)
    amax = {key: s.max_abs for key, s in base.stats.items() if key in wanted}
    lossy: dict[tuple[str, str], str] = {}
    rounds: list[Round] = []
    touching = tensors_of(model.graph_def, set(high.stats))
    while True:
        result = rewrite_model(model, target=target.name, lists=base.lists, cross_function=cross_function, amax=amax,
                               lossy=lossy)
        if not rounds and not result.report.float8_matmuls:  # the float16 rewrite, validated already
            why = collections.Counter(d.rule for d in result.report.decisions if d.rule.startswith("float8-"))
            found = ", ".join(f"{rule} {n}" for rule, n in why.most_common()) or "no converted matmul"
            say(f"calibration: float8: no matmul quantized ({found}); no float8 run needed")
            break
        low = statistics.collect(model, result.graph_def, feeds, keys, base.thresholds.smallest_normal)
        checks = _checks(high, low)
        failing = [c for c in checks if not c.ok(target)]
        added = {key: why for key, why in lossy_matmuls(result, touching, high.stats, low.stats, target,
                                                        bool(failing)).items() if key not in lossy}
        summary = (f"{result.report.float8_matmuls} matmul(s) on float8, "
                   + ("all outputs within tolerance" if not failing else
                      f"{len(failing)} output(s) over tolerance {target.tolerance:g}"))
        last = not added or len(rounds) + 1 >= max_rounds
        rounds.append(Round(checks, {} if last else dict(added)))
        if last:
            left = f"; {len(added)} lossy matmul(s) left (--max-rounds {max_rounds})" if added else ""
            say(f"calibration: float8 validation run {len(rounds)}: {summary}{left}")
            break
        say(f"calibration: float8 validation run {len(rounds)}: {summary}; keeping {len(added)} matmul(s) float16")
        lossy.update(added)
    calibration = replace(base, target=target.name, rounds=base.rounds + tuple(rounds), result=result,
                          float8=float8.Float8Calibration(amax, lossy))
    if not calibration.ok:
        say(f"calibration: float8 outputs still over tolerance {target.tolerance:g} after {len(rounds)} float8"
            f" validation run(s) (--max-rounds {max_rounds}); use --max-rounds up to {MAX_ROUNDS_LIMIT}, or target"
            f" {target.colouring} for this model")
    return calibration


def lossy_matmuls(result: RewriteResult, touching: Touching, high: Mapping[TensorKey, TensorStats],
                  low: Mapping[TensorKey, TensorStats], target: Target, failing: bool) -> dict[tuple[str, str], str]:
    """(function, node) → the measurement, for each float8 matmul whose own output drift
    (``blame``'s: its output's drift less the most its inputs carried in) is over the
    target's tolerance. With outputs ``failing`` and none over it, the worst ones (within
    ``_BLAME_SHARE`` of the worst), so each run moves towards tolerance."""
    own_drift: dict[tuple[str, str], tuple[float, float]] = {}
    for d in result.report.decisions:
        if d.rule != Rule.FLOAT8_MATMUL.value:
            continue
        own, out = _own_drift((d.function, d.node), touching.get((d.function, d.node), ()), high, low)
        if own > 0:
            own_drift[(d.function, d.node)] = (own, out)
    chosen = {key: v for key, v in own_drift.items() if v[0] > target.tolerance}
    if failing and not chosen and own_drift:
        worst = max(own for own, _ in own_drift.values())
        chosen = {key: v for key, v in own_drift.items() if v[0] >= _BLAME_SHARE * worst}
    return {key: ("calibration: output turned non-finite in float8" if math.isinf(out) else
                  f"calibration: output drifted {out:.3g} from float32 in float8, {own:.3g} of it its own"
                  f" (tolerance {target.tolerance:g})")
            for key, (own, out) in sorted(chosen.items())}
