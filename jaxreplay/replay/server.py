"""An in-process Reverb server with checkpoints that can be restored exactly.

Reverb's checkpointer keeps only the latest checkpoint in its directory (it deletes
the rest on every save) and, on start, loads the newest one there, falling back to
a given path only when the directory is empty. The training loop instead needs the
Reverb checkpoint taken at the same step as its Orbax checkpoint, not a newer
orphan. So each server writes into a fresh, private staging directory, every
checkpoint is moved out of it into `checkpoint_root` (where Reverb never deletes),
and a restore names its checkpoint explicitly as the fallback of an empty staging
directory.

Reverb listens on all interfaces without authentication (`reverb.Server` takes no bind
address): who can reach the port is the deployment's business. gRPC binds it with
SO_REUSEPORT, so a second server on a port in use would bind too and share its clients
with the first; a pinned port is therefore claimed first (`PortClaim`).
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import tempfile
from typing import Optional, Sequence, Union

from jaxreplay.config import ConfigError
from jaxreplay.replay.inprocess import InProcessServer, InProcessTable, prune_directories
from jaxreplay.replay.tables import (LimiterQueries, LimiterState, Snapshot, import_reverb, limiter_state,
                                     limiter_states)

_DONE = "DONE"  # Reverb marks a complete checkpoint with this file.


class PortInUseError(ConfigError):
    """`replay.port` is held by another jaxreplay run, or something else listens on it."""


class PortClaim:
    """This process's claim on a TCP port for one replay server, until `release()`.

    A claim is an exclusive flock on a per-port lock file, which the OS drops with the
    process (a killed run leaves no stale claim), plus a bind probe without SO_REUSEPORT,
    which fails if anything listens on the port on any interface.
    """

    def __init__(self, port: int):
        import fcntl  # POSIX only, as Reverb is
        directory = os.path.join(tempfile.gettempdir(), f"jaxreplay-ports-{os.getuid()}")
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._fd: Optional[int] = os.open(os.path.join(directory, f"{port}.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 32, 0).decode(errors="replace").strip() or "unknown"
            self.release()
            raise PortInUseError(f"replay.port: {port} is in use by another jaxreplay run (pid {holder}); "
                                 "choose another port, or 0 for a free one") from None
        if _listening(port):
            self.release()
            raise PortInUseError(f"replay.port: {port} is already in use (something listens on it); "
                                 "choose another port, or 0 for a free one")
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        """Gives the port up (closing the lock file drops the flock); idempotent."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def check_port(port: int) -> None:
    """Raises `PortInUseError` now if a server could not claim `port` (0: any free port)."""
    if port:
        PortClaim(port).release()


def _listening(port: int) -> bool:
    """Whether a socket listens on `port`: a bind without SO_REUSEPORT then fails, on every
    interface (SO_REUSEADDR only lets past connections in TIME_WAIT not count)."""
    for family, host in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            probe = socket.socket(family, socket.SOCK_STREAM)
        except OSError:  # no IPv6 on this host
            continue
        with probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return True
    return False


class ReplayServer(LimiterQueries):
    """Owns a `reverb.Server` hosting the rollout table (and any companion tables, such as
    positive-bias sampling's). Stop it explicitly (or use `with`)."""

    def __init__(self, table: "reverb.Table | Sequence[reverb.Table]", *, port: int = 0,
                 checkpoint_root: Optional[str | os.PathLike] = None,
                 restore_from: Optional[str | os.PathLike] = None, timeout_s: float = 60.0):
        """Starts serving `table` (or tables: the first is the rate-limited one that `info()`
        describes), or the tables saved at `restore_from`.

        port: 0 picks a free port; a pinned one is claimed first (`PortClaim`), so a
        port another run serves on is refused with `PortInUseError`. checkpoint_root: where `checkpoint()` puts its
        checkpoints (without one, `checkpoint()` is refused). restore_from: a path
        `checkpoint()` returned; the table is restored from it, items and limiter
        counters, and must have been saved with the same settings as `table`.
        """
        tables = list(table) if isinstance(table, (list, tuple)) else [table]
        if any(isinstance(t, InProcessTable) for t in tables):
            raise TypeError("ReplayServer serves Reverb tables; these are in-process ones (replay.backend): "
                            "start servers with replay.serve")
        reverb = import_reverb()
        checkpoint_root = None if checkpoint_root is None else os.fspath(checkpoint_root)
        restore_from = None if restore_from is None else os.path.abspath(restore_from)
        if restore_from is not None and not os.path.exists(os.path.join(restore_from, _DONE)):
            # Reverb would silently start empty.
            raise FileNotFoundError(f"no complete Reverb checkpoint at {restore_from}")
        self._table = tables[0].name  # the scheduled one: `info()` reports its limiter
        self._timeout_s = timeout_s
        self._checkpoint_root = checkpoint_root
        if checkpoint_root is not None:
            os.makedirs(checkpoint_root, exist_ok=True)
        self._claim = PortClaim(port) if port else None
        self._staging = None
        try:
            # Fresh and empty, so Reverb loads exactly `restore_from` (or nothing).
            self._staging = tempfile.mkdtemp(prefix=".reverb-staging-", dir=checkpoint_root)
            checkpointer = reverb.checkpointers.DefaultCheckpointer(
                self._staging, fallback_checkpoint_path=restore_from)
            self._server = reverb.Server(tables, port=port or None, checkpointer=checkpointer)
        except BaseException:
            if self._staging is not None:
                shutil.rmtree(self._staging, ignore_errors=True)
            if self._claim is not None:
                self._claim.release()
            raise
        self._port = self._server.port
        self._client = reverb.Client(self.address)
        if restore_from is not None:
            for t in tables:
                self._check_restored(t, restore_from)

    @property
    def address(self) -> str:
        return f"localhost:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    @property
    def table(self) -> str:
        return self._table

    def info(self) -> LimiterState:
        """Size, counters (inserts, samples, deletes, `ratio`) and limiter window."""
        return limiter_state(self._client, self._table, self._timeout_s)

    def snapshot(self) -> Snapshot:
        return limiter_states(self._client, self._timeout_s)

    def checkpoint(self) -> str:
        """Saves items and limiter counters; returns the path to pass as `restore_from`.

        Blocks the server while it writes; Reverb offers no timeout for this call.
        """
        if self._checkpoint_root is None:
            raise ValueError("this ReplayServer was started without a checkpoint_root")
        staged = self._client.checkpoint()
        path = os.path.join(self._checkpoint_root, os.path.basename(staged))
        os.replace(staged, path)  # Same filesystem: atomic, and out of Reverb's reach.
        return path

    def prune_checkpoints(self, keep: set[str]) -> list[str]:
        """Deletes the checkpoints in `checkpoint_root` not named in `keep`; returns them.

        The learner's checkpointer prunes its own steps; this drops the Reverb
        checkpoints that no remaining step refers to, and the staging directories
        that servers killed without `stop()` left behind (one server per root).
        """
        if self._checkpoint_root is None:
            return []
        staging = os.path.abspath(self._staging)
        return prune_directories(self._checkpoint_root, keep, skip=lambda name, path: path == staging)

    def stop(self) -> None:
        """Stops serving; idempotent."""
        if self._server is None:
            return
        self._server.stop()
        self._server = None
        if self._claim is not None:
            self._claim.release()
        shutil.rmtree(self._staging, ignore_errors=True)

    def __enter__(self) -> "ReplayServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _check_restored(self, table: "reverb.Table", path: str) -> None:
        # A restored table keeps the settings it was saved with, whatever `table` says.
        want, got = table.info, self._client.server_info(timeout=max(1, round(self._timeout_s)))[table.name]
        fields = {
            "sampler": (want.sampler_options, got.sampler_options),
            "remover": (want.remover_options, got.remover_options),
            "max_size": (want.max_size, got.max_size),
            "max_times_sampled": (want.max_times_sampled, got.max_times_sampled),
            "samples_per_insert": (want.rate_limiter_info.samples_per_insert,
                                   got.rate_limiter_info.samples_per_insert),
            "min_size_to_sample": (want.rate_limiter_info.min_size_to_sample,
                                   got.rate_limiter_info.min_size_to_sample),
            "min_diff": (want.rate_limiter_info.min_diff, got.rate_limiter_info.min_diff),
            "max_diff": (want.rate_limiter_info.max_diff, got.rate_limiter_info.max_diff),
            "signature": (want.signature, got.signature),
        }
        diffs = [f"{k}: checkpoint {g!r} vs config {w!r}".replace("\n", " ")
                 for k, (w, g) in fields.items() if w != g]
        if diffs:
            self.stop()
            raise ValueError(f"Reverb checkpoint {path} was saved with different table settings: "
                             + "; ".join(diffs))


def serve(tables: Sequence, *, seed: Optional[int] = None, **kwargs) -> ReplayServer | InProcessServer:
    """The server for `build_tables`' tables, whichever backend built them; `kwargs` as
    `ReplayServer`'s (an in-process server has no port).

    seed: seeds the in-process backend's uniform and prioritized selectors. Reverb's
    cannot be seeded (its fifo and lifo selectors need no seed)."""
    if all(isinstance(t, InProcessTable) for t in tables):
        kwargs.pop("port", None)
        return InProcessServer(tables, seed=seed, **kwargs)
    return ReplayServer(tables, **kwargs)


Source = Union[ReplayServer, InProcessServer, "reverb.Client", str]


def connect(source: Source):
    """A client for a `ReplayServer`, an address "host:port", or a client as is; an
    `InProcessServer` is its own client."""
    if isinstance(source, InProcessServer):
        return source
    reverb = import_reverb()
    if isinstance(source, reverb.Client):
        return source
    if isinstance(source, ReplayServer):
        return reverb.Client(source.address)
    return reverb.Client(source)
