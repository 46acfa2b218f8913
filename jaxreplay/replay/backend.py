"""The protocol every replay backend serves, and what it promises about checkpoint names.

Readers, writers, the multi-process views and the drivers talk to a table server only
through `Client` (the data path: states, insert, sample) and `Backend` (a server this
process owns: the data path plus checkpoint, prune, stop). Two implementations:
reverb_backend.py (DeepMind Reverb; the only module that touches Reverb or TensorFlow)
and inprocess.py (the same semantics in this process).

A checkpoint is named RELATIVE to its server's `checkpoint_root`: `checkpoint()` returns
the name, `restore_from=` and `prune(keep)` take names, resolved against the root. The
learner's checkpoint stores the name, so a run directory copied or moved elsewhere
resumes from its own buffer, not the original's. An absolute path (what older runs
stored) is taken as is.
"""

from __future__ import annotations

import os
import shutil
from typing import Callable, Mapping, NamedTuple, Optional, Protocol, runtime_checkable

import numpy as np

from jaxreplay.replay.tables import Interrupted, LimiterState


class SampleInfo(NamedTuple):
    """Per-row sampling metadata: `keys` identify items across calls; `probabilities`
    and `table_size` give importance weights (N * P)^-beta for prioritized replay."""

    keys: np.ndarray  # [B] uint64
    times_sampled: np.ndarray  # [B] int32, this sample included
    probabilities: np.ndarray  # [B] float64
    table_size: np.ndarray  # [B] int64


@runtime_checkable
class Client(Protocol):
    """The data path to a server's tables; every call ends by `timeout_s` (`ReplayTimeoutError`)
    or once `interrupted()` turns true (`ReplayInterrupted`)."""

    def states(self, interrupted: Interrupted = None) -> dict[str, LimiterState]:
        """Every table's limiter state, taken together (one query)."""

    def insert(self, table: str, rows: Mapping[str, np.ndarray], priorities: np.ndarray, *,
               also: Optional[Mapping[str, np.ndarray]] = None, timeout_s: float,
               interrupted: Interrupted = None) -> None:
        """Row i of every array (already checked against the item spec) as one item of
        `table` with `priorities[i]`, and, with priority 1, of each table t in `also` where
        `also[t][i]` (both items reference one stored row); each once its limiter admits it."""

    def sample(self, table: str, n: int, *, timeout_s: float, interrupted: Interrupted = None,
               known: Optional[LimiterState] = None) -> tuple[dict[str, np.ndarray], SampleInfo]:
        """`n` rows of `table` as arrays [n, ...], once the limiter admits all `n`.
        known: `table`'s state as the caller, its only client, knows it; where it admits
        the batch the backend need not ask, and a server whose counters then differ was
        changed by another client (`TableSharedError`)."""

    def delete(self, table: str, keys: np.ndarray) -> None:
        """Removes `table`'s items with these keys (`SampleInfo.keys`; keys no longer there are
        skipped). The limiter counts them as deletions: the table shrinks, its insert/sample
        ratio stays."""


@runtime_checkable
class Backend(Client, Protocol):
    """A table server this process started (`serve`); stop it explicitly (or use `with`)."""

    @property
    def table(self) -> str:
        """The rate-limited table the scheduler watches (the first of `Tables.defs`)."""

    def describe(self) -> str:
        """`table`'s state in one line, for error messages and logs."""

    def evict(self, table: str, below_version: int) -> int:
        """Deletes `table`'s items whose row's policy_version is below `below_version`
        (`replay.max_age`); returns how many. Only a backend that can find items by their
        rows serves it (the in-process one); Reverb reports no item keys at insert, so its
        stale items could only be found by sampling them, and config validation refuses."""

    def checkpoint(self) -> str:
        """Saves items and limiter counters of every table; returns the checkpoint's name,
        relative to `checkpoint_root`, to pass as `restore_from`."""

    def prune(self, keep: set[str]) -> list[str]:
        """Deletes the checkpoints under `checkpoint_root` not named in `keep`, and what
        killed servers left half-written; returns the deleted paths."""

    def stop(self) -> None:
        """Stops serving; idempotent."""


class DamagedCheckpoint(ValueError):
    """A replay checkpoint with a file that is missing, cut short or changed since it was written
    (either backend's; each checks its own files against the hashes written with them)."""


def checkpoint_path(root: Optional[str], name: str | os.PathLike) -> str:
    """Where checkpoint `name` lies: under `root`, or `name` itself if absolute."""
    name = os.fspath(name)
    if os.path.isabs(name):
        return name
    if root is None:
        raise ValueError(f"replay checkpoint {name!r} is named relative to a checkpoint_root; none was given")
    return os.path.join(root, name)


def prune_directories(root: str, keep: set[str], skip: Callable[[str, str], bool]) -> list[str]:
    """Deletes each directory in `root` unless `keep` names it or `skip(name, abspath)`
    is true; returns the deleted paths. Both backends prune their checkpoints with it."""
    keep = {os.path.abspath(checkpoint_path(root, k)) for k in keep}
    removed = []
    for name in sorted(os.listdir(root)):
        path = os.path.abspath(os.path.join(root, name))
        if path in keep or not os.path.isdir(path) or skip(name, path):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
