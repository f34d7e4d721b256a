"""``--tune speed`` on a model: time its converted ops here, keep float32 what does not pay,
then time the whole result against the source (README, "Tuning for speed").

1. **Shapes.** The feeds at each batch size (``--batch-sizes``; the inputs given or random
   ones, their first dim set to the batch) give every tensor's shape (``tuning.shapes``).
2. **Timing.** Each node the rewrite converts is timed alone in float32 and in the
   target, and so are the casts at the shapes it would need; identical ops once, what the
   cache knows not at all, largest first while the budget's op share lasts (``tuning.timing``).
3. **Decisions.** A minimum cut picks the converted nodes to keep float32
   (``tuning.decide``); they become keep_nodes entries whose reasons name the measurement
   (rule ``measured-slower``), and the model is rewritten with them. Numerics come first:
   the lists, ``--keep`` and calibration decide before this, which only adds keeps.
4. **The whole model** (``check_speed``): the written result and the source, called in
   turn at each batch size for what is left of the budget (a step starts only where it is
   expected to fit); a batch size where the result is slower gets one line naming the
   ops that cost most, one left unchecked a line saying why.
"""
from __future__ import annotations

import contextlib
import hashlib
import math
import os
import statistics
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import tensorflow as tf
import yaml
from tensorflow.core.framework import graph_pb2

from amp_rewrite.calibration import statistics as tensor_statistics
from amp_rewrite.calibration import staging, validate
from amp_rewrite.calibration.calibrate import keep_entries, node_items
from amp_rewrite.calibration.savedmodel import Model, plumbing_kinds, read_model, rewrite_model
from amp_rewrite.calibration.staging import write_text_atomically
from amp_rewrite.core.graph_io import parse_tensor_name, tensor_name
from amp_rewrite.core.lists import OpLists, load_lists
from amp_rewrite.core.program import program_of
from amp_rewrite.core.rewrite import RewriteResult, rewrite_graph_def
from amp_rewrite.core.target import Target, lookup_target
from amp_rewrite.errors import AmpRewriteError, ModelError, tensorflow_cause
from amp_rewrite.tuning import cache as timing_cache
from amp_rewrite.tuning.decide import Plan, Problem, costliest, loop_scale, plan_keeps, plan_rewrite
from amp_rewrite.tuning.shapes import Shapes, infer_shapes, traced_inputs
from amp_rewrite.tuning.timing import Budget, Timings

DEFAULT_BUDGET_S = 30.0
OP_SHARE = 0.6       # of the budget, for timing ops; the whole-model check has the rest, and what ops left
MIN_ROUNDS = 3       # whole-model rounds per batch size below which no ratio is given
MAX_ROUNDS = 15
SLOWER = 0.95        # a result under this speed-up is called slower: within 5%, two runs of one model differ
DEFAULT = object()   # cache=DEFAULT: the file at tuning.cache.default_path()
LOOP_PROBES = 8      # float tensors counted per function a loop runs, for its iterations
LOOP_SHARE = 0.5     # of the budget the op timing left, for running a model with converted loops whole

BatchFeeds = dict[int, validate.Feeds]  # batch size -> the feeds at it


def check_budget(budget_s: float) -> float:
    if not (isinstance(budget_s, (int, float)) and math.isfinite(budget_s) and budget_s > 0):
        raise AmpRewriteError(f"timing budget {budget_s!r}: use a number of seconds above 0, e.g. 30")
    return float(budget_s)


def check_target(target: Target) -> None:
    """Timing measures the target's kernels where they run: a GPU for float16."""
    if target.colouring != target.name:
        raise AmpRewriteError(f"--tune speed: not for target {target.name} (its FP8 matmuls run under XLA on a GPU);"
                              " tune the float16 rewrite instead")
    if target.device_type == "GPU" and not tf.config.list_physical_devices("GPU"):
        raise AmpRewriteError(f"--tune speed: target {target.name} runs on a GPU and TensorFlow sees none here;"
                              " convert on the machine you serve on")


# --- 1. shapes: the feeds at each batch size ---------------------------------------------------


def batch_feeds(model: Model, inputs: Path | Mapping[str, np.ndarray] | None,
                batch_sizes: Sequence[int] | None) -> tuple[BatchFeeds, list[str]]:
    """One feed per signature at each batch size: the inputs given (their first dim
    repeated or cut to the batch), or random ones; ``batch_sizes`` None: the inputs' batch
    (1 for random ones). Unknown dims other than the first need the inputs given."""
    feeds, notes = validate.plan_feeds(model, inputs, 1)
    specs = validate.input_specs(model)
    if inputs is None:
        vague = next((s for s in specs if s.shape is None or None in s.shape[1:]), None)
        if vague is not None:
            raise ModelError(f"{model.path}: {vague.describe()} has unknown dims beyond the batch; timing needs"
                             " their sizes: pass --inputs FILE.npz with arrays of the shapes you serve")
    first = next((a for runs in feeds.values() for feed in runs for a in feed.values() if a.ndim), None)
    sizes = tuple(batch_sizes or (first.shape[0] if inputs is not None and first is not None else 1,))
    fixed = next((s for s in specs if s.shape and s.shape[0] is not None and set(sizes) - {s.shape[0]}), None)
    if fixed is not None:
        raise ModelError(f"{model.path}: {fixed.describe()} has a fixed batch of {fixed.shape[0]}; time it at that"
                         f" batch size (--batch-sizes {fixed.shape[0]})")
    by_batch: BatchFeeds = {}
    for size in sizes:
        by_batch[size] = {key: [{name: _at_batch(array, size) for name, array in runs[0].items()}]
                          for key, runs in feeds.items() if runs}
    return by_batch, notes


def _at_batch(array: np.ndarray, size: int) -> np.ndarray:
    if array.ndim == 0 or array.shape[0] == size:
        return array
    return np.take(array, np.arange(size) % max(array.shape[0], 1), axis=0)


def _feed_shapes(model: Model, feeds: validate.Feeds) -> dict[str, tuple[int, ...]]:
    """Placeholder node -> the shape fed to it."""
    found: dict[str, tuple[int, ...]] = {}
    for key, runs in feeds.items():
        for name, array in runs[0].items():
            if model.kind == "savedmodel":
                name = parse_tensor_name(model.meta_graph.signature_def[key].inputs[name].name).node
            found[name] = tuple(array.shape)
    return found


# --- 2-3. timing ops, deciding ------------------------------------------------------------------


@dataclass(frozen=True)
class Tuning:
    """What timing decided for one model: the rewrite with its keeps, and how it got there."""

    model: Model
    target: Target
    result: RewriteResult               # the rewrite with the timing's keeps
    lists: OpLists                      # the lists it was made with: the given ones plus ``keep``
    keep: Mapping[str, str]             # keep_nodes entries -> the measurement (rule measured-slower)
    plan: Plan                          # per (function, node) kept, and the modeled seconds per batch size
    problem: Problem                    # what was timed, per node and batch size
    timings: Timings
    feeds: BatchFeeds
    budget: Budget
    weights_low: bool                   # weights stored in the target: reading one costs no cast
    notes: tuple[str, ...] = ()         # for the user: what could not be timed

    def overlay(self, base: Mapping | None = None) -> str:
        """The decisions as an overlay (YAML) for ``--lists``: ``base`` (the overlay this run
        was given) with ``keep`` added to its keep_nodes."""
        data = dict(base or {})
        keep = data.get("keep_nodes") or {}
        keep = dict(keep) if isinstance(keep, dict) else dict.fromkeys(keep, "")
        keep.update(self.keep)
        data["keep_nodes"] = keep
        return yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=120)

    def summary(self) -> str:
        """One line: what moved, the modeled speed-up per batch size, what the timing cost."""
        modeled = ", ".join(f"batch {b} {f32 / tuned if tuned else 1:.2f}x (lists alone {f32 / low if low else 1:.2f}x)"
                            for b, (f32, low, tuned) in self.plan.modeled.items())
        t = self.timings
        untimed = f", {t.skipped} left untimed by the budget" if t.skipped else ""
        kept, candidates = len(self.plan.keep), len(self.problem.candidates)
        return (f"Timing: {kept} of {candidates} converted node(s) kept float32 as slower here;"
                f" modeled speed of the converted ops: {modeled}; {t.timed} op(s) timed, {t.cached} from the cache"
                f"{untimed}, {self.budget.spent():.1f} s of the {self.budget.seconds:g} s budget")


def tune_model(model: Model, feeds: BatchFeeds, *, target: str | Target, lists: OpLists,
               cross_function: bool | str = False, budget_s: float = DEFAULT_BUDGET_S,
               cache: timing_cache.TimingCache | None = None, weights_low: bool = True,
               base: RewriteResult | None = None) -> Tuning:
    """Steps 1-3 for ``model`` at the batch sizes of ``feeds`` (``batch_feeds``). ``base``:
    the rewrite with ``lists`` if the caller has it. ``weights_low``: the weights will be
    stored in the target (convert's default), so reading one costs no cast."""
    target = lookup_target(target)
    check_target(target)
    budget = Budget(check_budget(budget_s))
    cache = cache or timing_cache.load_cache(None, timing_cache.gpu_name(target.device_type))
    base = base or rewrite_model(model, target=target.name, lists=lists, cross_function=cross_function)
    skip = [item for item, kind in plumbing_kinds(model).items() if kind == "save/restore"]
    shapes = {size: infer_shapes(model.program, _feed_shapes(model, fed), skip) for size, fed in feeds.items()}
    first = min(shapes)
    repeats, uncounted = loop_repeats(model, feeds[first], shapes[first])
    problem, timings, plan = plan_rewrite(model.program, base, target, shapes, cache,
                                          Budget(budget.left() * OP_SHARE), weights_low=weights_low, repeats=repeats)
    looped = run_loops(model, base, feeds, problem, timings=timings, target=target, weights_low=weights_low,
                       budget=budget, cache=cache)
    if problem.loop_scale:
        plan = plan_keeps(problem, timings, target.name, target.dtype, weights_low)
    keep = keep_entries(plan.keep, node_items(model.program, model.entry_functions)) if plan.keep else {}
    tuned_lists = lists.keeping(keep) if keep else lists
    result = rewrite_model(model, target=target.name, lists=tuned_lists, cross_function=cross_function) if keep \
        else base
    reached = set().union(*(found.graphs for found in shapes.values()))  # what no call reaches never runs
    untimeable = sum(1 for c in problem.candidates.values() if c.node[0] in reached and all(
        r is None for r in c.runs.values()))
    notes = [f"{untimeable} converted node(s) could not be timed alone (unknown shapes or values); they follow"
             " their neighbours"] if untimeable else []
    notes += [line for line in (uncounted, looped) if line]
    budget.pause()  # until the whole-model check: writing and validating are not timing
    return Tuning(model, target, result, tuned_lists, keep, plan, problem, timings, feeds, budget, weights_low,
                  tuple(notes))


def run_loops(model: Model, base: RewriteResult, feeds: BatchFeeds, problem: Problem, *, timings: Timings,
              target: Target, weights_low: bool, budget: Budget, cache: timing_cache.TimingCache) -> str:
    """Where loop bodies hold converted ops: the source and the lists' conversion (``base``)
    run whole at each batch size, in turn, for ``LOOP_SHARE`` of what ``budget`` has left
    once both are loaded (or their seconds from ``cache``, where this model ran whole on
    this machine before: a second conversion decides as the first); what a loop costs as
    it runs sets ``problem.loop_scale`` (``decide.loop_scale``). One line for the user (""
    where no loop holds a converted op)."""
    if not any(problem.looped(item) for item, _ in problem.candidates):
        return ""
    keys = _loop_keys(model, base, feeds)
    runs = {size: (cache.get(f"{key}: source"), cache.get(f"{key}: lists")) for size, key in keys.items()}
    missing = {size: fed for size, fed in feeds.items() if None in runs[size]}
    shown: dict[int, str] = {}
    if missing and budget.left() <= 0:
        shown.update((size, f"batch {size} not run: no time left in the budget") for size in missing)
    elif missing:
        try:
            with _conversion_loaded(model, base.graph_def) as lists:
                source = _loaded(model, model.path)
                end = time.perf_counter() + max(budget.left(), 0.0) * LOOP_SHARE  # loading both took what it took
                checks = _run_whole(missing, (source, lists), end)
        except (tf.errors.OpError, ValueError, KeyError, ModelError) as error:
            cause = str(error) if isinstance(error, ModelError) else tensorflow_cause(error)
            return f"the loops could not be run whole ({cause}): a loop body's ops count as timed alone"
        for size, check in checks.items():
            if check.speed is None:
                shown[size] = f"batch {size} not run: {check.unchecked or 'too few rounds fit in the budget'}"
                continue
            runs[size] = (check.source_s, check.source_s / check.speed)
            cache.put(f"{keys[size]}: source", runs[size][0])
            cache.put(f"{keys[size]}: lists", runs[size][1])
    for size, (source_s, lists_s) in runs.items():
        if size in shown:
            continue
        scale = loop_scale(problem, timings, target.dtype, weights_low, size, source_s=source_s, lists_s=lists_s)
        if scale is None:
            shown[size] = f"batch {size}: nothing in a loop was timed"
            continue
        problem.loop_scale[size] = scale
        shown[size] = (f"batch {size} {source_s * 1e3:.1f} -> {lists_s * 1e3:.1f} ms"
                       f"{'' if size in missing else ' (the timing cache)'}, a body's {target.name} seconds count"
                       f" x{scale:.2f}")
    said = "; ".join(shown[size] for size in sorted(shown))
    if not problem.loop_scale:
        return f"the loops were not run whole ({said}): a loop body's ops count as timed alone"
    return ("the source and the lists' conversion were run whole, to count what a loop body costs as it runs"
            f" (its ops timed alone say least): {said}")


def _loop_keys(model: Model, base: RewriteResult, feeds: BatchFeeds) -> dict[int, str]:
    """The timing cache's key of a whole run at each batch size: the source's graph, the
    conversion's (serialized once), the feeds."""
    graphs = hashlib.sha256()
    for graph_def in (model.graph_def, base.graph_def):
        graphs.update(graph_def.SerializeToString(deterministic=True))
    keys = {}
    for size, fed in feeds.items():
        digest = graphs.copy()
        for key, runs in sorted(fed.items()):
            for name, array in sorted(runs[0].items()):
                digest.update(f"{key}/{name}{array.shape}{array.dtype}".encode())
                digest.update(np.ascontiguousarray(array).tobytes())
        keys[size] = f"loop run whole {digest.hexdigest()[:16]}"
    return keys


def _run_whole(feeds: BatchFeeds, calls: tuple[Callable, Callable], end: float) -> dict[int, SpeedCheck]:
    """``calls`` (source, conversion) in turn at each batch size, each its share of the time to ``end``."""
    checks, took, last = {}, 0.0, 0
    for index, (size, fed) in enumerate(feeds.items()):
        share = (end - time.perf_counter()) / (len(feeds) - index)
        expected = took * max(size / last, 1.0) if last else 0.0  # a larger batch: up to as much longer
        checks[size], took = _check_batch(size, (calls[0](fed), calls[1](fed)), time.perf_counter() + share, expected)
        last = size
    return checks


@contextlib.contextmanager
def _conversion_loaded(model: Model, graph_def: graph_pb2.GraphDef) -> Iterator[Callable]:
    """``graph_def``, a rewrite of ``model``'s graph (its weights float32), loaded as
    ``_loaded`` loads a written result: a SavedModel staged in a temporary folder (the
    source's variables linked) for TensorFlow's loader; a GraphDef in a Session."""
    if model.kind != "savedmodel":
        yield _loaded(replace(model, graph_def=graph_def), model.path)
        return
    with staging.temporary_directory("amp-rewrite-timing-") as directory:
        tensor_statistics.stage_saved_model(model, graph_def, directory)
        yield _loaded(model, directory)


def loop_repeats(model: Model, feeds: validate.Feeds, shapes: Shapes) -> tuple[dict[str, float], str]:
    """How many times one call of the model runs each function a loop runs (``shapes.looped``):
    the model run once on ``feeds`` (each signature once), counting the elements that pass
    through a few of the function's float tensors, over every iteration
    (``statistics.collect``), over the elements each holds at its shape in ``shapes``; the
    median over those tensors. A function none of whose tensors ran is left out (1). Where
    the run fails, none is counted, and the second value says so in one line."""
    elements: dict[tensor_statistics.TensorKey, int] = {}
    for item in sorted(shapes.looped):
        probes = 0
        for node_def in model.program.item(item).node:
            info = shapes.info(item, tensor_name(node_def.name, 0))
            if probes < LOOP_PROBES and info is not None and info.dtype == tf.float32.as_datatype_enum \
                    and info.shape is not None and math.prod(info.shape) > 0:
                elements[tensor_statistics.TensorKey(item, node_def.name, 0)] = math.prod(info.shape)
                probes += 1
    if not elements:
        return {}, ""
    try:
        run = tensor_statistics.collect(model, model.program, feeds, list(elements),
                                        float(np.finfo(np.float32).tiny), "the timing inputs")
    except ModelError as error:
        loops = ", ".join(sorted({key.function for key in elements}))
        return {}, (f"the iterations of {loops} could not be counted ({error}); each counts once per call, so the"
                    " modeled speed leaves out most of the loop")
    counts: dict[str, list[float]] = {}
    for key, size in elements.items():
        if key in run.stats:
            counts.setdefault(key.function, []).append(run.stats[key].count / size)
    return {item: statistics.median(ratios) for item, ratios in counts.items()}, ""


def open_cache(path: str | os.PathLike | None | object, target: Target) -> timing_cache.TimingCache:
    """The cache at ``path`` (DEFAULT: the default file; None: none) for this machine and target."""
    where = timing_cache.default_path() if path is DEFAULT else path
    return timing_cache.load_cache(where, timing_cache.gpu_name(target.device_type))


def save_cache(cache: timing_cache.TimingCache) -> str:
    """Write what was measured into the cache file; the problem in one line, or ""."""
    if not cache.usable or not cache.added:
        return ""
    try:
        write_text_atomically(cache.path, cache.text())
    except OSError as error:
        return f"{cache.path}: cannot write the timing cache ({error.strerror or error}); the timings are lost"
    return ""


def tune(
    source: str | os.PathLike,
    inputs: str | os.PathLike | Mapping[str, np.ndarray] | None = None,
    *,
    target: str | Target = "bfloat16",
    batch_sizes: Sequence[int] | None = None,
    fetches: Sequence[str] = (),
    tag_set: str | None = None,
    lists: str | os.PathLike | OpLists | None = None,
    cross_function: bool | str = False,
    budget_s: float = DEFAULT_BUDGET_S,
    cache: str | os.PathLike | None | object = DEFAULT,
    weights_low: bool = True,
) -> Tuning:
    """Time the ops a rewrite of ``source`` (a SavedModel directory or a GraphDef file)
    converts, on this machine at ``batch_sizes`` (default: the inputs' batch, or 1), and
    keep float32 those that do not pay. ``inputs`` (an ``.npz`` or arrays by input name)
    give the shapes; random inputs need every dim but the batch known. ``cache``: the
    timing cache file (default ``$XDG_CACHE_HOME/amp_rewrite/timings.json``; None: none).
    Returns the decisions (``.keep``, ``.overlay()`` for ``lists=``) and the tuned rewrite
    (``.result``); ``.check_speed(written)`` times a written result against the source."""
    target = lookup_target(target)
    check_budget(budget_s)
    model = read_model(source, fetches, tag_set)
    data = Path(inputs) if isinstance(inputs, (str, os.PathLike)) else inputs
    feeds, _ = batch_feeds(model, data, batch_sizes)
    opened = open_cache(cache, target)
    tuning = tune_model(model, feeds, target=target, lists=load_lists(target, lists), cross_function=cross_function,
                        budget_s=budget_s, cache=opened, weights_low=weights_low)
    save_cache(opened)
    return tuning


@dataclass(frozen=True)
class StepTuning:
    """What ``tune_step`` timed into the cache for one training step."""

    cache: Path | None
    timings: Timings
    plan: Plan
    candidates: int
    budget: Budget

    def summary(self) -> str:
        """One line: what was timed and what it cost, and what the live rewrite will keep float32."""
        t = self.timings
        untimed = f", {t.skipped} left untimed by the budget" if t.skipped else ""
        return (f"Timed the step: {t.timed} op(s) timed, {t.cached} from the cache{untimed}, {self.budget.spent():.1f} s"
                f" of the {self.budget.seconds:g} s budget; with timing_cache={self.cache}, the live rewrite keeps"
                f" {len(self.plan.keep)} of its {self.candidates} converted node(s) float32")


def tune_step(step: Any, *args: Any, timing_cache: str | os.PathLike | object = DEFAULT,
              target: str | Target = "bfloat16", lists: str | os.PathLike | OpLists | None = None,
              budget_s: float = DEFAULT_BUDGET_S, **kwargs: Any) -> StepTuning:
    """Time a training step's converted ops on this machine, before training, into the cache
    that ``enable_mixed_precision_graph_rewrite(..., timing_cache=)`` and ``mixed_precision``
    read: the live rewrite times nothing, and ``convert --tune speed`` times only what a model
    serves (no gradients, no optimizer update). ``step``: a ``tf.function``, traced here on
    ``args``/``kwargs`` (one batch, at the batch size training uses); nothing runs it.
    ``timing_cache``: the file (default ``$XDG_CACHE_HOME/amp_rewrite/timings.json``)."""
    target = lookup_target(target)
    check_target(target)
    check_budget(budget_s)
    python_function = getattr(step, "python_function", None)
    if python_function is None:
        raise AmpRewriteError(f"tune_step: {type(step).__name__} is not a tf.function; pass the training step that"
                              " training calls, decorated with @tf.function")
    unknown = [spec.shape for spec in tf.nest.flatten(step.input_signature or ())
               if isinstance(spec, tf.TensorSpec) and not spec.shape.is_fully_defined()]
    if unknown:
        raise AmpRewriteError(f"tune_step: the step's input_signature leaves a shape unknown ({unknown[0]}), and the"
                              " live rewrite looks timings up by the shapes a trace has: give the signature the shapes"
                              " training uses, or drop it")
    cache = open_cache(timing_cache, target)
    if not cache.usable:
        why = cache.problem.split(";")[0] if cache.problem else "no timing cache file (timing_cache=None)"
        raise AmpRewriteError(f"tune_step: {why}; pass a timing_cache path this run can write")
    # A trace of its own: ``step`` stays untraced, so a live rewrite enabled after this rewrites it (one
    # enabled before rewrites this trace too, without the timings it is about to get: no warning for that).
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"amp_rewrite: .*: no timings of this machine there")
        graph = tf.function(python_function, input_signature=step.input_signature).get_concrete_function(
            *args, **kwargs).graph
    graph_def = graph.as_graph_def()
    feed_shapes, variables = traced_inputs(graph)
    feeds = {graph.inputs[index].op.name: shape for index, shape in feed_shapes.items()}
    handles = {graph.inputs[index].op.name: variable for index, variable in variables.items()}
    base = rewrite_graph_def(graph_def, target=target.name, fetches=[t.op.name for t in graph.outputs],
                             lists=load_lists(target, lists))
    program = program_of(graph_def)
    shapes = infer_shapes(program, feeds, handles=handles)
    batch = next((shape[0] for shape in feeds.values() if shape), 1)
    budget = Budget(budget_s)  # counts the timing, not the trace and the rewrite before it
    problem, timings, plan = plan_rewrite(program, base, target, {batch: shapes}, cache, budget)
    budget.pause()
    problem_line = save_cache(cache)
    if problem_line:
        raise AmpRewriteError(problem_line)
    return StepTuning(cache.path, timings, plan, len(problem.candidates), budget)


# --- 4. the whole model ------------------------------------------------------------------------


@dataclass(frozen=True)
class SpeedCheck:
    """The written result against its source at one batch size: median seconds per call and
    the median over rounds of source time / result time (None: too few rounds in the budget)."""

    batch: int
    rounds: int
    source_s: float
    result_s: float
    speed: float | None
    unchecked: str = ""  # why no round ran: the step that did not fit in the budget left

    @property
    def slower(self) -> bool:
        return self.speed is not None and self.speed < SLOWER


def _loaded(model: Model, path: Path) -> Callable[[validate.Feeds], Callable[[], None]]:
    """The model at ``path``, loaded once: given feeds, one call of it on them (a SavedModel's
    ``serving_default`` signature, else its first by name, as served; a GraphDef's outputs in
    a Session, grappler on as in serving)."""
    if model.kind == "savedmodel":
        signatures = tf.saved_model.load(str(path), tags=list(model.tags)).signatures

        def bind(feeds: validate.Feeds) -> Callable[[], None]:
            key = "serving_default" if "serving_default" in signatures and "serving_default" in feeds else min(feeds)
            call, fed = signatures[key], {name: tf.constant(v) for name, v in feeds[key][0].items()}
            return lambda: [t.numpy() for t in tf.nest.flatten(call(**fed))]
        return bind
    graph = tf.Graph()
    graph_def = model.graph_def if path == model.path else read_model(path, model.fetches).graph_def
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    session = tf.compat.v1.Session(graph=graph)
    fetches = [tensor_name(*parse_tensor_name(name)) for name in model.compared_outputs]

    def bind_graph(feeds: validate.Feeds) -> Callable[[], None]:
        fed = {f"{name}:0": value for name, value in feeds[validate.GRAPH][0].items()}
        return lambda: session.run(fetches, feed_dict=fed)
    return bind_graph


def _timed(call: Callable[[], None]) -> float:
    start = time.perf_counter()
    call()
    return time.perf_counter() - start


def check_speed(tuning: Tuning, written: str | os.PathLike, seconds: float | None = None) -> list[SpeedCheck]:
    """Step 4: the source and ``written`` called in turn at each batch size, for ``seconds``
    (default: what the budget has left, loading both included), split evenly over the batch
    sizes; none where the timing kept every node float32 (the result is the source's graph).
    The budget counts while this runs. A step starts only where what it is expected to take
    fits in what is left: loading the result as long as the source's load took, a call as
    long as the last one (at a larger batch, longer by the ratio of the batch sizes); the two
    steps nothing predicts, loading the source and its first call, need only time left."""
    if not any(d.converted for d in tuning.result.report.decisions):
        return []  # the source's graph: nothing to time
    tuning.budget.resume()
    try:
        left = tuning.budget.left() if seconds is None else seconds
        return _check_batches(tuning, Path(written), time.perf_counter() + max(left, 0.0))
    finally:
        tuning.budget.pause()


def _check_batches(tuning: Tuning, written: Path, end: float) -> list[SpeedCheck]:
    """Both models loaded if they fit before ``end``, then each batch size's share of what is left."""
    def unchecked(why: str) -> list[SpeedCheck]:
        return [SpeedCheck(size, 0, 0.0, 0.0, None, why) for size in tuning.feeds]

    if time.perf_counter() >= end:
        return unchecked("no time was left in the budget")
    load_s = time.perf_counter()
    source = _loaded(tuning.model, tuning.model.path)
    load_s = time.perf_counter() - load_s
    if time.perf_counter() + load_s > end:
        return unchecked(f"loading the result (about {load_s:.1f} s, as the source's load took) does not fit in"
                         " the budget left")
    result = _loaded(tuning.model, written)
    return list(_run_whole(tuning.feeds, (source, result), end).values())


def _check_batch(size: int, calls: tuple[Callable[[], None], Callable[[], None]], end: float,
                 expected: float) -> tuple[SpeedCheck, float]:
    """At one batch size: two warm-up calls of each model (tracing, kernel caches), then
    rounds, each calling both (in turn first), while the next round is expected to end by
    ``end``; the first call is expected to take ``expected`` s (0: unknown), the others as
    long as the last. Returns the check and its last call's seconds."""
    took = [expected, expected]  # the last two calls' seconds
    for call in calls * 2:
        if time.perf_counter() + took[-1] > end:
            return SpeedCheck(size, 0, 0.0, 0.0, None, f"its warm-up calls (about {took[-1]:.2f} s each) do not"
                              " fit in the budget left"), took[-1]
        took.append(_timed(call))
    pairs: list[tuple[float, float]] = []
    while len(pairs) < MAX_ROUNDS and time.perf_counter() + 1.05 * sum(pairs[-1] if pairs else took[-2:]) < end:
        order = calls if len(pairs) % 2 == 0 else calls[::-1]
        first, second = _timed(order[0]), _timed(order[1])
        pairs.append((first, second) if order is calls else (second, first))
    if not pairs:
        return SpeedCheck(size, 0, took[-2], took[-1], None, f"a round (about {sum(took[-2:]):.2f} s) does not fit"
                          " in the budget left"), took[-1]
    speed = statistics.median(a / b for a, b in pairs) if len(pairs) >= MIN_ROUNDS else None
    return SpeedCheck(size, len(pairs), statistics.median(a for a, _ in pairs),
                      statistics.median(b for _, b in pairs), speed), max(pairs[-1])


def speed_lines(tuning: Tuning, checks: Sequence[SpeedCheck]) -> list[str]:
    """One line for the check, and one per batch size where the result is slower, naming
    the converted op types that cost most there (their target time over float32's, summed)."""
    shown = "; ".join(_shown(c, modeled_speed(tuning.plan, c.batch, c.source_s)) for c in checks)
    if not checks:
        return ["Speed against the source: not timed; nothing is converted, so the result runs as the source does"
                f" (timing took {tuning.budget.spent():.1f} s of the {tuning.budget.seconds:g} s budget)"]
    spent = f"; timing took {tuning.budget.spent():.1f} s of the {tuning.budget.seconds:g} s budget in all"
    lines = [f"Speed against the source (median of the rounds' ratios): {shown}{spent}"]
    for check in checks:
        if check.slower:
            lines.append(f"Speed: slower than the source at batch {check.batch} ({check.speed:.2f}x); costliest in"
                         f" {tuning.target.name}: {_costliest(tuning, check.batch)}")
    return lines


def modeled_speed(plan: Plan, batch: int, source_s: float, tuned: bool = True) -> float | None:
    """The whole model's speed-up the timing predicts at ``batch``, for a source that takes
    ``source_s`` per call: its converted ops' float32 seconds replaced by their seconds as
    planned (``tuned`` False: as the lists convert them), each loop body's once per
    iteration. None where nothing was timed or the source's time is unknown."""
    f32, lists, planned = plan.modeled.get(batch, (0.0, 0.0, 0.0))
    result_s = source_s - f32 + (planned if tuned else lists)
    return source_s / result_s if f32 > 0 and source_s > 0 and result_s > 0 else None


def _shown(check: SpeedCheck, modeled: float | None = None) -> str:
    if check.speed is not None:
        model = f"modeled {modeled:.2f}x; " if modeled is not None else ""
        return (f"batch {check.batch} {check.speed:.2f}x ({model}{check.source_s * 1e3:.1f} ->"
                f" {check.result_s * 1e3:.1f} ms, {check.rounds} rounds)")
    why = check.unchecked or (f"{check.rounds} round(s) of {check.source_s + check.result_s:.2f} s in the budget"
                              f" left, {MIN_ROUNDS} needed")
    return f"batch {check.batch} not checked: {why} (a larger --tune-budget checks it)"


def _costliest(tuning: Tuning, batch: int) -> str:
    converted = {(d.function, d.node) for d in tuning.result.report.decisions if d.converted}
    return costliest(tuning.problem, tuning.timings, tuning.target.dtype, tuning.weights_low, converted, batch)
