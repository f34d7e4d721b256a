"""The one error family amp_rewrite raises for bad input, and TensorFlow's errors in one line.

Every message names the thing that is wrong (file, node, op or function) and says
what to do; callers such as the CLI print ``str(error)`` as a single line.
"""
from __future__ import annotations

import re


class AmpRewriteError(ValueError):
    """Base class: bad input that the user can fix."""


class ListsError(AmpRewriteError):
    """An op-list YAML file or TF_AUTO_MIXED_PRECISION_* variable is invalid."""


class GraphError(AmpRewriteError):
    """A GraphDef is malformed: dangling input, bad tensor name, unknown op, ..."""


class ModelError(AmpRewriteError):
    """A model file or directory (or its inputs) cannot be read or written."""


# Lines of a TensorFlow error that say where it happened, not why: its headline, the node
# and stack it was detected at, and the node it names again in [[...]].
_WHERE_LINES = re.compile(r"(Graph execution error:?|Detected at node |<stack traces unavailable>|File \"|Node: |"
                          r"\[\[\{\{node |Original stack trace|Traceback |During handling of)")
_FUNCTION_PREFIX = re.compile(r"\{\{function_node [^}]*\}\}\s*")  # an error raised inside a function body
_OP_SUFFIX = re.compile(r"\s*\[Op:[^\]]*\](\s*name:.*)?$")          # the eager op that ran it


def tensorflow_cause(error: BaseException) -> str:
    """The line of a TensorFlow error that names its cause ("indices[0,0] = 12 is not in
    [0, 3)"), without the lines saying where it was detected; the error's type if none does."""
    text = getattr(error, "message", None) or str(error)
    for line in text.splitlines():
        line = _OP_SUFFIX.sub("", _FUNCTION_PREFIX.sub("", line.strip()))
        if line and not _WHERE_LINES.match(line):
            return line
    return type(error).__name__
