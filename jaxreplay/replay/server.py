"""Starting the server a `Tables` asks for: the one place that picks a backend class.

Reverb runs in this process where it is importable (the Reverb lane), else in a sidecar
process beside it (sidecar.py: the default tier, Python 3.12+)."""

from __future__ import annotations

from typing import Optional

import importlib.util

from jaxreplay.config import Config, ConfigError, machine_check, owner_check
from jaxreplay.replay.backend import Backend
from jaxreplay.replay.inprocess import InProcessServer
from jaxreplay.replay.reverb_backend import ReverbServer
from jaxreplay.replay.sidecar import SidecarServer, find_python
from jaxreplay.replay.tables import Tables, resolve_backend


def serve(tables: Tables, *, seed: Optional[int] = None, port: int = 0, reverb_python: str = "",
          **kwargs) -> Backend:
    """The server for `build_tables`' tables; `kwargs`: checkpoint_root, restore_from,
    timeout_s (see `ReverbServer`).

    port: Reverb's (0: a free one); the in-process server has none. seed: seeds the
    in-process backend's uniform and prioritized selectors; Reverb's cannot be seeded
    (its fifo and lifo selectors need no seed). reverb_python: the sidecar's Python where
    Reverb is not importable here ("": found, see `sidecar.find_python`)."""
    if tables.backend == "inprocess":
        return InProcessServer(tables, seed=seed, **kwargs)
    if tables.backend == "reverb":
        if reverb_importable():
            return ReverbServer(tables, port=port, **kwargs)
        return SidecarServer(tables, python=reverb_python, port=port, **kwargs)
    raise ValueError(f"replay.backend: unknown backend {tables.backend!r} (reverb or inprocess)")


@owner_check
def check_backend_serves(config: Config) -> None:
    """replay.max_age evicts by the rows' policy versions, which only the in-process backend can find."""
    if config.replay.max_age and resolve_backend(config.replay.backend) != "inprocess":
        raise ConfigError("replay.max_age: needs replay.backend=inprocess: Reverb reports no item keys at insert, "
                          "so its stale items could only be found by sampling them (set replay.max_age=0)")


def reverb_importable() -> bool:
    """Whether Reverb runs in this process (else in a sidecar)."""
    return importlib.util.find_spec("reverb") is not None


def describe_reverb(reverb_python: str = "") -> str:
    """Which Reverb `serve` runs, and where, in one line."""
    if reverb_importable():
        from importlib.metadata import version
        return f"Reverb: dm-reverb {version('dm-reverb')} in this process"
    python, version = find_python(reverb_python)
    return f"Reverb: dm-reverb {version} in a sidecar process ({python})"


@machine_check
def check_reverb_runs(config: Config) -> None:
    """replay.backend=reverb: Reverb importable here, or a Python found to run its sidecar (one process)."""
    if resolve_backend(config.replay.backend) != "reverb" or reverb_importable():
        return
    if config.distributed.enabled:
        raise ConfigError(
            "replay.backend: reverb on a multi-host job needs Reverb importable in every process (the Reverb lane): "
            "through the sidecar each other process would need a sidecar of its own as Reverb's client, reaching "
            "process 0's Reverb port, which listens on all interfaces without authentication; use "
            "replay.backend=inprocess (sharded) on this tier")
    find_python(config.replay.reverb_python)
