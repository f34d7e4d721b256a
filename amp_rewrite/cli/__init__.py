"""The ``amp-rewrite`` command: its two ways in, over one module per subcommand.

``options`` is the command line without TensorFlow (the parser, the options several commands
share, the exit codes); ``steps`` the steps several commands share (read the model and
rewrite it, tune, store the weights, the summary); ``convert``, ``calibrate``, ``inspect``,
``explain`` and ``dump`` one command each (``run``); ``weights`` and ``graph_view`` what
convert and dump write.

Two ways in. ``console`` is the console script's entry point (``amp_rewrite.cli:console``,
and ``python -m amp_rewrite``): it owns the process, so it quiets TensorFlow's native
stderr and installs the Ctrl-C/SIGTERM handler that undoes a run's writes and exits
130/143 (``calibration.staging.on_interrupt``). ``main`` is for a program that runs the
command in its own process (a notebook, a service, the tests): it installs no handler and
never ends the interpreter; Ctrl-C raises ``KeyboardInterrupt`` there as anywhere in
Python, after the run's own ``finally`` blocks have removed what it had begun. Neither
quiets anything when imported, so importing ``amp_rewrite.cli.dump`` from a library leaves
stderr as it is.
"""
from __future__ import annotations

import importlib
import sys
from typing import Sequence

from amp_rewrite._quiet import silence_native_stderr
from amp_rewrite.calibration.staging import on_interrupt
from amp_rewrite.cli.options import EXIT_USAGE, Progress, build_parser, check_outputs, with_calibrate_value
from amp_rewrite.errors import AmpRewriteError


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``amp-rewrite`` with ``argv`` (default: the command line) in this process; returns
    the exit code. The command's boundary: an error is one line and exit 2. Signals are the
    caller's (``console`` handles them, a program in process gets ``KeyboardInterrupt``)."""
    args = build_parser().parse_args(with_calibrate_value(sys.argv[1:] if argv is None else argv))
    try:
        check_outputs(args)
        progress = Progress(args)
        progress("loading TensorFlow")
        # The one import inside a function: every command's module imports TensorFlow (seconds),
        # so it loads only once a command runs, and --help, --version and usage errors answer at once.
        command = importlib.import_module(f"{__name__}.{args.command}")
        return command.run(args, progress)
    except (AmpRewriteError, OSError) as error:
        if args.debug:
            raise
        message = str(error) if isinstance(error, AmpRewriteError) else f"{error.filename or ''}: {error.strerror}"
        print(f"amp-rewrite: error: {message}", file=sys.stderr)
        return EXIT_USAGE


def console(argv: Sequence[str] | None = None) -> int:
    """The ``amp-rewrite`` process: ``main`` under the interrupt handler, from its first line."""
    with on_interrupt():  # first: Ctrl-C or SIGTERM while the command loads exits 130/143 in one line
        silence_native_stderr()
        return main(argv)
