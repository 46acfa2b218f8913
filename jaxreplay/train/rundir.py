"""One run per `run.dir`, on a disk or in a bucket: created with one-line errors, locked while a run uses it.

A local run dir is locked by an flock on RUN_DIR/run.lock, which holds the holder's PID and
host for the line a refused run prints. The kernel drops an flock when its holder dies, so a
killed run never blocks its resume. (On NFS, Linux emulates flock with POSIX locks, which the
server arbitrates across hosts.)

A bucket run dir (gs://) is locked by a lease: the object RUN_DIR/run.lock, created only if
absent (a GCS generation precondition) and rewritten every quarter of `run.lease_s` (60 s) while
the run lives. A lease not renewed for `run.lease_s` has expired and the next run takes it over:
a run that finds a lease watches it, and is refused if the holder renews it, else waits until it
expires, so a preempted holder delays its resume by at most `run.lease_s` seconds.
Atomicity rests on real GCS's preconditions; an emulator that ignores them still refuses a live lease, since every claim reads
the lease first.

A bucket run dir has no rename and no append, so the run works in a fresh local mirror (`RunDir`):
records are written there as on a disk and uploaded at each checkpoint and when the run ends
(`sync`); a replay checkpoint is uploaded whole before the Orbax step that names it; Orbax writes
its steps to the bucket itself. A kill loses at most the records since the last checkpoint,
which a resume drops anyway.

A multi-host job is one run and takes one lock: process 0 holds it (driver.py), the other
processes `attach` without it. A process may claim a directory it already holds (the CLI claims
before the driver it calls does); the lock goes when the outermost claim ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Optional

from jaxreplay import storage
from jaxreplay.config import ConfigError, show

LOCK_FILE = "run.lock"
REPLAY_DIR = "replay"
CHECKPOINT_DIR = "checkpoints"
REPLAY_DONE = "DONE"  # the in-process backend's completion marker: uploaded last
SHARED_CHECK_S = 15.0  # each wait of the start-up check that a job's processes share run.dir
# The records a run reads back when it resumes: in the mirror before anything reads them.
RECORDS = ("config.yaml", "metrics.jsonl", "summary.json", "calibration.json")


class RunDirError(ConfigError):
    """`run.dir` cannot be used: not a writable directory or bucket, or another run holds it."""


class RunDirInUse(RunDirError):
    """Another run holds `run.dir`'s lock or lease: the config is sound, and the same command runs
    once that run ends, so the command's line calls it an error, not a config error."""

    kind = "error"


@dataclasses.dataclass
class RunDir:
    """Where a run's files go: `local`, the run dir itself on a disk, or the local mirror of the
    bucket run dir `url`."""

    url: str
    local: Path
    _synced: dict[str, tuple[int, int]] = dataclasses.field(default_factory=dict)

    @property
    def remote(self) -> bool:
        return storage.is_url(self.url)

    def __truediv__(self, name: str) -> Path:
        return self.local / name

    def __fspath__(self) -> str:
        """The local side: code that writes a run's files writes them here, on a disk or in the mirror."""
        return os.fspath(self.local)

    def __str__(self) -> str:
        return self.url

    def checkpoints(self) -> Any:
        """The Orbax checkpoint directory (in the bucket itself: Orbax writes there)."""
        return storage.orbax_path(storage.join(self.url, CHECKPOINT_DIR) if self.remote else self.local / CHECKPOINT_DIR)

    def has_checkpoints(self) -> bool:
        return storage.isdir(storage.join(self.url, CHECKPOINT_DIR)) if self.remote else \
            (self.local / CHECKPOINT_DIR).is_dir()

    def pull(self, *names: str) -> None:
        """Copies the named files of the bucket run dir into the mirror (those that exist)."""
        if not self.remote:
            return
        for name in names:
            with contextlib.suppress(FileNotFoundError):
                storage.download(storage.join(self.url, name), self.local / name)
                self._mark(self.local / name)

    def pull_replay(self, name: Optional[str]) -> None:
        """The replay checkpoint `name` from the bucket, for the backend to restore from."""
        if self.remote and name and not (self.local / REPLAY_DIR / name).is_dir():
            self.pull(f"{REPLAY_DIR}/{name}")

    def push_replay(self, name: str) -> None:
        """Uploads the replay checkpoint `name`, its completion marker last, before a step names it."""
        if self.remote:
            local = self.local / REPLAY_DIR / name
            storage.upload(local, storage.join(self.url, REPLAY_DIR, name), last=[REPLAY_DONE])

    def prune_replay(self, keep: Iterable[str]) -> None:
        """Deletes the bucket's replay checkpoints that no kept step names (`keep`: paths under
        replay/, a multi-host shard's as `shard-<id>/<name>`)."""
        if not self.remote:
            return
        keep = set(keep)
        shards = {path.split("/")[0] for path in keep if "/" in path}
        root = storage.join(self.url, REPLAY_DIR)
        for name in storage.listdir(root):
            children = [f"{name}/{c}" for c in storage.listdir(storage.join(root, name))] if name in shards else [name]
            for path in children:
                if path not in keep:
                    storage.rmtree(storage.join(root, path))

    def sync(self) -> None:
        """Uploads every record file of the mirror written since the last sync (replay checkpoints
        go with `push_replay`; files whose name starts with a dot are temporary)."""
        if not self.remote:
            return
        for file in sorted(self.local.rglob("*")):
            rel = file.relative_to(self.local)
            if not file.is_file() or rel.parts[0] == REPLAY_DIR or any(p.startswith(".") for p in rel.parts):
                continue
            stat = file.stat()
            if self._synced.get(rel.as_posix()) != (stat.st_mtime_ns, stat.st_size):
                storage.upload(file, storage.join(self.url, rel.as_posix()))
                self._synced[rel.as_posix()] = (stat.st_mtime_ns, stat.st_size)

    def _mark(self, path: Path) -> None:
        """Marks pulled files as synced: they are in the bucket already."""
        for file in [path] if path.is_file() else path.rglob("*"):
            if file.is_file():
                stat = file.stat()
                self._synced[file.relative_to(self.local).as_posix()] = (stat.st_mtime_ns, stat.st_size)


def create(path: str | Path) -> RunDir:
    """`path` as a usable run dir: a writable directory, created if need be, or a bucket run dir
    this process can write (checked by writing and deleting a probe object), with a fresh mirror."""
    if storage.is_url(path):
        return _bucket(str(path))
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
    return RunDir(url=str(directory), local=directory)


def _bucket(url: str) -> RunDir:
    try:
        storage.check(url, "run.dir")
    except storage.StorageError as e:
        raise RunDirError(str(e)) from None
    probe = storage.join(url, f".probe-{socket.gethostname()}-{os.getpid()}")
    try:
        storage.write_bytes(probe, b"")
        storage.remove(probe)
    except Exception as e:  # noqa: BLE001 - auth, a missing bucket, no network: one line naming run.dir
        raise RunDirError(f"run.dir: cannot write to {url}: {type(e).__name__}: "
                          f"{(str(e).strip().splitlines() or [''])[0][:300]}") from None
    run_dir = RunDir(url=url.rstrip("/"), local=Path(tempfile.mkdtemp(prefix="jaxreplay-run-")))
    run_dir.pull(*RECORDS)
    return run_dir


_held: dict[str, list[Any]] = {}  # real path or URL -> [RunDir, lock, claims]
_guard = threading.Lock()


@contextlib.contextmanager
def claim(path: str | Path, lease_s: float = 60.0,
          log: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)) -> Iterator[RunDir]:
    """Holds the lock on `path` (created if need be) for the block; `RunDirError` if another run has it.
    `lease_s`: a bucket lease's life unrenewed (`run.lease_s`); a lease another run left is watched
    until it expires (`log` says so). A bucket run dir's mirror is synced and removed when the
    outermost claim ends."""
    if storage.is_url(path):
        key = str(path).rstrip("/")
    else:
        try:
            key = os.path.realpath(path)
        except ValueError:  # a NUL character: `create` says so in one line
            create(path)
            raise
    with _guard:
        if key in _held:
            _held[key][2] += 1
        else:
            run_dir = create(path)
            try:
                lock = _Lease(run_dir.url, lease_s, log) if run_dir.remote else _flock(run_dir.local)
            except BaseException:
                _remove_mirror(run_dir)
                raise
            _held[key] = [run_dir, lock, 1]
    try:
        yield _held[key][0]
    finally:
        with _guard:
            entry = _held[key]
            entry[2] -= 1
            if entry[2] == 0:
                del _held[key]
                try:
                    entry[0].sync()
                finally:
                    entry[1].release()
                    _remove_mirror(entry[0])


@contextlib.contextmanager
def attach(path: str | Path) -> Iterator[RunDir]:
    """The run dir without its lock: a multi-host job's processes besides the one that holds it."""
    run_dir = create(path)
    try:
        yield run_dir
    finally:
        try:
            run_dir.sync()
        finally:
            _remove_mirror(run_dir)


def _remove_mirror(run_dir: RunDir) -> None:
    if run_dir.remote:
        shutil.rmtree(run_dir.local, ignore_errors=True)


class _Flock:
    def __init__(self, fd: int):
        self._fd = fd

    def release(self) -> None:
        os.close(self._fd)  # releases the flock


def _flock(directory: Path) -> _Flock:
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
        raise _in_use(directory, who) from None
    except OSError as e:
        os.close(fd)
        raise RunDirError(f"run.dir: cannot lock {show(str(path))}: {e.strerror}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
    return _Flock(fd)


def _in_use(where: Any, who: str, more: str = "") -> RunDirInUse:
    return RunDirInUse(f"run.dir: {show(str(where))} is in use by another run ({who}){more}; wait for it to "
                       "end or stop it, or choose another run.dir")


class _Lease:
    """The bucket run dir's lease object, renewed by a daemon thread until `release`."""

    def __init__(self, url: str, ttl_s: float, wait_log: Callable[[str], None]):
        self.url, self.ttl_s, self._wait_log = storage.join(url, LOCK_FILE), ttl_s, wait_log
        self._stop = threading.Event()
        self._generation = self._take(url)
        self._thread = threading.Thread(target=self._renew, args=(ttl_s / 4,), name="run-dir-lease", daemon=True)
        self._thread.start()

    def _body(self) -> bytes:
        return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "ttl_s": self.ttl_s}).encode()

    def _take(self, run_url: str) -> int:
        """Creates the lease, or takes over an expired one. A lease that has not expired yet is
        watched until it does: a holder that renews it meanwhile is alive, and the run is refused;
        one that does not (a killed or preempted run) is taken over once it has expired."""
        while True:
            current = storage.read_versioned(self.url)
            if current is None:
                if storage.write_if_generation(self.url, self._body(), 0):
                    break
                raise _in_use(run_url, "a run that created the lease first")
            data, generation, updated = current
            try:
                holder = json.loads(data)
                ttl, who = float(holder.get("ttl_s", self.ttl_s)), f"process {holder['pid']} on {holder['host']}"
            except (ValueError, KeyError, TypeError, AttributeError):
                ttl, who = self.ttl_s, "a holder whose lease cannot be read"
            left = ttl - (time.time() - updated)
            if left <= 0:
                if storage.write_if_generation(self.url, self._body(), generation):
                    break
                raise _in_use(run_url, "a run that took over the expired lease first")
            self._wait_log(f"run.dir: {run_url} is leased by {who} until {left:.0f}s from now unless renewed: "
                           "waiting to see whether it is")
            while left > 0:
                time.sleep(min(1.0, left))
                left -= min(1.0, left)
                again = storage.read_versioned(self.url)
                if again is None or again[1] != generation:
                    if again is not None:
                        raise _in_use(run_url, who, ", which renewed its lease just now")
                    break  # released: try to create it
        return storage.read_versioned(self.url)[1]

    def _renew(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            try:
                if storage.write_if_generation(self.url, self._body(), self._generation):
                    self._generation = storage.read_versioned(self.url)[1]
            except Exception:  # noqa: BLE001 - a passing network fault: the next renewal tries again
                pass

    def release(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with contextlib.suppress(Exception):
            storage.delete_if_generation(self.url, self._generation)


def check_shared(run_dir: RunDir, coordinator: Any, settle_s: float = 3.0) -> None:
    """Ends a multi-host job at start-up, on every process, when its processes do not see one
    run dir: process 0 writes a token there, and every other process must read it (retrying for
    `settle_s`, for NFS attribute caches). Each wait is bounded by the coordinator's timeout
    (`SHARED_CHECK_S`, plus `run.lease_s` that process 0 may spend waiting out an earlier run's
    lease), whatever `distributed.timeout_s` says, so a pod whose workers each have their own
    disk ends in seconds, not in Orbax's 10-minute wait for a directory it never sees."""
    key = "run-dir/shared"
    if coordinator.is_leader:
        token = f".shared-{os.getpid()}-{time.time_ns()}"
        storage.write_text(storage.join(run_dir.url, token), token)
        coordinator.publish(key, token)
    else:
        token = coordinator.lookup(key)
    seen, deadline = False, time.monotonic() + settle_s
    while not seen:
        try:
            seen = storage.read_text(storage.join(run_dir.url, token)) == token
        except (FileNotFoundError, NotADirectoryError):
            pass
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    blind = [i for i, ok in enumerate(coordinator.gather(key, "1" if seen else "0")) if ok == "0"]
    if coordinator.is_leader:
        storage.remove(storage.join(run_dir.url, token))
    if blind:
        raise RunDirError(f"run.dir: {show(run_dir.url)} is not one directory shared by the job's processes: "
                          f"process{'es' if len(blind) > 1 else ''} {', '.join(map(str, blind))} cannot see what "
                          "process 0 writes there (TPU VM workers each have their own disk): use a bucket "
                          "(run.dir=gs://BUCKET/PATH) or a mount every worker shares")
