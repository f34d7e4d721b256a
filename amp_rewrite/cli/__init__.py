"""The ``amp-rewrite`` command and what only it needs: the dump.

``main`` is the console script's entry point (``amp_rewrite.cli:main``). It imports the
command only when called, so importing ``amp_rewrite.cli.dump`` from a library or a
test never quiets TensorFlow's stderr the way the command does at start-up.
"""
from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``amp-rewrite`` with ``argv`` (default: the command line); returns the exit code."""
    from amp_rewrite.calibration.staging import on_interrupt

    with on_interrupt():  # first: Ctrl-C or SIGTERM while the command loads exits 130/143 in one line
        from amp_rewrite.cli.command import main as run_command

        return run_command(argv)
