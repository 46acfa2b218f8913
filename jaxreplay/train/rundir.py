"""One run per `run.dir`: the directory is created with one-line errors, and locked while a run uses it.

The lock is an flock on RUN_DIR/run.lock, which holds the holder's PID and host for the
line a refused run prints. The kernel drops an flock when its holder dies, however it
dies, so a killed run never blocks its resume; the PID left in the file is overwritten.
A multi-host job is one run and takes one lock: process 0 holds it (driver.py), the
other processes share the directory without it. (On NFS, Linux emulates flock with
POSIX locks, which the server arbitrates across hosts.)

A process may claim a directory it already holds (the CLI claims before the driver it
calls does); the lock goes when the outermost claim ends.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from jaxreplay.config import ConfigError, show

LOCK_FILE = "run.lock"


class RunDirError(ConfigError):
    """`run.dir` cannot be used: not a writable directory, or another run holds it."""


def create(path: str | Path) -> Path:
    """`path` as an existing, writable directory, created if need be."""
    directory = Path(path)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise RunDirError(f"run.dir: {show(str(directory))} exists and is not a directory") from None
    except NotADirectoryError:
        raise RunDirError(f"run.dir: {show(str(directory))} lies under a file, not a directory") from None
    except OSError as e:
        raise RunDirError(f"run.dir: cannot create {show(str(directory))}: {e.strerror}") from None
    except ValueError:  # a NUL character, which YAML's "\0" can give
        raise RunDirError(f"run.dir: {show(str(directory))} is not a usable path") from None
    try:  # permission bits alone do not tell (root ignores them; a read-only mount does not)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise RunDirError(f"run.dir: {show(str(directory))} is not writable: {e.strerror}") from None
    return directory


_held: dict[str, list[int]] = {}  # real path -> [lock file descriptor, claims]
_guard = threading.Lock()


@contextlib.contextmanager
def claim(path: str | Path) -> Iterator[Path]:
    """Holds the lock on `path` (created if need be) for the block; `RunDirError` if another run has it."""
    directory = create(path)
    key = os.path.realpath(directory)
    with _guard:
        if key in _held:
            _held[key][1] += 1
        else:
            _held[key] = [_lock(directory), 1]
    try:
        yield directory
    finally:
        with _guard:
            entry = _held[key]
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                os.close(entry[0])  # releases the flock


def _lock(directory: Path) -> int:
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # not inherited by child processes
    except OSError as e:
        raise RunDirError(f"run.dir: cannot open its lock file {show(str(path))}: {e.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 200, 0).decode(errors="replace").split()
        os.close(fd)
        who = "a process that has not written its PID yet"
        if holder:
            who = f"process {holder[0]}" + (f" on {holder[1]}" if len(holder) > 1 else "")
        raise RunDirError(f"run.dir: {show(str(directory))} is in use by another run ({who}); wait for it to "
                          "end or stop it, or choose another run.dir") from None
    except OSError as e:
        os.close(fd)
        raise RunDirError(f"run.dir: cannot lock {show(str(path))}: {e.strerror}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return fd
