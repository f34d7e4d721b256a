"""amp_rewrite: automatic mixed precision for TensorFlow graphs by graph rewriting.

The public API is the names in ``__all__``; everything else is private.
"""
from __future__ import annotations

from amp_rewrite.errors import AmpRewriteError, GraphError, ListsError
from amp_rewrite.lists import TARGETS, Colour, OpLists, load_lists
from amp_rewrite.live import disable_mixed_precision_graph_rewrite, enable_mixed_precision_graph_rewrite, mixed_precision
from amp_rewrite.report import Decision, Report
from amp_rewrite.rewrite import RewriteResult, rewrite_graph_def

__all__ = [
    "AmpRewriteError",
    "Colour",
    "Decision",
    "GraphError",
    "ListsError",
    "OpLists",
    "Report",
    "RewriteResult",
    "TARGETS",
    "disable_mixed_precision_graph_rewrite",
    "enable_mixed_precision_graph_rewrite",
    "load_lists",
    "mixed_precision",
    "rewrite_graph_def",
]
