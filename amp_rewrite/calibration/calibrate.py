"""Calibration: precision decisions from data, so a model that overflows or loses precision
under the op lists alone comes out finite and within tolerance.

Every decision is made against a goal tighter than the target's tolerance (``GOAL_SHARE``
of it), so what meets the goal on the calibration inputs stays within tolerance on
held-out data of the same distribution; an output's error is a metric chosen by the user
(``validate.METRICS``; by default one that does not grow with the number of samples).

1. **Statistics**: the float32 model runs once over the calibration inputs with every
   float tensor instrumented, function bodies included (``statistics.collect``): its
   largest magnitude and the share of its magnitude below the target's smallest normal.
2. **Range rules** (no run): a node the rewrite would convert that reads or writes a
   tensor over the format's largest value, or carrying most of its magnitude below the
   smallest normal, is kept float32. Kept nodes act as deny ops (``keep_nodes``), so this
   repeats until no converted node touches such a tensor. A tensor between the safe
   magnitude and the format's limit is not kept: it is tried in low precision.
3. **Repair by validation**: the rewrite runs on the calibration inputs. The nodes that
   were tried are kept only if the run needs it: their low-precision values come within
   ``HEADROOM`` of the format's limit (held-out data runs larger), or repair blames them.
   While an output is over the goal, the converted nodes whose own output drifts most from
   float32's (magnitude, RMS or finiteness, beyond what their inputs carried) are kept
   float32, and it runs again, up to ``max_rounds`` runs. Repair is monotonic: the result
   is the best run's (lowest error), never a later, worse one, and it stops after
   ``_STALE_RUNS`` runs in a row no better than the best. A kept MatMul or Conv2D that
   the run shows converting alone is fine is given back (``_give_back``).
4. **float8** (``_calibrate_float8``): the float16 calibration, then amax from the float32
   statistics, then float8 runs in which every quantized matmul also runs in float16 on
   the same inputs (``float8.add_probes``): the element-wise difference is its own FP8
   error. While the outputs are over the goal, the worst matmuls move back to float16,
   as many as the measured errors say the goal needs.

The decisions are ``keep_nodes`` entries with the measurement that made each
(``Calibration.overlay``): an overlay YAML that reproduces the rewrite without data.
Its entries name a node plainly where that is unambiguous, else by the function's stable
name (without TensorFlow's trace counter), so they survive a re-export.
"""
from __future__ import annotations

import collections
import math
import os
import re
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml
from tensorflow.core.framework import graph_pb2

from amp_rewrite.calibration import statistics, validate
from amp_rewrite.calibration.savedmodel import Model, graph_sinks, read_model, rewrite_model
from amp_rewrite.calibration.statistics import TensorKey, TensorStats
from amp_rewrite.core import functions
from amp_rewrite.core.float8 import inference as float8
from amp_rewrite.core.graph_io import copy_graph_def, parse_tensor_name
from amp_rewrite.core.lists import OpLists, load_lists
from amp_rewrite.core.program import MAIN_GRAPH, Program, program_of
from amp_rewrite.core.rewrite import RewriteResult
from amp_rewrite.core.rules import Rule
from amp_rewrite.core.target import FLOAT16, Target, lookup_target
from amp_rewrite.errors import AmpRewriteError

# float16's largest finite value is 65504. Below a quarter of it a tensor is safe; between
# that and the limit it is tried in float16 and kept only if validation needs it.
FLOAT16_SAFE_MAGNITUDE = 16384.0
FLOAT16_LIMIT = float(np.finfo(np.float16).max)
# A tried tensor whose float16 values come within this factor of the limit is kept: a
# held-out maximum ran up to 1.22x the calibration maximum with 8 samples (issue 18).
HEADROOM = 1.25
# A tensor whose magnitude (sum of |x|) is mostly carried by values below the target's
# smallest normal loses its precision. By mass, not by count: a sharp softmax has half its
# values below 6.1e-5 (BERT with query kernels x4), but they carry under 0.1% of its mass
# and keeping it float32 changes nothing (tools/calibration_models_report.py).
SMALL_SHARE = 0.5
# Decisions aim at this share of the target's tolerance: over random 64-sample subsets of
# the trained Transformer in float8, p99-rel's 95th percentile was 1.5x its median
# (tools/metric_spread.py), under the 2x this leaves.
GOAL_SHARE = 0.5
DEFAULT_MAX_ROUNDS = 5
RANDOM_FEEDS = 2  # random calibration batches when no data is given
MAX_ROUNDS_LIMIT = 10
# Repair keeps, per round, each converted node whose drift is at least this share of the worst one's.
_BLAME_SHARE = 0.5
# float8 repair moves matmuls back until the errors they leave predict this share of the goal.
_FLOAT8_AIM = 0.8
# Repair stops after this many runs in a row no better than the best (one may be: a
# round can get worse before it gets better).
_STALE_RUNS = 2
_GIVE_BACK_OPS = frozenset({"MatMul", "BatchMatMul", "BatchMatMulV2", "Conv2D", "Einsum"})


@dataclass(frozen=True)
class Thresholds:
    """When a tensor is out of the target's range."""

    max_magnitude: float  # the safe largest |x|: above it a tensor is tried; math.inf: none
    smallest_normal: float
    max_small_share: float = SMALL_SHARE  # of the magnitude: see SMALL_SHARE
    limit: float = math.inf  # the format's largest finite value: above it a tensor is kept

    @classmethod
    def for_target(cls, target: Target, max_magnitude: float | None = None,
                   max_small_share: float | None = None) -> Thresholds:
        """float16 (and float8, which colours as float16): 16384, 6.1e-5 and 65504. bfloat16
        has float32's exponent range: no range rule fires for it, and its 8-bit mantissa is
        left to repair by validation."""
        if lookup_target(target.colouring) is FLOAT16:
            default, smallest, limit = FLOAT16_SAFE_MAGNITUDE, float(np.finfo(np.float16).tiny), FLOAT16_LIMIT
        else:
            default, smallest, limit = math.inf, 0.0, math.inf
        return cls(default if max_magnitude is None else max_magnitude, smallest,
                   SMALL_SHARE if max_small_share is None else max_small_share, limit)

    def violation(self, stats: TensorStats) -> str:
        """Why the tensor is kept out of low precision, or "": over the format's limit (over
        the safe magnitude where the format has none), or mostly below the smallest normal."""
        if stats.max_abs > self.limit:
            return f"reached {stats.max_abs:.3g}, over the format's largest value {self.limit:.3g}"
        if not math.isfinite(self.limit) and stats.max_abs > self.max_magnitude:
            return f"reached {stats.max_abs:.3g}, over the safe magnitude {self.max_magnitude:.3g}"
        if self.smallest_normal and stats.small_mass > self.max_small_share:
            return (f"has {stats.small_mass:.0%} of its magnitude in values below the smallest normal"
                    f" {self.smallest_normal:.3g} ({stats.small_share:.0%} of its non-zero values)")
        return ""

    def tried(self, stats: TensorStats) -> bool:
        """Between the safe magnitude and the limit: tried in low precision, kept if validation needs it."""
        return self.max_magnitude < stats.max_abs <= self.limit and math.isfinite(self.limit)


@dataclass(frozen=True)
class OutputCheck:
    signature: str
    output: str
    error: float  # the metric's value over the calibration inputs
    metric: str = ""  # its name, where it is not the calibration's (integer outputs: agreement)

    def within(self, limit: float) -> bool:
        return math.isfinite(self.error) and self.error <= limit


@dataclass(frozen=True)
class Round:
    """One validation run: each output's error, and what was decided after it (nodes kept
    float32, or float8 matmuls moved back to float16)."""

    checks: tuple[OutputCheck, ...]
    kept: Mapping[tuple[str, str], str]
    stage: str = "repair"  # "repair", "give-back" or "float8"

    @property
    def compared(self) -> bool:
        """Whether the run measured any output: one whose outputs are all strings has nothing to compare."""
        return bool(self.checks)

    def score(self, tolerance: float) -> float:
        """The worst output's error as a share of ``tolerance`` (infinite when not finite;
        NaN, which meets no bound, when nothing was compared)."""
        if not self.compared:
            return math.nan
        return max(c.error / tolerance if math.isfinite(c.error) else math.inf for c in self.checks)


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
    result: RewriteResult                   # the calibrated rewrite: the best run's
    thresholds: Thresholds
    source: str = ""                        # what the statistics came from, for the overlay's header
    float8: float8.Float8Calibration | None = None  # target float8: the amax and lossy matmuls it used
    metric: str = validate.DEFAULT_METRIC
    best: int = -1                          # the round whose decisions ``result`` holds
    tolerance: float = 0.0                  # the error accepted (0: the target's)
    # the float32 model's outputs on the calibration inputs, signature → one dict per feed
    outputs: Mapping[str, Sequence[Mapping[str, np.ndarray]]] = field(default_factory=dict, compare=False, repr=False)

    @property
    def validation_runs(self) -> int:
        return len(self.rounds)

    @property
    def _tolerance(self) -> float:
        return self.tolerance or lookup_target(self.target, quantized=True).tolerance

    @property
    def compared(self) -> bool:
        """Whether the result's run measured any output. A model whose outputs are all
        strings has nothing to compare: its decisions are the range rules' alone, and it is
        neither ``ok`` nor over tolerance."""
        return bool(self.rounds) and self.rounds[self.best].compared

    @property
    def ok(self) -> bool:
        """Every output within the tolerance on the calibration inputs (the result's run);
        False when nothing was compared."""
        return self.compared and self.rounds[self.best].score(self._tolerance) <= 1.0

    @property
    def reached_goal(self) -> bool:
        """Every output within the goal (``GOAL_SHARE`` of the tolerance) on the calibration inputs."""
        return self.compared and self.rounds[self.best].score(self._tolerance) <= GOAL_SHARE

    def overlay(self, base: Mapping | None = None) -> str:
        """An overlay YAML reproducing the calibrated rewrite: ``base`` (the overlay the
        run was given, as loaded) with ``keep`` added to its keep_nodes."""
        data = dict(base or {})
        keep = data.get("keep_nodes") or {}
        keep = dict.fromkeys(keep, "") if isinstance(keep, list) else dict(keep)
        keep.update(self.keep)
        data["keep_nodes"] = keep
        if self.float8 is not None:
            where = node_items(self.result.program, [item.function for item in self.result.report.items])
            data["amax"] = dict(sorted(overlay_keys(self.float8.amax, where).items()))
            data["lossy"] = dict(sorted(overlay_keys(self.float8.lossy, where).items()))
        source = self.source or "calibration data"
        converted = "nothing converted: every candidate is kept float32; " if not converted_nodes(self.result) else ""
        header = (f"# Written by amp-rewrite calibrate for target {self.target}, from {source}.\n"
                  f"# Range rules: over {self.thresholds.limit:.6g} kept, over {self.thresholds.max_magnitude:.6g}"
                  f" tried; at most {self.thresholds.max_small_share:.0%} of a tensor's magnitude in values below"
                  f" {self.thresholds.smallest_normal:.3g};"
                  f" {converted}{self.range_kept} node(s) kept by them, {len(self.kept) - self.range_kept} by repair"
                  f" ({self.validation_runs} validation run(s), metric {self.metric}).\n"
                  + (f"# float8: amax of {len(self.float8.amax)} matmul operand(s) (largest |x| in float32);"
                     f" {self.result.report.float8_matmuls} matmul(s) on float8, {len(self.float8.lossy)} kept float16"
                     " as too lossy.\n" if self.float8 is not None else "")
                  + f"# Use it without data: amp-rewrite convert SRC DST --target {self.target} --lists THIS_FILE\n")
        return header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000)


def node_items(program: Program, roots: Iterable[str] = ()) -> dict[str, set[str]]:
    """Node name → the items the rewrite meets it in (the main graph, the functions it reaches,
    from ``roots`` too: a SavedModel's restored functions, ``Model.entry_functions``)."""
    where: dict[str, set[str]] = {}
    for item in [MAIN_GRAPH, *functions.reachable_functions(program.graph_def, program.library, roots=roots)]:
        for node_def in program.item(item).node:
            where.setdefault(node_def.name, set()).add(item)
    return where


def _scope(function: str, where: Mapping[str, set[str]]) -> str:
    """How an overlay names ``function``: its stable name (without TensorFlow's trace
    counter, so the entry survives a re-export) where no other item shares it, else its name."""
    stable = functions.stable_name(function)
    items = {item for found in where.values() for item in found}
    if stable != function and not any(functions.stable_name(item) == stable for item in items - {function}):
        return stable
    return function


def keep_entries(kept: Mapping[tuple[str, str], str], where: Mapping[str, set[str]]) -> dict[str, str]:
    """keep_nodes entries (→ reason) naming exactly the ``kept`` (function, node)s, given
    ``node_items``: a node name kept wherever the rewrite meets it is one plain entry (a
    model's functions that share their layers' node names, and also the live rewrite's
    traces); otherwise ``FUNCTION::name`` per function, FUNCTION its stable name where
    that is unambiguous (``_scope``). A main-graph node has no qualified form: its plain
    entry also keeps its namesakes in functions float32, which is safe."""
    by_name: dict[str, dict[str, str]] = {}
    for (function, node), why in kept.items():
        by_name.setdefault(node, {})[function] = why
    entries: dict[str, str] = {}
    for node, functions_kept in sorted(by_name.items()):
        if set(functions_kept) >= where.get(node, set()):
            entries[re.escape(node)] = max(functions_kept.values(), key=len)  # one reason: the copies measure alike
            continue
        for function, why in sorted(functions_kept.items()):  # _scope(MAIN_GRAPH) is MAIN_GRAPH: the plain name
            entries[functions.scoped_name(_scope(function, where), re.escape(node))] = why
    return entries


def overlay_keys(found: Mapping[tuple, object], where: Mapping[str, set[str]]) -> dict[str, object]:
    """An overlay's ``amax`` or ``lossy`` (``float8.key_text``): a node named plainly where
    every item holding a node of that name has the same value, else scoped by ``_scope``."""
    by_name: dict[tuple, dict[str, object]] = {}
    for key, value in found.items():
        by_name.setdefault(key[1:], {})[key[0]] = value
    keys: dict[str, object] = {}
    for rest, values in by_name.items():
        if set(values) >= where.get(rest[0], set()) and len(set(values.values())) == 1:
            keys[float8.key_text(("", *rest))] = next(iter(values.values()))
            continue
        for function, value in values.items():
            keys[float8.key_text((_scope(function, where) if function else "", *rest))] = value
    return keys


def converted_nodes(result: RewriteResult) -> set[tuple[str, str]]:
    """(function, node) of every node with a vertex the rewrite converted."""
    return {(d.function, d.node) for d in result.report.decisions if d.converted}


Touching = Mapping[tuple[str, str], Sequence[TensorKey]]  # (function, node) → the tensors it reads and writes


def tensors_of(program: Program, keys: set[TensorKey]) -> Touching:
    """(function, node) → the float tensors it reads and writes, among ``keys``."""
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


def _touching_violations(result: RewriteResult, touching: Touching, stats: Mapping[TensorKey, TensorStats],
                         flagged: Mapping[TensorKey, str], prefix: str) -> dict[tuple[str, str], str]:
    """(function, node) → why, for the converted nodes that read or write a ``flagged`` tensor."""
    kept = {}
    for function, node in sorted(converted_nodes(result)):
        violations = [key for key in touching.get((function, node), ()) if key in flagged]
        if violations:  # the largest tensor decides; the output first where it is flagged too
            key = max(violations, key=lambda k: (stats[k].max_abs, k[:2] == (function, node)))
            side = f"output {key[2]}" if key[:2] == (function, node) else f"input '{key[1]}:{key[2]}'"
            kept[(function, node)] = f"calibration: {side} {prefix}{flagged[key]}"
    return kept


def range_keeps(result: RewriteResult, touching: Touching, stats: Mapping[TensorKey, TensorStats],
                thresholds: Thresholds) -> dict[tuple[str, str], str]:
    """(function, node) → why, for the converted nodes that read or write an out-of-range
    tensor; ``touching``: ``tensors_of`` the model and ``stats``' keys."""
    out_of_range = {key: why for key, s in stats.items() if (why := thresholds.violation(s))}
    return _touching_violations(result, touching, stats, out_of_range, "") if out_of_range else {}


def headroom_keeps(result: RewriteResult, touching: Touching, high: Mapping[TensorKey, TensorStats],
                   low: Mapping[TensorKey, TensorStats], thresholds: Thresholds) -> dict[tuple[str, str], str]:
    """The converted nodes touching a tried tensor (``Thresholds.tried`` in float32) whose
    low-precision values came within ``HEADROOM`` of the limit (or turned non-finite)."""
    close = {}
    for key, s in high.items():
        found = low.get(key)
        if thresholds.tried(s) and found is not None and (found.nonfinite > s.nonfinite
                                                          or found.max_abs * HEADROOM > thresholds.limit):
            close[key] = (f"reached {found.max_abs:.3g} in low precision, within {HEADROOM:g}x of the format's largest"
                          f" value {thresholds.limit:.3g} (float32: {s.max_abs:.3g})")
    return _touching_violations(result, touching, high, close, "") if close else {}


def drift(low: TensorStats | None, high: TensorStats | None) -> float:
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
    out = max((drift(low.get(k), high.get(k)) for k in keys if k[:2] == node), default=0.0)
    carried = max((drift(low.get(k), high.get(k)) for k in keys if k[:2] != node), default=0.0)
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


def output_checks(high: statistics.Run, low: statistics.Run,
                  metric: validate.NamedMetric | validate.Metric) -> tuple[OutputCheck, ...]:
    """Each output's error over all feeds together (``validate.measure``): a floating output's
    by ``metric``, an integer output's by agreement (``validate.MetricChoice``)."""
    metric = metric if isinstance(metric, validate.NamedMetric) else validate.lookup_metric(metric)
    choice = validate.MetricChoice(metric.name if metric.name in validate.METRICS else metric.function)
    checks = []
    for signature in sorted(high.outputs):
        names = sorted(high.outputs[signature][0]) if high.outputs[signature] else []
        for name in names:
            pairs = [(old[name], new[name]) for old, new in zip(high.outputs[signature], low.outputs[signature])]
            where = f"signature '{signature}' output '{name}'"
            chosen = choice.for_output(signature, name, np.asarray(pairs[0][0])) if pairs else metric
            measured = validate.measure(chosen.function, pairs, where)
            if measured is not None:
                checks.append(OutputCheck(signature, name, measured[0], chosen.name if chosen != metric else ""))
    return tuple(checks)


def _summary(checks: Sequence[OutputCheck], target: Target, metric: str) -> str:
    """The worst output's error against the goal and the tolerance."""
    if not checks:
        return "nothing to compare (no output of the model is a number)"
    worst = max(checks, key=lambda c: c.error if math.isfinite(c.error) else math.inf)
    goal = GOAL_SHARE * target.tolerance
    verdict = ("within the goal" if worst.within(goal) else "over the goal" if worst.within(target.tolerance)
               else "over tolerance")
    return (f"worst {worst.signature}/{worst.output} {validate.shown(worst.metric or metric)} {worst.error:.3g}"
            f" ({verdict}; goal {goal:g}, tolerance {target.tolerance:g})")


def calibrate(
    source: str | os.PathLike | graph_pb2.GraphDef,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    *,
    target: str | Target = "float16",
    fetches: Sequence[str] = (),
    tag_set: str | None = None,
    lists: str | os.PathLike | OpLists | None = None,
    cross_function: bool | str = False,
    max_rounds: int = DEFAULT_MAX_ROUNDS,
    thresholds: Thresholds | None = None,
    metric: str | validate.Metric = validate.DEFAULT_METRIC,
) -> Calibration:
    """Calibrate a SavedModel directory, a GraphDef file or a ``GraphDef`` (a
    ``tf.function``'s: ``fn.get_concrete_function().graph.as_graph_def()``; its outputs are
    ``fetches``, default the nodes nothing reads) on ``inputs``: an ``.npz`` file or arrays
    by input name (SavedModel signature inputs, GraphDef placeholders), all fed as one
    batch; None: random inputs (real data is better). ``metric``: how an output's error is
    measured, a name of ``validate.METRICS`` or ``metric(reference, candidate) -> float``
    (the float32 and the rewritten outputs as arrays), compared with the target's
    tolerance. Returns the statistics (``.stats``), the decisions (``.keep``;
    ``.overlay()`` is the YAML for ``lists=``) and the calibrated rewrite (``.result``);
    target float8 also the amax and lossy matmuls (``.float8``, for
    ``rewrite_graph_def(amax=..., lossy=...)``).
    """
    target = lookup_target(target, quantized=True)
    model = source_model(source, fetches, tag_set)
    data = Path(inputs) if isinstance(inputs, (str, os.PathLike)) else inputs
    feeds, _ = validate.plan_feeds(model, data, RANDOM_FEEDS)
    shown = (statistics.RANDOM_INPUTS if inputs is None
             else str(data) if isinstance(data, Path) else "the arrays given")
    return run_calibration(model, feeds, Options(target=target, lists=load_lists(target, lists),
                                                 cross_function=cross_function, max_rounds=max_rounds,
                                                 thresholds=thresholds, metric=metric, source=shown))


def source_model(source: str | os.PathLike | graph_pb2.GraphDef, fetches: Sequence[str] = (),
                 tag_set: str | None = None) -> Model:
    """A SavedModel directory, a GraphDef file or a ``GraphDef`` as a ``Model``: a GraphDef's
    outputs are ``fetches``, default the nodes nothing reads."""
    if isinstance(source, graph_pb2.GraphDef):
        names = tuple(dict.fromkeys(fetches)) or graph_sinks(source)
        return Model(Path("<GraphDef>"), "graphdef", source, names, (), fetches_are_sinks=not fetches)
    return read_model(source, fetches, tag_set)


def check_max_rounds(max_rounds: int) -> None:
    if not 1 <= max_rounds <= MAX_ROUNDS_LIMIT:
        raise AmpRewriteError(f"--max-rounds {max_rounds}: use 1 to {MAX_ROUNDS_LIMIT}")


def _silent(line: str) -> None:
    """The default ``Options.say``: no lines."""


@dataclass(frozen=True)
class Options:
    """How one calibration runs, as its caller (``calibrate``, the command) chose: the
    target (whose tolerance is the error accepted) and lists, the cap on validation runs,
    the range rules' thresholds (None: the target's), how an output's error is measured (a
    name of ``validate.METRICS`` or a function), what the inputs were (the overlay's header;
    ``statistics.RANDOM_INPUTS``: random ones) and where each step's line goes."""

    target: Target
    lists: OpLists
    cross_function: bool | str = False
    max_rounds: int = DEFAULT_MAX_ROUNDS
    thresholds: Thresholds | None = None
    metric: str | validate.Metric = validate.DEFAULT_METRIC
    source: str = ""
    say: Callable[[str], None] = _silent


@dataclass(frozen=True)
class _Context:
    """What every step of one calibration reads, settled before its first validation run
    and passed whole: the model, the session its runs share, the options (thresholds
    settled), the metric, the float32 run, and for repair the tensors it measured, which
    nodes touch them, and where each node is met (for ``keep_entries``)."""

    model: Model
    runner: statistics.Runner
    options: Options
    metric: validate.NamedMetric
    high: statistics.Run
    keys: Sequence[TensorKey] = ()
    touching: Touching = field(default_factory=dict)
    where: Mapping[str, set[str]] = field(default_factory=dict)

    @property
    def target(self) -> Target:
        return self.options.target

    @property
    def goal(self) -> float:
        return GOAL_SHARE * self.target.tolerance

    def say(self, line: str) -> None:
        self.options.say(line)

    def validate(self, program: Program, keys: Sequence[TensorKey] = ()
                 ) -> tuple[statistics.Run, tuple[OutputCheck, ...]]:
        """Run a rewrite on the calibration inputs, measuring ``keys``: the run and each output's error."""
        low = self.runner.collect(program, keys, self.options.thresholds.smallest_normal)
        return low, output_checks(self.high, low, self.metric)

    def summary(self, checks: Sequence[OutputCheck]) -> str:
        return _summary(checks, self.target, self.metric.name)

    def rewrite(self, keeping: Mapping[tuple[str, str], str]) -> RewriteResult:
        """The rewrite with ``keeping`` float32."""
        return rewrite_model(self.model, target=self.target.name, lists=self.options.lists.keeping(
            keep_entries(keeping, self.where)), cross_function=self.options.cross_function)


@dataclass
class _Repair:
    """Where repair stands: its validation runs so far, the best run (its score, round,
    result and decisions), the last rewrite validated, the nodes kept by a measured range
    (never given back), and how many runs in a row were no better than the best."""

    last: RewriteResult
    measured: set[tuple[str, str]]
    rounds: list[Round] = field(default_factory=list)
    score: float = math.inf
    round: int = -1
    result: RewriteResult | None = None
    kept: dict[tuple[str, str], str] = field(default_factory=dict)
    stale: int = 0

    def offer(self, score: float, result: RewriteResult, kept: Mapping[tuple[str, str], str]) -> bool:
        """Whether the run just made (``rounds`` holds those before it) is the best so far; it is recorded if so."""
        if score < self.score or self.result is None:
            self.score, self.round, self.result, self.kept = score, len(self.rounds), result, dict(kept)
            return True
        return False


def run_calibration(model: Model, feeds: validate.Feeds, options: Options) -> Calibration:
    """Statistics, range rules and repair (module doc) for ``model`` on ``feeds``
    (``validate.plan_feeds``), every run in one session; ``options.say`` gets one line per
    step and run. Target float8: this for float16 against float8's tolerance (repairing
    float16's rounding below what FP8 adds buys nothing), then the float8 runs (``_calibrate_float8``)."""
    metric = validate.lookup_metric(options.metric)  # an unknown metric fails before any run
    with statistics.Runner(model, feeds) as runner:  # the session every run of this calibration shares
        if options.target.colouring != options.target.name:
            return _calibrate_float8(model, runner, options, metric)
        return _calibrate_repairing(model, runner, options, metric)


def _calibrate_repairing(model: Model, runner: statistics.Runner, options: Options,
                         metric: validate.NamedMetric) -> Calibration:
    """Steps 1-3 (module doc): a float16 or bfloat16 calibration."""
    check_max_rounds(options.max_rounds)
    options = replace(options, thresholds=options.thresholds or Thresholds.for_target(options.target))
    c = _measure_float32(model, runner, options, metric)  # 1. statistics
    result, kept, tried = _keep_out_of_range(c)  # 2. range rules
    range_kept = len(kept)
    repair = _repair(c, result, kept, tried)  # 3. repair by validation: the best run stands
    result, best_round = repair.last, repair.round
    if repair.result is not None:
        result, kept = repair.result, repair.kept
        if repair.score <= GOAL_SHARE:  # then each matmul repair kept, tried converted alone
            result, kept, best_round = _give_back(c, repair)
    keep = keep_entries(kept, c.where)
    calibration = Calibration(
        target=c.target.name, stats=c.high.stats, keep=keep, kept=kept, range_kept=range_kept,
        rounds=tuple(repair.rounds), lists=options.lists.keeping(keep), result=result,
        thresholds=options.thresholds, source=options.source, metric=c.metric.name, best=best_round,
        tolerance=c.target.tolerance, outputs=c.high.outputs)
    _report_repair(c, calibration, repair.stale)
    return calibration


def _measure_float32(model: Model, runner: statistics.Runner, options: Options,
                     metric: validate.NamedMetric) -> _Context:
    """1. Statistics: the float32 model on the calibration inputs, every float tensor
    measured. Returns the calibration's context, with the run and what it measured."""
    keys = statistics.model_tensors(model)
    options.say(f"calibration: running the float32 model on the calibration inputs ({len(keys)} tensors instrumented)")
    described = statistics.RANDOM_INPUTS if options.source == statistics.RANDOM_INPUTS else "the calibration inputs"
    high = runner.collect(model.program, keys, options.thresholds.smallest_normal, described)
    return _Context(model=model, runner=runner, options=options, metric=metric, high=high, keys=keys,
                    touching=tensors_of(model.program, set(high.stats)),
                    where=node_items(model.program, model.entry_functions))


def _keep_out_of_range(c: _Context) -> tuple[RewriteResult, dict[tuple[str, str], str], bool]:
    """2. Range rules: keep float32 the converted nodes touching an out-of-range tensor, until
    none does. Returns the rewrite, the nodes kept, and whether any node is tried (touches a
    tensor between the safe magnitude and the limit)."""
    thresholds = c.options.thresholds
    result = rewrite_model(c.model, target=c.target.name, lists=c.options.lists,
                           cross_function=c.options.cross_function)
    kept: dict[tuple[str, str], str] = {}
    while added := {k: v for k, v in range_keeps(result, c.touching, c.high.stats, thresholds).items()
                    if k not in kept}:
        kept.update(added)
        result = c.rewrite(kept)
    tried = {key for key, s in c.high.stats.items() if thresholds.tried(s)}
    tried_nodes = _touching_violations(result, c.touching, c.high.stats, dict.fromkeys(tried, ""), "") if tried else {}
    c.say(f"calibration: range rules keep {len(kept)} node(s) float32"
          + (f"; {len(tried_nodes)} node(s) over the safe magnitude {thresholds.max_magnitude:.3g} are tried in"
             f" {c.target.name}" if tried_nodes else ""))
    return result, kept, bool(tried_nodes)


def _repair(c: _Context, result: RewriteResult, kept: dict[tuple[str, str], str], tried: bool) -> _Repair:
    """3. Repair by validation: run the rewrite; while an output is over the goal, keep
    float32 the nodes a run needs for headroom, else the ones it blames, and run again, up
    to ``max_rounds`` runs or ``_STALE_RUNS`` in a row no better than the best. ``kept``
    grows in place; the best run is in the result."""
    repair = _Repair(result, set(kept))
    while True:
        instrumented = tried or bool(repair.rounds)  # a first run on a model with nothing tried: outputs only
        low, checks = c.validate(result.program, c.keys if instrumented else [])
        needed, note = _judge(c, repair, result, kept, low if instrumented else None, checks)
        round_ = Round(checks, {})
        if (not needed and all(check.within(c.goal) for check in checks)) \
                or len(repair.rounds) + 1 >= c.options.max_rounds or repair.stale >= _STALE_RUNS:
            repair.rounds.append(round_)
            stop = f"; {repair.stale} run(s) in a row no better: repair stops" if repair.stale >= _STALE_RUNS else ""
            c.say(f"calibration: validation run {len(repair.rounds)}: {c.summary(checks)}{note}{stop}")
            return repair
        if not needed and not instrumented:  # the outputs-only run failed: measure every tensor
            low, _ = c.validate(result.program, c.keys)
        added = needed or blame(result, c.touching, c.high.stats, low.stats, kept)
        repair.rounds.append(replace(round_, kept=added))
        c.say(f"calibration: validation run {len(repair.rounds)}: {c.summary(checks)}{note};"
              f" keeping {len(added)} more node(s) float32")
        if not added:
            return repair
        kept.update(added)
        repair.measured.update(needed)
        result = repair.last = c.rewrite(kept)


def _judge(c: _Context, repair: _Repair, result: RewriteResult, kept: Mapping[tuple[str, str], str],
           low: statistics.Run | None, checks: Sequence[OutputCheck]) -> tuple[dict[tuple[str, str], str], str]:
    """A validation run's verdict: the nodes it needs kept for headroom (none from an
    outputs-only run, ``low`` None), and the note its line gets; a run that needs none is
    offered to ``repair`` as the best, and counted stale when it is no better."""
    score = Round(checks, {}).score(c.target.tolerance)
    needed = (headroom_keeps(result, c.touching, c.high.stats, low.stats, c.options.thresholds)
              if low is not None else {})
    needed = {k: v for k, v in needed.items() if k not in kept}
    # a run that needs more headroom is no candidate: held-out data would overflow it
    improved = not needed and repair.offer(score, result, kept)
    note = "" if improved or needed else f" (no better than run {repair.round + 1}: its decisions stand)"
    # still non-finite is not stale: repair cannot see its progress in the error yet
    repair.stale = 0 if improved or needed or not math.isfinite(score) else repair.stale + 1
    return needed, note


def _give_back(c: _Context, repair: _Repair) -> tuple[RewriteResult, dict[tuple[str, str], str], int]:
    """Repair keeps every node within ``_BLAME_SHARE`` of the worst, so a MatMul or Conv2D
    can be kept along with the one that needed it. Each such matmul that repair kept (not
    one ``measured`` out of range: past the format's limit, or within the headroom of it)
    is tried converted alone, in the runs left, and given back when the outputs stay
    within the goal. Returns the result, its kept nodes and the round it was measured in,
    from the best run's."""
    result, kept, best_round = repair.result, repair.kept, repair.round
    ops = {(d.function, d.node): d.op for d in result.report.decisions}
    candidates = [node for node in kept if node not in repair.measured and ops.get(node) in _GIVE_BACK_OPS]
    for node in candidates:
        if len(repair.rounds) >= c.options.max_rounds:
            break
        trial = {k: v for k, v in kept.items() if k != node}
        candidate = c.rewrite(trial)
        _, checks = c.validate(candidate.program)
        fine = all(check.within(c.goal) for check in checks)
        repair.rounds.append(Round(checks, {} if fine else {node: kept[node]}, "give-back"))
        c.say(f"calibration: validation run {len(repair.rounds)}: {node[1]} converted alone: {c.summary(checks)};"
              f" {'given back to ' + c.target.name if fine else 'kept float32'}")
        if fine:
            kept, result, best_round = trial, candidate, len(repair.rounds) - 1
    return result, kept, best_round


def _report_repair(c: _Context, calibration: Calibration, stale: int) -> None:
    """The last line of a calibration that did not meet the goal: why, and what to do
    (nothing compared: its run's line said so)."""
    if not calibration.compared:
        return
    runs = calibration.validation_runs
    if not calibration.ok:
        why = (f"the cap of {c.options.max_rounds} validation run(s) (--max-rounds) was reached"
               if runs >= c.options.max_rounds
               else "keeping more nodes float32 made it no better" if stale >= _STALE_RUNS
               else "no converted node drifts from float32 enough to blame")
        c.say(f"calibration: outputs still over tolerance after {runs} validation run(s): {why}; keep more"
              f" nodes float32 with --keep REGEX, or allow up to {MAX_ROUNDS_LIMIT} runs with --max-rounds")
    elif not calibration.reached_goal:
        c.say(f"calibration: within tolerance but over the goal {c.goal:g} after {runs} validation run(s);"
              " held-out data may exceed the tolerance")


@dataclass
class _Float8Search:
    """The float8 runs' search for how many of the worst matmuls to keep float16: the
    quantized matmuls ranked by their own FP8 error (the first run's probes), the largest
    count that failed the goal and the smallest that met it, each count's run, and the
    float8 validation runs so far."""

    amax: Mapping[TensorKey, float]
    ranked: list[tuple[str, str]] = field(default_factory=list)   # worst own FP8 error first
    errors: dict[tuple[str, str], float] = field(default_factory=dict)
    failed: int = 0
    met: int | None = None
    tried: dict[int, tuple[float, RewriteResult, dict[tuple[str, str], str]]] = field(default_factory=dict)
    rounds: list[Round] = field(default_factory=list)

    def record(self, count: int, score: float, result: RewriteResult, lossy: dict[tuple[str, str], str]) -> None:
        self.tried[count] = (score, result, lossy)
        if score <= GOAL_SHARE:
            self.met = count if self.met is None else min(self.met, count)
        else:
            self.failed = max(self.failed, count)

    def next_count(self, count: int, score: float) -> int | None:
        """The count to run next after ``count`` gave ``score``; None: the search is over."""
        if self.met is None:
            found = _float8_count(self.ranked, self.errors, count, score)
        else:
            found = (self.failed + self.met) // 2 if self.met - self.failed > 1 else None
        return None if found is None or found >= len(self.ranked) + 1 or found in self.tried else found

    def best(self) -> int | None:
        """The count that met the goal with the most matmuls on float8, else the lowest error's."""
        if not self.tried:
            return None
        return self.met if self.met is not None else min(self.tried, key=lambda k: self.tried[k][0])


def _calibrate_float8(model: Model, runner: statistics.Runner, options: Options,
                      metric: validate.NamedMetric) -> Calibration:
    """Target float8: calibration for float16 (the colouring float8 builds on), then the
    float8 step with amax from the float32 statistics, then up to ``max_rounds`` float8 runs.

    The first run quantizes every matmul it can and also runs each in float16 on the same
    inputs (``float8.add_probes``): the RMS of the difference over the RMS of its output
    is the matmul's own FP8 error, which ranks them, worst first. If the outputs are over
    the goal, the next run moves the k worst back to float16, k as a quadrature model of
    the errors predicts (``_float8_count``); the runs after that halve the interval between
    the largest k that failed and the smallest that met the goal. The result is the run
    that met the goal with the most matmuls on float8, else the lowest error."""
    target = options.target
    colouring = replace(lookup_target(target.colouring, quantized=True), tolerance=target.tolerance)
    base = _calibrate_repairing(model, runner, replace(options, target=colouring), metric)
    wanted = float8.activation_operands(model.graph_def)
    search = _Float8Search({key: s.max_abs for key, s in base.stats.items() if key in wanted})
    c = _Context(model=model, runner=runner, options=replace(options, lists=base.lists, thresholds=base.thresholds),
                 metric=metric, high=statistics.Run(base.stats, base.outputs))
    result = _float8_runs(c, search)
    best_count = search.best()
    if best_count is None:  # nothing quantized: the float8 rewrite is the float16 one, with its reasons
        calibration = replace(base, target=target.name, result=result, float8=float8.Float8Calibration(search.amax, {}),
                              tolerance=target.tolerance)
    else:
        _, result, lossy = search.tried[best_count]
        calibration = replace(base, target=target.name, rounds=base.rounds + tuple(search.rounds), result=result,
                              float8=float8.Float8Calibration(search.amax, lossy), tolerance=target.tolerance,
                              best=len(base.rounds) + list(search.tried).index(best_count))
    _report_float8(c, search, calibration)
    return calibration


def _float8_runs(c: _Context, search: _Float8Search) -> RewriteResult:
    """4. The float8 runs (``_calibrate_float8``), each recorded in ``search``, until the
    search is over or the runs are spent. Returns the last rewrite."""
    count = 0
    while True:
        lossy = {m: _lossy_reason(c, search, m, count) for m in search.ranked[:count]}
        result = rewrite_model(c.model, target=c.target.name, lists=c.options.lists,
                               cross_function=c.options.cross_function, amax=search.amax, lossy=lossy)
        quantized = sorted({(d.function, d.node) for d in result.report.decisions
                            if d.rule == Rule.FLOAT8_MATMUL.value})
        if not search.rounds and not quantized:  # the float16 rewrite, validated already
            why = collections.Counter(d.rule for d in result.report.decisions if d.rule.startswith("float8-"))
            found = ", ".join(f"{rule} {n}" for rule, n in why.most_common()) or "no converted matmul"
            c.say(f"calibration: float8: no matmul quantized ({found}); no float8 run needed")
            return result
        checks, summary = _float8_run(c, search, result, quantized)
        score = Round(checks, {}).score(c.target.tolerance)
        search.record(count, score, result, lossy)
        next_count = search.next_count(count, score) if checks else None  # nothing to compare: nothing to search
        if next_count is None or len(search.rounds) + 1 >= c.options.max_rounds:
            search.rounds.append(Round(checks, {}, "float8"))
            c.say(f"calibration: float8 validation run {len(search.rounds)}: {summary}")
            return result
        moved = {m: "" for m in search.ranked[count:next_count]} if next_count > count else {}
        search.rounds.append(Round(checks, moved, "float8"))
        action = (f"keeping the {next_count} worst float16" if next_count > count
                  else f"giving {count - next_count} back to float8: the {next_count} worst stay float16")
        c.say(f"calibration: float8 validation run {len(search.rounds)}: {summary}; {action}")
        count = next_count


def _float8_run(c: _Context, search: _Float8Search, result: RewriteResult, quantized: Sequence[tuple[str, str]]
                ) -> tuple[tuple[OutputCheck, ...], str]:
    """One float8 run of ``result`` on the calibration inputs; the first also measures each
    quantized matmul's own FP8 error (``_with_probes``) and ranks them by it in ``search``.
    Returns each output's error and the run's line."""
    first = not search.rounds
    probed, probes = _with_probes(result.program, quantized) if first else (result.program, {})
    low, checks = c.validate(probed, [key for pair in probes.values() for key in pair])
    for matmul, (reference, difference) in probes.items():
        if reference in low.stats and difference in low.stats:
            search.errors[matmul] = _relative_rms(low.stats[difference], low.stats[reference])
    summary = f"{len(quantized)} matmul(s) on float8; {c.summary(checks)}"
    if first:
        search.ranked = ranked = sorted(quantized, key=lambda m: (-search.errors.get(m, 0.0), m))
        summary += (f"; own FP8 error of each, of its output's RMS: {search.errors.get(ranked[0], 0.0):.3g} (worst,"
                    f" {ranked[0][1]}) to {search.errors.get(ranked[-1], 0.0):.3g}") if ranked else ""
    return checks, summary


def _report_float8(c: _Context, search: _Float8Search, calibration: Calibration) -> None:
    """The last line of a float8 calibration that did not meet the goal: why, and what to do
    (nothing compared: its runs' lines said so)."""
    if not calibration.compared:
        return
    if not calibration.ok:
        c.say(f"calibration: float8 outputs still over tolerance {c.target.tolerance:g} after {len(search.rounds)}"
              f" float8 validation run(s) (--max-rounds {c.options.max_rounds}); use --max-rounds up to"
              f" {MAX_ROUNDS_LIMIT}, or target {c.target.colouring} for this model")
    elif not calibration.reached_goal:
        c.say(f"calibration: float8 within tolerance but over the goal {c.goal:g};"
              " held-out data may exceed the tolerance")


def _relative_rms(difference: TensorStats, reference: TensorStats) -> float:
    """The RMS of a difference over the RMS of the reference: 0 where both are 0."""
    if difference.nonfinite > reference.nonfinite:
        return math.inf
    if reference.rms > 0:
        return difference.rms / reference.rms
    return 0.0 if difference.rms == 0 else math.inf


def _lossy_reason(c: _Context, search: _Float8Search, matmul: tuple[str, str], count: int) -> str:
    """Why ``matmul`` stays float16 in a run that keeps the ``count`` worst so: its own error, and the first run's."""
    rounds = search.rounds
    first = max((check.error for check in rounds[0].checks), default=0.0) if rounds else 0.0
    return (f"calibration: own float8 error {search.errors.get(matmul, 0.0):.3g} of its output's RMS, among the"
            f" {count} worst of {len(search.ranked)} quantized matmul(s); all on float8, the model's {c.metric.name}"
            f" was {first:.3g} (goal {GOAL_SHARE * c.target.tolerance:g})")


def _float8_count(ranked: Sequence[tuple[str, str]], errors: Mapping[tuple[str, str], float], count: int,
                  score: float) -> int:
    """How many of the worst matmuls to keep float16 next, more than ``count`` (which gave
    ``score``): as few as a quadrature model (the output error ∝ the root sum of squares of
    the quantized matmuls' own errors, its factor fitted to this run) predicts bring the
    score to ``_FLOAT8_AIM`` of the goal. A non-finite run keeps the worse half more."""
    squares = [min(errors.get(m, 0.0), 1e6) ** 2 for m in ranked]
    left = sum(squares[count:])
    if not math.isfinite(score) or left <= 0:
        return count + max(1, (len(ranked) - count) // 2)
    factor, next_count = score / math.sqrt(left), count
    while next_count < len(ranked) and factor * math.sqrt(max(left, 0.0)) > _FLOAT8_AIM * GOAL_SHARE:
        left -= squares[next_count]
        next_count += 1
    return max(next_count, count + 1)


def _with_probes(program: Program, quantized: Sequence[tuple[str, str]]
                 ) -> tuple[Program, dict[tuple[str, str], tuple[TensorKey, TensorKey]]]:
    """``program`` (a float8 rewrite's) with ``float8.add_probes`` in every item that holds
    ``quantized`` matmuls: matmul → (its float16 copy's tensor, the difference's tensor)."""
    output = copy_graph_def(program.graph_def)
    by_item: dict[str, list[str]] = {}
    for function, node in quantized:
        by_item.setdefault(function, []).append(node)
    probes: dict[tuple[str, str], tuple[TensorKey, TensorKey]] = {}
    for item, names in by_item.items():
        body, found = float8.add_probes(program.item(item), names)
        program.put(output, item, body)
        for node, (reference, difference) in found.items():
            probes[(item, node)] = (TensorKey(item, reference, 0), TensorKey(item, difference, 0))
    return program_of(output), probes
