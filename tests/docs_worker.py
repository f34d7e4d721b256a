"""Runs one Python block of the documentation as a reader runs it: saved as a script in the
page's folder and run there, ``python block.py``.

``tests/test_docs.py`` starts one process per block, in the page's folder, with the block's
code on stdin and the page's path and the block's first line as arguments:
``python tests/docs_worker.py PAGE LINE < code``. The block runs as ``__main__`` with the
folder first on ``sys.path`` (as a script's own folder is, and not this ``tests/`` folder,
whose helpers a reader does not have), compiled under the page's path with its own line
numbers, so a traceback names the Markdown file and shows the line that failed. Nothing is
caught: an exception prints its traceback and exits 1, as the script would.
"""
from __future__ import annotations

import os
import sys


def main() -> None:
    page, line = sys.argv[1], int(sys.argv[2])
    code = sys.stdin.read()
    sys.argv = [page]
    sys.path[0] = os.getcwd()
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile("\n" * (line - 1) + code, page, "exec"), namespace)


if __name__ == "__main__":
    main()
