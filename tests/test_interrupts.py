"""Ctrl-C and SIGTERM at any moment of a real conversion (``amp-rewrite convert`` as a
process, or its console entry point ``amp_rewrite.cli.console``): exit 130 (SIGINT) or 143 (SIGTERM), one line on stderr, no traceback, nothing at
the destination, no hidden leftovers (beside it, or calibration's in TMPDIR), the source
untouched, and a ``--force``d destination as it was. The signal is sent while TensorFlow
is being imported (the handler is in place from the first line of the command), while
calibration runs, while the dump is written (a new dump folder is removed) and while the
staged result is validated; a signal that comes while the
result is moved into place waits for the move, and the run then says it was written.
SIGKILL cannot be handled: its leftover is removed by the next run. ``amp_rewrite.cli.main``,
called by a program in its own process, installs no handler and never ends the
interpreter: the signal reaches the caller as ``KeyboardInterrupt``, after the run removed
what it had begun.
"""
from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import pytest

from amp_rewrite import cli
from amp_rewrite.calibration import staging

from cli_models import hash_tree, save_module
from test_cli import Run, cli_env, listing, run_cli

CALIBRATION_ROWS = 200_000  # a calibration batch large enough that its temporary SavedModel stays a moment


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("interrupts")
    save_module(folder / "module")
    rng = np.random.default_rng(0)
    np.savez(folder / "calibration.npz", x=rng.standard_normal((CALIBRATION_ROWS, 5)).astype(np.float32),
             z=rng.standard_normal((CALIBRATION_ROWS, 16)).astype(np.float32))
    return folder / "module"


def importing_tensorflow(pid: int, folder: Path) -> bool:
    """TensorFlow's native library is loaded: its import has begun (and lasts seconds more)."""
    try:
        return "libtensorflow_framework" in Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return False


def calibrating(pid: int, folder: Path) -> bool:
    """Calibration's temporary SavedModel exists (in the run's TMPDIR)."""
    return any(name.startswith("amp-rewrite-calibration-") for name in os.listdir(folder / "tmp"))


def dumping(pid: int, folder: Path) -> bool:
    """The --dump folder, new to this run, exists: the dump is being written."""
    return (folder / "dump").exists()


def validating(pid: int, folder: Path) -> bool:
    """The staged result is complete beside the destination: validation is running."""
    return bool(list(folder.glob(".dst.*/dst/fingerprint.pb")))


MOMENTS: dict[str, tuple[Callable[[int, Path], bool], tuple[str, ...]]] = {
    "importing-tensorflow": (importing_tensorflow, ()),
    "calibrating": (calibrating, ("--calibrate", "{calibration}")),
    "dumping": (dumping, ("--dump", "{folder}/dump")),
    "validating": (validating, ("--validate", "200")),
}
CASES = [("importing-tensorflow", signal.SIGINT), ("importing-tensorflow", signal.SIGTERM),
         ("calibrating", signal.SIGTERM), ("dumping", signal.SIGINT), ("validating", signal.SIGINT)]


def start_until(moment: str, source: Path, folder: Path, *args: str) -> subprocess.Popen:
    """``amp-rewrite convert SOURCE FOLDER/dst ARGS`` (TMPDIR: FOLDER/tmp), returned at ``moment``."""
    ready, extra = MOMENTS[moment]
    (folder / "tmp").mkdir(exist_ok=True)
    extra = tuple(a.format(calibration=source.parent / "calibration.npz", folder=folder) for a in extra)
    process = subprocess.Popen([sys.executable, "-m", "amp_rewrite", "convert", str(source), str(folder / "dst"),
                                *args, *extra], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=cli_env(TMPDIR=str(folder / "tmp")))
    deadline = time.monotonic() + 240
    while not ready(process.pid, folder):
        assert process.poll() is None, f"ended before the moment came: {process.communicate()}"
        assert time.monotonic() < deadline, "the moment never came"
        time.sleep(0.005)
    return process


@pytest.mark.parametrize("moment, signum", CASES, ids=[f"{m}-{signal.Signals(s).name}" for m, s in CASES])
def test_a_signal_at_any_moment_leaves_nothing_behind(
    tmp_path: Path, source: Path, moment: str, signum: int
) -> None:
    """The destination exists (--force): it must be as it was after the interrupt."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("the destination before the run", encoding="utf-8")
    before = hash_tree(source), hash_tree(dst)
    process = start_until(moment, source, tmp_path, "--force")
    process.send_signal(signum)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 128 + signum, err
    assert err.strip().splitlines() == [staging.INTERRUPTED], err
    assert listing(tmp_path) == {"dst", "tmp"} and listing(tmp_path / "tmp") == set()
    assert (hash_tree(source), hash_tree(dst)) == before


def test_a_killed_runs_leftover_is_removed_by_the_next_run(tmp_path: Path, source: Path) -> None:
    """SIGKILL cannot be caught: the hidden staging folder stays, and the next run to the same
    destination removes it (its lock is free) and says so."""
    process = start_until("validating", source, tmp_path)
    process.kill()
    process.communicate(timeout=60)
    leftovers = sorted(p for p in tmp_path.iterdir() if p.name != "tmp")
    assert len(leftovers) == 1 and leftovers[0].name.startswith(".dst."), leftovers
    run = run_cli("convert", source, tmp_path / "dst")
    assert run.code == 0, run.err
    assert f"Removed {leftovers[0]}, left by an interrupted run" in run.out
    assert listing(tmp_path) == {"dst", "tmp"}


def test_a_signal_while_the_result_moves_into_place_waits_for_it(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The move into place is not cut: a signal that comes during it is handled after the
    run's last lines, with the exit code it asks for and a line saying DST was written."""
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "old.txt").write_text("replaced", encoding="utf-8")
    real = staging._move_into_place

    def interrupted(staged: Path, destination: Path) -> None:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.1)  # the handler runs here, in the middle of the move
        real(staged, destination)

    monkeypatch.setattr(staging, "_move_into_place", interrupted)
    run = run_console("convert", source, dst, "--force")
    assert run.code == 130, run
    assert run.err.strip().splitlines() == [f"amp-rewrite: interrupted; {dst} had been written in full"], run.err
    assert f"Wrote {dst}" in run.out
    assert listing(tmp_path) == {"dst"} and (dst / "saved_model.pb").is_file() and not (dst / "old.txt").exists()


def run_console(*args: object) -> Run:
    """``amp-rewrite ARGS`` as its console script runs it (the interrupt handler on), in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.console([str(a) for a in args])
        except SystemExit as exit_:  # a signal held until the run's end
            code = exit_.code
    return Run(code, out.getvalue(), err.getvalue())


def test_main_in_process_leaves_a_signal_to_its_caller(
    tmp_path: Path, source: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A program (a notebook, a service) runs ``cli.main`` in its own process: it installs
    no handler, and SIGINT during a conversion (while the staged result is validated)
    raises ``KeyboardInterrupt`` in the caller, whose ``finally`` runs; the interpreter
    lives on; the staged result and the run's temporary files are gone."""
    from amp_rewrite.calibration import validate

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    # The caller's handler is Python's own, whatever an earlier test in this worker left.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    during: list[object] = []
    real = validate.validate_saved_models

    def interrupted(*args: object, **kwargs: object) -> object:
        during.extend((signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)))
        assert validating(os.getpid(), tmp_path), "validation started before the result was staged"
        if tuple(during) == handlers:  # a handler of ours would end this interpreter: then the run goes on
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # Python runs the default handler here, in the main thread
        return real(*args, **kwargs)

    monkeypatch.setattr(validate, "validate_saved_models", interrupted)
    finished = []
    try:
        with pytest.raises(KeyboardInterrupt):
            try:
                cli.main(["convert", str(source), str(tmp_path / "dst"), "--validate", "2"])
            finally:
                finished.append("the caller's finally ran")
    finally:
        signal.signal(signal.SIGINT, previous)
    assert tuple(during) == handlers, "cli.main installed a signal handler"
    assert finished == ["the caller's finally ran"]
    assert listing(tmp_path) == {"tmp"} and listing(tmp_path / "tmp") == set()


HANDLER_PROBE = """
import os, signal, sys, time
from pathlib import Path
from amp_rewrite.calibration import staging

marker = Path(sys.argv[1])
with staging.on_interrupt():
    with staging.undone_if_interrupted(marker.unlink, leaves="DIR holds part of a dump"):
        with staging.held():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the signal waits for the held step
            print("held step done", flush=True)
        time.sleep(5)
print("not interrupted")
"""


def test_the_handler_undoes_after_a_held_step_and_names_what_it_cannot_undo(tmp_path: Path) -> None:
    """No TensorFlow needed: a signal inside a held step is handled when the step ends; the
    undo runs; the line names what could not be undone (an existing dump folder, rewritten
    in part); exit 128 + SIGTERM."""
    marker = tmp_path / "marker"
    marker.write_text("", encoding="utf-8")
    process = subprocess.run([sys.executable, "-c", HANDLER_PROBE, str(marker)], capture_output=True, text=True,
                             env=cli_env(), timeout=60)
    assert process.returncode == 143, process.stderr
    assert process.stdout == "held step done\n"
    assert process.stderr.splitlines() == ["amp-rewrite: interrupted; DIR holds part of a dump"]
    assert not marker.exists()
