"""Every example in the documentation runs: each ```python, ```bash/```sh/```console block of
``docs/**/*.md`` and of ``README.md`` is one test.

Each block runs alone in a fresh directory, so alternatives are simply separate blocks. A
block is complete, or names a setup on the HTML comment line just before it,
``<!-- docs-test: setup=NAME -->``: ``docs/setups/NAME.py`` (the page shows it, included with
``--8<--``) runs first in the same directory and namespace; ``setup=checkout`` runs the block
among links to this checkout's files (for the tools' command lines). ``skip=REASON`` is a
visible skip, for the few commands that cannot run inside the suite (``make test`` itself);
``min_tf=2.18 why="the float8 target"`` skips a block on an older TensorFlow, saying why.
Python blocks share one TensorFlow process (``tests/docs_worker.py``); ``fresh`` runs a block
(and its setup) in a process of its own, for blocks that change the process for good (graph
mode, a rewrite left enabled) or name Keras layers by their counters; shell blocks run in
bash with ``-euo pipefail`` and this environment's ``amp-rewrite`` first on PATH; a console
block runs its ``$ `` lines. ```yaml blocks are loaded as op-list overlays (``target=NAME``,
default float16), ```text and the like are not run; any other language fails, so nothing is
left out unseen. A failure names the file and line.
"""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tensorflow as tf
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from docs_worker import PREFIX  # noqa: E402

from amp_rewrite._tf import tensorflow_version  # noqa: E402

README = ROOT / "README.md"
SETUPS = ROOT / "docs" / "setups"
RUN_LANGUAGES = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell",
                 "console": "console"}
SHOWN_LANGUAGES = {"text", "yaml", "toml", "json", "pbtxt", "dot", "html", "ini"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
OPTIONS = re.compile(r"^\s*<!-- docs-test: (?P<options>.*?) -->\s*$")
SNIPPET = re.compile(r'^(?P<indent>[ \t]*)--8<-- "(?P<path>[^"]+)"[ \t]*$', re.MULTILINE)
BLOCK_TIMEOUT_S = 600


@dataclass(frozen=True)
class Block:
    """One fenced block of a page: where it is, its language, its text and its options."""

    path: Path
    line: int  # of the first line of code, 1-based
    language: str
    code: str
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _options(text: str) -> dict[str, str]:
    """``setup=savedmodel skip="needs a GPU"`` -> {"setup": "savedmodel", "skip": "needs a GPU"}."""
    return dict(part.split("=", 1) if "=" in part else (part, "") for part in shlex.split(text))


def _expand_snippets(code: str) -> str:
    """What pymdownx.snippets shows: each ``--8<-- "path"`` line replaced by the file (from the root)."""
    def include(match: re.Match[str]) -> str:
        return "".join(match["indent"] + line for line in (ROOT / match["path"]).read_text().splitlines(True))

    return SNIPPET.sub(include, code)


def blocks_of(path: Path) -> Iterator[Block]:
    """The fenced blocks of a Markdown file, with the options of the comment line just above each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    index = 0
    while index < len(lines):
        opening = FENCE.match(lines[index])
        if not opening:
            index += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        language = opening["info"].strip().split(" ")[0].lstrip(".").lower()
        previous = next((line for line in reversed(lines[:index]) if line.strip()), "")
        options = _options(m["options"]) if (m := OPTIONS.match(previous)) else {}
        end = index + 1
        while end < len(lines) and not (lines[end].strip().startswith(fence) and lines[end].strip().strip(fence[0]) == ""):
            end += 1
        body = [line[len(indent):] if line.startswith(indent) else line.lstrip() for line in lines[index + 1:end]]
        yield Block(path, index + 2, language, _expand_snippets("\n".join(body) + "\n"), options)
        index = end + 1


def pages() -> list[Path]:
    """docs/**/*.md, the files they include whole (CONTRIBUTING.md), and README.md."""
    found = sorted((ROOT / "docs").rglob("*.md"))
    included = {ROOT / m["path"] for page in found for m in SNIPPET.finditer(page.read_text()) if not m["indent"]}
    return found + sorted(path for path in included if path.suffix == ".md") + [README]


def _collected() -> list[Block]:
    return [block for page in pages() for block in blocks_of(page)]


ALL_BLOCKS = _collected()
BLOCKS = [block for block in ALL_BLOCKS if block.language in RUN_LANGUAGES or block.language == "yaml"]


class Worker:
    """tests/docs_worker.py, started on first use and again after a block kills it."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[str] | None = None

    def run(self, block: Block, cwd: Path, setup: Path | None) -> dict:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "docs_worker.py")], stdin=subprocess.PIPE,
                stdout=subprocess.PIPE, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"},
            )
        request = {"code": block.code, "filename": str(block.path.relative_to(ROOT)), "line": block.line,
                   "cwd": str(cwd), "setup": str(setup) if setup else None}
        self._process.stdin.write(json.dumps(request) + "\n")
        self._process.stdin.flush()
        for line in self._process.stdout:
            if line.startswith(PREFIX):
                return json.loads(line[len(PREFIX):])
        self._process = None
        return {"ok": False, "error": "the Python worker died (a crash in TensorFlow?)", "output": ""}

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait(timeout=60)


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    running = Worker()
    yield running
    running.close()


def _setup_path(block: Block) -> Path | None:
    name = block.options.get("setup")
    if name in (None, "checkout"):
        return None
    path = SETUPS / f"{name}.py"
    assert path.is_file(), f"{block.where}: no setup {name!r}; write docs/setups/{name}.py or fix the name"
    return path


def _link_checkout(directory: Path) -> None:
    """The checkout's top-level files and folders, linked into ``directory`` (writes stay there);
    ``.venv`` is the environment this suite runs in (``make matrix`` runs it in another
    release's venv, and a fresh checkout may have none of its own)."""
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "site", ".venv"):
            (directory / entry.name).symlink_to(entry)
    (directory / ".venv").symlink_to(Path(sys.prefix))


def _shell_script(block: Block) -> str:
    if block.language != "console":
        return block.code
    commands, continued = [], False
    for line in block.code.splitlines():
        if line.startswith("$ ") or continued:
            commands.append(line[2:] if line.startswith("$ ") and not continued else line)
            continued = line.endswith("\\")
    assert commands, f"{block.where}: a console block without a '$ ' line; use ```text for output alone"
    return "\n".join(commands) + "\n"


def _run_shell(block: Block, cwd: Path) -> None:
    environment = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2",
                   "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    completed = subprocess.run(["bash", "-euo", "pipefail", "-c", _shell_script(block)], cwd=cwd, env=environment,
                               capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False)
    if completed.returncode != 0:
        pytest.fail(f"{block.where}: the {block.language} block exited {completed.returncode}\n"
                    f"--- script\n{_shell_script(block)}--- stdout (end)\n{completed.stdout[-3000:]}"
                    f"--- stderr (end)\n{completed.stderr[-3000:]}", pytrace=False)


def _load_overlay(block: Block, cwd: Path) -> None:
    import amp_rewrite

    document = yaml.safe_load(block.code)
    path = cwd / "overlay.yaml"
    path.write_text(block.code)
    try:
        amp_rewrite.load_lists(block.options.get("target", "float16"), path)
        amp_rewrite.load_float8(path)
    except amp_rewrite.ListsError as error:
        pytest.fail(f"{block.where}: the yaml block is not a valid overlay: {error}", pytrace=False)
    assert isinstance(document, dict), f"{block.where}: a yaml block that is no mapping"


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_block_runs(block: Block, worker: Worker, tmp_path: Path) -> None:
    """The block runs as written (with its named setup) in a fresh directory."""
    if "skip" in block.options:
        pytest.skip(f"{block.where}: {block.options['skip']}")
    if "min_tf" in block.options and tensorflow_version() < tuple(map(int, block.options["min_tf"].split("."))):
        pytest.skip(f"{block.where}: {block.options.get('why', 'it')} needs TensorFlow {block.options['min_tf']}+;"
                    f" this is {tf.version.VERSION}")
    if block.language == "yaml":
        _load_overlay(block, tmp_path)
        return
    if block.options.get("setup") == "checkout":
        _link_checkout(tmp_path)
    setup = _setup_path(block)
    runner = Worker() if "fresh" in block.options else worker
    try:
        if RUN_LANGUAGES[block.language] == "python":
            answer = runner.run(block, tmp_path, setup)
            if not answer["ok"]:
                pytest.fail(f"{block.where}: the python block failed\n{answer['error']}"
                            f"--- its output (end)\n{answer['output'][-3000:]}", pytrace=False)
            return
        if setup is not None:
            answer = runner.run(Block(setup, 1, "python", setup.read_text()), tmp_path, None)
            assert answer["ok"], f"{block.where}: setup {setup.name} failed\n{answer['error']}"
    finally:
        if runner is not worker:
            runner.close()
    _run_shell(block, tmp_path)


def test_every_block_is_run_or_shown_on_purpose() -> None:
    """A block in a language the runner does not know would be left out unseen: name one it knows."""
    unknown = [f"{block.where}: {block.language!r}" for block in ALL_BLOCKS
               if block.language not in RUN_LANGUAGES and block.language not in SHOWN_LANGUAGES]
    assert not unknown, (f"blocks neither run ({', '.join(RUN_LANGUAGES)}) nor shown"
                         f" ({', '.join(sorted(SHOWN_LANGUAGES))}): {'; '.join(unknown)}")


def test_readme_shows_the_setups_it_names() -> None:
    """GitHub does not expand ``--8<--``, so a setup the README names must be shown in it: each
    code line of the setup (its model and export) is a line of a README block."""
    shown = {line.strip() for block in blocks_of(README) for line in block.code.splitlines()}
    for block in blocks_of(README):
        name = block.options.get("setup")
        if name in (None, "checkout"):
            continue
        code = [line.strip() for line in (SETUPS / f"{name}.py").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith(("#", "import ", "from ", "assert "))]
        missing = [line for line in code if line not in shown]
        assert not missing, f"{block.where}: setup {name} does what the README does not show: {missing}"


# --------------------------------------------------------------------------------------
# The generated parts (docs/hooks.py), checked without MkDocs


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_cli_reference_has_every_subcommand_and_option() -> None:
    """Each option string of each subcommand's parser (but --help) appears in the generated reference."""
    import argparse

    from amp_rewrite.cli.options import build_parser

    hooks = _hooks()
    page = hooks.cli_options()
    for name, sub in hooks._subcommands(build_parser()).items():
        assert f"## `amp-rewrite {name}`" in page
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            for flag in action.option_strings:
                assert f"`{flag}`" in page, f"{name} {flag} is missing from the CLI reference"
            if not action.option_strings:
                assert f"`{action.metavar or action.dest}` (positional)" in page


def test_exit_codes_page_is_the_help_text() -> None:
    """Every code the command's help lists is one row, with its meaning."""
    from amp_rewrite.cli.options import EXIT_CODES

    table = _hooks().exit_codes()
    section = EXIT_CODES.split("exit codes:\n", 1)[1].split("\n\n", 1)[0]
    for line in filter(str.strip, section.splitlines()):
        code, meaning = line.split(None, 1)
        assert f"| `{code}` | {meaning} |" in table


def test_api_reference_covers_all_public_names() -> None:
    """One mkdocstrings block per name of amp_rewrite.__all__, and nothing else."""
    import amp_rewrite

    blocks = re.findall(r"^::: amp_rewrite\.(\w+)$", _hooks().api(), re.MULTILINE)
    assert blocks == list(amp_rewrite.__all__)


def test_op_list_pages_hold_every_op_of_the_yaml_lists() -> None:
    """Each op of lists/<target>.yaml is a row under its list, and the counts add up."""
    hooks = _hooks()
    for target in ("float16", "bfloat16"):
        page = hooks.op_list(target)
        document = yaml.safe_load((ROOT / "lists" / f"{target}.yaml").read_text())
        for colour in hooks.LIST_COLOURS:
            ops = (document.get(colour) or {}).get("ops") or {}
            if colour in document:
                assert f"### `{colour}` ({len(ops)} ops)" in page
            for op in ops:
                assert f"| `{op}` |" in page, f"{target} {colour} {op} missing"
    assert "| `float16` | 39 | 9 | 43 | 110 | 0 |" in hooks.op_list_counts()


def test_mutation_table_lists_every_mutant() -> None:
    """The design page's table is tools/mutation_check.py's MUTANTS, one row each."""
    hooks = _hooks()
    table = hooks.mutations()
    names = re.findall(r"^\| `([\w-]+)` \|", table, re.MULTILINE)
    assert names == [mutant.name for mutant in sys.modules["mutation_check"].MUTANTS] and len(names) >= 10


def test_the_last_mutation_run_is_recorded_for_every_mutant() -> None:
    """The recorded run (docs/design/mutations.md) has a row per mutant of the tool's table,
    each caught (some test failed), and the README's count is the table's."""
    _hooks().mutations()  # loads tools/mutation_check.py
    mutants = [mutant.name for mutant in sys.modules["mutation_check"].MUTANTS]
    page = (ROOT / "docs" / "design" / "mutations.md").read_text(encoding="utf-8")
    recorded = dict(re.findall(r"^\| `([\w-]+)` \| (\d+)/\d+ \|", page, re.MULTILINE))
    assert sorted(recorded) == sorted(mutants), "rerun tools/mutation_check.py and record its table"
    assert all(int(failed) > 0 for failed in recorded.values())
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert f"puts {len(mutants)} deliberate" in readme and f"caught all {len(mutants)}" in readme



def test_internals_page_lists_every_private_name_with_its_reason() -> None:
    """Every entry of amp_rewrite/_tf.py is in the generated table, and no row lacks its why."""
    from amp_rewrite import _tf

    table = _hooks().tf_internals()
    rows = table.splitlines()[2:]
    for entry in _tf.ENTRIES:
        assert f"`{entry.name}`" in table, f"{entry.name} missing from the internals table"
    for attribute in (_tf.SESSION_HANDLE, _tf.V1_GOOD_STEPS):
        assert f"`{attribute}`" in table
    assert rows and all(row.rsplit("|", 2)[1].strip() for row in rows), "a row without its reason"

def test_an_unknown_generated_part_fails_naming_the_page() -> None:
    with pytest.raises(ValueError, match=r"docs/x\.md: unknown generated part 'no-such-part'"):
        _hooks().expand("<!-- generated: no-such-part -->\n", "docs/x.md")


def test_every_page_is_in_the_navigation_and_every_generated_part_is_known() -> None:
    """A page left out of mkdocs.yml's nav is built but unreachable; a misspelt marker would stay a comment."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text().replace("!!python", "#"))

    def paths(entries):
        for entry in entries:
            value = entry if isinstance(entry, str) else next(iter(entry.values()))
            yield from paths(value) if isinstance(value, list) else [value]

    pages = sorted(str(p.relative_to(ROOT / "docs")) for p in (ROOT / "docs").rglob("*.md"))
    assert sorted(paths(config["nav"])) == pages
    hooks = _hooks()
    for page in pages:
        for match in hooks.MARKER.finditer((ROOT / "docs" / page).read_text()):
            assert match["name"] in hooks.GENERATORS, f"docs/{page}: unknown generated part {match['name']!r}"


def test_licence_and_metadata() -> None:
    """LICENSE is Apache-2.0 and pyproject.toml says so; its classifiers name the Pythons requires-python allows."""
    import tomllib

    assert "Apache License\n                           Version 2.0" in (ROOT / "LICENSE").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == {"text": "Apache-2.0"}
    assert "License :: OSI Approved :: Apache Software License" in project["classifiers"]
    assert project["requires-python"] == ">=3.9,<3.14"
    versions = [c.rsplit(" ", 1)[1] for c in project["classifiers"] if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert versions == [f"3.{minor}" for minor in range(9, 14)]
    assert {"mkdocs>=1.6", "mkdocs-material>=9.5", "mkdocstrings[python]>=0.26"} == set(project["optional-dependencies"]["docs"])
