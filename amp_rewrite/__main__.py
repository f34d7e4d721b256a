"""``python -m amp_rewrite``: the ``amp-rewrite`` command, as its console script runs it."""
import sys

from amp_rewrite.cli import console

sys.exit(console())
