"""Claiming a TCP port for a replay server (Reverb's; the in-process one has no port).

Reverb listens on all interfaces without authentication (`reverb.Server` takes no bind
address): who can reach the port is the deployment's business. gRPC binds it with
SO_REUSEPORT, so a second server on a port in use would bind too and share its clients
with the first; a pinned port is therefore claimed first (`PortClaim`).
"""

from __future__ import annotations

import errno
import os
import socket
import tempfile
from typing import Optional

from jaxreplay.config import ConfigError


class PortInUseError(ConfigError):
    """`replay.port` is held by another jaxreplay run, or something else listens on it: a port
    taken, as a run dir's lock can be, is an error, not a config error (the config is sound)."""

    kind = "error"


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
