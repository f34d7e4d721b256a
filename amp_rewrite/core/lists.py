"""Build the four op lists (allow, deny, infer, clear) that colour a graph for one target.

Sources, applied in this order (spec §2.1, §4), then checked: no op may be in two lists.

1. The built-in file ``lists/<target>.yaml``: the lists TensorFlow 2.21 builds
   (float16: ``AutoMixedPrecisionListsFp16``, CUDA variant, all gates open;
   bfloat16: ``AutoMixedPrecisionListsMkl``), with a reason where an entry is not obvious,
   less the ops of its optional ``float32`` section: ops grappler would convert whose
   low-precision kernels are measurably slower than float32's. They are in no list (never
   converted, nothing spreads from them); their reasons say why. ``held_float32(target)``
   names them; an overlay or variable may still put them in any list.
2. An optional user overlay file; every key is optional, ``add`` is applied before ``remove``::

       allow: {add: [Foo], remove: [Bar]}
       deny:  {add: [...], remove: [...]}
       infer: {...}
       clear: {...}
       keep_nodes: ["model/head/.*", "logits"]  # node names or regexes (re.fullmatch) kept
                                                # float32; beyond grappler, tensorflow#40562

   To move an op, remove it from its list and add it to the other. ``keep_nodes`` may
   also map each entry to a one-line reason (calibration writes its measurements so)::

       keep_nodes:
         model/dense/MatMul: "calibration: output 0 reached 2.1e+05, over float16's 1.6e+04"
         "__inference_call_123::dense_1/BiasAdd": ""   # "" or the list form: no reason

   An entry ``FUNCTION::PATTERN`` matches only in the library function named FUNCTION
   (``:`` never occurs in a node name), or whose name is FUNCTION once TensorFlow's trace
   counter is dropped (``functions.stable_name``: ``__inference___call__`` for
   ``__inference___call___23578``, so an entry survives a re-export); one without ``::``
   matches in every item. A kept
   node stays float32 and acts as a deny op (``colouring.propagate_deny_forward``).
   ``OpLists.keeping`` adds entries to loaded lists (the CLI's ``--keep``).
   Target float8's calibration lives in the overlay too, read by ``load_float8``, not by
   ``load_lists`` (it only checks them)::

       amax:  {"dense/Relu:0": 3.25, "__inference_call_123::dense/Relu:0": 3.25}  # tensor -> largest |x|
       lossy: {"__inference_call_123::dense_2/MatMul": "calibration: ..."}       # matmul -> its FP8 error

   Names are literal (no regex); ``FUNCTION::`` names a library function's tensor or node
   (its exact or stable name, as in keep_nodes); a name without it, a node of that name in
   any item (``float8.inference.resolve``).
3. TensorFlow's variables, with TensorFlow's semantics, read here and nowhere else:
   ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_<LIST>_ADD`` then ``..._REMOVE`` for LIST in
   ALLOWLIST, INFERLIST, DENYLIST, CLEARLIST, then the legacy WHITELIST, GRAYLIST,
   BLACKLIST. Values are split on "," and not trimmed; like TensorFlow, an empty piece
   ("A,,B", "A,") is the op name "" — it matches no node, but two lists holding it conflict.
4. ``TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LEVEL`` (case-insensitive):
   ``TENSOR_CORES_ONLY`` empties float16's infer, deny and clear lists before step 3, so
   only allow edits count; ``TREAT_INFER_AS_DENY`` moves infer into deny after step 3;
   ``UNSAFE_FORCE_ALL`` sets ``force_all`` for float16 and is refused for bfloat16.
   ``infer_as_deny`` records ``TREAT_INFER_AS_DENY``, so that ops acting as infer ops
   only in some graphs (``colouring.bounded_ops``) are denied too.
"""
from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import os
import re
import string
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType

import yaml

from amp_rewrite.core import functions, support
from amp_rewrite.core.float8 import inference as float8
from amp_rewrite.core.target import BFLOAT16, FLOAT16, Target, lookup_target
from amp_rewrite.errors import ListsError


class Colour(enum.Enum):
    ALLOW = "allow"
    DENY = "deny"
    INFER = "infer"
    CLEAR = "clear"


_LIST_NAMES = tuple(colour.value for colour in Colour)
ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
_LEVEL_VAR = ENV_PREFIX + "LEVEL"
_LEVELS = ("TENSOR_CORES_ONLY", "TREAT_INFER_AS_DENY", "UNSAFE_FORCE_ALL")
# TensorFlow's variable names per list, in the order it applies them (legacy name second).
_LIST_TO_ENV_NAMES = {
    "allow": ("ALLOWLIST", "WHITELIST"),
    "deny": ("DENYLIST", "BLACKLIST"),
    "infer": ("INFERLIST", "GRAYLIST"),
    "clear": ("CLEARLIST",),
}
_FLOAT8_KEYS = ("amax", "lossy")  # target float8's calibration: load_float8
_OVERLAY_KEYS = (*_LIST_NAMES, "keep_nodes", *_FLOAT8_KEYS)
_EDIT_KEYS = ("add", "remove")
_HELD_SECTION = "float32"  # ops taken off grappler's lists because they run slower converted
_BUILTIN_KEYS = ("target", "tensorflow", *_LIST_NAMES, _HELD_SECTION)
_BUILTIN_LIST_KEYS = ("meaning", "ops")
# Package data, found wherever the package is installed (--prefix, --user, --target, a
# bundler); in a checkout, a link to the repository's lists/, where they are edited. A
# package on disk (always: TensorFlow cannot be imported from a zip either) gives a Path.
_BUILTIN_DIR: Path = resources.files("amp_rewrite") / "lists"
# (list, action, variable) in the order TensorFlow applies them.
_LIST_VARIABLES = tuple(
    (name, action, f"{ENV_PREFIX}{env_name}_{action.upper()}")
    for name, env_names in _LIST_TO_ENV_NAMES.items() for env_name in env_names for action in ("add", "remove")
)
# Every variable the lists read: with none set, the built-in lists are used as they are.
_VARIABLES = (_LEVEL_VAR, *(var for _, _, var in _LIST_VARIABLES))
# TensorFlow upper-cases with ASCII rules only (str_util::Uppercase).
_ASCII_UPPER = str.maketrans(string.ascii_lowercase, string.ascii_uppercase)


@dataclass(frozen=True)
class OpLists:
    """The lists for one target; ``colour(op)`` is how the passes read them."""

    target: str
    allow: frozenset[str]
    deny: frozenset[str]
    infer: frozenset[str]
    clear: frozenset[str]
    keep_nodes: tuple[str, ...] = ()
    force_all: bool = False
    infer_as_deny: bool = False
    reasons: Mapping[str, str] = field(default_factory=dict, compare=False)
    sources: tuple[str, ...] = ()
    keep_reasons: Mapping[str, str] = field(default_factory=dict, compare=False)  # keep_nodes entry -> reason
    _op_to_colour: Mapping[str, Colour] = field(init=False, repr=False, compare=False)
    # (entry, function or None for every item, pattern), in keep_nodes order.
    _keep_patterns: tuple[tuple[str, str | None, re.Pattern[str]], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", lookup_target(self.target).name)
        for name in _LIST_NAMES:
            object.__setattr__(self, name, frozenset(getattr(self, name)))
        object.__setattr__(self, "keep_nodes", tuple(self.keep_nodes))
        object.__setattr__(self, "sources", tuple(self.sources))
        object.__setattr__(self, "reasons", MappingProxyType(dict(self.reasons)))
        object.__setattr__(self, "keep_reasons", MappingProxyType(dict(self.keep_reasons)))
        op_to_colour: dict[str, Colour] = {}
        for colour in Colour:
            for op in sorted(getattr(self, colour.value)):
                if op in op_to_colour:
                    where = " + ".join(self.sources) or "OpLists"
                    raise ListsError(
                        f"{where}: op {op!r} is in both {op_to_colour[op].value!r} and {colour.value!r}; "
                        "remove it from one"
                    )
                op_to_colour[op] = colour
        object.__setattr__(self, "_op_to_colour", MappingProxyType(op_to_colour))
        object.__setattr__(self, "_keep_patterns", _compile_keep_nodes(self.keep_nodes, "OpLists"))
        _check_keep_reasons(self.keep_reasons, self.keep_nodes, "OpLists", "keep_reasons")

    def colour(self, op: str) -> Colour | None:
        """The list ``op`` is in, or None if it is in none."""
        return self._op_to_colour.get(op)

    def keep_entry(self, node_name: str, function: str = "") -> str | None:
        """The first keep_nodes entry that keeps ``node_name`` of ``function`` ("": the main
        graph), or None: an unscoped entry matching the name in full as a regex, or a
        ``FUNCTION::PATTERN`` entry whose FUNCTION names ``function`` (``functions.scope_matches``)
        and whose PATTERN matches."""
        for entry, scope, pattern in self._keep_patterns:
            if (scope is None or functions.scope_matches(scope, function)) and pattern.fullmatch(node_name):
                return entry
        return None

    def keeps(self, node_name: str, function: str = "") -> bool:
        """True if a keep_nodes entry keeps ``node_name`` of ``function`` (``keep_entry``)."""
        return self.keep_entry(node_name, function) is not None

    def unmatched_keep_nodes(self, graph_def) -> list[str]:
        """The keep_nodes entries that keep no node of ``graph_def``'s main graph or library
        functions (read from the FunctionDefs: no body is built)."""
        items = {"": [node.name for node in graph_def.node]}
        for function in graph_def.library.function:
            items[function.signature.name] = [node.name for node in function.node_def]
        def matches(scope: str | None, pattern: re.Pattern[str], item: str, names: list[str]) -> bool:
            return (scope is None or functions.scope_matches(scope, item)) and any(map(pattern.fullmatch, names))

        return [entry for entry, scope, pattern in self._keep_patterns
                if not any(matches(scope, pattern, item, names) for item, names in items.items())]

    def keeping(self, entries: Mapping[str, str]) -> OpLists:
        """These lists with more keep_nodes entries, entry -> one-line reason ("": none given).
        An entry already there keeps its place, and takes the new reason if one is given."""
        keep_nodes = tuple(dict.fromkeys((*self.keep_nodes, *entries)))
        keep_reasons = {**self.keep_reasons, **{entry: reason for entry, reason in entries.items() if reason}}
        return dataclasses.replace(self, keep_nodes=keep_nodes, keep_reasons=keep_reasons)

    def __reduce__(self) -> tuple[type[OpLists], tuple[object, ...]]:
        # Rebuild through __init__ (mappingproxy cannot be pickled), so copy and pickle work.
        lists = tuple(getattr(self, name) for name in _LIST_NAMES)
        return OpLists, (self.target, *lists, self.keep_nodes, self.force_all, self.infer_as_deny, dict(self.reasons),
                         self.sources, dict(self.keep_reasons))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{name}={len(getattr(self, name))} ops" for name in _LIST_NAMES)
        return (
            f"OpLists(target={self.target!r}, {sizes}, keep_nodes={self.keep_nodes!r}, "
            f"force_all={self.force_all!r}, infer_as_deny={self.infer_as_deny!r}, sources={self.sources!r})"
        )


def load_lists(
    target: str | Target,
    overlay: str | os.PathLike[str] | OpLists | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> OpLists:
    """Built-in lists for ``target`` + ``overlay`` file + TensorFlow's variables (module doc).

    An ``OpLists`` overlay is taken as already loaded and returned unchanged.
    ``environ`` defaults to ``os.environ``. Raises ListsError for any invalid input.
    With no overlay and none of the variables set, every call returns the same lists
    (``OpLists`` is immutable): the pass loads them on each rewrite. A target built on
    another's colouring (float8) gets that target's lists (float16's).
    """
    target = _colouring(target)
    if isinstance(overlay, OpLists):
        if overlay.target != target.name:
            raise ListsError(
                f"the OpLists passed are for {overlay.target!r}, not {target.name!r}; "
                f"load lists for {target.name!r} or rewrite to {overlay.target!r}"
            )
        return overlay
    environ = os.environ if environ is None else environ
    builtin_path = find_builtin(target)
    if overlay is None and not any(environ.get(var) for var in _VARIABLES):
        return _builtin_lists(builtin_path, target)
    return _build(target, builtin_path, overlay, environ)


def load_float8(overlay: str | os.PathLike[str]) -> float8.Float8Calibration | None:
    """Target float8's calibration in an overlay file (``amax`` and ``lossy``, module doc), as
    ``rewrite_graph_def(amax=..., lossy=...)`` takes it; None if the file has no ``amax``.
    Raises ListsError for any invalid input."""
    shown = os.fspath(overlay)
    data = _read_yaml(Path(overlay), shown)
    if data is None:
        return None
    _check_mapping(data, shown, "the file", _OVERLAY_KEYS)
    return _read_float8(data, shown)


@functools.cache
def _builtin_lists(builtin_path: Path, target: Target) -> OpLists:
    """The lists with no overlay and no variable set: the same for every call, built once."""
    return _build(target, builtin_path, None, {})


def _build(
    target: Target, builtin_path: Path, overlay: str | os.PathLike[str] | None, environ: Mapping[str, str]
) -> OpLists:
    """Steps 1-4 of the module doc; warns about ops an overlay or variable adds that
    TensorFlow has not registered."""
    # 1. Built-in file.
    draft = _Draft(_read_builtin(builtin_path, target))
    sources = [str(builtin_path)]
    keep_nodes: tuple[str, ...] = ()
    keep_reasons: dict[str, str] = {}
    # 2. User overlay.
    if overlay is not None:
        edits, keep_nodes, keep_reasons = _read_overlay(Path(overlay), os.fspath(overlay))
        draft.apply(edits, os.fspath(overlay))
        sources.append(os.fspath(overlay))
    # 3. TensorFlow's variables; TENSOR_CORES_ONLY acts first, TREAT_INFER_AS_DENY last (spec §4).
    level = _read_level(environ, target)
    tensor_cores_only = level == "TENSOR_CORES_ONLY" and target == FLOAT16
    if tensor_cores_only:
        draft.empty(("deny", "infer", "clear"))
    if level:
        sources.append(_LEVEL_VAR)
    for name, action, var in _LIST_VARIABLES:
        value = environ.get(var, "")
        if value and not (tensor_cores_only and name != "allow"):
            sources.append(var)
            # str_util::Split keeps empty pieces; an empty value adds nothing.
            draft.apply({name: {action: tuple(value.split(","))}}, var)
    if level == "TREAT_INFER_AS_DENY":
        draft.merge("infer", into="deny")
    # 4. No op in two lists.
    draft.check_disjoint()

    lists = OpLists(
        target=target.name,
        **draft.final_lists(),
        keep_nodes=keep_nodes,
        force_all=level == "UNSAFE_FORCE_ALL",
        infer_as_deny=level == "TREAT_INFER_AS_DENY",
        reasons=draft.reasons(),
        sources=tuple(sources),
        keep_reasons=keep_reasons,
    )
    _warn_unregistered(draft.user_added(lists))
    return lists


# --- building -------------------------------------------------------------------------------


@dataclass(frozen=True)
class _BuiltinFile:
    shown: str
    name_to_op_to_reason: Mapping[str, Mapping[str, str | None]]


class _Draft:
    """Lists while they are edited: list -> op -> (edit number, source that added it)."""

    def __init__(self, builtin: _BuiltinFile) -> None:
        self._builtin = builtin
        self._count = 0
        self._name_to_op_to_origin: dict[str, dict[str, tuple[int, str]]] = {
            name: {op: (0, builtin.shown) for op in builtin.name_to_op_to_reason[name]} for name in _LIST_NAMES
        }

    def apply(self, edits: Mapping[str, Mapping[str, Iterable[str]]], source: str) -> None:
        for name, action_to_ops in edits.items():
            self._count += 1
            op_to_origin = self._name_to_op_to_origin[name]
            for op in action_to_ops.get("add", ()):
                op_to_origin[op] = (self._count, source)
            for op in action_to_ops.get("remove", ()):
                op_to_origin.pop(op, None)

    def empty(self, names: Iterable[str]) -> None:
        for name in names:
            self._name_to_op_to_origin[name].clear()

    def merge(self, name: str, *, into: str) -> None:
        for op, origin in self._name_to_op_to_origin[name].items():
            self._name_to_op_to_origin[into].setdefault(op, origin)
        self._name_to_op_to_origin[name].clear()

    def check_disjoint(self) -> None:
        for i, first in enumerate(_LIST_NAMES):
            for second in _LIST_NAMES[i + 1 :]:
                a, b = self._name_to_op_to_origin[first], self._name_to_op_to_origin[second]
                for op in sorted(a.keys() & b.keys()):
                    raise ListsError(_conflict_message(op, (first, *a[op]), (second, *b[op])))

    def final_lists(self) -> dict[str, frozenset[str]]:
        # The empty name from "A,,B" matches no node; it only mattered for check_disjoint.
        return {name: frozenset(op for op in ops if op) for name, ops in self._name_to_op_to_origin.items()}

    def reasons(self) -> dict[str, str]:
        """Built-in reasons of ops still in the list the reason was written for, and of
        held float32 ops that are still in no list."""
        listed = {op for op_to_origin in self._name_to_op_to_origin.values() for op in op_to_origin}
        return {
            op: reason
            for name, op_to_reason in self._builtin.name_to_op_to_reason.items()
            for op, reason in sorted(op_to_reason.items())
            if reason and (op not in listed if name == _HELD_SECTION else op in self._name_to_op_to_origin[name])
        }

    def user_added(self, lists: OpLists) -> dict[str, str]:
        """Op -> source for ops that an overlay or variable put in the final lists."""
        return {
            op: source
            for op_to_origin in self._name_to_op_to_origin.values()
            for op, (count, source) in op_to_origin.items()
            if count > 0 and op and lists.colour(op) is not None
        }


def held_float32(target: str | Target) -> frozenset[str]:
    """The ops of ``lists/<target>.yaml``'s ``float32`` section (module doc, step 1)."""
    target = _colouring(target)
    return frozenset(_read_builtin(find_builtin(target), target).name_to_op_to_reason[_HELD_SECTION])


def _colouring(target: str | Target) -> Target:
    """The target whose lists ``target`` colours with: itself, or float16 for float8."""
    return lookup_target(lookup_target(target, quantized=True).colouring)


def _conflict_message(op: str, first: tuple[str, int, str], second: tuple[str, int, str]) -> str:
    """One line: who added the op last, both lists, where the other entry came from, what to do."""
    (old_list, _, old_source), (new_list, _, new_source) = sorted((first, second), key=lambda entry: entry[1])
    shown_op = f"{op!r}" if op else "'' (an empty name from a doubled or trailing comma)"
    message = f"{new_source}: op {shown_op} is in both {first[0]!r} and {second[0]!r}"
    if old_source != new_source:
        message += f" ({old_list!r} from {old_source})"
    if not op:
        return message + "; remove the extra comma"
    if new_source.startswith(ENV_PREFIX) and old_list in _LIST_TO_ENV_NAMES and old_source != new_source:
        hint = f"{ENV_PREFIX}{_LIST_TO_ENV_NAMES[old_list][0]}_REMOVE={op}"
        return message + f"; remove it from one (to move it, also set {hint})"
    if old_source != new_source:
        return message + f"; remove it from one (to move it, also write {old_list}: {{remove: [{op}]}})"
    return message + "; remove it from one"


def _read_level(environ: Mapping[str, str], target: Target) -> str:
    raw = environ.get(_LEVEL_VAR, "")
    level = raw.translate(_ASCII_UPPER)
    if not raw:
        return ""
    if level not in _LEVELS:
        warnings.warn(
            f"{_LEVEL_VAR}={raw!r} is not one of {', '.join(_LEVELS)}; TensorFlow ignores it and so does amp_rewrite",
            stacklevel=4,  # the caller of load_lists
        )
        return ""
    if level == "UNSAFE_FORCE_ALL" and target == BFLOAT16:
        raise ListsError(
            f"{_LEVEL_VAR}=UNSAFE_FORCE_ALL is not supported for target 'bfloat16' "
            "(TensorFlow refuses it when oneDNN is used); unset it or use TREAT_INFER_AS_DENY"
        )
    return level


def _warn_unregistered(op_to_source: Mapping[str, str]) -> None:
    if not op_to_source:
        return
    unknown = sorted(op for op in op_to_source if support.registered_op_def(op) is None)
    if unknown:
        shown = ", ".join(f"{op!r} ({op_to_source[op]})" for op in unknown)
        warnings.warn(
            f"ops not in TensorFlow's op registry (typo, or a custom op library not loaded?): {shown}; "
            "they only match nodes whose op has exactly that name",
            stacklevel=4,  # the caller of load_lists
        )


# --- reading and validating files -----------------------------------------------------------


def find_builtin(target: str | Target) -> Path:
    """``lists/<target>.yaml`` inside the installed package (in the repository, a link to ``lists/``)."""
    target = lookup_target(target)
    path = _BUILTIN_DIR / f"{target.name}.yaml"
    if not path.is_file():
        raise ListsError(f"built-in lists {target.name}.yaml not found in {_BUILTIN_DIR}; reinstall amp_rewrite")
    return path


@functools.lru_cache(maxsize=None)
def _read_builtin(path: Path, target: Target) -> _BuiltinFile:
    shown = f"{path.parent.name}/{path.name}"
    data = _read_yaml(path, shown)
    _check_mapping(data, shown, "the file", _BUILTIN_KEYS)
    missing = [key for key in _BUILTIN_KEYS if key not in data and key != _HELD_SECTION]
    if missing:
        raise ListsError(f"{shown}: missing keys {', '.join(missing)}; restore the file from the repository")
    if data["target"] != target.name:
        raise ListsError(f"{shown}: target is {data['target']!r}, expected {target.name!r}; restore the file")
    name_to_op_to_reason: dict[str, Mapping[str, str | None]] = {}
    for name in (*_LIST_NAMES, _HELD_SECTION):
        section = data.get(name, {"ops": {}})
        _check_mapping(section, shown, repr(name), _BUILTIN_LIST_KEYS)
        ops = section.get("ops") or {}
        _check_mapping(ops, shown, f"{name}.ops", None)
        for op, reason in ops.items():
            if not isinstance(op, str) or not (reason is None or isinstance(reason, str)):
                message = f"{name}.ops entry {op!r}: {reason!r} must map an op name to a reason or nothing"
                raise ListsError(f"{shown}: {message}")
        name_to_op_to_reason[name] = MappingProxyType(dict(ops))
    for name in _LIST_NAMES:
        for op in sorted(name_to_op_to_reason[name].keys() & name_to_op_to_reason[_HELD_SECTION].keys()):
            raise ListsError(f"{shown}: op {op!r} is in both {name!r} and {_HELD_SECTION!r}; restore the file")
    return _BuiltinFile(shown, MappingProxyType(name_to_op_to_reason))


def _read_overlay(
    path: Path, shown: str
) -> tuple[dict[str, dict[str, tuple[str, ...]]], tuple[str, ...], dict[str, str]]:
    """Validated overlay: (list -> {add, remove} -> ops, keep_nodes, keep_nodes entry -> reason)."""
    data = _read_yaml(path, shown)
    if data is None:  # an empty file edits nothing
        return {}, (), {}
    _check_mapping(data, shown, "the file", _OVERLAY_KEYS)
    edits: dict[str, dict[str, tuple[str, ...]]] = {}
    for name in _LIST_NAMES:
        if name not in data:
            continue
        section = data[name]
        if section is None:
            continue
        _check_mapping(section, shown, repr(name), _EDIT_KEYS, example="{add: [Foo], remove: [Bar]}")
        edits[name] = {action: _strings(section.get(action), shown, f"{name}.{action}") for action in _EDIT_KEYS}
    keep_nodes, keep_reasons = _keep_nodes(data.get("keep_nodes"), shown)
    _compile_keep_nodes(keep_nodes, shown, indexed=not isinstance(data.get("keep_nodes"), dict))
    _read_float8(data, shown)  # checked here too: a bad file fails whichever reads it first
    return edits, keep_nodes, keep_reasons


def _read_float8(data: Mapping[str, object], shown: str) -> float8.Float8Calibration | None:
    """An overlay's ``amax`` and ``lossy``, validated; None without ``amax``."""
    amax_data, lossy_data = data.get("amax"), data.get("lossy")
    if amax_data is None:
        if lossy_data:
            raise ListsError(f"{shown}: 'lossy' without 'amax'; write both, as amp-rewrite calibrate --target float8"
                             " does, or remove 'lossy'")
        return None
    _check_mapping(amax_data, shown, "amax", None, example="{'dense/Relu:0': 3.25}")
    _check_mapping(lossy_data or {}, shown, "lossy", None, example="{'dense/MatMul': 'calibration: ...'}")
    amax: dict[tuple[str, str, int], float] = {}
    for text, value in amax_data.items():
        key = _float8_key(text, shown, "amax", port=True)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ListsError(f"{shown}: amax {text!r} is {value!r}, not the largest |x| (a finite number >= 0);"
                             " recalibrate")
        amax[key] = float(value)
    lossy: dict[tuple[str, str], str] = {}
    for text, reason in (lossy_data or {}).items():
        key = _float8_key(text, shown, "lossy", port=False)
        if not isinstance(reason, str) or "\n" in reason or "\r" in reason:
            raise ListsError(f"{shown}: lossy {text!r} has reason {reason!r}, not one line of text; quote it on one line")
        lossy[key] = reason
    return float8.Float8Calibration(MappingProxyType(amax), MappingProxyType(lossy))


def _float8_key(text: object, shown: str, where: str, *, port: bool) -> tuple:
    if not isinstance(text, str):
        raise ListsError(f"{shown}: {where} key {text!r} is {type(text).__name__}, not a name; quote it")
    try:
        return float8.parse_key(text, port=port)
    except ValueError as error:
        raise ListsError(f"{shown}: {where} key {error}; names are as amp-rewrite calibrate writes them") from None


def _keep_nodes(value: object, shown: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """An overlay's keep_nodes, a list of entries or a mapping entry -> reason: (entries, entry -> reason)."""
    if not isinstance(value, dict):
        if value is not None and not isinstance(value, list):
            raise ListsError(
                f"{shown}: keep_nodes must be a list like [logits, 'head/.*'] or a mapping like"
                f" {{logits: reason}}, not {type(value).__name__} {value!r}"
            )
        return _strings(value, shown, "keep_nodes"), {}
    for entry in value:
        if not isinstance(entry, str) or not entry:
            raise ListsError(
                f"{shown}: keep_nodes key {entry!r} is {type(entry).__name__}, not a node name or regex; quote it"
            )
    _check_keep_reasons(value, value, shown, "keep_nodes")
    return tuple(value), {entry: reason for entry, reason in value.items() if reason}


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects a key written twice in one mapping (PyYAML keeps the last)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[str] = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                if key_node.value in seen:
                    message = f"duplicate key {key_node.value!r}"
                    raise yaml.constructor.ConstructorError(None, None, message, key_node.start_mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep=deep)


def _read_yaml(path: Path, shown: str) -> object:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ListsError(f"{shown}: cannot read the lists file ({error}); check the path") from error
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        where = f"{shown}:{mark.line + 1}" if mark else shown
        problem = " ".join(str(part) for part in (error.context, error.problem) if part)
        raise ListsError(f"{where}: invalid YAML ({problem}); fix the syntax there") from error
    except yaml.YAMLError as error:
        raise ListsError(f"{shown}: invalid YAML ({error}); fix the syntax") from error


def _check_mapping(
    value: object, shown: str, what: str, allowed: tuple[str, ...] | None, example: str | None = None
) -> None:
    """``value`` must be a mapping whose keys are all in ``allowed`` (None: any keys)."""
    if not isinstance(value, dict):
        like = f" like {example}" if example else ""
        raise ListsError(f"{shown}: {what} must be a mapping{like}, not {type(value).__name__} {value!r}")
    if allowed is None:
        return
    for key in value:
        if key not in allowed:
            inside = "" if what == "the file" else f" under {what}"
            close = difflib.get_close_matches(str(key), allowed, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ListsError(f"{shown}: unknown key {key!r}{inside}{hint}; allowed keys: {', '.join(allowed)}")


def _strings(value: object, shown: str, where: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise ListsError(f"{shown}: {where} must be a list like [Foo, Bar], not {type(value).__name__} {value!r}")
    for i, item in enumerate(value):
        if not isinstance(item, str) or not item:
            raise ListsError(
                f"{shown}: {where}[{i}] is {type(item).__name__} {item!r}, not a non-empty name; quote it or remove it"
            )
    return tuple(value)


def _check_keep_reasons(entry_to_reason: Mapping[object, object], entries: Iterable[str], shown: str,
                        where: str) -> None:
    """Every reason is one line of text, for an entry of ``entries``."""
    known = set(entries)
    for entry, reason in entry_to_reason.items():
        if not isinstance(reason, str) or "\n" in reason or "\r" in reason:
            raise ListsError(
                f"{shown}: {where} entry {entry!r} has reason {reason!r} ({type(reason).__name__}), not one line of"
                " text; quote it on one line, or write \"\" for none"
            )
        if entry not in known:
            raise ListsError(f"{shown}: {where} has a reason for {entry!r}, which is not a keep_nodes entry; add it")


def _compile_keep_nodes(
    entries: Iterable[str], shown: str, *, indexed: bool = True
) -> tuple[tuple[str, str | None, re.Pattern[str]], ...]:
    """(entry, function or None, compiled pattern) per entry; FUNCTION::PATTERN scopes one."""
    compiled = []
    for i, entry in enumerate(entries):
        where = f"keep_nodes[{i}]" if indexed else "keep_nodes entry"
        if not isinstance(entry, str) or not entry:
            raise ListsError(f"{shown}: {where} is {type(entry).__name__} {entry!r}, not a non-empty node name or regex")
        scope, pattern = functions.split_scope(entry)
        if scope is not None and (not scope or not pattern):
            raise ListsError(
                f"{shown}: {where} {entry!r} has nothing {'before' if not scope else 'after'} '{functions.SCOPE}';"
                f" write FUNCTION{functions.SCOPE}PATTERN, or PATTERN alone to match in every function"
            )
        try:
            compiled.append((entry, scope, re.compile(pattern)))
        except re.error as error:
            raise ListsError(
                f"{shown}: {where} {entry!r} is not a valid regular expression ({error}); "
                "fix it or escape special characters with a backslash"
            ) from error
    return tuple(compiled)
