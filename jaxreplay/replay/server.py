"""Starting the server a `Tables` asks for: the one place that picks a backend class."""

from __future__ import annotations

from typing import Optional

from jaxreplay.replay.backend import Backend
from jaxreplay.replay.inprocess import InProcessServer
from jaxreplay.replay.reverb_backend import ReverbServer
from jaxreplay.replay.tables import Tables


def serve(tables: Tables, *, seed: Optional[int] = None, port: int = 0, **kwargs) -> Backend:
    """The server for `build_tables`' tables; `kwargs`: checkpoint_root, restore_from,
    timeout_s (see `ReverbServer`).

    port: Reverb's (0: a free one); the in-process server has none. seed: seeds the
    in-process backend's uniform and prioritized selectors; Reverb's cannot be seeded
    (its fifo and lifo selectors need no seed)."""
    if tables.backend == "inprocess":
        return InProcessServer(tables, seed=seed, **kwargs)
    if tables.backend == "reverb":
        return ReverbServer(tables, port=port, **kwargs)
    raise ValueError(f"replay.backend: unknown backend {tables.backend!r} (reverb or inprocess)")
