"""The one error family amp_rewrite raises for bad input, and TensorFlow's errors in one line.

Every message names the thing that is wrong (file, node, op or function) and says
what to do; callers such as the CLI print ``str(error)`` as a single line.
"""
from __future__ import annotations

import difflib
import heapq
import re
from collections.abc import Iterable


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


CLOSE = 0.6  # difflib.get_close_matches' default cutoff


def closest_names(name: str, names: Iterable[str], count: int = 3) -> list[str]:
    """The ``count`` names most like ``name``, best first, for a "did you mean" after a name
    that is not there. A name is compared whole and by its last path components, as many as
    ``name`` has: Keras 3 exports scope every layer in the model's name and number repeated
    layers (``dense/MatMul`` is ``sequential_1/dense_1/MatMul`` there)."""
    depth = name.count("/") + 1
    matcher = difflib.SequenceMatcher()
    matcher.set_seq2(name)  # difflib caches what it knows of seq2: the side compared many times
    bounds = []  # (quick_ratio, name, text compared): an upper bound of the ratio, cheap to compute
    for candidate in dict.fromkeys(names):
        for text in {candidate, "/".join(candidate.split("/")[-depth:])}:
            matcher.set_seq1(text)
            if matcher.real_quick_ratio() >= CLOSE and matcher.quick_ratio() >= CLOSE:
                bounds.append((matcher.quick_ratio(), candidate, text))
    best: dict[str, float] = {}
    bar = CLOSE  # the count-th best ratio so far, once there are count
    for bound, candidate, text in sorted(bounds, key=lambda b: -b[0]):
        if bound < bar:
            break  # no ratio left can beat it
        matcher.set_seq1(text)
        if matcher.ratio() >= max(CLOSE, best.get(candidate, 0.0)):
            best[candidate] = matcher.ratio()
            bar = heapq.nlargest(count, best.values())[-1] if len(best) >= count else CLOSE
    return sorted(best, key=lambda candidate: (-best[candidate], candidate))[:count]


def did_you_mean(name: str, names: Iterable[str]) -> str:
    """"did you mean 'a' or 'b'? " for a message about a missing ``name`` ("" if nothing is close)."""
    close = closest_names(name, names)
    return f"did you mean {' or '.join(map(repr, close))}? " if close else ""
