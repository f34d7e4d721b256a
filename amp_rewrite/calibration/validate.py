"""Run the original and the rewritten model on the same inputs and measure the difference.

Everything that can be checked is checked before anything is written: ``plan_feeds``
reads each input's dtype and shape from the SavedModel's signatures (or the GraphDef's
placeholders) and either makes random inputs the model takes (seeded; unknown dimensions
become 2; an integer input that indexes a table within its rows, ``core.bounds``; masks as
padding masks; ``plan_draws``) or checks an ``.npz`` file's arrays against them. A model
that fails on the inputs is the user's to fix (exit 2, with what to pass); only numbers over
tolerance are a failed validation. An output's error is a metric of the float32 output (the
reference) and the rewrite's (the candidate), over every run's outputs together, measured
against the target's tolerance (``METRICS``; for floating outputs the default, ``p99-rel``,
does not grow with the number of samples the way the largest error does; integer outputs are
equal or wrong, and are compared by agreement, ``MetricChoice``). A non-finite candidate
where float32 is finite is an infinite error, whatever the metric.
"""
from __future__ import annotations

import gc
import re
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, NamedTuple, Sequence

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import graph_pb2, tensor_shape_pb2

from amp_rewrite.calibration.savedmodel import GRAPH, Model, ModelError
from amp_rewrite.core import bounds
from amp_rewrite.core.graph_io import parse_tensor_name, tensor_name
from amp_rewrite.core.target import Target
from amp_rewrite.errors import tensorflow_cause

UNKNOWN_DIM = 2
RANDOM_INT_HIGH = 10  # integer inputs that index no table are 0..9: a guess, said in a note


@dataclass(frozen=True)
class InputSpec:
    """One input a model takes: a signature's input, or a GraphDef's placeholder."""

    signature: str
    name: str
    dtype: tf.DType
    shape: tuple[int | None, ...] | None  # None: unknown rank

    def describe(self) -> str:
        where = f"placeholder '{self.name}'" if self.signature == GRAPH else \
            f"input '{self.name}' of signature '{self.signature}'"
        return f"{where} ({self.dtype.name}{_shape_text(self.shape)})"


Feeds = dict[str, list[dict[str, np.ndarray]]]  # signature → one feed per run


Metric = Callable[[np.ndarray, np.ndarray], float]  # (reference, candidate) -> error, against the tolerance


def max_rel(reference: np.ndarray, candidate: np.ndarray) -> float:
    """The largest |candidate - reference| over the largest |reference|: grows with the
    number of samples, as the largest of more draws does."""
    return _relative(float(np.max(np.abs(candidate - reference))), reference)


def p99_rel(reference: np.ndarray, candidate: np.ndarray) -> float:
    """The 99th percentile of |candidate - reference| over the largest |reference|: the
    error of all but the worst 1% of elements, a quantile that more samples estimate
    better instead of pushing up."""
    return _relative(float(np.percentile(np.abs(candidate - reference), 99)), reference)


def top1_disagreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """The share of samples whose largest class (argmax over the last axis) changed: 1 minus
    the top-1 agreement, for classifiers."""
    if reference.ndim < 1 or reference.shape[-1] < 2:
        raise ValueError(f"an output of shape {reference.shape} has no classes on its last axis")
    return float(np.mean(np.argmax(reference, axis=-1) != np.argmax(candidate, axis=-1)))


def disagreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """The share of values that changed: 1 minus the agreement, for integer outputs (class
    ids, token ids, indices), whose values are equal or wrong."""
    return float(np.mean(reference != candidate)) if reference.size else 0.0


def prefix_disagreement(reference: np.ndarray, candidate: np.ndarray) -> float:
    """For sequences along the last axis (generated tokens): 1 minus the mean share of each
    sequence that is identical up to its first difference. A token after a difference is
    lost whatever its value: the rest was generated from another sequence."""
    prefixes, length = identical_prefixes(reference, candidate)
    return 1.0 - float(np.mean(prefixes)) / length if prefixes.size and length else 0.0


def identical_prefixes(reference: np.ndarray, candidate: np.ndarray) -> tuple[np.ndarray, int]:
    """Each sequence's (last axis) count of leading values equal in both, and the sequences' length."""
    if reference.ndim == 0:
        reference, candidate = reference.reshape(1, 1), candidate.reshape(1, 1)
    length = reference.shape[-1]
    equal = (reference == candidate).reshape(-1, length)
    return np.where(equal.all(axis=1), length, np.argmin(equal, axis=1)), length


def _relative(difference: float, reference: np.ndarray) -> float:
    scale = float(np.max(np.abs(reference)))
    return difference / scale if scale > 0 else (0.0 if difference == 0 else np.inf)


METRICS: Mapping[str, Metric] = {"max-rel": max_rel, "p99-rel": p99_rel, "top1-agreement": top1_disagreement,
                                 "agreement": disagreement, "prefix-agreement": prefix_disagreement}
DEFAULT_METRIC = "p99-rel"
AGREEMENTS = frozenset({"agreement", "prefix-agreement"})  # their value is a share changed; shown as the share kept
# what a metric's value is, where its name says the opposite
_SHOWN = {"top1-agreement": "top-1 changed", "agreement": "share changed",
          "prefix-agreement": "share after a first difference"}


def shown(metric: str) -> str:
    """How a value of ``metric`` is labelled in messages."""
    return _SHOWN.get(metric, metric)


class NamedMetric(NamedTuple):
    """A metric, and the name messages give it."""

    name: str
    function: Metric


def lookup_metric(metric: str | Metric) -> NamedMetric:
    """A metric named in ``METRICS``, or a callable(reference, candidate) -> float of the
    user's (named after it)."""
    if callable(metric):
        return NamedMetric(getattr(metric, "__name__", "metric"), metric)
    if metric not in METRICS:
        raise ModelError(f"unknown metric {metric!r}; use one of {', '.join(METRICS)}, or pass a function"
                         " (reference, candidate) -> float")
    return NamedMetric(metric, METRICS[metric])


@dataclass(frozen=True)
class MetricChoice:
    """Which metric measures each output: ``by_output`` names one for an output (``NAME``,
    or ``SIGNATURE/NAME`` for one signature's), ``default`` measures the others that are
    floating; integer and bool outputs are compared by what they are, values equal or not:
    ``agreement``, ``prefix-agreement`` for sequences (two dims or more)."""

    default: str | Metric = DEFAULT_METRIC
    by_output: Mapping[str, str] = field(default_factory=dict)

    def for_output(self, signature: str, output: str, reference: np.ndarray) -> NamedMetric:
        for key in (f"{signature}/{output}", output):
            if key in self.by_output:
                return lookup_metric(self.by_output[key])
        if np.issubdtype(reference.dtype, np.integer) or reference.dtype == bool:
            return lookup_metric("prefix-agreement" if reference.ndim >= 2 else "agreement")
        return lookup_metric(self.default)

    def check(self, model: Model) -> None:
        """Every output ``by_output`` names is one of the model's, or exit 2 naming them."""
        outputs = {name for _, named in model.signatures.values() for name in named}
        keys = {f"{signature}/{name}" for signature, (_, named) in model.signatures.items() for name in named}
        for key in sorted(self.by_output):
            if key not in outputs and key not in keys:
                raise ModelError(f"{model.path}: --metric {key}={self.by_output[key]}: the model has no output"
                                 f" '{key}'; its outputs are {', '.join(map(repr, sorted(outputs)))}")


def measure(metric: Metric, pairs: Sequence[tuple[np.ndarray, np.ndarray]], where: str) -> tuple[float, float] | None:
    """(the metric, the largest |difference|) of one output over its runs, as (reference,
    candidate) arrays: the runs concatenated on their first axis where their other dims
    agree, else the worst run. None for outputs that are not numbers (strings)."""
    pairs = [(np.asarray(old), np.asarray(new)) for old, new in pairs]
    if not pairs or not (np.issubdtype(pairs[0][0].dtype, np.number) or pairs[0][0].dtype == bool):
        return None
    errors = []
    for old, new in _stacked([(old.astype(np.float64), new.astype(np.float64)) for old, new in pairs]):
        if old.size == 0:
            errors.append((0.0, 0.0))
            continue
        largest = float(np.max(np.abs(new - old)))
        if not np.all(np.isfinite(new[np.isfinite(old)])):
            errors.append((np.inf, largest))
            continue
        try:
            value = float(metric(old, new))
        except (ValueError, TypeError, ArithmeticError) as error:
            raise ModelError(f"{where}: the metric cannot measure it ({error}); choose another with --metric") from None
        errors.append((value if not np.isnan(value) else np.inf, largest))
    return max(errors, key=lambda e: e[0])


def _stacked(pairs: list[tuple[np.ndarray, np.ndarray]]) -> list[tuple[np.ndarray, np.ndarray]]:
    """The runs as one (reference, candidate) pair, concatenated on the first axis, where
    their other dims agree; else the runs as they are."""
    shapes = {old.shape[1:] for old, _ in pairs}
    if len(pairs) > 1 and len(shapes) == 1 and all(old.ndim for old, _ in pairs):
        return [(np.concatenate([old for old, _ in pairs]), np.concatenate([new for _, new in pairs]))]
    return pairs


def agreement_detail(metric: str, pairs: Sequence[tuple[np.ndarray, np.ndarray]]) -> str:
    """What an agreement's value counts: values changed, or sequences identical and the
    identical prefix's mean length (the runs together where they stack)."""
    stacked = _stacked([(np.asarray(old), np.asarray(new)) for old, new in pairs])
    if metric == "agreement":
        changed = sum(int(np.sum(old != new)) for old, new in stacked)
        return f"{changed} of {sum(old.size for old, _ in stacked)} value(s) changed"
    found = [identical_prefixes(old, new) for old, new in stacked if old.size]
    if not found:
        return "no sequences"
    prefixes = np.concatenate([p for p, _ in found])
    length = max(n for _, n in found)
    return (f"{int(np.sum(prefixes == length))} of {prefixes.size} sequence(s) identical, identical prefix"
            f" {float(np.mean(prefixes)):.3g} of {length} on average")


@dataclass(frozen=True)
class OutputError:
    signature: str
    output: str
    max_abs: float
    error: float  # the metric's value
    metric: str = DEFAULT_METRIC
    detail: str = ""  # for an agreement, what it counts

    def ok(self, target: Target) -> bool:
        """Finite, and within the target's tolerance."""
        return bool(np.isfinite(self.error)) and self.error <= target.tolerance

    def describe(self) -> str:
        """The output's error as the summary shows it: an agreement as the share kept."""
        if self.metric in AGREEMENTS:
            return f"{self.metric} {1 - self.error:.3g} ({self.detail})"
        return f"max abs {self.max_abs:.3g}, {shown(self.metric)} {self.error:.3g}"


def _shape_text(shape: tuple[int | None, ...] | None) -> str:
    if shape is None:
        return ", any shape"
    return ", shape (" + ", ".join("None" if d is None else str(d) for d in shape) + ("," if len(shape) == 1 else "") + ")"


def _shape(proto: tensor_shape_pb2.TensorShapeProto) -> tuple[int | None, ...] | None:
    if proto.unknown_rank:
        return None
    return tuple(None if d.size < 0 else d.size for d in proto.dim)


def input_specs(model: Model) -> list[InputSpec]:
    """What the model takes, from its protos (nothing is loaded or run)."""
    if model.kind == "savedmodel":
        return [InputSpec(key, name, tf.as_dtype(info.dtype), _shape(info.tensor_shape))
                for key, signature in sorted(model.meta_graph.signature_def.items())
                for name, info in sorted(signature.inputs.items())]
    return [InputSpec(GRAPH, node.name, tf.as_dtype(node.attr["dtype"].type),
                      _shape(node.attr["shape"].shape) if "shape" in node.attr else None)
            for node in model.placeholders]


def load_inputs(path: Path) -> Mapping[str, np.ndarray]:
    """The arrays of an ``.npz`` file by name. Object arrays are refused: only pickle reads
    them, and unpickling a file can run any code; strings come as str or bytes arrays."""
    unreadable = (OSError, ValueError, EOFError, zipfile.BadZipFile)
    try:
        data = np.load(path, allow_pickle=False)
    except unreadable as error:
        raise ModelError(f"{path}: cannot read inputs ({error}); pass an .npz file saved with numpy.savez") from None
    if not hasattr(data, "files"):  # an .npy file
        raise ModelError(f"{path}: one array, not arrays by input name; save them with numpy.savez(FILE, NAME=array)")
    arrays = {}
    with data:
        for key in data.files:
            try:
                arrays[key] = data[key]
            except unreadable as error:
                if "allow_pickle" in str(error):
                    raise ModelError(f"{path}: array '{key}' holds Python objects, which only pickle reads; save"
                                     f" strings as a str or bytes array ({key}.astype(str) or {key}.astype(bytes))"
                                     ) from None
                raise ModelError(f"{path}: cannot read array '{key}' ({error}); save the inputs again with"
                                 " numpy.savez") from None
    return arrays


@dataclass(frozen=True)
class Draw:
    """How random values are drawn for one input: ``kind`` "normal" (floats, N(0,1)),
    "range" (integers ``low`` ≤ v < ``high``), "mask" (a padding mask: per row along the last
    axis, ones then zeros, at least one one) or "length" (integers 1 ≤ v < ``high``); ``why``
    says what set the range, None for integers that reach no table (0-9, a guess)."""

    kind: str
    low: int = 0
    high: int = RANDOM_INT_HIGH
    why: str | None = None

    def describe(self) -> str:
        if self.kind == "mask":
            return "a padding mask (per row ones, then zeros)"
        if self.kind == "length":
            return f"1-{self.high - 1} (a length, up to the sequence's)"
        return f"{self.low}-{self.high - 1} ({self.why or 'no table bounds it: a guess'})"


def _is_mask(spec: InputSpec) -> bool:
    return "mask" in spec.name.lower() and (spec.dtype.is_integer or spec.dtype.is_floating or spec.dtype == tf.bool)


LENGTH_NAME = re.compile(r"(^|[^a-z])(seq_?|sequence_)?len(gth)?s?$")  # lengths, seq_len, input_length …


def _is_length(spec: InputSpec) -> bool:
    return spec.dtype.is_integer and LENGTH_NAME.search(spec.name.lower()) is not None


def _sequence_length(spec: InputSpec, specs: Sequence[InputSpec]) -> int:
    """The longest axis-1 size of the signature's other inputs (unknown dims 2): what a length may be."""
    sizes = [UNKNOWN_DIM if other.shape[1] is None else other.shape[1] for other in specs
             if other.signature == spec.signature and other is not spec and other.shape is not None
             and len(other.shape) >= 2]
    return max(sizes, default=UNKNOWN_DIM)


def plan_draws(model: Model, specs: Sequence[InputSpec] | None = None) -> dict[tuple[str, str], Draw]:
    """How each (signature, input) of ``model`` is drawn at random: an integer input that
    indexes a table within that table's rows (``bounds.index_bound``), masks and lengths
    valid ones, other integers 0-9."""
    specs = input_specs(model) if specs is None else specs
    draws = {}
    for spec in specs:
        if _is_mask(spec):
            draws[(spec.signature, spec.name)] = Draw("mask", 0, 2)
        elif spec.dtype.is_floating:
            draws[(spec.signature, spec.name)] = Draw("normal")
        elif spec.dtype == tf.bool:
            draws[(spec.signature, spec.name)] = Draw("range", 0, 2, "true or false")
        elif spec.dtype.is_integer:
            draws[(spec.signature, spec.name)] = _integer_draw(model, spec, specs)
    return draws


def _integer_draw(model: Model, spec: InputSpec, specs: Sequence[InputSpec]) -> Draw:
    if spec.signature == GRAPH:
        tensor = f"{spec.name}:0"
    else:
        tensor = model.meta_graph.signature_def[spec.signature].inputs[spec.name].name
    bound = bounds.index_bound(model.program, tensor)
    if bound is not None:
        return Draw("range", bound.low, bound.high, f"bounded by {bound.table}")
    if _is_length(spec):
        return Draw("length", 1, _sequence_length(spec, specs) + 1)
    return Draw("range")


def describe_draws(draws: Mapping[tuple[str, str], Draw]) -> str:
    """The ranges random inputs used, one phrase per input (once where every signature
    draws it alike); floats N(0,1), unknown dims 2."""
    by_name: dict[str, set[tuple[str, str]]] = {}
    for (signature, name), draw in sorted(draws.items()):
        if draw.kind != "normal":
            by_name.setdefault(name, set()).add((signature, draw.describe()))
    phrases = []
    for name, found in by_name.items():
        texts = {text for _, text in found}
        phrases += ([f"{name} {texts.pop()}"] if len(texts) == 1
                    else [f"{signature}/{name} {text}" for signature, text in sorted(found)])
    return "; ".join(phrases + [f"floats N(0,1); unknown dims {UNKNOWN_DIM}"])


def unbounded(draws: Mapping[tuple[str, str], Draw]) -> list[str]:
    """The integer inputs drawn 0-9 because no table bounds them: their values are a guess."""
    return sorted({name for (_, name), draw in draws.items() if draw.kind == "range" and draw.why is None})


def _sample(spec: InputSpec, rng: np.random.Generator, draw: Draw) -> np.ndarray:
    shape = [UNKNOWN_DIM if d is None else d for d in (spec.shape or ())]
    dtype = np.dtype(spec.dtype.as_numpy_dtype)
    if draw.kind == "normal":
        return rng.standard_normal(shape).astype(dtype)
    if draw.kind == "mask":
        if not shape:
            return np.ones((), dtype)
        lengths = rng.integers(1, max(shape[-1], 1) + 1, size=shape[:-1])
        return (np.arange(shape[-1]) < lengths[..., None]).astype(dtype)
    return rng.integers(draw.low, draw.high, size=shape).astype(dtype)  # tf.bool: 0 or 1


def _check_samplable(spec: InputSpec, specs: Sequence[InputSpec], path: Path) -> None:
    if not (spec.dtype.is_floating or spec.dtype.is_integer or spec.dtype == tf.bool):
        raise ModelError(f"{path}: {spec.describe()}: random inputs cannot be made for {spec.dtype.name};"
                         f" pass real ones with --inputs inputs.npz, saved so: {savez_example(specs)}")


def savez_example(specs: Sequence[InputSpec]) -> str:
    """A ``numpy.savez`` line that writes an array every input takes (unknown dims 2): text
    for string inputs, zeros for the others."""
    arrays: dict[str, str] = {}
    for spec in specs:
        shape = tuple(UNKNOWN_DIM if d is None else d for d in (spec.shape or ()))
        arrays.setdefault(spec.name, f"numpy.full({shape}, 'text')" if spec.dtype == tf.string
                          else f"numpy.zeros({shape}, '{np.dtype(spec.dtype.as_numpy_dtype).name}')")
    named = [f"{name}={array}" for name, array in arrays.items() if name.isidentifier()]
    other = [f"{name!r}: {array}" for name, array in arrays.items() if not name.isidentifier()]
    return f"numpy.savez('inputs.npz', {', '.join(named + (['**{' + ', '.join(other) + '}'] if other else []))})"


def _text(array: np.ndarray) -> np.ndarray:
    """A str or bytes array as ``tf.string`` takes it: bytes (str as UTF-8), one object each."""
    if array.dtype.kind == "U":
        array = np.char.encode(array, "utf-8")
    return array.astype(object)


def _fit(spec: InputSpec, array: np.ndarray, path: Path, notes: list[str]) -> np.ndarray:
    """``array`` as ``spec`` takes it: a float array of another width, or an integer array
    whose values fit, is cast (with a note); any other dtype or a shape that cannot be fed is refused."""
    want = np.dtype(spec.dtype.as_numpy_dtype)
    what = f"{path}: array '{spec.name}' ({array.dtype}, shape {tuple(array.shape)})"
    if spec.shape is not None and (len(array.shape) != len(spec.shape) or any(
            d is not None and d != n for d, n in zip(spec.shape, array.shape))):
        raise ModelError(f"{what} does not fit {spec.describe()}; save an array of that shape")
    if spec.dtype == tf.string:
        if array.dtype.kind in "US":
            return _text(array)
        raise ModelError(f"{what} does not fit {spec.describe()}; save it as strings ({spec.name}.astype(str))")
    if array.dtype == want:
        return array
    if np.issubdtype(array.dtype, np.floating) and np.issubdtype(want, np.floating):
        notes.append(f"{path.name}: '{spec.name}' is {array.dtype}; cast to {want} as {spec.describe()} takes")
        return array.astype(want)
    if np.issubdtype(array.dtype, np.integer) and np.issubdtype(want, np.integer) and (
            array.size == 0 or (np.iinfo(want).min <= array.min() and array.max() <= np.iinfo(want).max)):
        notes.append(f"{path.name}: '{spec.name}' is {array.dtype}; cast to {want} as {spec.describe()} takes")
        return array.astype(want)
    raise ModelError(f"{what} does not fit {spec.describe()}; save it as {want} ({spec.name}.astype('{want}'))")


def plan_feeds(model: Model, inputs: Path | Mapping[str, np.ndarray] | None, runs: int, *,
               draws: Mapping[tuple[str, str], Draw] | None = None) -> tuple[Feeds, list[str]]:
    """The inputs for validation, checked before anything is written, and notes for the user
    (casts made; integer inputs whose values are a guess). ``inputs``: an ``.npz`` file or its
    arrays by name, fed once; else ``runs`` random feeds, drawn as ``draws`` says (``plan_draws``)."""
    specs = input_specs(model)
    feeds: Feeds = {}
    if model.kind == "savedmodel":
        for key in model.meta_graph.signature_def:
            feeds.setdefault(key, [])
    if inputs is not None:
        return _given_feeds(specs, inputs, feeds)
    for spec in specs:
        _check_samplable(spec, specs, model.path)
    draws = plan_draws(model, specs) if draws is None else draws
    notes = [f"random inputs: {name} feeds no table whose size this rewrite can find; its values are drawn 0-9,"
             " a guess: if the model takes other values, pass real inputs with --inputs FILE.npz"
             for name in unbounded(draws)]
    rng = np.random.default_rng(0)
    for _ in range(runs):
        batch: dict[str, dict[str, np.ndarray]] = {key: {} for key in feeds}
        drawn: dict[tuple, np.ndarray] = {}  # signatures with the same input (model.export's two) share its values
        for spec in specs:
            draw = draws[(spec.signature, spec.name)]
            key = (spec.name, spec.dtype, spec.shape, draw.kind, draw.low, draw.high)
            if key not in drawn:
                drawn[key] = _sample(spec, rng, draw)
            batch.setdefault(spec.signature, {})[spec.name] = drawn[key]
        for key, feed in batch.items():
            feeds.setdefault(key, []).append(feed)
    return feeds, notes


def _given_feeds(specs: Sequence[InputSpec], inputs: Path | Mapping[str, np.ndarray], feeds: Feeds
                 ) -> tuple[Feeds, list[str]]:
    """``plan_feeds`` for an ``.npz`` file or its arrays: every input's array, fitted."""
    notes: list[str] = []
    given = inputs if isinstance(inputs, Mapping) else load_inputs(inputs)
    inputs = Path("inputs") if isinstance(inputs, Mapping) else inputs
    names = sorted({spec.name for spec in specs})
    problems = []
    lacking = next((spec for spec in specs if spec.name not in given), None)
    if lacking is not None:
        where = "placeholder(s)" if lacking.signature == GRAPH else f"input(s) of signature '{lacking.signature}':"
        missing = sorted(s.name for s in specs if s.signature == lacking.signature and s.name not in given)
        problems.append(f"no array for {where} {', '.join(missing)}")
    unknown = sorted(set(given) - set(names))
    if unknown:
        problems.append(f"array(s) {', '.join(map(repr, unknown))} match no input of the model; its inputs are"
                        f" {', '.join(map(repr, names)) or 'none'}; rename or drop the array(s)")
    if problems:
        raise ModelError(f"{inputs}: {'; '.join(problems)}")
    feed_by_signature: dict[str, dict[str, np.ndarray]] = {key: {} for key in feeds}
    for spec in specs:
        feed_by_signature.setdefault(spec.signature, {})[spec.name] = _fit(spec, given[spec.name], inputs, notes)
    return {key: [feed] for key, feed in feed_by_signature.items()}, notes


def _errors(metric: str | Metric | MetricChoice, pairs: Mapping[tuple[str, str], list[tuple[np.ndarray, np.ndarray]]]
            ) -> list[OutputError]:
    choice = metric if isinstance(metric, MetricChoice) else MetricChoice(metric)
    errors = []
    for (signature, output), found in pairs.items():
        where = f"signature '{signature}' output '{output}'" if signature != GRAPH else f"output '{output}'"
        if not found:
            continue
        name, function = choice.for_output(signature, output, np.asarray(found[0][0]))
        found, note = _same_lengths(found, name, where)
        measured = measure(function, found, where)
        if measured is not None:
            detail = agreement_detail(name, found) if name in AGREEMENTS else ""
            errors.append(OutputError(signature, output, measured[1], measured[0], name, detail + note))
    return errors


def _same_lengths(pairs: list[tuple[np.ndarray, np.ndarray]], metric: str, where: str
                  ) -> tuple[list[tuple[np.ndarray, np.ndarray]], str]:
    """The runs with both sides of one shape, and what was done to get there. A decode loop
    with a data-dependent stop (an end token) may generate sequences of another length
    after conversion: compared by prefix agreement, the shorter one is padded with a value
    neither holds, so its missing tokens count as differences. Any other change of shape is refused."""
    changed = [(np.asarray(old), np.asarray(new)) for old, new in pairs if np.shape(old) != np.shape(new)]
    if not changed:
        return pairs, ""
    old, new = changed[0]
    if metric != "prefix-agreement" or old.ndim != new.ndim or old.shape[:-1] != new.shape[:-1]:
        raise ModelError(f"{where}: float32 gives shape {old.shape}, the conversion {new.shape}: an output whose"
                         " size depends on its values; compare it as a sequence (--metric OUTPUT=prefix-agreement)"
                         " if it is one, or validate with --inputs that give both one size")
    padded = [_padded(np.asarray(a), np.asarray(b)) for a, b in pairs]
    return padded, (f"; differs in length (float32 {old.shape[-1]} vs converted {new.shape[-1]} tokens):"
                    " a data-dependent stop; the missing tokens count as differences")


def _padded(old: np.ndarray, new: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both padded on the last axis to the longer length with a value neither holds."""
    length = max(old.shape[-1], new.shape[-1])
    fill = min(old.min(initial=0), new.min(initial=0)) - 1
    widths = [(0, 0)] * (old.ndim - 1)
    return tuple(np.pad(a.astype(np.int64), [*widths, (0, length - a.shape[-1])], constant_values=fill)
                 for a in (old, new))


def _fails_on_inputs(where: str, error: Exception, random: bool, guessed: Sequence[str] = ()) -> ModelError:
    """``guessed``: the integer inputs no table bounds, drawn 0-9."""
    drawn = (f"{', '.join(guessed)} drawn 0-9 as no table bounds {'it' if len(guessed) == 1 else 'them'}"
             if guessed else "ids within the tables they index, else 0-9")
    how = (f"random inputs ({drawn}; unknown dims 2); pass real inputs with --inputs FILE.npz"
           if random else "the --inputs arrays; check them against the model's inputs")
    return ModelError(f"{where}: the source model fails on {how} ({tensorflow_cause(error)})")


def validate_saved_models(model: Model, destination: Path, feeds: Feeds, random: bool,
                          metric: str | Metric | MetricChoice = DEFAULT_METRIC, *,
                          guessed: Sequence[str] = ()) -> list[OutputError]:
    """The error of each (signature, output) of ``model`` (a SavedModel) against its
    rewrite written at ``destination``, over ``feeds`` (from ``plan_feeds``). The source runs
    every feed and is let go before the result is loaded: one model in memory at a time.
    A SavedModel without an object graph (TF1) runs in a Session by TensorFlow's v1 loader,
    which restores each variable in place (``tf.saved_model.load`` restores them all before
    assigning them: 1.6x the variables at once). ``guessed``: the integer inputs drawn 0-9
    as no table bounds them (``unbounded``), named where the source fails on the inputs."""
    outputs = _outputs if model.meta_graph.object_graph_def.nodes else _session_outputs
    old_outputs = outputs(model.path, model.tags, feeds, lambda key, error: _fails_on_inputs(
        f"{model.path}: signature '{key}'", error, random, guessed))
    gc.collect()
    new_outputs = outputs(destination, model.tags, feeds, None)
    pairs: dict[tuple[str, str], list[tuple[np.ndarray, np.ndarray]]] = {}
    for (key, name), runs in old_outputs.items():
        pairs[(key, name)] = list(zip(runs, new_outputs[(key, name)]))
    return _errors(metric, pairs)


def _outputs(path: Path, tags: Sequence[str], feeds: Feeds,
             failing: Callable[[str, Exception], ModelError] | None) -> dict[tuple[str, str], list[np.ndarray]]:
    """Every signature's outputs over its feeds, as arrays; the model is dropped on return.
    ``failing``: the error for a feed the model fails on (None: TensorFlow's own)."""
    try:
        model = tf.saved_model.load(str(path), tags=list(tags))
    except (ValueError, RuntimeError, tf.errors.OpError) as error:
        raise ModelError(f"{path}: TensorFlow cannot load it ({tensorflow_cause(error)})") from None
    found: dict[tuple[str, str], list[np.ndarray]] = {}
    for key in sorted(model.signatures):
        function = model.signatures[key]
        for feed in feeds.get(key, [{}]):
            try:
                outputs = function(**{name: tf.constant(value) for name, value in feed.items()})
            except (tf.errors.OpError, ValueError, TypeError) as error:
                if failing is None:
                    raise
                raise failing(key, error) from None
            for name in sorted(outputs):
                found.setdefault((key, name), []).append(outputs[name].numpy())
    return found


def _session_outputs(path: Path, tags: Sequence[str], feeds: Feeds,
                     failing: Callable[[str, Exception], ModelError] | None) -> dict[tuple[str, str], list[np.ndarray]]:
    """``_outputs`` for a TF1 SavedModel: its signatures' tensors run in a Session."""
    found: dict[tuple[str, str], list[np.ndarray]] = {}
    logger, level = tf.get_logger(), tf.get_logger().level
    with tf.Graph().as_default() as graph, tf.compat.v1.Session(graph=graph) as session:
        logger.setLevel("ERROR")  # the v1 loader's deprecation notice
        try:
            meta = tf.compat.v1.saved_model.loader.load(session, list(tags), str(path))
        except (ValueError, RuntimeError, OSError, tf.errors.OpError) as error:
            raise ModelError(f"{path}: TensorFlow cannot load it ({tensorflow_cause(error)})") from None
        finally:
            logger.setLevel(level)
        for key in sorted(meta.signature_def):
            signature = meta.signature_def[key]
            for feed in feeds.get(key, [{}]):
                fed = {signature.inputs[name].name: value for name, value in feed.items()}
                try:
                    values = session.run({name: info.name for name, info in signature.outputs.items()}, fed)
                except (tf.errors.OpError, ValueError, TypeError) as error:
                    if failing is None:
                        raise
                    raise failing(key, error) from None
                for name in sorted(values):
                    found.setdefault((key, name), []).append(np.asarray(values[name]))
    return found


def available_memory() -> int | None:
    """Bytes this process can still allocate: the kernel's MemAvailable, or less under a cgroup
    limit; None where neither can be read."""
    found = []
    try:
        meminfo = Path("/proc/meminfo").read_text(encoding="ascii")
        found += [int(line.split()[1]) * 1024 for line in meminfo.splitlines() if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text(encoding="ascii").strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text(encoding="ascii")))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def check_fits(model: Model, largest: int, what: str = "--validate loads the model",
               advice: str = "convert without --validate and --inputs, then validate the result where it fits") -> None:
    """Refuse, before anything is written, a validation whose model (``largest`` bytes of
    variables or graph: the larger of the source and the result, loaded one at a time)
    cannot fit in the memory left; ``what`` and ``advice``: another step's, in the line."""
    available = available_memory()
    if available is not None and largest > available:
        raise ModelError(f"{model.path}: {what} ({largest / 1e9:.1f} GB) and {available / 1e9:.1f} GB of memory is"
                         f" available; it cannot fit: {advice}")


def validate_graph_defs(model: Model, rewritten: graph_pb2.GraphDef, feeds: Feeds, random: bool,
                        metric: str | Metric | MetricChoice = DEFAULT_METRIC, *,
                        guessed: Sequence[str] = ()) -> list[OutputError]:
    """The same for a GraphDef file: placeholders fed, the model's ``compared_outputs`` compared;
    ``guessed``: as ``validate_saved_models``'s, the integer inputs drawn 0-9 (``unbounded``)."""
    outputs = model.compared_outputs
    pairs: dict[tuple[str, str], list[tuple[np.ndarray, np.ndarray]]] = {}
    for feed in feeds.get(GRAPH, [{}]):
        fed = {f"{name}:0": value for name, value in feed.items()}
        try:
            old = _run(model.graph_def, outputs, fed)
        except (tf.errors.OpError, ValueError, TypeError) as error:
            raise _fails_on_inputs(str(model.path), error, random, guessed) from None
        new = _run(rewritten, outputs, fed)
        for name, a, b in zip(outputs, old, new):
            pairs.setdefault((GRAPH, name), []).append((a, b))
    return _errors(metric, pairs)


def _run(graph_def: graph_pb2.GraphDef, fetches: tuple[str, ...], feed: Mapping[str, np.ndarray]) -> list[np.ndarray]:
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    config = tf.compat.v1.ConfigProto()
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        return session.run([tensor_name(*parse_tensor_name(name)) for name in fetches], feed_dict=feed)
