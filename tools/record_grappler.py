"""Record grappler's answers for the test suite into ``tests/grappler_answers.zip``.

Runs the whole suite once with ``AMP_RECORD_GRAPPLER=1``: every question a test asks
grappler (a rewritten graph, or the op lists for some variables) goes to live grappler,
and when the suite passes, the recording is replaced by exactly the answers asked for,
each with the inputs the oracle gave grappler and the tests that asked it, and with the
TensorFlow version and CPU that made them (``index.json`` in the file); when it fails,
nothing is written. Later runs on any machine compare with the recording, and where
live grappler can answer they check that the recording still equals it
(``tests/recorded_grappler.py``). ``AMP_RECORD_GRAPPLER=1`` on a part of the suite
(``pytest tests/test_x.py``) merges that part's answers into the recording instead.

Needs the TensorFlow release the lists come from and a CPU with AVX512F (both passes)::

    .venv/bin/python tools/record_grappler.py
    .venv/bin/python tools/record_grappler.py --smoke   # one float16 test, into a copy of the recording

``--smoke`` records ``SMOKE_TEST``'s answers into a copy of the recording in a temporary
directory and checks the copy holds them; it exits 77 where live grappler cannot answer.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SMOKE_TEST = "tests/test_grappler_cases.py::test_simple"  # float16: a virtual GPU, any CPU
CANNOT_RECORD = 77  # --smoke's exit status where live grappler cannot answer (tests/test_tools.py skips)


def record(tests: list[str], environ: dict[str, str]) -> int:
    """Run pytest on ``tests`` with the recording on; its exit status."""
    import recorded_grappler

    environ = {**os.environ, **environ, recorded_grappler.RECORD: "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests]
    status = subprocess.call(command, cwd=ROOT, env=environ)
    if status != 0:
        print("error: the suite failed, so the recording was left as it was", file=sys.stderr)
    return status


def smoke() -> int:
    """Record ``SMOKE_TEST`` into a copy of the recording; the copy must hold its answers."""
    import recorded_grappler

    reason = recorded_grappler.live_unavailable("float16")
    if reason is not None:
        print(f"cannot record here: {reason}", file=sys.stderr)
        return CANNOT_RECORD
    with tempfile.TemporaryDirectory(prefix="amp-record-smoke-") as directory:
        copy = Path(directory) / recorded_grappler.ANSWERS.name
        shutil.copy(recorded_grappler.ANSWERS, copy)
        status = record([str(ROOT / SMOKE_TEST)], {recorded_grappler.ANSWERS_FILE: str(copy)})
        with zipfile.ZipFile(copy) as archive:
            index = json.loads(archive.read("index.json"))
    asked = [key for key, question in index["answers"].items() if SMOKE_TEST in question.get("tests", ())]
    print(f"{SMOKE_TEST}: {len(asked)} answer(s) in the copy of {recorded_grappler.ANSWERS.name}")
    return status or (0 if asked else 1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help=f"record {SMOKE_TEST} into a copy of the recording")
    args = parser.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    if args.smoke:
        return smoke()
    import recorded_grappler

    for target in ("float16", "bfloat16"):
        reason = recorded_grappler.live_unavailable(target)
        if reason is not None:
            print(f"error: cannot record {target} here: {reason}", file=sys.stderr)
            return 2
    return record([str(ROOT / "tests")], {})


if __name__ == "__main__":
    sys.exit(main())
