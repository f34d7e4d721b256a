"""Grappler's answers, recorded once on a capable machine and replayed on every machine.

The conformance tests compare our rewrite with TensorFlow's own pass. That pass cannot
always answer: its bfloat16 mode needs a CPU with AVX512F, and another TensorFlow version
builds other lists. So every answer the tests need (a rewritten graph, or the four op
lists for some variables) is recorded in ``tests/grappler_answers.zip`` by
``tools/record_grappler.py`` from live grappler, with the TensorFlow version the lists
come from (``LISTS_TENSORFLOW``), on a CPU that runs both passes. Then:

* every machine compares with the recorded answer;
* where live grappler can answer (that TensorFlow version, and for bfloat16 a CPU with
  AVX512F), the test also asks it and requires the recording to equal its answer, so a
  stale recording fails, and so does a question that was never recorded;
* each answer records the inputs the oracle gave grappler besides the graph (the ops it
  held float32, the bounded Exp nodes it ran as Tanh: ``reference.oracle_inputs``); a
  test whose inputs now differ fails naming the input, so an answer is never replayed
  for a question grappler was not asked;
* a missing answer is told apart from a stale recording. On the release the answers come
  from, every missing answer is stale: the test fails. On another release a test may ask
  the question the recording holds for it with another graph, because that release builds
  the graph otherwise (TensorFlow 2.16's GELU is ``Erf``, 2.21's ``Erfc``; the question is
  the test file's, as a module's shared fixture asks for whichever test runs first): then
  ``rewrite`` returns None, the test leaves out its grappler comparison (a test that is
  nothing else skips, saying why) and still runs its own assertions and numerics, and the
  summary counts and names those tests, under pytest-xdist too. Any other missing answer
  (a test the recording never heard of, or one that now asks with other fetches,
  variables or lists) is stale there too, and fails.

An answer is keyed by its question: the target, fetches, lists flag and
``TF_AUTO_MIXED_PRECISION_*`` variables, and the input graph in a canonical form, so the
same test finds its answer whatever ran before it and on every supported TensorFlow:
the names that depend on the process (``__inference_f_123``, ``while_body_45``:
TensorFlow's counters) are numbered by rank, attrs that hold their op's default value
are left out (releases add attrs with defaults, e.g. ``TensorListSetItem``'s
``resize_if_index_out_of_bounds``), and the producer version is cleared. Answers are
stored in the same form and given back with the installed TensorFlow's defaults.

Recording (``AMP_RECORD_GRAPPLER=1``, what ``tools/record_grappler.py`` sets) writes when
the run passes: the answers of a run of the whole suite replace the recording; a part of
the suite (paths, ``-k``, ``--lf``...) merges its answers into it and says so.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import re
import zipfile
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NoReturn

import pytest
import tensorflow as tf
from tensorflow.core.framework.graph_pb2 import GraphDef
from tensorflow.python.framework import op_def_registry

from amp_rewrite.testing.reference import GrapplerUnavailable, grappler_environ, oracle_inputs, unavailable_reason
from amp_rewrite.testing.reference import run_grappler as _run_live

# The recording; AMP_GRAPPLER_ANSWERS names another file (tools/record_grappler.py --smoke records into a copy).
ANSWERS_FILE = "AMP_GRAPPLER_ANSWERS"
ANSWERS = Path(os.environ.get(ANSWERS_FILE) or Path(__file__).with_name("grappler_answers.zip"))
# The TensorFlow release whose lists lists/*.yaml hold: answers come from it.
LISTS_TENSORFLOW = "2.21"
# Set to 1 by tools/record_grappler.py: ask live grappler and write every answer asked for.
RECORD = "AMP_RECORD_GRAPPLER"
_ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
_ZIP_TIME = (2026, 1, 1, 0, 0, 0)  # fixed, so the same answers give the same file

# (target, how) -> count, printed at the end of the run; how: "recorded" (compared with a
# recorded answer), "live" (also asked live grappler) or "built otherwise" (no answer on
# this release: the comparison was not made).
comparisons: Counter[tuple[str, str]] = Counter()
# Tests (pytest node ids) that made no comparison for lack of an answer on this release -> why.
tests_without_answer: dict[str, str] = {}


class MissingAnswer(AssertionError):
    """The recording has no answer for a question a test asks."""


class ChangedInput(AssertionError):
    """The oracle's inputs for a question differ from those its recorded answer was made with."""


class ListsRefused(RuntimeError):
    """Grappler refused the list variables and built no lists (its message)."""


def recording() -> bool:
    return os.environ.get(RECORD, "") not in ("", "0")


def live_unavailable(target: str) -> str | None:
    """Why live grappler cannot give the recorded kind of answer here, or None."""
    if _installed_release() != LISTS_TENSORFLOW:
        return f"the lists are TensorFlow {LISTS_TENSORFLOW}'s and this is TensorFlow {tf.__version__}"
    return unavailable_reason(target)


# --------------------------------------------------------------------------------------
# Questions


def rewrite(
    graph_def: GraphDef, *, target: str, fetches: Sequence[str] = (), our_lists: bool = True
) -> GraphDef | None:
    """What ``amp_rewrite.testing.reference.run_grappler`` answers, from the recording or
    live; None on another release that builds the graph otherwise (the module's notes)."""
    names = _canonical_names(graph_def)
    canonical = _canonical(graph_def, names).SerializeToString(deterministic=True)
    question = {
        "kind": "rewrite", "target": target, "fetches": list(fetches), "our_lists": our_lists, "environ": _amp_environ(),
    }
    inputs = {}
    if our_lists:
        given = oracle_inputs(graph_def, target, os.environ)
        inputs = {"held_float32": list(given.held_float32),
                  "stand_ins": sorted([names.get(function, function), node] for function, node in given.stand_ins)}

    def live() -> bytes:
        answer = _run_live(graph_def, target=target, fetches=fetches, our_lists=our_lists)
        return _canonical(answer, names).SerializeToString(deterministic=True)

    recorded = _answer(question, canonical, inputs, live)
    if recorded is None:
        return None
    answer = _renamed(GraphDef.FromString(recorded), {v: k for k, v in names.items()})
    _add_defaults(answer)
    return answer


def lists(
    target: str, environ: Mapping[str, str] | None = None, *, our_lists: bool = False
) -> dict[str, tuple[str, ...]] | None:
    """What ``tools/dump_grappler_lists.py``'s ``dump_lists`` answers under ``environ``, from
    the recording or live; ``our_lists`` first takes the ops we hold float32 off grappler's
    infer list (``reference.grappler_environ``). ``ListsRefused`` where grappler refuses the
    variables and builds no lists; None as for ``rewrite``."""
    environ = dict(sorted((environ or {}).items()))
    question = {"kind": "lists", "target": target, "environ": environ}
    inputs = {}
    if our_lists:
        question["our_lists"] = True
        given = oracle_inputs(GraphDef(), target, environ)
        inputs = {"held_float32": list(given.held_float32), "stand_ins": []}

    def live() -> bytes:
        asked = grappler_environ(target, environ) if our_lists else environ
        try:
            answer = {name: list(ops) for name, ops in dump_tool().dump_lists(target, asked).items()}
        except GrapplerUnavailable:
            raise
        except RuntimeError as error:
            answer = {"refused": str(error)}
        return json.dumps(answer, sort_keys=True).encode()

    recorded = _answer(question, b"", inputs, live)
    if recorded is None:
        return None
    answer = json.loads(recorded)
    if "refused" in answer:
        raise ListsRefused(answer["refused"])
    return {name: tuple(ops) for name, ops in answer.items()}


def _answer(question: dict, payload: bytes, inputs: dict, live: Callable[[], bytes]) -> bytes | None:
    """The recorded answer to ``question`` about ``payload`` (both canonical), given the
    oracle's ``inputs``, checked against ``live()`` where live grappler can answer; in a
    recording run, ``live()``'s. None where ``_no_answer`` says so."""
    key, target = _key(question, payload), question["target"]
    if recording():
        answer = live()
        _store().put(key, {**question, "graph": _digest(payload)}, inputs, answer)
        return answer
    recorded = _store().get(key)
    reason = live_unavailable(target)
    if recorded is None:
        return _no_answer(question, payload, key, reason)
    _check_inputs(question, key, inputs)
    comparisons[(target, "recorded")] += 1
    if reason is None:
        assert live() == recorded, (
            f"the recorded grappler answer {key[:12]} ({question['kind']} {target}) differs from live grappler's: "
            f"re-run tools/record_grappler.py ({_current_test()})"
        )
        comparisons[(target, "live")] += 1
    return recorded


def _check_inputs(question: dict, key: str, inputs: dict) -> None:
    """The oracle's inputs must be those the recorded answer was made with; the message
    names each that changed and how."""
    recorded = _store().index["answers"][key].get("oracle_inputs", {})
    changed = []
    for name in sorted(set(recorded) | set(inputs)):
        was, now = recorded.get(name), inputs.get(name)
        if was == now:
            continue
        if was is None or now is None:
            changed.append(f"{name}: recorded {was!r}, now {now!r}")
            continue
        was_set, now_set = {json.dumps(v) for v in was}, {json.dumps(v) for v in now}
        changed.append(f"{name}: now adds {sorted(now_set - was_set)} and drops {sorted(was_set - now_set)}")
    if changed:
        raise ChangedInput(
            f"the oracle's inputs for recorded answer {key[:12]} ({question['kind']} {question['target']}, "
            f"{_current_test()}) changed since the recording: {'; '.join(changed)}. held_float32 comes from "
            "lists/<target>.yaml's float32 section, stand_ins from amp_rewrite/testing/reference.py's bounded-Exp "
            "rule; if the change is meant, re-run tools/record_grappler.py"
        )


@functools.cache
def dump_tool():
    """``tools/dump_grappler_lists.py`` as a module (it is a script, not part of the package)."""
    import importlib.util

    path = Path(__file__).resolve().parent.parent / "tools" / "dump_grappler_lists.py"
    spec = importlib.util.spec_from_file_location("dump_grappler_lists", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _no_answer(question: dict, payload: bytes, key: str, reason: str | None) -> None:
    """A question with no recorded answer: None (no comparison, counted) where this release
    builds the test's graph otherwise; else the recording is stale and the test fails
    (the module's notes)."""
    if _installed_release() != LISTS_TENSORFLOW and _differing_fields(question, payload) == ["graph"]:
        comparisons[(question["target"], "built otherwise")] += 1
        tests_without_answer[_current_test()] = (
            f"TensorFlow {tf.__version__} builds this {question['kind']} {question['target']} question's graph"
            f" otherwise than TensorFlow {LISTS_TENSORFLOW}, whose answers are recorded")
        return None
    raise MissingAnswer(_missing(question, payload, key, reason))


def _installed_release() -> str:
    return ".".join(tf.__version__.split(".")[:2])


def _missing(question: dict, payload: bytes, key: str, reason: str | None) -> str:
    if _installed_release() != LISTS_TENSORFLOW:
        where = f"so the recording is stale (TensorFlow {tf.__version__} only explains another graph)"
    elif reason is None:
        where = "live grappler answers here, so the recording is stale"
    else:
        where = f"and live grappler cannot answer here: {reason}"
    differing = _differing_fields(question, payload)
    what = ("; the recording holds no question of this test's file" if differing is None else
            f"; the recording asked this test's file the same with another {', '.join(differing)}")
    return (
        f"no recorded grappler answer {key[:12]} for {question['kind']} {question['target']} "
        f"({_current_test()}){what}; {where}; re-run tools/record_grappler.py on a "
        f"CPU with AVX512F and TensorFlow {LISTS_TENSORFLOW}"
    )


def _differing_fields(question: dict, payload: bytes) -> list[str] | None:
    """The fewest fields in which a question of this kind and target that the recording
    holds for this test's file differs from this one (``["graph"]``: only the graph), or
    None where it holds none. By file, not by test: a module's shared fixture asks for the
    test that happens to run first, which pytest-xdist's order changes."""
    asked = {**question, "graph": _digest(payload)}
    module = _current_test().split("::")[0]
    recorded = [q for q in _store().index["answers"].values()
                if any(test.split("::")[0] == module for test in q.get("tests", ()))
                and q.get("kind") == question["kind"] and q.get("target") == question["target"]]
    if not recorded:
        return None
    return min((sorted(name for name in (set(asked) | set(q)) - {"tests", "oracle_inputs"} if q.get(name) != asked.get(name))
                for q in recorded), key=lambda fields: (len(fields), fields))


def _digest(payload: bytes) -> str:
    return hashlib.sha256(payload).hexdigest()[:16]


def _amp_environ() -> dict[str, str]:
    return dict(sorted((k, v) for k, v in os.environ.items() if k.startswith(_ENV_PREFIX)))


def _key(question: dict, payload: bytes) -> str:
    digest = hashlib.sha256(json.dumps(question, sort_keys=True).encode())
    digest.update(payload)
    return digest.hexdigest()


def _current_test() -> str:
    return os.environ.get("PYTEST_CURRENT_TEST", "outside a test").rsplit(" ", 1)[0]


# --------------------------------------------------------------------------------------
# The canonical form of a graph


def _canonical(graph_def: GraphDef, names: Mapping[str, str]) -> GraphDef:
    """``graph_def`` with canonical function names, functions and nodes sorted by name
    (grappler's output order varies from run to run), no default-valued attrs and no
    versions."""
    canonical = _renamed(graph_def, names)
    canonical.ClearField("versions")  # the producer version differs between releases; AMP never reads it
    _sort(canonical.library.function, lambda function: function.signature.name)
    for node_defs in _node_lists(canonical):
        _sort(node_defs, lambda node_def: node_def.name)
    for node_defs in _node_lists(canonical):
        for node_def in node_defs:
            op_def = op_def_registry.get(node_def.op)
            for attr in op_def.attr if op_def is not None else ():
                if attr.HasField("default_value") and attr.name in node_def.attr and (
                    node_def.attr[attr.name] == attr.default_value
                ):
                    del node_def.attr[attr.name]
    return canonical


def _sort(field, key) -> None:
    """Sort a repeated message field in place."""
    ordered = sorted(field, key=key)
    del field[:]
    field.extend(ordered)


def _add_defaults(graph_def: GraphDef) -> None:
    """Put back, in place, the attrs the installed TensorFlow's op definitions default."""
    for node_defs in _node_lists(graph_def):
        for node_def in node_defs:
            op_def = op_def_registry.get(node_def.op)
            for attr in op_def.attr if op_def is not None else ():
                if attr.HasField("default_value") and attr.name not in node_def.attr:
                    node_def.attr[attr.name].CopyFrom(attr.default_value)


def _node_lists(graph_def: GraphDef) -> list:
    return [graph_def.node] + [function.node_def for function in graph_def.library.function]


_DIGITS = re.compile(r"\d+")


def _canonical_names(graph_def: GraphDef) -> dict[str, str]:
    """Names that depend on TensorFlow's counters -> names that do not.

    Those are library function names and all-digit node names (captured tensors). Digits
    in a name are replaced by ``#``; names that then coincide are told apart by the order
    of their numbers, which the counters hand out in creation order.
    """
    numbered = [function.signature.name for function in graph_def.library.function]
    numbered += sorted({node_def.name for node_defs in _node_lists(graph_def) for node_def in node_defs
                        if node_def.name.isdigit()})
    pattern_to_names: dict[str, list[str]] = {}
    for name in numbered:
        pattern_to_names.setdefault(_DIGITS.sub("#", name), []).append(name)
    names: dict[str, str] = {}
    for pattern, members in pattern_to_names.items():
        members.sort(key=lambda name: [int(d) for d in _DIGITS.findall(name)])
        for rank, name in enumerate(members):
            names[name] = f"{pattern}~{rank}"
    return names


def _renamed(graph_def: GraphDef, old_to_new: Mapping[str, str]) -> GraphDef:
    """A copy of ``graph_def`` in which each name of ``old_to_new`` is replaced wherever
    names are written: function, argument, node and input names, ops, ``func`` and string
    attrs. It is also replaced inside such names (TensorFlow derives argument names like
    ``..._while_cond_149___redundant_placeholder0`` from a function's, and casts are named
    ``<node>-<port>-CastTo...``) where it is not preceded by a letter or digit (for an
    all-digit name, nor by ``_`` or ``/``) nor followed by a digit."""
    copy = GraphDef.FromString(graph_def.SerializeToString())
    if not old_to_new:
        return copy
    names = sorted(old_to_new, key=len, reverse=True)  # the longest name that matches wins
    pattern = re.compile("|".join(
        (r"(?<![0-9A-Za-z_/])" if name.isdigit() else r"(?<![0-9A-Za-z])") + re.escape(name) + r"(?![0-9])"
        for name in names
    ))

    def new(text: str) -> str:
        return pattern.sub(lambda match: old_to_new[match.group(0)], text)

    def rename_attr(value) -> None:
        kind = value.WhichOneof("value")
        if kind == "s":
            try:
                value.s = new(value.s.decode("utf-8")).encode("utf-8")
            except UnicodeDecodeError:
                pass  # bytes, not a name
        functions = [value.func] if kind == "func" else list(value.list.func) if kind == "list" else []
        for function in functions:
            function.name = new(function.name)
            for nested in function.attr.values():
                rename_attr(nested)

    def rename_nodes(node_defs) -> None:
        for node_def in node_defs:
            node_def.name, node_def.op = new(node_def.name), new(node_def.op)
            node_def.input[:] = [new(tensor) for tensor in node_def.input]
            for value in node_def.attr.values():
                rename_attr(value)

    rename_nodes(copy.node)
    for function in copy.library.function:
        signature = function.signature
        signature.name = new(signature.name)
        for arg in [*signature.input_arg, *signature.output_arg]:
            arg.name = new(arg.name)
        signature.control_output[:] = [new(name) for name in signature.control_output]
        rename_nodes(function.node_def)
        for returns in (function.ret, function.control_ret):
            renamed = {new(key): new(value) for key, value in returns.items()}
            returns.clear()
            returns.update(renamed)
        for value in function.attr.values():
            rename_attr(value)
    for gradient in copy.library.gradient:
        gradient.function_name, gradient.gradient_func = new(gradient.function_name), new(gradient.gradient_func)
    return copy


# --------------------------------------------------------------------------------------
# The recording


class _Store:
    """``grappler_answers.zip``: ``index.json`` (who made it, what each answer is: its
    question, the tests that asked it, the oracle's inputs) and one member per answer."""

    def __init__(self) -> None:
        self.key_to_answer: dict[str, bytes] = {}
        self.index: dict = {"answers": {}}
        if ANSWERS.exists():
            with zipfile.ZipFile(ANSWERS) as archive:
                self.index = json.loads(archive.read("index.json"))
                self.key_to_answer = {key: archive.read(key) for key in self.index["answers"]}
        self.recorded: dict[str, tuple[dict, bytes]] = {}

    def get(self, key: str) -> bytes | None:
        return self.key_to_answer.get(key)

    def put(self, key: str, question: dict, inputs: dict, answer: bytes) -> None:
        if key in self.recorded:
            question = self.recorded[key][0]
        question.setdefault("tests", [])
        if _current_test() not in question["tests"]:
            question["tests"].append(_current_test())
        if inputs:
            question["oracle_inputs"] = inputs
        self.recorded[key] = (question, answer)

    def write(self, *, whole_suite: bool) -> tuple[int, int]:
        """Write this run's answers: they replace the recording after a run of the whole
        suite and are merged into it otherwise (an answer asked again replaces its old one,
        the others stay). Returns (answers written, of them kept from the old recording)."""
        entries = dict(self.recorded)
        kept = 0
        if not whole_suite:
            for key, question in self.index["answers"].items():
                if key not in entries:
                    entries[key] = (question, self.key_to_answer[key])
                    kept += 1
                else:  # asked again: by these tests and by those the other part of the suite holds
                    tests = entries[key][0]["tests"]
                    tests += [test for test in question.get("tests", ()) if test not in tests]
        index = {
            "tensorflow": tf.__version__,
            "cpu": _cpu_description(),
            "made_by": "tools/record_grappler.py",
            "answers": {key: question for key, (question, _) in sorted(entries.items())},
        }
        temporary = ANSWERS.with_suffix(".zip.tmp")
        with zipfile.ZipFile(temporary, "w", compression=zipfile.ZIP_LZMA) as archive:
            archive.writestr(zipfile.ZipInfo("index.json", _ZIP_TIME), json.dumps(index, indent=1, sort_keys=True))
            for key, (_, answer) in sorted(entries.items()):
                archive.writestr(zipfile.ZipInfo(key, _ZIP_TIME), answer, compress_type=zipfile.ZIP_LZMA)
        temporary.replace(ANSWERS)
        return len(entries), kept


_STORE: _Store | None = None


def _store() -> _Store:
    global _STORE
    if _STORE is None:
        _STORE = _Store()
    return _STORE


def write_recording(*, whole_suite: bool) -> tuple[int, int]:
    """``_Store.write``: the answers this run recorded, replacing or merged into the file."""
    return _store().write(whole_suite=whole_suite)


def recorded_by() -> str:
    """"TensorFlow 2.21.0 on <cpu>": what made the recording."""
    index = _store().index
    return f"TensorFlow {index.get('tensorflow', '?')} on {index.get('cpu', '?')}"


def _cpu_description() -> str:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and ":" in line:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    shown = [flag for flag in ("avx512f", "avx512_bf16", "amx_bf16", "avx512_fp16") if flag in flags]
    return f"{model} ({', '.join(shown) or 'no AVX512'})"


def skip_comparison() -> NoReturn:
    """Skip a test that is nothing but a comparison with grappler, where ``rewrite`` or
    ``lists`` has no answer on this release (None), saying why; the summary names it too,
    also where the question was asked before it, for another test (a shared fixture)."""
    why = tests_without_answer.setdefault(
        _current_test(), f"TensorFlow {tf.__version__} has no recorded answer for a question a fixture asked earlier")
    pytest.skip(f"nothing to compare: {why}")
