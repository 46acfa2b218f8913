"""An in-process Reverb server with checkpoints that can be restored exactly.

Reverb's checkpointer keeps only the latest checkpoint in its directory (it deletes
the rest on every save) and, on start, loads the newest one there, falling back to
a given path only when the directory is empty. The training loop instead needs the
Reverb checkpoint taken at the same step as its Orbax checkpoint, not a newer
orphan. So each server writes into a fresh, private staging directory, every
checkpoint is moved out of it into `checkpoint_root` (where Reverb never deletes),
and a restore names its checkpoint explicitly as the fallback of an empty staging
directory.

Reverb listens on all interfaces without authentication: who can reach the port is
the deployment's business.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Optional, Sequence, Union

from jaxreplay.replay.inprocess import InProcessServer, InProcessTable, prune_directories
from jaxreplay.replay.tables import (LimiterQueries, LimiterState, Snapshot, import_reverb, limiter_state,
                                     limiter_states)

_DONE = "DONE"  # Reverb marks a complete checkpoint with this file.


class ReplayServer(LimiterQueries):
    """Owns a `reverb.Server` hosting the rollout table (and any companion tables, such as
    positive-bias sampling's). Stop it explicitly (or use `with`)."""

    def __init__(self, table: "reverb.Table | Sequence[reverb.Table]", *, port: int = 0,
                 checkpoint_root: Optional[str | os.PathLike] = None,
                 restore_from: Optional[str | os.PathLike] = None, timeout_s: float = 60.0):
        """Starts serving `table` (or tables: the first is the rate-limited one that `info()`
        describes), or the tables saved at `restore_from`.

        port: 0 picks a free port. checkpoint_root: where `checkpoint()` puts its
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
        # Fresh and empty, so Reverb loads exactly `restore_from` (or nothing).
        self._staging = tempfile.mkdtemp(prefix=".reverb-staging-", dir=checkpoint_root)
        checkpointer = reverb.checkpointers.DefaultCheckpointer(
            self._staging, fallback_checkpoint_path=restore_from)
        try:
            self._server = reverb.Server(tables, port=port or None, checkpointer=checkpointer)
        except BaseException:
            shutil.rmtree(self._staging, ignore_errors=True)
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


def serve(tables: Sequence, **kwargs) -> ReplayServer | InProcessServer:
    """The server for `build_tables`' tables, whichever backend built them; `kwargs` as
    `ReplayServer`'s (an in-process server has no port)."""
    if all(isinstance(t, InProcessTable) for t in tables):
        kwargs.pop("port", None)
        return InProcessServer(tables, **kwargs)
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
