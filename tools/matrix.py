"""Run the whole test suite once per supported TensorFlow release, each in a fresh venv.

For every release it creates ``.matrix/tf-<release>/`` anew and installs as a user of that
release does: first ``tensorflow==<release>.*`` with the matching ``tf-keras`` (what pip
picks for them alone), then this package with its test extras, as ``pip install`` installs
it (built, not editable), TensorFlow held at the release (an extra that needs another one
fails the install instead of replacing it) and nothing else pinned by hand: pip settles the
rest (protobuf, say) by what each package declares. keras-hub, in the test extra for
the corpus (tests/test_hub_corpus_*.py), installs only beside TensorFlow 2.20 and 2.21 (``HUB_RELEASES``:
it needs tensorflow-text 2.20.1+, which pins TensorFlow to its own release): for 2.16-2.19
the test extra is installed without it, the corpus modules are deselected (``--deselect``,
and ``AMP_HUB_CORPUS=deselected``, which the module reads), and the row says so. It runs the suite there as ``make test`` does, and at
the end prints one table row per release: the exact versions installed, passed/failed/
skipped/errors and the time. The releases run one after the other (the suite takes both
cores). Exit status 0 only if every release passed with no failure and no error.

    .venv/bin/python tools/matrix.py [RELEASE ...]     # default: RELEASES
    make matrix
    .venv/bin/python tools/matrix.py --smoke           # no install: a suite of its own in this venv
"""
from __future__ import annotations

import argparse
import datetime
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Exactly the releases pyproject.toml admits (tensorflow>=2.16,<2.22).
RELEASES = ("2.16", "2.17", "2.18", "2.19", "2.20", "2.21")
_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")
# pytest's closing line ("798 passed, 51 skipped, 4 warnings in 985.13s (0:16:25)"); TensorFlow
# 2.16 prints "Exception ignored in: AtomicFunction.__del__" tracebacks after it at exit.
_SUMMARY = re.compile(r"\d+ (passed|failed|errors?)\b.* in [\d.]+s")
VERSIONS_SHOWN = ("tensorflow", "keras", "tf_keras", "protobuf")
# The releases keras-hub 0.32 installs beside: its tensorflow-text>=2.20.1 pins TensorFlow
# 2.20.x (tensorflow-text 2.20.1) or 2.21.x (2.21.x); before 2.20 it would replace TensorFlow.
HUB_RELEASES = ("2.20", "2.21")
HUB_CORPUS = ("tests/test_hub_corpus_text.py", "tests/test_hub_corpus_decoders.py")
HUB_LEFT_OUT = "keras-hub left out (tensorflow-text pins TensorFlow 2.20+), tests/test_hub_corpus_*.py deselected"


@dataclass(frozen=True)
class Row:
    release: str
    versions: str  # "tensorflow 2.16.2, keras 3.15.1, tf_keras 2.16.0", or why not installed
    counts: dict[str, int]
    seconds: float

    @property
    def green(self) -> bool:
        return bool(self.counts.get("passed")) and not self.counts.get("failed") and not self.counts.get("error")


def test_requirements(*, hub: bool) -> list[str]:
    """pyproject.toml's test extra, without keras-hub unless ``hub``."""
    with open(ROOT / "pyproject.toml", "rb") as file:
        extra = tomllib.load(file)["project"]["optional-dependencies"]["test"]
    return [r for r in extra if hub or not re.match(r"keras[-_]hub\b", r)]


def install_commands(venv: Path, release: str) -> list[list[str]]:
    """A user's steps: a venv, TensorFlow ``release`` (and its tf-keras), then this package
    with its test extra (keras-hub only for ``HUB_RELEASES``), TensorFlow held at ``release``."""
    python = str(venv / "bin" / "python")
    held = f"tensorflow=={release}.*"
    package = ([f"{ROOT}[test]"] if release in HUB_RELEASES
               else [str(ROOT), *test_requirements(hub=False)])
    return [
        [sys.executable, "-m", "venv", str(venv)],
        [python, "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [python, "-m", "pip", "install", "-q", held, f"tf-keras=={release}.*"],
        [python, "-m", "pip", "install", "-q", held, *package],
    ]


def installed_versions(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import importlib.metadata as m; print(', '.join(f'{p} {m.version(p)}' "
         f"for p in {VERSIONS_SHOWN!r}))"],
        capture_output=True, text=True, cwd=ROOT,
    ).stdout.strip()


def run_suite(python: Path, tests: list[str], out, workers: int = 2, *, hub: bool = True) -> dict[str, int]:
    """The suite (``tests``) as ``make test`` runs it (two xdist workers), its output to ``out``; pytest's counts.
    Without ``hub`` (keras-hub not installed) the keras_hub corpus is deselected."""
    environ = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"}
    if not hub:
        environ["AMP_HUB_CORPUS"] = "deselected"
        tests = [*(f"--deselect={module}" for module in HUB_CORPUS), *tests]
    test = subprocess.run([str(python), "-m", "pytest", "-q", "-rs", "-n", str(workers), "--dist", "loadfile", *tests],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=environ)
    out.write(test.stdout)
    summary = next((line for line in reversed(test.stdout.splitlines()) if _SUMMARY.search(line)), "")
    return {("error" if kind.startswith("error") else kind): int(n) for n, kind in _COUNT.findall(summary)}


def run_release(release: str, log_dir: Path) -> Row:
    venv = ROOT / ".matrix" / f"tf-{release}"
    shutil.rmtree(venv, ignore_errors=True)
    python = venv / "bin" / "python"
    log = log_dir / f"tf-{release}.log"
    start = time.monotonic()
    with log.open("w") as out:
        for command in install_commands(venv, release):
            if subprocess.call(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT) != 0:
                return Row(release, f"install failed (see {log})", {}, time.monotonic() - start)
        hub = release in HUB_RELEASES
        versions = installed_versions(python) + ("" if hub else f"; {HUB_LEFT_OUT}")
        counts = run_suite(python, ["tests"], out, hub=hub)
    return Row(release, versions, counts, time.monotonic() - start)


SMOKE_SUITE = """
import pytest

def test_one():
    pass

def test_two():
    pass

def test_skipped():
    pytest.skip("a skip, counted")
"""


def smoke() -> int:
    """The tool's own steps without an install: a suite of its own (no TensorFlow) in this
    venv, its counts read back from pytest's closing line, its row."""
    for release in ("2.19", "2.20"):
        commands = install_commands(Path("venv"), release)
        if any("protobuf" in " ".join(command) for command in commands):
            print("error: the install pins protobuf by hand", file=sys.stderr)
            return 1
        package = commands[-1]
        if f"tensorflow=={release}.*" not in package or (release in HUB_RELEASES) != (f"{ROOT}[test]" in package):
            print(f"error: TensorFlow {release}: the package's install {package[4:]} does not hold TensorFlow"
                  " or takes keras-hub where it cannot install", file=sys.stderr)
            return 1
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="amp-matrix-smoke-") as directory:
        suite = Path(directory) / "test_smoke.py"
        suite.write_text(SMOKE_SUITE, encoding="utf-8")
        with open(Path(directory) / "smoke.log", "w") as out:
            counts = run_suite(Path(sys.executable), ["-p", "no:cacheprovider", str(suite)], out, workers=0, hub=False)
    row = Row("this venv", installed_versions(Path(sys.executable)), counts, time.monotonic() - start)
    print(table([row]))
    return 0 if counts == {"passed": 2, "skipped": 1} else 1


def table(rows: list[Row]) -> str:
    lines = ["| TensorFlow | installed | passed | failed | errors | skipped | minutes |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        c = row.counts
        lines.append(f"| {row.release} | {row.versions} | {c.get('passed', 0)} | {c.get('failed', 0)} | "
                     f"{c.get('error', 0)} | {c.get('skipped', 0)} | {row.seconds / 60:.1f} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("releases", nargs="*", metavar="RELEASE", help=f"default: {' '.join(RELEASES)}")
    parser.add_argument("--smoke", action="store_true", help="no install: check this tool on a suite of its own")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke()
    releases = args.releases or list(RELEASES)
    unknown = sorted(set(releases) - set(RELEASES))
    if unknown:
        print(f"error: {', '.join(unknown)} not supported; pyproject.toml admits {', '.join(RELEASES)}",
              file=sys.stderr)
        return 2
    log_dir = ROOT / ".matrix"
    log_dir.mkdir(exist_ok=True)
    rows = []
    for release in releases:
        print(f"TensorFlow {release}: installing and testing (log: .matrix/tf-{release}.log)", flush=True)
        rows.append(run_release(release, log_dir))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    print(f"\nmake matrix, {datetime.date.today().isoformat()}, Python {sys.version.split()[0]}:\n")
    print(table(rows))
    return 0 if all(row.green for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
