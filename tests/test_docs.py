"""Every example in the documentation runs as a reader follows it: each page (``docs/**/*.md``,
the files they include whole, ``README.md``) is a program whose ```python, ```bash/```sh and
```console blocks run in page order, in one folder, with nothing the page does not show.

**The folder.** Each page gets a folder of its own that starts as the README's quick start
left it: the README's own blocks run, in order, in an empty folder until one of them has made
``my_model/`` (its Keras 3 ``Sequential``, exported), and every other page starts from a copy
of that folder. The README itself runs in that empty folder, all its blocks in order. A block
sees what the blocks before it on its page made; a file a page uses, the page makes, in a
block the reader sees. There are no setup files. ``checkout`` runs a block among links to
this checkout's files instead (writes stay in the test's folder), for the tools' command
lines; the paragraph before such a block says it runs in a checkout.

**Processes.** Each block runs in a process of its own, as a reader who saves it as a script
in that folder and runs it: a Python block through ``tests/docs_worker.py`` (a fresh
``__main__``, the folder first on ``sys.path``, tracebacks naming the page and line), a shell
block in ``bash -euo pipefail`` (a console block: its ``$`` lines), this environment's
``python`` and ``amp-rewrite`` first on PATH. So nothing a block does to its process (graph
mode, a rewrite left enabled, Keras' layer-name counters, which give the README's model the
node names ``sequential_1/dense_1/MatMul`` the pages use) reaches a later block or another
page. Each of these processes is a fork of one that imported numpy, TensorFlow and Keras once
(``tests/forks.py``, ``tests/docs_worker.py``), made before any TensorFlow runtime starts: a Python
block's, and each ``amp-rewrite`` command's of a shell block (a shim first on its PATH asks
for it), so no block pays a TensorFlow import (7 s of CPU; half of these tests' time) and
still nothing one block does reaches another; other commands (``python tools/...``) start a
Python of their own. The README's model is built once per session and copied.
The differences from a reader's shell: ``amp-rewrite`` is that shim (its fork runs the same
console script), and ``XDG_CACHE_HOME`` is a folder of the session, so ``--tune speed``'s
timing cache is not written into your home.

**Failures.** A block that fails names its page and line, with the end of its output. The
blocks after it on its page are not run and are reported as skipped, naming the block that
failed. Selecting one block (``-k 'cli.md:40'``) runs the blocks before it on its page first,
and the README's quick start; if one of those fails, the selected block fails with its error.

**Options**, on the HTML comment line just before a block, ``<!-- docs-test: ... -->``:
``skip="REASON"`` a visible skip for a block that cannot run here (``make test`` itself, an
install) or that holds a placeholder the reader replaces (``<your_node>``): the reason says
what stands in for it and where the suite runs the real thing; ``min_tf=2.18 why="the float8
target"`` skips it before that TensorFlow release; ``checkout`` (above); ``target=NAME`` for a
```yaml block, which is loaded as an op-list overlay (default float16) and is no step of the
page. ```text and the like are shown, not run; any other language fails, so nothing is left
out unseen.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tensorflow as tf
import yaml

from amp_rewrite._tf import tensorflow_version
from forks import Forks

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
WORKER = ROOT / "tests" / "docs_worker.py"
RUN_LANGUAGES = {"python": "python", "py": "python", "bash": "shell", "sh": "shell", "shell": "shell",
                 "console": "console"}
SHOWN_LANGUAGES = {"text", "yaml", "toml", "json", "pbtxt", "dot", "html", "ini"}
OPTION_NAMES = {"skip", "min_tf", "why", "checkout", "target"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`\n]*)$")
OPTIONS = re.compile(r"^\s*<!-- docs-test: (?P<options>.*?) -->\s*$")
SNIPPET = re.compile(r'^(?P<indent>[ \t]*)--8<-- "(?P<path>[^"]+)"[ \t]*$', re.MULTILINE)
PLACEHOLDER = re.compile(r"<your_[a-z0-9_]+>")
QUICK_START_MAKES = Path("my_model") / "saved_model.pb"  # the README's model, which every other page starts from
BLOCK_TIMEOUT_S = 600
OUTPUT_SHOWN = 3000  # characters of a failed block's stdout and stderr, from the end


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
        return f"{_shown(self.path)}:{self.line}"

    @property
    def runs(self) -> bool:
        """Whether the block is a step of its page: code the runner runs, not skipped here."""
        return self.language in RUN_LANGUAGES and skip_reason(self) is None


def _shown(path: Path) -> str:
    """A page as the messages name it: from the checkout's root (a made-up page: its whole path)."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _options(text: str) -> dict[str, str]:
    """``skip="needs a GPU" checkout`` -> {"skip": "needs a GPU", "checkout": ""}."""
    return dict(part.split("=", 1) if "=" in part else (part, "") for part in shlex.split(text))


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
        yield Block(path, index + 2, language, "\n".join(body) + "\n", options)
        index = end + 1


def skip_reason(block: Block) -> str | None:
    """Why the block does not run here (its page's ``skip=``, or a TensorFlow too old), or None."""
    if "skip" in block.options:
        return f"{block.where}: {block.options['skip']}"
    if "min_tf" in block.options and tensorflow_version() < tuple(map(int, block.options["min_tf"].split("."))):
        return (f"{block.where}: {block.options.get('why', 'it')} needs TensorFlow {block.options['min_tf']}+;"
                f" this is {tf.version.VERSION}")
    return None


def pages() -> list[Path]:
    """docs/**/*.md, the files they include whole (CONTRIBUTING.md), and README.md."""
    found = sorted((ROOT / "docs").rglob("*.md"))
    included = {ROOT / m["path"] for page in found for m in SNIPPET.finditer(page.read_text()) if not m["indent"]}
    return found + sorted(path for path in included if path.suffix == ".md") + [README]


ALL_BLOCKS = [block for page in pages() for block in blocks_of(page)]
BLOCKS = [block for block in ALL_BLOCKS if block.language in RUN_LANGUAGES or block.language == "yaml"]


# --------------------------------------------------------------------------------------
# Running a block as a reader would


def _environment(cache: Path, forks: Forks | None = None) -> dict[str, str]:
    """The reader's shell: this environment's python and amp-rewrite first on PATH (with
    ``forks``, its ``amp-rewrite`` before them); caches kept in the session's folder, not the
    home of whoever runs the suite."""
    first = [str(forks.shims)] if forks is not None else []
    return {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "XDG_CACHE_HOME": str(cache),
            "PATH": os.pathsep.join([*first, str(Path(sys.executable).parent), os.environ.get("PATH", "")])}


def _shell_script(block: Block) -> str:
    """A shell block as it is; a console block's ``$ `` lines (and their ``\\`` continuations)."""
    if block.language != "console":
        return block.code
    commands, continued = [], False
    for line in block.code.splitlines():
        if line.startswith("$ ") or continued:
            commands.append(line[2:] if line.startswith("$ ") and not continued else line)
            continued = line.endswith("\\")
    assert commands, f"{block.where}: a console block without a '$ ' line; use ```text for output alone"
    return "\n".join(commands) + "\n"


def run_block(block: Block, cwd: Path, cache: Path, forks: Forks | None = None) -> str | None:
    """Runs the block in ``cwd`` in a process of its own (``forks``: forked, tests/forks.py); None
    if it exits 0, else why it failed, naming its page and line, with the end of its output."""
    if RUN_LANGUAGES[block.language] == "python":
        command = (forks.python_block(block.path, block.line) if forks is not None
                   else [sys.executable, str(WORKER), str(block.path), str(block.line)])
        stdin, shown = block.code, ""
    else:
        script = _shell_script(block)
        command, stdin, shown = ["bash", "-euo", "pipefail", "-c", script], None, f"--- script\n{script}"
    try:
        completed = subprocess.run(command, input=stdin, cwd=cwd, env=_environment(cache, forks), capture_output=True,
                                   text=True, timeout=BLOCK_TIMEOUT_S, check=False)
    except subprocess.TimeoutExpired:
        return f"{block.where}: the {block.language} block ran over {BLOCK_TIMEOUT_S} s (in {cwd})\n{shown}"
    if completed.returncode == 0:
        return None
    return (f"{block.where}: the {block.language} block exited {completed.returncode} (in {cwd})\n{shown}"
            f"--- stdout (end)\n{completed.stdout[-OUTPUT_SHOWN:]}--- stderr (end)\n{completed.stderr[-OUTPUT_SHOWN:]}")


def _link_checkout(directory: Path) -> None:
    """The checkout's top-level files and folders, linked into ``directory`` (writes stay there);
    ``.venv`` is the environment this suite runs in (``make matrix`` runs it in another
    release's venv, and a fresh checkout may have none of its own)."""
    for entry in ROOT.iterdir():
        if entry.name not in (".git", "site", ".venv"):
            (directory / entry.name).symlink_to(entry)
    (directory / ".venv").symlink_to(Path(sys.prefix))


# --------------------------------------------------------------------------------------
# The pages of one session: each in its folder, its blocks in order


@dataclass(frozen=True)
class Outcome:
    """How a block ran: ``error`` is None when it passed."""

    where: str
    error: str | None


@dataclass(frozen=True)
class Verdict:
    """What a block's test reports: ``passed``, ``failed`` (with why) or ``not run`` (and why)."""

    state: str
    message: str = ""


class DocsRun:
    """The pages run in one session. It owns each page's folder, each block's outcome (a block
    runs once, when its own test or a later block of its page needs it) and the copy of the
    README's folder taken when its blocks had made ``my_model/``; every page but the README
    starts from that copy."""

    def __init__(self, base: Path, readme: Path = README, forks: Forks | None = None) -> None:
        self._base = base
        self._readme = readme
        self._cache = base / "xdg-cache"
        self._forks = forks
        self._folders: dict[Path, Path] = {}
        self._outcomes: dict[tuple[Path, int], Outcome] = {}
        self._reported: set[str] = set()  # the failures a test has failed with: later ones say "not run"
        self._quick_start: Path | None = None

    def check(self, block: Block) -> Verdict:
        """Runs what the block needs first (the README's quick start, the blocks before it on
        its page), then the block; a failure is reported once, as a failed test, and the
        blocks it kept from running say so."""
        blocker = self._first_failure_before(block)
        if blocker is not None:
            if blocker.where in self._reported:
                return Verdict("not run", f"{block.where}: not run: {blocker.where}, before it, failed")
            self._reported.add(blocker.where)
            return Verdict("failed", f"{block.where}: not run: {blocker.where}, which it needs, failed:\n"
                                     f"{blocker.error}")
        outcome = self._outcome(block)
        if outcome.error is None:
            return Verdict("passed")
        self._reported.add(outcome.where)
        return Verdict("failed", outcome.error)

    def folder(self, page: Path) -> Path:
        """The page's folder: empty for the README; for any other page, a copy of the README's
        folder as its quick start left it (which ``check`` has made before)."""
        if page not in self._folders:
            folder = self._base / _shown(page).strip("/").replace("/", "_")
            if page == self._readme:
                folder.mkdir(parents=True)
            else:
                assert self._quick_start is not None, f"{_shown(page)}: the README's quick start has not run"
                shutil.copytree(self._quick_start, folder, symlinks=True)
            self._folders[page] = folder
        return self._folders[page]

    def _checkout(self, page: Path) -> Path:
        """The page's checkout: links to this checkout's files, for its ``checkout`` blocks."""
        folder = self._base / (_shown(page).strip("/").replace("/", "_") + "-checkout")
        if not folder.is_dir():
            folder.mkdir(parents=True)
            _link_checkout(folder)
        return folder

    def _outcome(self, block: Block) -> Outcome:
        """The block's outcome, running it the first time it is asked for."""
        key = (block.path, block.line)
        if key not in self._outcomes:
            cwd = self._checkout(block.path) if "checkout" in block.options else self.folder(block.path)
            self._outcomes[key] = Outcome(block.where, run_block(block, cwd, self._cache, self._forks))
            if block.path == self._readme and self._quick_start is None and (cwd / QUICK_START_MAKES).is_file():
                self._quick_start = self._base / "quick-start"
                shutil.copytree(cwd, self._quick_start, symlinks=True)
        return self._outcomes[key]

    def _first_failure_before(self, block: Block) -> Outcome | None:
        """The first failure among what the block needs: the README's quick start (for another
        page), then the blocks before it on its page, which run here if they have not."""
        if block.path != self._readme:
            failure = self._run_quick_start()
            if failure is not None:
                return failure
        for earlier in (b for b in blocks_of(block.path) if b.runs and b.line < block.line):
            outcome = self._outcome(earlier)
            if outcome.error is not None:
                return outcome
        return None

    def _run_quick_start(self) -> Outcome | None:
        """The README's blocks, in order, until one has made my_model/; the first failure, if any."""
        for block in (b for b in blocks_of(self._readme) if b.runs):
            if self._quick_start is not None:
                return None
            outcome = self._outcome(block)
            if outcome.error is not None:
                return outcome
        if self._quick_start is None:
            return Outcome(_shown(self._readme), f"{_shown(self._readme)}: no block makes {QUICK_START_MAKES}, the"
                                                 " model every other page starts from")
        return None


@pytest.fixture(scope="module")
def docs_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DocsRun]:
    base = tmp_path_factory.mktemp("pages")
    forks = Forks(_environment(base / "xdg-cache"))
    try:
        yield DocsRun(base, forks=forks)
    finally:
        forks.close()


def _report(verdict: Verdict) -> None:
    if verdict.state == "failed":
        pytest.fail(verdict.message, pytrace=False)
    if verdict.state == "not run":
        pytest.skip(verdict.message)


def _load_overlay(block: Block, cwd: Path) -> None:
    """A yaml block is an op-list overlay: it loads for its target (and as float8's amax/lossy)."""
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
def test_block_runs(block: Block, docs_run: DocsRun, tmp_path: Path) -> None:
    """The block runs as written, in its page's folder, after the blocks before it on its page."""
    if (reason := skip_reason(block)) is not None:
        pytest.skip(reason)
    if block.language == "yaml":
        _load_overlay(block, tmp_path)
        return
    _report(docs_run.check(block))


def test_every_block_is_run_or_shown_on_purpose() -> None:
    """A block in a language the runner does not know would be left out unseen: name one it knows."""
    unknown = [f"{block.where}: {block.language!r}" for block in ALL_BLOCKS
               if block.language not in RUN_LANGUAGES and block.language not in SHOWN_LANGUAGES]
    assert not unknown, (f"blocks neither run ({', '.join(RUN_LANGUAGES)}) nor shown"
                         f" ({', '.join(sorted(SHOWN_LANGUAGES))}): {'; '.join(unknown)}")


def test_every_option_is_one_the_runner_knows() -> None:
    """An option the runner ignores (a ``setup=`` of the old runner, a typo) would change nothing
    unseen; a skip says why; a yaml target is a name."""
    for block in ALL_BLOCKS:
        unknown = sorted(set(block.options) - OPTION_NAMES)
        assert not unknown, f"{block.where}: unknown docs-test option(s) {unknown}; known: {sorted(OPTION_NAMES)}"
        assert block.options.get("skip", "why") != "", f"{block.where}: skip= without a reason"


def test_a_block_with_a_placeholder_is_skipped_saying_what_stands_in() -> None:
    """``<your_node>`` is for the reader to replace: the block cannot run as written, so it is a
    visible skip whose reason names what stands in for it."""
    for block in BLOCKS:
        if PLACEHOLDER.search(block.code):
            assert "skip" in block.options, (f"{block.where}: holds {PLACEHOLDER.search(block.code)[0]}, which the"
                                             " reader replaces; show a real value, or skip= saying what stands in")


def test_a_checkout_block_says_it_runs_in_a_checkout() -> None:
    """A ``checkout`` block runs among the checkout's files: the paragraph before it says so."""
    for block in ALL_BLOCKS:
        if "checkout" in block.options:
            before = block.path.read_text(encoding="utf-8").splitlines()[:block.line - 2]
            text = "\n".join(line for line in before if not OPTIONS.match(line)).rstrip()
            paragraph = text.rsplit("\n\n", 1)[-1].lower()
            assert "checkout" in paragraph, f"{block.where}: runs in the checkout; say so in the paragraph before it"


# --------------------------------------------------------------------------------------
# The runner itself, on made-up pages


def _made_up(path: Path, *blocks: str) -> list[Block]:
    """Writes a page of the given blocks (each a fence and its code) and returns its runnable blocks."""
    path.write_text("# A made-up page\n\n" + "\nSome text.\n\n".join(blocks), encoding="utf-8")
    return [block for block in blocks_of(path) if block.runs]


def _made_up_readme(folder: Path) -> Path:
    """A README whose first block makes my_model/ and whose second makes a file after it."""
    readme = folder / "README.md"
    _made_up(readme, "```console\n$ mkdir my_model && echo model > my_model/saved_model.pb\n```\n",
             "```console\n$ echo after > after_the_quick_start.txt\n```\n")
    return readme


def test_a_block_sees_what_the_blocks_before_it_made_from_the_readme_model(tmp_path: Path) -> None:
    """A page starts as the README's blocks left it once my_model/ was made (not after its later
    blocks), and each block sees the files the blocks before it on its page made."""
    docs = DocsRun(tmp_path / "run", readme=_made_up_readme(tmp_path))
    blocks = _made_up(tmp_path / "page.md",
                      "```python\nimport pathlib\npathlib.Path('made.txt').write_text('by the first block')\n```\n",
                      "```console\n$ test -f my_model/saved_model.pb && test ! -e after_the_quick_start.txt\n"
                      "$ grep -q 'first block' made.txt\n```\n")
    assert [docs.check(block) for block in blocks] == [Verdict("passed"), Verdict("passed")]
    assert sorted(p.name for p in docs.folder(blocks[0].path).iterdir()) == ["made.txt", "my_model"]


def test_a_block_using_a_file_no_block_made_fails_naming_its_page_and_line(tmp_path: Path) -> None:
    """What the page did not make is not there: the block fails, and its message names the page
    and line (a Python block's traceback names them too)."""
    docs = DocsRun(tmp_path / "run", readme=_made_up_readme(tmp_path))
    shell_page, python_page = tmp_path / "shell.md", tmp_path / "python.md"
    [shell] = _made_up(shell_page, "```console\n$ wc -c batch.npz\n```\n")
    [python] = _made_up(python_page, "```python\nimport numpy\n\nnumpy.load('batch.npz')\n```\n")
    verdict = docs.check(shell)
    assert verdict.state == "failed", verdict
    assert verdict.message.startswith(f"{shell_page}:{shell.line}: the console block exited 1")
    assert "batch.npz: No such file" in verdict.message
    verdict = docs.check(python)
    assert verdict.state == "failed", verdict
    assert verdict.message.startswith(f"{python_page}:{python.line}: the python block exited 1")
    assert f'File "{python_page}", line {python.line + 2}' in verdict.message and "batch.npz" in verdict.message


def test_a_forked_block_passes_and_fails_as_its_own_process_would(tmp_path: Path) -> None:
    """With ``Forks``, as the suite runs the pages: a block sees its folder and its shell's
    environment; a Python block's traceback names its page and line; an ``amp-rewrite`` command
    is the shim's fork, whose exit status and error line the block gets."""
    forks = Forks(_environment(tmp_path / "cache"))
    try:
        docs = DocsRun(tmp_path / "run", readme=_made_up_readme(tmp_path), forks=forks)
        page = tmp_path / "page.md"
        passing, raising, failing = _made_up(
            page, "```python\nimport os, pathlib\nassert pathlib.Path('my_model/saved_model.pb').is_file()\n"
                  "assert os.environ['XDG_CACHE_HOME'].endswith('cache')\n```\n",
            "```python\nimport numpy\n\nnumpy.load('batch.npz')\n```\n",
            "```console\n$ test \"$(command -v amp-rewrite)\" = " + f'"{forks.shims / "amp-rewrite"}"\n'
            "$ amp-rewrite inspect no_such_model/\n```\n")
        assert docs.check(passing) == Verdict("passed")
        verdict = docs.check(raising)
        assert verdict.state == "failed" and verdict.message.startswith(f"{raising.where}: the python block exited 1")
        assert f'File "{page}", line {raising.line + 2}' in verdict.message and "batch.npz" in verdict.message
        verdict = run_block(failing, docs.folder(page), tmp_path / "cache", forks)
        assert verdict is not None and verdict.startswith(f"{failing.where}: the console block exited 2"), verdict
        assert "amp-rewrite: error:" in verdict and "no_such_model" in verdict, verdict
    finally:
        forks.close()


def test_a_failure_stops_the_later_blocks_of_its_page_and_says_so(tmp_path: Path) -> None:
    """The blocks after a failed one are not run, each naming it; selected alone, a later block
    runs the ones before it and fails with their failure; a failed README fails every page."""
    readme = _made_up_readme(tmp_path)
    first, second, third = _made_up(tmp_path / "page.md", "```console\n$ false\n```\n",
                                    "```console\n$ touch second\n```\n", "```sh\ntouch third\n```\n")
    docs = DocsRun(tmp_path / "run", readme=readme)
    assert docs.check(first).state == "failed"
    for later in (second, third):
        assert docs.check(later) == Verdict("not run", f"{later.where}: not run: {first.where}, before it, failed")
    assert not (docs.folder(first.path) / "second").exists()
    alone = DocsRun(tmp_path / "alone", readme=readme).check(third)
    assert alone.state == "failed", alone
    assert alone.message.startswith(f"{third.where}: not run: {first.where}, which it needs")
    broken = tmp_path / "broken" / "README.md"
    broken.parent.mkdir()
    _made_up(broken, "```console\n$ echo no model\n```\n")
    verdict = DocsRun(tmp_path / "broken-run", readme=broken).check(first)
    assert verdict.state == "failed" and f"{broken}: no block makes my_model/saved_model.pb" in verdict.message


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
    for attribute in (_tf.SESSION_HANDLE, _tf.TF_KERAS_LOSS_SCALE):
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
