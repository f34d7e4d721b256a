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
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> int:
    sys.path.insert(0, str(ROOT / "tests"))
    import recorded_grappler

    for target in ("float16", "bfloat16"):
        reason = recorded_grappler.live_unavailable(target)
        if reason is not None:
            print(f"error: cannot record {target} here: {reason}", file=sys.stderr)
            return 2
    environ = {**os.environ, recorded_grappler.RECORD: "1", "TF_CPP_MIN_LOG_LEVEL": "2"}
    command = [sys.executable, "-m", "pytest", "-q", str(ROOT / "tests")]
    status = subprocess.call(command, cwd=ROOT, env=environ)
    if status != 0:
        print("error: the suite failed, so the recording was left as it was", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
