"""``python -m amp_rewrite``: the ``amp-rewrite`` command."""
import sys

from amp_rewrite.calibration.staging import on_interrupt

with on_interrupt():  # first: Ctrl-C or SIGTERM while the rest loads exits 130/143 in one line
    from amp_rewrite._quiet import silence_native_stderr

    silence_native_stderr()
    from amp_rewrite.cli.command import main

    code = main()
sys.exit(code)
