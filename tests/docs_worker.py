"""Runs one Python block of the documentation as a reader runs it: saved as a script in the
page's folder and run there, ``python block.py``.

``tests/test_docs.py`` starts one process per block, in the page's folder, with the block's
code on stdin and the page's path and the block's first line as arguments:
``python tests/docs_worker.py PAGE LINE < code``. The block runs as ``__main__`` with the
folder first on ``sys.path`` (as a script's own folder is, and not this ``tests/`` folder,
whose helpers a reader does not have), compiled under the page's path with its own line
numbers, so a traceback names the Markdown file and shows the line that failed. Nothing is
caught: an exception prints its traceback and exits 1, as the script would.

**Forks.** Each block's process would import TensorFlow (7 s of CPU here), and so would
each ``amp-rewrite`` command of a shell block. ``--serve SOCKET`` is a process that imports
numpy, TensorFlow and Keras once (not amp_rewrite: each block imports it from where its own
``sys.path`` finds it) and starts no TensorFlow runtime; for each request it forks a child,
which is the block's process: the requester's stdin, stdout and stderr, folder, environment
and arguments, a fresh ``__main__``, its own TensorFlow runtime. ``--client SOCKET python
PAGE LINE`` (a Python block, its code on stdin) and ``--client SOCKET script PATH ARGS...``
(a console script, e.g. the ``amp-rewrite`` that a shell block's PATH finds first) send such
a request and exit with the child's status; a client that dies (its block timed out) takes
its child with it.
"""
from __future__ import annotations

import json
import os
import socket
import sys
import time

CONNECT_S = 300  # how long a client waits for the server's imports


def main() -> None:
    page, line = sys.argv[1], int(sys.argv[2])
    code = sys.stdin.read()
    sys.argv = [page]
    sys.path[0] = os.getcwd()
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    exec(compile("\n" * (line - 1) + code, page, "exec"), namespace)


def client(path: str, request: list[str]) -> int:
    """Sends ``request`` (``python PAGE LINE`` or ``script PATH ARGS...``) with this process's
    stdin, stdout, stderr, folder and environment; the child's exit status."""
    deadline = time.monotonic() + CONNECT_S
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    while True:
        try:
            connection.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
    header = json.dumps({"request": request, "cwd": os.getcwd(), "env": dict(os.environ)}).encode()
    socket.send_fds(connection, [len(header).to_bytes(8, "big") + header], [0, 1, 2])
    answer = connection.makefile("rb").readline()
    return int(answer) if answer.strip() else 1


def _receive(connection: socket.socket) -> tuple[dict, list[int]]:
    data, fds, _, _ = socket.recv_fds(connection, 1 << 20, 3)
    size = int.from_bytes(data[:8], "big")
    while len(data) < 8 + size:
        data += connection.recv(1 << 20)
    return json.loads(data[8:8 + size]), fds


def _child(header: dict, fds: list[int]) -> None:
    """The block's process: the requester's descriptors, folder, environment and arguments."""
    import runpy
    import tempfile

    code = 1
    try:
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.chdir(header["cwd"])
        os.environ.clear()
        os.environ.update(header["env"])
        tempfile.tempdir = None
        kind, *arguments = header["request"]
        if kind == "python":
            sys.argv = ["docs_worker.py", *arguments]
            main()
        else:
            sys.argv, sys.path[0] = arguments, os.path.dirname(arguments[0])
            runpy.run_path(arguments[0], run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, int) and exit_.code is not None:
            print(exit_.code, file=sys.stderr)
    except BaseException:  # the block's own traceback, as Python prints it, then exit 1
        import traceback

        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _wait(pid: int, connection: socket.socket) -> int:
    """The child's exit status; a requester that hangs up (its block timed out) kills it."""
    import select

    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code
        if select.select([connection], [], [], 0.05)[0] and not connection.recv(1, socket.MSG_PEEK):
            os.kill(pid, 9)


def serve(path: str) -> None:
    """Imports what every block imports, then forks a child per request, one at a time."""
    import numpy  # noqa: F401  (imported once here, for every child)
    import tensorflow  # noqa: F401
    import keras  # noqa: F401

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(4)
    while True:
        connection, _ = listener.accept()
        with connection:
            header, fds = _receive(connection)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                _child(header, fds)
            for fd in fds:
                os.close(fd)
            code = _wait(pid, connection)
            try:
                connection.sendall(f"{code}\n".encode())
            except OSError:  # the requester is gone
                pass


if __name__ == "__main__":
    if sys.argv[1:2] == ["--serve"]:
        serve(sys.argv[2])
    elif sys.argv[1:2] == ["--client"]:
        sys.exit(client(sys.argv[2], sys.argv[3:]))
    else:
        main()
