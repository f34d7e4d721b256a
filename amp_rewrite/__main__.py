"""``python -m amp_rewrite``: the ``amp-rewrite`` command."""
import sys

from amp_rewrite._quiet import silence_native_stderr

silence_native_stderr()

from amp_rewrite.cli.command import main  # noqa: E402

sys.exit(main())
