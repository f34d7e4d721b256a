"""Writing safely: a destination is written whole or not at all, and a run interrupted at
any moment leaves nothing behind.

A destination is built in a temporary directory beside it (``staged``) and moved into
place only if nothing appeared there meanwhile; a killed run's leftover is removed by the
next run to the same destination (``remove_leftovers``).

``on_interrupt`` handles Ctrl-C and SIGTERM for a whole command; only the console entry
point installs it (``amp_rewrite.cli.console``): it ends the process. The handler undoes what
the run has begun (staging directories, temporary files and directories), prints one
line and exits 128 + the signal's number (130, 143) at once. It cleans up itself rather
than by raising: an exception raised from a handler can be swallowed by TensorFlow's C++
callbacks or by a half-done import, and the run then went on and wrote its output. The
steps that must not be cut (creating a temporary path and registering its undo, moving a
destination into place) hold a signal until they end. Once a destination is in place the
run is done: a signal then waits for the run's last lines, and the exit line says the
destination was written. No TensorFlow here: the handler is installed before TensorFlow
is imported, and may run while it is being imported.
"""
from __future__ import annotations

import contextlib
import fcntl
import itertools
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

from amp_rewrite.errors import ModelError

STAGING_MARK = "amp-rewrite-partial"  # in the name of the temporary directory beside the destination
LOCK_FILE = ".lock"                   # held (flock) by the run that writes the staging directory
INTERRUPTED = "amp-rewrite: interrupted; nothing was written"
SIGNALS = (signal.SIGINT, signal.SIGTERM)

class _Interrupts:
    """What a signal must undo, and the handlers that undo it: one object for the process
    (signal handlers are process-wide). ``undo``: what to undo on an interrupt, and what it
    cannot undo; ``holding``: the depth of ``held`` blocks; ``pending``: the signals that
    came while holding; ``written``: the destinations this run has moved into place.
    ``install`` puts its handler in place and puts the replaced ones back exactly."""

    def __init__(self) -> None:
        self._keys = itertools.count()
        self.undo: dict[int, tuple[Callable[[], None], str]] = {}
        self.holding = 0
        self.pending: list[int] = []
        self.written: list[Path] = []

    def line(self) -> str:
        if self.written:
            return f"amp-rewrite: interrupted; {', '.join(map(str, self.written))} had been written in full"
        left = [note for _, note in self.undo.values() if note]
        return f"amp-rewrite: interrupted; {'; '.join(left)}" if left else INTERRUPTED

    def handle(self, signum: int, frame: object) -> None:
        if self.holding or self.written:
            self.pending.append(signum)
            return
        self.exit(signum)

    def exit(self, signum: int) -> None:
        """Undo everything registered, newest first, say so in one line and exit 128 + ``signum``
        (whatever an undo raises: the process ends here)."""
        try:
            line = self.line()
            for key in sorted(self.undo, reverse=True):
                with contextlib.suppress(OSError):  # one path that cannot be removed does not stop the other undos
                    self.undo[key][0]()
            with contextlib.suppress(OSError, ValueError):  # a closed or broken stream: the exit code still says it
                sys.stdout.flush()
            with contextlib.suppress(OSError, ValueError):
                newline = "\n" if sys.stderr.isatty() else ""  # after a progress line left open (cli.options.Progress)
                sys.stderr.write(f"{newline}{line}\n")
                sys.stderr.flush()
        finally:
            os._exit(128 + signum)

    @contextlib.contextmanager
    def install(self) -> Iterator[None]:
        """``on_interrupt``: the handler in place for the block, the replaced ones back after it."""
        if signal.getsignal(signal.SIGINT) == self.handle:  # a nested block: the outer one handles it
            yield
            return
        self.pending.clear()
        self.written.clear()
        try:
            previous = {signum: signal.signal(signum, self.handle) for signum in SIGNALS}
        except ValueError:  # not the main thread
            yield
            return
        try:
            yield
            if self.pending:  # came after a destination was in place: the run finished, then says it was interrupted
                print(self.line(), file=sys.stderr)
                raise SystemExit(128 + self.pending[0])
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self.pending.clear()
            self.written.clear()

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """``held``: a signal that comes during the block is handled when it ends."""
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
            if not self.holding and self.pending and not self.written:
                self.exit(self.pending[0])

    @contextlib.contextmanager
    def undone(self, undo: Callable[[], None], leaves: str) -> Iterator[None]:
        """``undone_if_interrupted``: ``undo`` registered while the block runs."""
        key = next(self._keys)
        self.undo[key] = (undo, leaves)
        try:
            yield
        finally:
            del self.undo[key]


_INTERRUPTS = _Interrupts()  # the one owner: its handler is installed once per process at most


def on_interrupt() -> contextlib.AbstractContextManager[None]:
    """SIGINT and SIGTERM, while the block runs, undo the run's writes and exit (module doc);
    the replaced handlers come back after it. Nested blocks install nothing more. Outside the
    main thread (a program running the command in a thread), signals are left alone."""
    return _INTERRUPTS.install()


def held() -> contextlib.AbstractContextManager[None]:
    """A signal that comes during the block is handled when it ends."""
    return _INTERRUPTS.held()


def undone_if_interrupted(undo: Callable[[], None], leaves: str = "") -> contextlib.AbstractContextManager[None]:
    """``undo`` runs if a signal interrupts the block; ``leaves``: what it cannot undo, for the exit line."""
    return _INTERRUPTS.undone(undo, leaves)


@contextlib.contextmanager
def temporary_directory(prefix: str, parent: Path | None = None) -> Iterator[Path]:
    """A new directory (``tempfile.mkdtemp``), removed when the block ends or the run is interrupted."""
    with contextlib.ExitStack() as stack:
        with held():
            path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
            stack.enter_context(undone_if_interrupted(lambda: shutil.rmtree(path, ignore_errors=True)))
            stack.callback(shutil.rmtree, path, ignore_errors=True)  # before the undo is dropped
        yield path


def check_outside(source: Path, destination: Path, what: str = "destination") -> None:
    """Refuse a ``destination`` that is, lies inside, or holds the ``source``: nothing is written into a source."""
    source, destination = source.resolve(), destination.resolve()
    if destination == source or source in destination.parents:
        raise ModelError(f"{destination}: is (inside) the source {source}; choose a {what} outside it")
    if destination in source.parents:
        raise ModelError(f"{destination}: contains the source {source}; choose a {what} outside it")


def check_destination(source: Path, destination: Path, force: bool) -> None:
    """Refuse to write into the source, or over an existing destination without ``force``."""
    check_outside(source, destination)
    destination = destination.resolve()
    if destination.exists() and not force:
        raise ModelError(f"{destination}: already exists; choose another destination or pass --force to replace it")
    if not destination.parent.is_dir():
        what = "is not a directory" if destination.parent.exists() else "no such directory; create it first"
        raise ModelError(f"{destination.parent}: {what}")


def write_text_atomically(path: Path, text: str) -> None:
    """Write ``path`` whole or not at all: a temporary file beside it, then a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        with held():
            handle, staged_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=f".{STAGING_MARK}", dir=path.parent)
            stack.enter_context(undone_if_interrupted(lambda: os.unlink(staged_name)))
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as file:
                file.write(text)
            with held():
                os.replace(staged_name, path)
                _INTERRUPTS.written.append(path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(staged_name)
            raise


def remove_leftovers(destination: Path) -> list[Path]:
    """Remove the staging directories that killed runs (SIGKILL, power loss) left beside
    ``destination``. A run holds a lock on its own until it ends, so one whose lock can be
    taken belongs to no running process; one without a lock file is left alone and named."""
    removed = []
    for leftover in sorted(destination.parent.glob(f".{destination.name}.{STAGING_MARK}.*")):
        try:
            descriptor = os.open(leftover / LOCK_FILE, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # another conversion to this destination is running now
        finally:
            os.close(descriptor)
        shutil.rmtree(leftover, ignore_errors=True)
        removed.append(leftover)
    return removed


def _move_into_place(staged_path: Path, destination: Path) -> None:
    """Move ``staged_path`` to ``destination`` only if nothing is there: a destination that
    appeared since the run began (another run, the user) is never replaced silently.
    A directory claims the name with ``mkdir`` (atomic), then replaces that empty directory;
    a file is hard-linked (fails if the name exists), then its staged name removed."""
    if staged_path.is_dir():
        os.mkdir(destination)
        try:
            os.replace(staged_path, destination)
        except OSError:
            os.rmdir(destination)
            raise
    else:
        os.link(staged_path, destination)
        os.unlink(staged_path)


def _appeared(destination: Path) -> ModelError:
    return ModelError(f"{destination}: appeared while this run was writing (another run?); nothing was replaced;"
                      " choose another destination or pass --force to replace it")


class StepFailed(ModelError):
    """An OSError in a named step of writing a destination (``step``), for ``staged`` to place."""

    def __init__(self, what: str, error: OSError) -> None:
        super().__init__(f"{error.filename or ''}: {what} failed ({error.strerror}); nothing was written")
        self.what, self.strerror = what, error.strerror


@contextlib.contextmanager
def step(what: str) -> Iterator[None]:
    """An OSError in the block is ``what`` failing (e.g. "writing the checkpoint"), said so."""
    try:
        yield
    except OSError as error:
        raise StepFailed(what, error) from None


def check_room(destination: Path, needed: int) -> None:
    """Refuse, before anything is written, a destination whose file system has less free space
    than the ``needed`` bytes (and the staging copy beside it, which becomes the destination)."""
    free = shutil.disk_usage(destination.parent).free
    if needed > free:
        raise ModelError(f"{destination.parent}: the result needs {_gigabytes(needed)} and {_gigabytes(free)} is"
                         " free there; nothing was written; free some space or choose another destination")


def _gigabytes(count: int) -> str:
    return f"{count / 1e9:.2f} GB" if count >= 1e7 else f"{count / 1e6:.2f} MB"


@contextlib.contextmanager
def staged(destination: Path, force: bool) -> Iterator[Path]:
    """A temporary path beside ``destination``, moved into place only if the block succeeds
    and leaves something there; a failure or an interrupt removes it. With ``force`` an
    existing destination is replaced; if the replacement fails it is put back. An OSError is
    said with the step it came from: making the staging directory, a ``step`` of the block,
    or the move into place; any other comes out as it was raised."""
    with contextlib.ExitStack() as stack:
        try:
            directory = stack.enter_context(
                temporary_directory(f".{destination.name}.{STAGING_MARK}.", destination.parent))
            lock = os.open(directory / LOCK_FILE, os.O_CREAT | os.O_RDWR, 0o600)
        except OSError as error:
            raise ModelError(f"{destination.parent}: cannot write here ({error.strerror}); check permissions") from None
        stack.callback(os.close, lock)
        fcntl.flock(lock, fcntl.LOCK_EX)
        target = directory / destination.name
        try:
            yield target
        except StepFailed as failed:
            raise ModelError(f"{destination}: {failed.what} failed ({failed.strerror}); nothing was written") from None
        if not target.exists():
            return
        try:
            with held():
                _publish(target, destination, directory / "replaced", force)
        except FileExistsError:
            raise _appeared(destination) from None
        except OSError as error:
            raise ModelError(f"{destination}: moving the result into place failed ({error.strerror}); nothing was"
                             " changed") from None


def _publish(target: Path, destination: Path, old: Path, force: bool) -> None:
    """Move the finished ``target`` into place; ``force``: the existing destination aside to
    ``old`` first, and back if the move fails."""
    if destination.exists() or destination.is_symlink():
        if not force:
            raise _appeared(destination)
        os.replace(destination, old)
    try:
        _move_into_place(target, destination)
    except OSError:
        if old.exists() and not destination.exists():
            os.replace(old, destination)
        raise
    _INTERRUPTS.written.append(destination)
