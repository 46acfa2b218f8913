"""The in-process replay backend: Reverb's table semantics for one host, without Reverb.

dm-reverb ships wheels only for CPython 3.10/3.11 and needs TensorFlow; this backend
is plain Python and numpy, so the stack runs where Reverb cannot install (Colab's
Python 3.12). It serves the same `TableDef`s with the same rules: the selector
(uniform, fifo, lifo, prioritized with an exponent), a FIFO remover at `max_size`,
`max_times_sampled`, and the rate limiter decided by `LimiterState.can_insert` /
`can_sample`, the operation-for-operation mirror of Reverb's rate_limiter.cc, so both
backends admit and block the same calls (tests/test_replay_differential.py checks).
Like Reverb, the limiter admits one item at a time. Unlike Reverb, rows that a timed-out
insert had not yet landed are dropped rather than left queued, and the server is
reachable only from this process (threads included): multi-host runs keep one such
table per process, as shards of one (multiprocess.py).

Checkpoints are plain directories: per table an `.npz` of the items (fields, keys,
priorities, times sampled; loaded without pickle) and a `tables.json` of settings,
counters and the selectors' RNG state, written under a temporary name and renamed into
place. tables.json holds each .npz's sha256 and the `DONE` marker tables.json's, hashed
from the bytes as they are written, so a file cut short or changed since is named on
restore (`DamagedCheckpoint`) before a table is filled from it; checkpoints written before
the hashes (an empty `DONE`) are read unchecked. A seeded server therefore samples the same items as an uninterrupted one after
a restore: runs with the same seed are reproducible, resumed or not.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import zipfile
import tempfile
import threading
import time
from typing import Mapping, Optional

import numpy as np

from jaxreplay.replay.backend import DamagedCheckpoint, SampleInfo, checkpoint_path, prune_directories
from jaxreplay.replay.tables import (
    WAIT_SLICE_S, Interrupted, ItemSpec, LimiterState, RateLimit, ReplayTimeoutError, TableDef, Tables,
    check_interrupted)

_DONE = "DONE"  # marks a complete checkpoint, as in Reverb's
_FORMAT = 2  # 2: tables.json holds the selectors' RNG state (format 1 had none)
_SELECTOR_STREAM = 0x5E1EC7  # keeps the selectors' stream apart from other users of the same seed


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise DamagedCheckpoint(f"{path}: missing ({what})") from None


def _json(path: str, data: bytes):
    try:
        record = json.loads(data)
        record.keys()  # an object, as written
    except (ValueError, AttributeError) as e:
        raise DamagedCheckpoint(f"{path}: not a JSON object as written ({e})") from None
    return record


def verify(path: str | os.PathLike) -> dict:
    """The checkpoint's tables.json, once its files match the hashes written with them; else
    `DamagedCheckpoint` naming the first file that does not."""
    path = os.fspath(path)
    done = _read(os.path.join(path, _DONE), "the marker of a complete replay checkpoint")
    expected = _json(os.path.join(path, _DONE), done) if done.strip() else {}  # empty: written before the hashes
    text = _read(os.path.join(path, "tables.json"), "the replay checkpoint's settings and counters")
    if expected and _sha256(text) != expected.get("tables.json"):
        raise DamagedCheckpoint(f"{os.path.join(path, 'tables.json')}: its sha256 is not the one written with it")
    meta = _json(os.path.join(path, "tables.json"), text)
    for table in meta.get("tables", []):
        if "sha256" in table:
            npz = os.path.join(path, f"{table['definition']['name']}.npz")
            if _sha256(_read(npz, "a replay table's items")) != table["sha256"]:
                raise DamagedCheckpoint(f"{npz}: its sha256 is not the one written with it (cut short or changed)")
    return meta


ITEM_ARRAYS = ("key", "priority", "times_sampled")  # beside the `field.<name>` arrays of each table's .npz


def read_table(path: str | os.PathLike, table: str = "rollouts") -> dict[str, np.ndarray]:
    """One table of an in-process replay checkpoint (`RUN/replay/<name>/`), for tools outside the run:
    every row field by name ([n, *shape], oldest item first) and `ITEM_ARRAYS`, once the checkpoint's files
    match their hashes (`verify`). The format is docs/checkpoints.md's "The rows of a replay checkpoint"."""
    meta = verify(path)
    names = [t["definition"]["name"] for t in meta.get("tables", [])]
    if table not in names:
        raise KeyError(f"no table {table!r} in the replay checkpoint {os.fspath(path)} (tables: {', '.join(names)})")
    with np.load(os.path.join(os.fspath(path), f"{table}.npz"), allow_pickle=False) as z:
        return {k.removeprefix("field."): z[k] for k in z.files}


@dataclasses.dataclass
class _Item:
    key: int
    row: Mapping[str, np.ndarray]  # shared between tables that hold the same rollout
    priority: float
    times_sampled: int = 0


class InProcessTable:
    """One table's items and limiter counters. Not thread-safe on its own: the
    `InProcessServer` that hosts it calls it under its lock."""

    def __init__(self, definition: TableDef, item_spec: ItemSpec):
        if definition.selector not in ("uniform", "fifo", "lifo", "prioritized"):
            raise ValueError(f"replay.selector: unknown selector {definition.selector!r}")
        self.definition = definition
        self.item_spec = {k: (tuple(shape), np.dtype(dtype)) for k, (shape, dtype) in item_spec.items()}
        self.items: list[_Item] = []  # insertion order: the FIFO remover takes items[0]
        self.inserts = 0
        self.samples = 0

    @property
    def name(self) -> str:
        return self.definition.name

    def state(self) -> LimiterState:
        d, rl = self.definition, self.definition.rate_limit
        return LimiterState(
            table=d.name, size=len(self.items), max_size=d.max_size, max_times_sampled=d.max_times_sampled,
            inserts=self.inserts, samples=self.samples, deletes=self.inserts - len(self.items),
            samples_per_insert=rl.samples_per_insert, min_size_to_sample=rl.min_size_to_sample,
            min_diff=rl.min_diff, max_diff=rl.max_diff)

    def insert(self, item: _Item) -> None:
        """Inserts one admitted item, first evicting the oldest if the table is full."""
        if len(self.items) >= self.definition.max_size:
            self.items.pop(0)
        self.items.append(item)
        self.inserts += 1

    def sample(self, rng: np.random.Generator) -> tuple[_Item, float, int, int]:
        """Samples one admitted item: (item, its probability, table size before any removal,
        times sampled with this sample)."""
        n, d = len(self.items), self.definition
        if d.selector == "fifo":
            i, p = 0, 1.0
        elif d.selector == "lifo":
            i, p = n - 1, 1.0
        elif d.selector == "uniform":
            i, p = int(rng.integers(n)), 1.0 / n
        else:
            weights = np.array([it.priority for it in self.items], np.float64) ** d.priority_exponent
            probs = weights / weights.sum()
            i = int(rng.choice(n, p=probs))
            p = float(probs[i])
        item = self.items[i]
        item.times_sampled += 1
        self.samples += 1
        if d.max_times_sampled > 0 and item.times_sampled >= d.max_times_sampled:
            self.items.pop(i)
        return item, p, n, item.times_sampled


class InProcessServer:
    """The `Backend` protocol (backend.py) for `Tables` in this process: server and client
    in one object, shared by this process's threads."""

    def __init__(self, tables: Tables, *, checkpoint_root: Optional[str | os.PathLike] = None,
                 restore_from: Optional[str | os.PathLike] = None, timeout_s: float = 60.0,
                 seed: Optional[int] = None):
        """As `ReverbServer` (no port); `seed` seeds the uniform and prioritized selectors
        (None: fresh entropy), and a restore continues the RNG the checkpoint saved."""
        self._tables = {d.name: InProcessTable(d, tables.item_spec) for d in tables.defs}
        self._table = tables.defs[0].name
        self._timeout_s = timeout_s
        self._checkpoint_root = None if checkpoint_root is None else os.fspath(checkpoint_root)
        if self._checkpoint_root is not None:
            os.makedirs(self._checkpoint_root, exist_ok=True)
        self._cond = threading.Condition()
        self._rng = np.random.default_rng(None if seed is None else [_SELECTOR_STREAM, seed])
        self._next_key = 1
        self._stopped = False
        if restore_from is not None:
            self._restore(checkpoint_path(self._checkpoint_root, restore_from))

    @property
    def table(self) -> str:
        return self._table

    def describe(self) -> str:
        return self.states()[self._table].describe()

    def states(self, interrupted: Interrupted = None) -> dict[str, LimiterState]:
        with self._cond:
            return {name: t.state() for name, t in self._tables.items()}

    def insert(self, table: str, rows: Mapping[str, np.ndarray], priorities: np.ndarray, *,
               also: Optional[Mapping[str, np.ndarray]] = None, timeout_s: float,
               interrupted: Interrupted = None) -> None:
        """As `Client.insert`; a timeout drops the rows not yet inserted."""
        deadline, n = time.monotonic() + timeout_s, len(priorities)
        also = also or {}
        for i in range(n):
            row = {k: a[i] for k, a in rows.items()}
            for name, priority in [(table, float(priorities[i])), *((t, 1.0) for t, m in also.items() if m[i])]:
                with self._cond:
                    t = self._await(name, lambda s: s.can_insert(1), deadline, interrupted,
                                    lambda s: f"insert of {n} rows timed out after {timeout_s:g}s "
                                    f"with {i} inserted, waiting for the rate limiter to admit them "
                                    f"(no sampler draining the table?): {s.describe()}")
                    t.insert(_Item(self._next_key, row, priority))
                    self._next_key += 1
                    self._cond.notify_all()

    def sample(self, table: str, n: int, *, timeout_s: float, interrupted: Interrupted = None,
               known: Optional[LimiterState] = None) -> tuple[dict[str, np.ndarray], SampleInfo]:
        """As `Client.sample`: waits until the limiter admits all `n`, then takes them one at
        a time (each once admitted: samples may delete items). `known` changes nothing here."""
        deadline, taken = time.monotonic() + timeout_s, []
        with self._cond:
            t = self._await(table, lambda s: s.can_sample(n), deadline, interrupted,
                            lambda s: f"sample({n}) timed out after {timeout_s:g}s waiting for the rate limiter "
                            f"to allow {n} samples (no actor inserting?): {s.describe()}")
            for i in range(n):
                t = self._await(table, lambda s: s.can_sample(1), deadline, interrupted,
                                lambda s: f"sample({n}) timed out after {timeout_s:g}s with {i} of {n} items taken, "
                                f"waiting for the rate limiter (no actor inserting?): {s.describe()}")
                taken.append(t.sample(self._rng))
                self._cond.notify_all()
        batch = {k: np.stack([item.row[k] for item, *_ in taken]) for k in sorted(t.item_spec)}
        return batch, SampleInfo(
            keys=np.array([item.key for item, *_ in taken], np.uint64),
            times_sampled=np.array([ts for *_, ts in taken], np.int32),
            probabilities=np.array([p for _, p, _, _ in taken], np.float64),
            table_size=np.array([size for _, _, size, _ in taken], np.int64))

    def delete(self, table: str, keys: np.ndarray) -> None:
        """As `Client.delete`."""
        self._delete(table, lambda item, gone=set(np.asarray(keys, np.uint64).tolist()): item.key in gone)

    def evict(self, table: str, below_version: int) -> int:
        """As `Backend.evict`."""
        return self._delete(table, lambda item: int(item.row["policy_version"]) < below_version)

    def checkpoint(self) -> str:
        """As `Backend.checkpoint`: every table's items and counters, and the selectors' RNG."""
        if self._checkpoint_root is None:
            raise ValueError("this InProcessServer was started without a checkpoint_root")
        with self._cond:
            staging = tempfile.mkdtemp(prefix=".inprocess-staging-", dir=self._checkpoint_root)
            meta = {"format": _FORMAT, "next_key": self._next_key, "rng": self._rng.bit_generator.state,
                    "tables": []}
            for t in self._tables.values():
                arrays = {f"field.{k}": (np.stack([it.row[k] for it in t.items]) if t.items
                                         else np.zeros((0, *shape), dtype))
                          for k, (shape, dtype) in t.item_spec.items()}
                arrays["key"] = np.array([it.key for it in t.items], np.uint64)
                arrays["priority"] = np.array([it.priority for it in t.items], np.float64)
                arrays["times_sampled"] = np.array([it.times_sampled for it in t.items], np.int64)
                buffer = io.BytesIO()  # hashed as written: no second pass over the file
                np.savez(buffer, **arrays)
                data = buffer.getvalue()
                with open(os.path.join(staging, f"{t.name}.npz"), "wb") as f:
                    f.write(data)
                meta["tables"].append({"definition": dataclasses.asdict(t.definition),
                                       "inserts": t.inserts, "samples": t.samples, "sha256": _sha256(data)})
            text = json.dumps(meta).encode()
            with open(os.path.join(staging, "tables.json"), "wb") as f:
                f.write(text)
            with open(os.path.join(staging, _DONE), "w") as f:
                json.dump({"tables.json": _sha256(text)}, f)
            name = f"{time.strftime('%Y%m%dT%H%M%S')}-{self._next_key}-{os.urandom(4).hex()}"
            os.replace(staging, os.path.join(self._checkpoint_root, name))
            return name

    def prune(self, keep: set[str]) -> list[str]:
        """As `Backend.prune`, also deleting the staging directories of checkpoints a killed
        process left unfinished."""
        if self._checkpoint_root is None:
            return []
        # This server stages only inside checkpoint(): any staging directory is stale.
        hidden = lambda name, path: name.startswith(".") and not name.startswith(".inprocess-staging-")
        return prune_directories(self._checkpoint_root, keep, skip=hidden)

    def stop(self) -> None:
        """Wakes every blocked call (which then fails); idempotent."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def __enter__(self) -> "InProcessServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- internals ----------------------------------------------------------------

    def _get(self, table: str) -> InProcessTable:
        if table not in self._tables:
            raise KeyError(f"no table {table!r} on the in-process server (tables: {', '.join(sorted(self._tables))})")
        return self._tables[table]

    def _delete(self, table: str, doomed) -> int:
        """Deletes the items of `table` for which `doomed(item)`; how many."""
        with self._cond:
            t = self._get(table)
            kept = [item for item in t.items if not doomed(item)]
            deleted, t.items = len(t.items) - len(kept), kept
            self._cond.notify_all()
            return deleted

    def _await(self, table: str, admitted, deadline: float, interrupted: Interrupted, message) -> InProcessTable:
        """Waits (holding the lock between checks, in slices that let signal handlers run)
        until `admitted(state)`; the table."""
        t = self._get(table)
        while not admitted(t.state()):
            if self._stopped:
                raise RuntimeError(f"the in-process replay server was stopped: {t.state().describe()}")
            check_interrupted(interrupted, f"a replay call on table {table!r} was waiting: {t.state().describe()}")
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ReplayTimeoutError(message(t.state()))
            self._cond.wait(min(remaining, WAIT_SLICE_S))
        return t

    def _restore(self, path: str) -> None:
        meta = verify(path)
        saved = {m["definition"]["name"]: m for m in meta["tables"]}
        if sorted(saved) != sorted(self._tables):
            raise ValueError(f"replay checkpoint {path} holds tables {sorted(saved)}, the config {sorted(self._tables)}")
        for name, t in self._tables.items():
            d = saved[name]["definition"]
            got = dataclasses.replace(t.definition, rate_limit=RateLimit(**d.pop("rate_limit")), **d)
            if got != t.definition:
                diffs = [f"{f.name}: checkpoint {getattr(got, f.name)!r} vs config {getattr(t.definition, f.name)!r}"
                         for f in dataclasses.fields(TableDef) if getattr(got, f.name) != getattr(t.definition, f.name)]
                raise ValueError(f"replay checkpoint {path} was saved with different table settings: "
                                 + "; ".join(diffs))
            npz = os.path.join(path, f"{name}.npz")
            try:
                z = np.load(npz, allow_pickle=False)
                fields = {k: z[f"field.{k}"] for k in t.item_spec if f"field.{k}" in z}
                keys, priorities, sampled = z["key"], z["priority"], z["times_sampled"]
            except (OSError, EOFError, KeyError, ValueError, zipfile.BadZipFile) as e:  # unhashed (older) files
                raise DamagedCheckpoint(f"{npz}: not a readable table ({e.__class__.__name__}: {e})") from None
            with z:
                if set(fields) != set(t.item_spec) or any(
                        fields[k].shape[1:] != shape or fields[k].dtype != dtype
                        for k, (shape, dtype) in t.item_spec.items()):
                    raise ValueError(f"replay checkpoint {path}: table {name!r} was saved with other item fields")
                t.items = [_Item(int(key), {k: a[i] for k, a in fields.items()}, float(pr), int(ts))
                           for i, (key, pr, ts) in enumerate(zip(keys, priorities, sampled))]
            t.inserts, t.samples = saved[name]["inserts"], saved[name]["samples"]
        self._next_key = meta["next_key"]
        if "rng" in meta:  # format 1 checkpoints carry none: sampling continues from `seed`
            self._rng.bit_generator.state = meta["rng"]
