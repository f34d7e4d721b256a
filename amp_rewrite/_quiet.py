"""Keep TensorFlow's native start-up chatter off a command line's stderr (no TF import here)."""
from __future__ import annotations

import os
import sys


def silence_native_stderr() -> None:
    """TensorFlow's C++ code writes start-up and device lines straight to file descriptor 2,
    whatever TF_CPP_MIN_LOG_LEVEL says. A CLI prints only its own lines: point fd 2 at
    /dev/null and give Python's ``sys.stderr`` the real one (``--debug`` keeps everything)."""
    if "--debug" in sys.argv or "tensorflow" in sys.modules:
        return
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    sys.stderr.flush()
    real = os.fdopen(os.dup(2), "w", buffering=1)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    sys.stderr = real
