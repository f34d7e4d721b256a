"""MkDocs hook: the parts of the pages that the code already says, generated at build time.

A page asks for one with an HTML comment on a line of its own, ``<!-- generated: NAME ARG -->``;
``on_page_markdown`` puts the Markdown in its place. Generating them means the CLI options,
the exit codes, the op lists, the API reference, the mutation table and the list of TensorFlow internals
cannot drift from the parser, the YAML lists, ``amp_rewrite.__all__``,
``tools/mutation_check.py`` and ``amp_rewrite/_tf.py``. An
unknown name fails the build, naming the page. ``tests/test_docs.py`` checks each generator
without MkDocs.
"""
from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"^<!-- generated: (?P<name>[\w-]+)(?: (?P<arg>[^>]*?))? -->$", re.MULTILINE)
LIST_COLOURS = ("allow", "deny", "infer", "clear", "float32")


def _cell(text: object) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    # argparse has no public way to list a parser's subcommands; its action list is the one source.
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _option_row(action: argparse.Action) -> tuple[str, ...]:
    if action.option_strings:
        name = ", ".join(f"`{flag}`" for flag in action.option_strings)
    else:
        name = f"`{action.metavar or action.dest}` (positional)"
    if action.choices:
        value = " \\| ".join(f"`{choice}`" for choice in action.choices)
    elif action.nargs == 0:
        value = "—"
    else:
        value = f"`{action.metavar or action.dest.upper()}`" + (" (optional)" if action.nargs == "?" else "")
    default = "—" if action.default in (None, False, [], argparse.SUPPRESS) or action.nargs == 0 else f"`{action.default}`"
    repeat = " Repeatable." if isinstance(action, argparse._AppendAction) else ""
    return name, value, default, (action.help or "") + repeat


def cli_options(_arg: str = "") -> str:
    """Every subcommand of ``amp-rewrite`` with its usage line and a row per option."""
    from amp_rewrite.cli.options import build_parser

    parser = build_parser()
    parts = []
    for name, sub in _subcommands(parser).items():
        actions = [a for a in sub._actions if not isinstance(a, argparse._HelpAction)]
        parts += [
            f"## `amp-rewrite {name}`",
            (sub.description or "").split("\n\n")[0].strip() or _help_of(parser, name),
            "```text\n" + sub.format_usage().strip() + "\n```",
            _table(("option", "value", "default", "what it does"), [_option_row(a) for a in actions]),
        ]
    return "\n\n".join(parts)


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return (choice.help or "").capitalize() + "."
    return ""


def exit_codes(_arg: str = "") -> str:
    """The ``exit codes:`` section of ``amp-rewrite --help`` (and each command's), as a table."""
    from amp_rewrite.cli.options import EXIT_CODES

    section = EXIT_CODES.split("exit codes:\n", 1)[1].split("\n\n", 1)[0]
    rows = [tuple(line.strip().split(None, 1)) for line in section.splitlines() if line.strip()]
    return _table(("code", "meaning"), [(f"`{code}`", meaning) for code, meaning in rows])


def _list_sections(target: str) -> Iterator[tuple[str, str, dict[str, Any]]]:
    document = yaml.safe_load((ROOT / "lists" / f"{target}.yaml").read_text())
    for colour in LIST_COLOURS:
        if colour in document:
            section = document[colour]
            yield colour, " ".join(str(section.get("meaning", "")).split()), section.get("ops") or {}


def op_list_counts(_arg: str = "") -> str:
    """How many ops each built-in list holds, per target."""
    rows = []
    for target in ("float16", "bfloat16"):
        counts = {colour: len(ops) for colour, _, ops in _list_sections(target)}
        rows.append((f"`{target}`", *(str(counts.get(colour, 0)) for colour in LIST_COLOURS)))
    return _table(("target", *LIST_COLOURS), rows)


def op_list(target: str) -> str:
    """One target's built-in lists: each list's meaning, then its ops with their reasons."""
    parts = []
    for colour, meaning, ops in _list_sections(target):
        parts += [f"### `{colour}` ({len(ops)} ops)", meaning,
                  _table(("op", "why"), [(f"`{op}`", reason or "") for op, reason in sorted(ops.items())])]
    return "\n\n".join(parts)


def api(_arg: str = "") -> str:
    """One mkdocstrings block per public name, in ``__all__``'s order."""
    import amp_rewrite

    return "\n\n".join(f"::: amp_rewrite.{name}" for name in amp_rewrite.__all__)


def mutations(_arg: str = "") -> str:
    """``tools/mutation_check.py``'s faults: name, what it breaks, the file, the tests run."""
    spec = importlib.util.spec_from_file_location("mutation_check", ROOT / "tools" / "mutation_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)  # dataclasses look their module up there
    spec.loader.exec_module(module)
    rows = [(f"`{m.name}`", m.fault, f"`{m.path}`", ", ".join(f"`{t}`" for t in m.tests)) for m in module.MUTANTS]
    return _table(("mutant", "fault", "file", "tests run against it"), rows)


def _private_names(value: Any) -> list[str]:
    """The private names one assignment in ``_tf.py`` lists: a ``Private(feature, module,
    attribute)`` entry, or attribute names (strings with a leading underscore)."""
    if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "Private":
        module, attribute = (ast.literal_eval(arg) for arg in (value.args[1:3] + [ast.Constant("")])[:2])
        return [f"{module}.{attribute}" if attribute else module]
    constants = value.elts if isinstance(value, ast.Tuple) else [value]
    return [c.value for c in constants if isinstance(c, ast.Constant) and str(c.value).startswith("_")]


def tf_internals(_arg: str = "") -> str:
    """``amp_rewrite/_tf.py``'s private names by section (the feature and the modules using
    them), each group with the comment above it there, which says why it is private."""
    source = (ROOT / "amp_rewrite" / "_tf.py").read_text(encoding="utf-8")
    lines = source.splitlines()
    rows: list[tuple[str, list[str], str]] = []
    for node in ast.parse(source).body:
        names = _private_names(node.value) if isinstance(node, ast.Assign) else []
        if not names:
            continue
        above = []
        for line in reversed(lines[:node.lineno - 1]):
            if not line.startswith("# ") or line.startswith("# ---"):
                break
            above.insert(0, line[2:])
        section = next(line for line in reversed(lines[:node.lineno - 1]) if line.startswith("# ---"))
        section = section.strip("# -")
        if above or not rows or rows[-1][0] != section:
            rows.append((section, [], " ".join(above)))
        rows[-1][1].extend(names)
    return _table(("feature (modules)", "private names", "why private"),
                  [(section, "<br>".join(f"`{n}`" for n in names), why) for section, names, why in rows])


GENERATORS: dict[str, Callable[[str], str]] = {
    "cli-options": cli_options,
    "exit-codes": exit_codes,
    "op-list-counts": op_list_counts,
    "op-list": op_list,
    "api": api,
    "mutations": mutations,
    "tf-internals": tf_internals,
}


def expand(markdown: str, where: str) -> str:
    """``markdown`` with every generated part filled in; an unknown name is an error naming ``where``."""
    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in GENERATORS:
            raise ValueError(f"{where}: unknown generated part {name!r}; known: {', '.join(GENERATORS)}")
        return GENERATORS[name](match["arg"] or "")

    return MARKER.sub(replace, markdown)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    return expand(markdown, page.file.src_path)
