"""One Python process that runs the documentation's Python blocks for tests/test_docs.py.

TensorFlow loads once here instead of once per block, and a block that changes global state
(enables a rewrite, builds Keras models) cannot touch the test process. Each request is one
JSON line on stdin: ``{"code", "filename", "line", "cwd", "setup"}``; the block runs in a
fresh namespace in ``cwd`` after the setup file (if any), compiled so that tracebacks name
the Markdown file and its line numbers. The answer is one line on stdout after ``PREFIX``;
the block's own output is captured and sent back in it.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import traceback

PREFIX = "\0docs-result "


def run(request: dict) -> dict:
    os.chdir(request["cwd"])
    namespace = {"__name__": "__main__"}
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            if request.get("setup"):
                with open(request["setup"], encoding="utf-8") as file:
                    exec(compile(file.read(), request["setup"], "exec"), namespace)
            source = "\n" * (request["line"] - 1) + request["code"]
            exec(compile(source, request["filename"], "exec"), namespace)
    except SystemExit as error:
        if error.code not in (None, 0):
            return {"ok": False, "error": f"SystemExit({error.code!r})", "output": output.getvalue()}
    except BaseException:  # noqa: BLE001 - every failure of a block is reported, none is fatal here
        return {"ok": False, "error": traceback.format_exc(), "output": output.getvalue()}
    return {"ok": True, "error": "", "output": output.getvalue()}


def main() -> None:
    answers = sys.stdout
    for line in sys.stdin:
        answer = run(json.loads(line))
        answers.write(PREFIX + json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
