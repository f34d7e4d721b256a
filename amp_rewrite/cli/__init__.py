"""The ``amp-rewrite`` command and what only it needs: the dump.

Two ways in. ``console`` is the console script's entry point (``amp_rewrite.cli:console``,
and ``python -m amp_rewrite``): it owns the process, so it quiets TensorFlow's native
stderr and installs the Ctrl-C/SIGTERM handler that undoes a run's writes and exits
130/143 (``calibration.staging.on_interrupt``). ``main`` is for a program that runs the
command in its own process (a notebook, a service, the tests): it installs no handler and
never ends the interpreter; Ctrl-C raises ``KeyboardInterrupt`` there as anywhere in
Python, after the run's own ``finally`` blocks have removed what it had begun. Both import
the command only when called, so importing ``amp_rewrite.cli.dump`` from a library never
quiets stderr the way the command does.
"""
from __future__ import annotations

from typing import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``amp-rewrite`` with ``argv`` (default: the command line) in this process; returns the exit code."""
    from amp_rewrite.cli.command import main as run_command

    return run_command(argv)


def console(argv: Sequence[str] | None = None) -> int:
    """The ``amp-rewrite`` process: ``main`` under the interrupt handler, from its first line."""
    from amp_rewrite.calibration.staging import on_interrupt

    with on_interrupt():  # first: Ctrl-C or SIGTERM while the command loads exits 130/143 in one line
        from amp_rewrite._quiet import silence_native_stderr

        silence_native_stderr()
        return main(argv)
