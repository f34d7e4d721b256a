"""The wheel, as a user installs it: built from this checkout, installed with
``pip install --prefix`` into a temporary directory (as ``--user``, ``--target`` and
bundlers place packages away from the interpreter's prefix), and run from there. The
built-in op lists travel inside the package and are found with importlib.resources.
``make dist`` (CI) builds the sdist and wheel as a release does and runs ``twine check``.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cli_models import save_module

REPO = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "MANIFEST.in", "README.md", "amp_rewrite", "lists")  # what the build reads
# Runs the installed console script, after checking that amp_rewrite comes from the install.
RUN_INSTALLED = """
import runpy, sys
import amp_rewrite
packages, script = sys.argv[1:3]
assert amp_rewrite.__file__.startswith(packages), f"amp_rewrite imported from {amp_rewrite.__file__}"
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


def _pip(*args: object) -> None:
    process = subprocess.run([sys.executable, "-m", "pip", *map(str, args)], capture_output=True, text=True,
                             timeout=300)
    assert process.returncode == 0, process.stdout[-2000:] + process.stderr[-2000:]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built offline from a copy of the checkout (a build writes build/ and
    *.egg-info beside its sources)."""
    folder = tmp_path_factory.mktemp("wheel")
    source = folder / "source"
    source.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(REPO / name, source / name)
    _pip("wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "--wheel-dir", folder / "dist", source)
    (built,) = (folder / "dist").glob("amp_rewrite-*.whl")
    return built


def test_the_wheel_holds_the_op_lists_and_its_command(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(archive.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert {f"amp_rewrite/lists/{p.name}" for p in (REPO / "lists").glob("*.yaml")} <= names
    assert not any(name.startswith(("tests/", "tools/")) or "__pycache__" in name for name in names)
    assert "amp-rewrite = amp_rewrite.cli:console" in entry_points


def _installed_here() -> str:
    """amp_rewrite's installation in this interpreter's environment, as a new process sees it."""
    return subprocess.run([sys.executable, "-c", INSTALLED_HERE], capture_output=True, text=True, cwd="/",
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, timeout=60).stdout


INSTALLED_HERE = """
import importlib.metadata as m
try:
    print(m.distribution("amp_rewrite").locate_file(""))
except m.PackageNotFoundError:
    print("not installed")
"""


def test_the_wheel_installed_with_prefix_converts_from_there(wheel: Path, tmp_path: Path) -> None:
    """``pip install --prefix DIR`` puts the package outside the interpreter's prefix; its
    ``amp-rewrite`` finds its own lists there (earlier: "built-in lists float16.yaml not found").
    The install leaves this environment's amp_rewrite in place (without --ignore-installed pip
    uninstalls it first, even for another prefix)."""
    prefix = tmp_path / "prefix"
    before = _installed_here()
    _pip("install", "-q", "--no-deps", "--no-index", "--ignore-installed", "--prefix", prefix, wheel)
    assert _installed_here() == before
    packages = next(prefix.rglob("amp_rewrite/__init__.py")).parents[1]
    script = next(prefix.rglob("bin/amp-rewrite"))
    save_module(tmp_path / "src")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    process = subprocess.run([sys.executable, "-c", RUN_INSTALLED, str(packages), str(script), "convert",
                              str(tmp_path / "src"), str(tmp_path / "dst"), "--target", "bfloat16"],
                             capture_output=True, text=True, cwd=tmp_path, env={**env, "PYTHONPATH": str(packages)},
                             timeout=300)
    assert process.returncode == 0, process.stderr
    assert f"Wrote {tmp_path / 'dst'}" in process.stdout and (tmp_path / "dst" / "saved_model.pb").is_file()
