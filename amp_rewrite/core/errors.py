"""The one error family amp_rewrite raises for bad input.

Every message names the thing that is wrong (file, node, op or function) and says
what to do; callers such as the CLI print ``str(error)`` as a single line.
"""
from __future__ import annotations


class AmpRewriteError(ValueError):
    """Base class: bad input that the user can fix."""


class ListsError(AmpRewriteError):
    """An op-list YAML file or TF_AUTO_MIXED_PRECISION_* variable is invalid."""


class GraphError(AmpRewriteError):
    """A GraphDef is malformed: dangling input, bad tensor name, unknown op, ..."""
