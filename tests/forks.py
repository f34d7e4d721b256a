"""Processes forked from one that imported TensorFlow once (``tests/docs_worker.py --serve``).

A test that runs a Python program as a process of its own (a documentation block, TensorFlow's
``saved_model_cli``) pays a TensorFlow import for it, 7 s of CPU on two shared cores. Through
``Forks`` the program's process is a fork of a server that imported numpy, TensorFlow and Keras
and started no TensorFlow runtime: it has the requester's stdin, stdout, stderr, folder,
environment and arguments, a fresh ``__main__`` and a runtime of its own, so nothing it does
reaches another (docs_worker.py says how). What it cannot show is the import itself: a test of
what a command prints while TensorFlow imports runs the command as a process of its own.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

WORKER = Path(__file__).resolve().parent / "docs_worker.py"


class Forks:
    """The server, started in ``environment``; ``shims/amp-rewrite`` (for a shell's PATH) asks
    it for the ``amp-rewrite`` beside this Python. ``close`` ends it."""

    def __init__(self, environment: dict[str, str]) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="amp-forks-"))  # short: a Unix socket's path has 107 bytes
        self.socket = self.folder / "forks.sock"
        self.shims = self.folder / "shims"
        self.shims.mkdir()
        shim = self.shims / "amp-rewrite"
        command = " ".join(f'"{part}"' for part in self.script(Path(sys.executable).parent / "amp-rewrite"))
        shim.write_text(f'#!/bin/sh\nexec {command} "$@"\n', encoding="utf-8")
        shim.chmod(0o755)
        with (self.folder / "server.log").open("wb") as log:
            self._server = subprocess.Popen([sys.executable, str(WORKER), "--serve", str(self.socket)], cwd=self.folder,
                                            env=environment, stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def python_block(self, page: Path, line: int) -> list[str]:
        """The command of a documentation block's process (its code on stdin): ``docs_worker.py PAGE LINE``."""
        return [sys.executable, str(WORKER), "--client", str(self.socket), "python", str(page), str(line)]

    def script(self, path: Path, *args: object) -> list[str]:
        """The command of a Python script's process (a console script such as ``saved_model_cli``)."""
        return [sys.executable, str(WORKER), "--client", str(self.socket), "script", str(path), *map(str, args)]

    def close(self) -> None:
        self._server.kill()
        self._server.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
