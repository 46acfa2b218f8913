"""Starting the server a `Tables` asks for: the one place that picks a backend class.

Reverb runs in this process where it is importable (the Reverb lane), else in a sidecar
process beside it (sidecar.py: the default tier, Python 3.12+)."""

from __future__ import annotations

from typing import Optional

import importlib.util

from jaxreplay.config import Config, ConfigError, machine_check, owner_check
from jaxreplay.replay.backend import Backend
from jaxreplay.replay import inprocess, reverb_backend
from jaxreplay.replay.inprocess import InProcessServer
from jaxreplay.replay.reverb_backend import ReverbClient, ReverbServer
from jaxreplay.replay.sidecar import SidecarServer, find_python
from jaxreplay.replay.tables import ItemSpec, Tables, build_tables, resolve_backend


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


def verify_checkpoint(backend: str, path: str) -> None:
    """Returns once `backend`'s replay checkpoint at `path` matches the hashes written with it;
    else `DamagedCheckpoint` naming the first file that does not. Reads files only."""
    if backend == "inprocess":
        inprocess.verify(path)
    elif backend == "reverb":
        reverb_backend.verify(path)
    else:
        raise ValueError(f"replay.backend: unknown backend {backend!r} (reverb or inprocess)")


def reverb_client(config: Config, item_spec: ItemSpec, address: str) -> "ReverbClient | SidecarServer":
    """A Reverb client to the server at `address` (process 0's, for `CentralReplay`): in this
    process where Reverb is importable, else in a sidecar of its own holding only that client."""
    if reverb_importable():
        return ReverbClient(address, item_spec, timeout_s=config.replay.timeout_s)
    return SidecarServer(build_tables(config, item_spec, "reverb"), python=config.replay.reverb_python,
                         timeout_s=config.replay.timeout_s, connect=address)


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
    """replay.backend=reverb: Reverb importable here, or a Python found to run its sidecar. On a
    multi-host job every process runs one: process 0's serves the table, each other's holds only
    a Reverb client to it (`reverb_client`), as the Reverb lane's processes do in process."""
    if resolve_backend(config.replay.backend) != "reverb" or reverb_importable():
        return
    find_python(config.replay.reverb_python)
