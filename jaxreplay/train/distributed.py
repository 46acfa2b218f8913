"""Process coordination for multi-host SPMD: start-up, barriers and small messages.

`jax.distributed.initialize` starts a coordination service on process 0. Besides
wiring up the devices, it offers barriers and a key-value store, both with timeouts.
Everything here that waits goes through that service rather than through device
collectives, so a peer that died or hangs becomes a `TimeoutError` naming what was
awaited, never a silent hang.
"""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path
from typing import Optional

import jax
from jax._src import distributed as _jax_distributed  # the coordination client (barriers, key-value store)

from jaxreplay import compat
from jaxreplay.config import ConfigError, DistributedConfig
from jaxreplay.train.guards import PreemptionNotice

MTLS_FILES = ("mtls_cert_file", "mtls_key_file", "mtls_ca_file")


def initialize(config: DistributedConfig) -> None:
    """Joins the job; unset values ("", 0, -1) are left to JAX: the JAX_COORDINATOR_ADDRESS
    variable and cluster auto-detection (TPU pod metadata, SLURM, Open MPI).

    Must run before anything touches a JAX device. On CPU, cross-process collectives
    need gloo (the default CPU client has none); the setting is inert on TPU and GPU.
    Process 0's coordination service listens where `bind_address` says, not on every
    interface (JAX's default); with the `mtls_*` files it authenticates its peers.
    """
    for key in MTLS_FILES:
        path = getattr(config, key)
        if path and not Path(path).is_file():
            raise ConfigError(f"distributed.{key}: {path} is not a readable file")
    options, unsupported = compat.distributed_options({
        "coordinator_bind_address": bind_address(config),
        **{key: getattr(config, key) or None for key in (*MTLS_FILES, "mtls_peer_uri_prefix")},
    })
    if unsupported:
        raise ConfigError(f"distributed.{unsupported[0]}: jax {jax.__version__} cannot take it (mutual TLS for the "
                          f"coordination service needs the default tier's jax)")
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=config.coordinator_address or None,
        num_processes=config.num_processes or None,
        process_id=None if config.process_id < 0 else config.process_id,
        initialization_timeout=max(1, int(config.timeout_s)),
        **compat.heartbeat_timeout(config.heartbeat_timeout_s),
        **options,
    )
    PreemptionNotice.reclaim()  # JAX's preemption service took SIGTERM: the command's notice takes it back


def bind_address(config: DistributedConfig) -> Optional[str]:
    """Where process 0's coordination service listens: `coordinator_bind_address` if set, else
    the coordinator's own address (the same host and port: the interface the peers reach it
    on). None leaves it to JAX (its JAX_COORDINATOR_BIND_ADDRESS variable, else every
    interface): when the address itself is left to JAX's cluster detection."""
    if config.coordinator_bind_address:
        return config.coordinator_bind_address
    if os.environ.get("JAX_COORDINATOR_BIND_ADDRESS"):
        return None
    return config.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS") or None


_FAILED = "jaxreplay/failed/"  # a process's one line for a failure its peers cannot see (a write failure)


def publish_failure(process_id: int, line: str) -> None:
    """Leaves `line` on the coordination service before this process exits, for its peers."""
    client = _jax_distributed.global_state.client
    if client is not None:
        client.key_value_set(f"{_FAILED}{process_id}", line)


def failure_of_a_peer(process_id: int, wait_s: float = 5.0) -> Optional[str]:
    """The line another process published before it exited (None if none did, or the service,
    on process 0, has gone), as 'process N <what>'. Waits at most `wait_s`."""
    client = _jax_distributed.global_state.client
    if client is None:
        return None
    found: list = []

    def read() -> None:
        with contextlib.suppress(Exception):
            found.extend(client.key_value_dir_get(_FAILED))

    reader = threading.Thread(target=read, daemon=True)  # the service may be gone: never wait on it for long
    reader.start()
    reader.join(wait_s)
    for key, line in sorted(found):
        peer = key.rsplit("/", 1)[-1]
        if peer != str(process_id):
            return f"process {peer} {line}"
    return None


class Coordinator:
    """Barriers and string messages between the processes of an initialized job."""

    def __init__(self, timeout_s: float):
        client = _jax_distributed.global_state.client
        if client is None:
            raise RuntimeError("jax.distributed is not initialized: call distributed.initialize first")
        self._client = client
        self._timeout_ms = max(1, int(timeout_s * 1000))
        self.timeout_s = timeout_s
        self.process_id = jax.process_index()
        self.num_processes = jax.process_count()
        self._gathered: list[str] = []  # this process's keys of the last `gather`

    @property
    def is_leader(self) -> bool:
        return self.process_id == 0

    @property
    def coordinator_host(self) -> str:
        """The host of process 0 as every process reaches it (the coordinator's address)."""
        return _jax_distributed.global_state.coordinator_address.rsplit(":", 1)[0]

    def barrier(self, name: str) -> None:
        """Returns once every process reached barrier `name` (use each name once)."""
        try:
            self._client.wait_at_barrier(f"jaxreplay/{name}", self._timeout_ms)
        except Exception as e:  # the client raises XlaRuntimeError(DEADLINE_EXCEEDED ...)
            raise TimeoutError(f"process {self.process_id}: barrier {name!r} not reached by all "
                               f"{self.num_processes} processes within {self._timeout_ms / 1000:g}s ({e})") from None

    def publish(self, key: str, value: str) -> None:
        """Makes `value` readable by every process as `key` (each key is set once)."""
        self._client.key_value_set(f"jaxreplay/{key}", value)

    def lookup(self, key: str) -> str:
        """The value some process published as `key`, waiting for it up to the timeout."""
        try:
            return self._client.blocking_key_value_get(f"jaxreplay/{key}", self._timeout_ms)
        except Exception as e:
            raise TimeoutError(f"process {self.process_id}: no value for {key!r} published within "
                               f"{self._timeout_ms / 1000:g}s ({e})") from None

    def gather(self, key: str, value: str) -> list[str]:
        """Every process's `value` for `key`, in process order (each key is used once).

        One write, one barrier, one read of the key's directory. The values live until
        the next `gather`, whose barrier proves that every process has read them, so a
        long run leaves no growing pile of keys on the coordinator.
        """
        mine = f"jaxreplay/{key}/{self.process_id}"
        self._client.key_value_set(mine, value)
        self.barrier(f"gather/{key}")
        for stale in self._gathered:
            self._client.key_value_delete(stale)
        self._gathered = [mine]
        entries = dict(self._client.key_value_dir_get(f"jaxreplay/{key}/"))
        values = [entries.get(f"jaxreplay/{key}/{i}") for i in range(self.num_processes)]
        if None in values:  # the barrier passed, so every process had written its value
            raise RuntimeError(f"gather {key!r}: no value from processes "
                               f"{[i for i, v in enumerate(values) if v is None]}")
        return values

    def broadcast(self, key: str, value: str | None) -> str:
        """Process 0's `value` on every process (others pass None)."""
        if self.is_leader:
            self.publish(key, value)
            return value
        return self.lookup(key)
