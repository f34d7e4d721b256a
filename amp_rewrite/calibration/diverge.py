"""Where a converted model first diverges from float32, the path its error takes to the worst
output, and the ``--keep`` that brings the outputs back within the target's tolerance.

The float32 model and its conversion run on the same inputs with every float tensor of the
float32 model instrumented (``statistics.Runner.collect``, calibration's one way to read
intermediate tensors); a converted node's output keeps its name, so each tensor of the
conversion is compared with float32's tensor of the same name (the rewrite's own casts are
not compared). A tensor's error is calibration's ``drift``: the larger of the relative
changes of its largest magnitude and of its RMS over the inputs, infinite where it holds
non-finite values float32's does not.

**The first diverging node** is the first node, in execution order (each item's
topological order, a called function's body at its call), whose output's error is over
the target's tolerance while every float tensor it reads is within it. Error grows along
a path; a node whose inputs already diverged carries the error, it does not make it.

**The fix**, checked by running it: a converted node that diverges is kept float32; a
float32 node that diverges amplifies the rounding of what it reads (a softmax fed large
logits), so the converted nodes that feed it are kept. While an output is still over the
tolerance, the run with the keeps applied names the next first diverging node, up to
``max_runs`` runs of the conversion.
"""
from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import networkx as nx
import numpy as np
from tensorflow.core.framework import graph_pb2, types_pb2

from amp_rewrite.calibration import calibrate, statistics, validate
from amp_rewrite.calibration.calibrate import OutputCheck, Touching, drift
from amp_rewrite.calibration.savedmodel import Model, ModelError, plumbing_kinds, read_model, rewrite_model
from amp_rewrite.calibration.statistics import TensorKey, TensorStats
from amp_rewrite.core import functions
from amp_rewrite.core.casts import is_amp_cast
from amp_rewrite.core.float8.inference import amp_source
from amp_rewrite.core.graph_io import data_inputs, parse_tensor_name
from amp_rewrite.core.instrument import execution_order
from amp_rewrite.core.lists import OpLists, load_float8, load_lists
from amp_rewrite.core.program import MAIN_GRAPH, Program
from amp_rewrite.core.rewrite import RewriteResult
from amp_rewrite.core.rules import Rule
from amp_rewrite.core.target import FLOAT_DTYPES, Target, lookup_target
from amp_rewrite.core.typegraph import output_dtypes

DEFAULT_MAX_RUNS = 5  # runs of the conversion: the first, and up to four with keeps added (calibration caps its runs at 5 too)
_PATH_SHOWN = 8  # nodes of a path shown; the middle of a longer one is elided
_BOUNDARY = frozenset({"_Arg", "_Retval"})
FLOAT8 = "float8"  # what a matmul on float8_e4m3fn operands runs in, for ``Found.runs_in``
_FEEDERS_SEARCHED = 64  # float32 nodes searched upstream of a float32 diverging node for the converted ones feeding it
Node = tuple[str, str]  # (function, node); MAIN_GRAPH "" for the main graph
# The dtypes a converted node outputs, by name (a converted model's graph tells them so).
_LOW_DTYPES = {dtype: found.name for dtype, found in FLOAT_DTYPES.items() if dtype != types_pb2.DT_FLOAT}


@dataclass(frozen=True)
class Found:
    """A first diverging node: where it is, its op, its output's error and float32's largest
    |x| there, what the conversion ran it in, and the path to the worst output."""

    node: Node
    op: str
    error: float  # its output's drift; math.inf: non-finite where float32 is finite
    largest: float
    runs_in: str  # "float32", the dtype it was converted to, or FLOAT8 (a matmul on float8 operands)
    path: tuple[str, ...] = ()
    read_largest: float = 0.0  # float32's largest |x| of the float tensors it reads

    @property
    def converted(self) -> bool:
        return self.runs_in != "float32"

    def describe(self) -> str:
        where = f" in function '{self.node[0]}'" if self.node[0] else ""
        how = f"converted to {self.runs_in}" if self.converted else "float32"
        read = f", of what it reads {self.read_largest:.3g}"
        what = (f"turned non-finite (float32's largest |x| {self.largest:.3g}{read})" if math.isinf(self.error)
                else f"is {self.error:.3g} off float32's (largest |x| {self.largest:.3g}{read})")
        return f"{self.node[1]} ({self.op}, {how}){where}: its output {what}"


@dataclass(frozen=True)
class Step:
    """One run of the conversion: the keep entries it applied, each output's error, and its
    first diverging node (None: none diverges beyond the tolerance)."""

    keep: tuple[str, ...]
    checks: tuple[OutputCheck, ...]
    found: Found | None


@dataclass(frozen=True)
class Divergence:
    """What ``find_divergence`` (``run_search``) found: each run of the conversion (the first as given, each
    later one with more nodes kept float32), and the keep entries (entry → why) the last
    applied."""

    target: str
    tolerance: float
    metric: str
    steps: tuple[Step, ...]
    keep: Mapping[str, str] = field(default_factory=dict)
    converted: str = ""  # the conversion on disk the first run ran ("": the options' rewrite)

    @property
    def first(self) -> Found | None:
        """The conversion's first diverging node, as given."""
        return self.steps[0].found

    @property
    def fixed(self) -> bool:
        """Whether the keeps bring every output within the tolerance (a run with them says so)."""
        return len(self.steps) > 1 and all(c.within(self.tolerance) for c in self.steps[-1].checks)

    def lines(self) -> list[str]:
        """The report, for ``explain --diverge`` and the dump."""
        first = self.first
        if first is None:
            return [f"Divergence: no node diverges beyond {self.tolerance:g} from float32 in {self.target};"
                    f" {self._outputs(self.steps[0].checks)}"]
        lines = [f"Divergence (tolerance {self.tolerance:g}): first diverging node {first.describe()}",
                 f"  path to the worst output: {' -> '.join(first.path)}",
                 f"  run 1, {self.converted or 'the conversion'}: {self._outputs(self.steps[0].checks)}"]
        rewrite = "the options' rewrite with " if self.converted else ""
        for number, step in enumerate(self.steps[1:], start=2):
            more = (f"; then {step.found.describe()}" if step.found is not None
                    and not all(c.within(self.tolerance) for c in step.checks) else "")
            entries = f"{len(step.keep)} keep entr{'y' if len(step.keep) == 1 else 'ies'}"
            lines.append(f"  run {number}, {rewrite}{entries}: {self._outputs(step.checks)}{more}")
        if first.runs_in == FLOAT8:
            lines.append(f"  a float8 matmul: its operands' amax may be stale; amp-rewrite calibrate --target"
                         f" {self.target} measures them again; or keep it float32 as below")
        return [*lines, self._fix_line()]

    def _fix_line(self) -> str:
        """The keeps that fixed it, or how far the runs got."""
        keeps = " ".join(f"--keep '{entry}'" for entry in self.keep)
        if self.fixed:
            return f"  fix: {keeps}"
        if not keeps:
            return ("  no node to keep: it runs float32 and no converted node feeds it in its function;"
                    " amp-rewrite calibrate may find what to keep")
        return (f"  not fixed in {len(self.steps)} run(s): {keeps} is a start; amp-rewrite calibrate finds"
                " the rest")

    def _outputs(self, checks: Sequence[OutputCheck]) -> str:
        worst = max(checks, key=lambda c: c.error if math.isfinite(c.error) else math.inf)
        verdict = "within" if worst.within(self.tolerance) else "over"
        return (f"worst output {worst.signature}/{worst.output} {validate.shown(self.metric)} {worst.error:.3g}"
                f" ({verdict} tolerance)")


@dataclass(frozen=True)
class Options:
    """How one search runs: the target (its tolerance is the bound), the lists of the
    conversion as given, the rewrite that makes a conversion from lists (float8's amax
    bound in), how an output's error is measured, the cap on runs and what the inputs are
    (for the error a model that fails on them gets)."""

    target: Target
    lists: OpLists
    rewrite: Callable[[OpLists], RewriteResult]
    metric: str | validate.Metric = validate.DEFAULT_METRIC
    max_runs: int = DEFAULT_MAX_RUNS
    described: str = "the inputs"
    converted: Model | None = None  # a conversion on disk: the first run's, instead of ``rewrite(lists)``
    rewritten: RewriteResult | None = None  # ``rewrite(lists)`` where the caller made it already


@dataclass(frozen=True)
class _Float32:
    """The float32 model's run and what every run of the conversion is compared with: the
    tensors measured, which nodes read and write them, where each node is met (for
    ``keep_entries``), the execution order and each node's op."""

    model: Model
    run: statistics.Run
    keys: Sequence[TensorKey]
    touching: Touching
    where: Mapping[str, set[str]]
    order: Sequence[Node]
    ops: Mapping[Node, str]


def run_search(model: Model, feeds: validate.Feeds, options: Options) -> Divergence:
    """The first diverging node of ``options``' conversion of ``model`` (or of
    ``options.converted``) on ``feeds`` (``validate.plan_feeds``), and the keeps that fix it
    (module doc); the float32 model and the rewrites in one session."""
    metric = validate.lookup_metric(options.metric)
    small_below = calibrate.Thresholds.for_target(options.target).smallest_normal
    tolerance = options.target.tolerance
    with statistics.Runner(model, feeds) as runner:
        base = _measure_float32(model, runner, small_below, options.described)
        kept: dict[Node, str] = {}
        steps: list[Step] = []
        while True:
            entries = {}  # in the order found: the first diverging node's first
            for node, why in kept.items():
                entries.update(calibrate.keep_entries({node: why}, base.where))
            if options.converted is not None and not steps:
                conversion, low = _run_converted(base, options.converted, feeds, small_below, options.described)
            else:
                result = (options.rewritten if options.rewritten is not None and not entries
                          else options.rewrite(options.lists.keeping(entries) if entries else options.lists))
                conversion = _of_result(result)
                low = runner.collect(result.program, base.keys, small_below, options.described)
            step = _step(base, low, conversion, metric, tolerance, tuple(entries))
            steps.append(step)
            added = {} if step.found is None else {node: f"diverge: {step.found.describe()}"
                                                   for node in fixing_nodes(step.found, conversion) if node not in kept}
            within = all(c.within(tolerance) for c in step.checks)
            if (len(steps) > 1 and within) or not added or len(steps) >= options.max_runs:
                return Divergence(options.target.name, tolerance, metric.name, tuple(steps), entries,
                                  str(options.converted.path) if options.converted is not None else "")
            kept.update(added)


def find_divergence(
    source: str | os.PathLike | graph_pb2.GraphDef,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    *,
    target: str | Target = "float16",
    fetches: Sequence[str] = (),
    tag_set: str | None = None,
    lists: str | os.PathLike | OpLists | None = None,
    cross_function: bool | str = False,
    metric: str | validate.Metric = validate.DEFAULT_METRIC,
    converted: str | os.PathLike | None = None,
) -> Divergence:
    """Where the conversion of ``source`` (a SavedModel directory, a GraphDef file or a
    ``GraphDef``, as ``calibrate`` takes it) to ``target`` with ``lists`` (an overlay: its
    keep_nodes, and float8's amax) first diverges from float32 on ``inputs`` (an ``.npz``
    file or arrays by input name; None: random inputs), the path to the worst output and
    the keeps that bring the outputs within the target's tolerance, each checked by a run
    (module doc). ``converted``: a conversion of ``source`` on disk to compare instead.
    ``.first`` is the first diverging node (None: none), ``.keep`` the keep_nodes entries,
    ``.fixed`` whether they bring the outputs within the tolerance, ``.lines()`` the report."""
    found = lookup_target(target, quantized=True)
    model = calibrate.source_model(source, fetches, tag_set)
    data = Path(inputs) if isinstance(inputs, (str, os.PathLike)) else inputs
    feeds, _ = validate.plan_feeds(model, data, calibrate.RANDOM_FEEDS)
    overlay = lists if isinstance(lists, (str, os.PathLike)) else None
    return run_search(model, feeds, Options(
        target=found, lists=load_lists(found, lists),
        rewrite=rewriter(model, found, cross_function=cross_function, overlay=overlay), metric=metric,
        converted=read_model(converted, fetches, tag_set) if converted is not None else None,
        described=statistics.RANDOM_INPUTS if inputs is None else str(data) if isinstance(data, Path)
        else "the arrays given"))


def rewriter(model: Model, target: Target, *, cross_function: bool | str = False,
             overlay: str | os.PathLike | None = None) -> Callable[[OpLists], RewriteResult]:
    """The rewrite of ``model`` to ``target`` with the lists it is given (a run that keeps
    more nodes float32): target float8's amax and lossy from ``overlay`` bound in."""
    found = load_float8(overlay) if overlay is not None and target.name == FLOAT8 else None
    quantized = {"amax": found.amax, "lossy": found.lossy} if found is not None else {}

    def rewrite(lists: OpLists) -> RewriteResult:
        return rewrite_model(model, target=target.name, lists=lists, cross_function=cross_function, **quantized)

    return rewrite


def _measure_float32(model: Model, runner: statistics.Runner, small_below: float, described: str) -> _Float32:
    """The float32 model run with every float tensor measured, and what the runs after it are compared with."""
    keys = statistics.model_tensors(model)
    high = runner.collect(model.program, keys, small_below, described)
    order = execution_order(model.program)
    return _Float32(model, high, keys, calibrate.tensors_of(model.program, set(high.stats)),
                    calibrate.node_items(model.program), order, dict(_ops(model.program, order)))


def _run_converted(base: _Float32, converted: Model, feeds: validate.Feeds, small_below: float,
                   described: str) -> tuple[_Conversion, statistics.Run]:
    """A conversion on disk run on ``feeds`` in a session of its own; one that lacks most of
    the tensors the float32 model computed is another model's, and refused."""
    conversion = _of_model(converted, base.order)
    library = conversion.program.library
    keys = [key for key in base.keys if key.function == MAIN_GRAPH or key.function in library]
    low = statistics.collect(converted, conversion.program, feeds, keys, small_below, described)
    missing = [key for key in base.run.stats if key not in low.stats]
    if len(missing) > len(base.run.stats) / 2:
        raise ModelError(f"{converted.path}: {len(missing)} of the {len(base.run.stats)} float tensors"
                         f" {base.model.path} computes are not in it (e.g. '{missing[0].node}'); --converted takes"
                         f" a conversion of {base.model.path}, as amp-rewrite convert writes it")
    return conversion, low


def _step(base: _Float32, low: statistics.Run, conversion: _Conversion, metric: validate.NamedMetric,
          tolerance: float, keep: tuple[str, ...]) -> Step:
    """One run of a conversion (with ``keep``) judged: each output's error and its first
    diverging node, with its path."""
    checks = calibrate.output_checks(base.run, low, metric.function)
    if not checks:
        raise ModelError(f"{base.model.path}: no output of the model is a number, so no run can show where it"
                         " diverges; compare a model with a numeric output")
    found = first_diverging(base, low.stats, conversion, tolerance)
    if found is not None:
        found = replace(found, path=worst_path(base, found.node, checks))
    return Step(keep, checks, found)


@dataclass(frozen=True)
class _Conversion:
    """A conversion as the search reads it: its graph, and what each node it converted runs
    in (a dtype name, or ``FLOAT8``); a node not there runs float32."""

    program: Program
    runs_in: Mapping[Node, str]


def _of_result(result: RewriteResult) -> _Conversion:
    """A rewrite's conversion, from its decisions."""
    return _Conversion(result.program, {(d.function, d.node): FLOAT8 if d.rule == Rule.FLOAT8_MATMUL.value
                                        else d.after for d in result.report.decisions if d.converted})


def _of_model(converted: Model, order: Sequence[Node]) -> _Conversion:
    """A converted model's conversion, from its graph: the nodes of the float32 model's items
    with an output of a low dtype (but the rewrite's own casts)."""
    program = converted.program
    runs_in: dict[Node, str] = {}
    for item in dict.fromkeys(item for item, _ in order):
        if item != MAIN_GRAPH and item not in program.library:
            continue
        for node_def in program.item(item).node:
            low = [_LOW_DTYPES[d] for d in output_dtypes(node_def, program.op_defs) if d in _LOW_DTYPES]
            if low and not is_amp_cast(node_def):
                runs_in[(item, node_def.name)] = low[0]
    return _Conversion(program, runs_in)


def _ops(program: Program, order: Sequence[Node]) -> Iterator[tuple[Node, str]]:
    for item in dict.fromkeys(item for item, _ in order):
        for node_def in program.item(item).node:
            yield (item, node_def.name), node_def.op


def _error(keys: Sequence[TensorKey], high: Mapping[TensorKey, TensorStats],
           low: Mapping[TensorKey, TensorStats]) -> float:
    """The largest drift of ``keys`` (0 for none)."""
    return max((drift(low.get(k), high.get(k)) for k in keys), default=0.0)


def first_diverging(base: _Float32, low: Mapping[TensorKey, TensorStats], conversion: _Conversion,
                    tolerance: float) -> Found | None:
    """The first node of ``base.order`` whose output is over ``tolerance`` from float32's
    while every float tensor it reads is within it (module doc); None: no such node. Its
    path is left for ``worst_path``."""
    high = base.run.stats
    for node in base.order:
        keys = base.touching.get(node, ())
        written = [k for k in keys if k[:2] == node]
        if not written or base.ops.get(node) in _BOUNDARY:
            continue
        error, read = _error(written, high, low), [k for k in keys if k[:2] != node]
        if error > tolerance and not _error(read, high, low) > tolerance:
            largest = max((high[k].max_abs for k in written if k in high), default=0.0)
            return Found(node, base.ops[node], error, largest, conversion.runs_in.get(node, "float32"),
                         read_largest=max((high[k].max_abs for k in read if k in high), default=0.0))
    return None


def fixing_nodes(found: Found, conversion: _Conversion) -> list[Node]:
    """What to keep float32 for ``found``: itself where it was converted; else the converted
    nodes that feed it in its item, through float32 nodes (its error is their rounding,
    amplified), nearest first."""
    if found.converted:
        return [found.node]
    item, name = found.node
    if item != MAIN_GRAPH and item not in conversion.program.library:
        return []
    nodes = {node_def.name: node_def for node_def in conversion.program.item(item).node}
    converted = conversion.runs_in
    feeders: list[Node] = []
    pending, seen = [name], {name}
    while pending and len(seen) < _FEEDERS_SEARCHED:
        for tensor in data_inputs(nodes[pending.pop(0)]):
            source = amp_source(nodes, tensor).node
            if source in seen or source not in nodes:
                continue
            seen.add(source)
            if (item, source) in converted:
                feeders.append((item, source))
            elif nodes[source].op not in _BOUNDARY:
                pending.append(source)
    return feeders


def worst_path(base: _Float32, node: Node, checks: Sequence[OutputCheck]) -> tuple[str, ...]:
    """The nodes from ``node`` to the worst output of ``checks`` along the data edges, into
    and out of called functions (``_flow``), but function boundaries and TensorFlow's
    plumbing; a long path's middle elided."""
    worst = max(checks, key=lambda c: c.error if math.isfinite(c.error) else math.inf)
    output = f"output {worst.signature}/{worst.output}"
    tensor = base.model.signatures[worst.signature][1][worst.output]
    try:
        path = nx.shortest_path(_flow(base), node, (MAIN_GRAPH, parse_tensor_name(tensor).node))
    except (nx.NetworkXNoPath, nx.NodeNotFound):
        return node[1], f"(no data path to {output})"
    plumbing = plumbing_kinds(base.model)  # signature wrappers and the loader's graph: the same in every model
    names = [name for item, name in path if base.ops.get((item, name)) not in _BOUNDARY and item not in plumbing]
    if len(names) > _PATH_SHOWN:
        names = [*names[:4], f"... {len(names) - 7} more ...", *names[-3:]]
    return (*names, output)


def _flow(base: _Float32) -> nx.DiGraph:
    """The data edges of every item ``base.order`` runs, as one graph of (item, node): a call
    node's inputs flow into its function's ``_Arg`` nodes, its ``_Retval`` nodes into the call."""
    program, graph = base.model.program, nx.DiGraph()
    items = set(item for item, _ in base.order)
    for item in items:
        for node_def in program.item(item).node:
            graph.add_edges_from(((item, parse_tensor_name(t).node), (item, node_def.name))
                                 for t in data_inputs(node_def))
            for called in set(functions.called_functions(node_def)) & items:
                for boundary in program.item(called).node:
                    if boundary.op == "_Arg":
                        graph.add_edge((item, node_def.name), (called, boundary.name))
                    elif boundary.op == "_Retval":
                        graph.add_edge((called, boundary.name), (item, node_def.name))
    return graph
