"""The Reverb sidecar process: Reverb's own server and client (reverb_backend.py) serving one
trainer the Backend protocol over a Unix socket, in a Python 3.10/3.11 environment with
dm-reverb and no JAX (`make venv-sidecar`). sidecar.py starts it and is its only client:

    python -m jaxreplay.replay.sidecar_main SOCKET_PATH PARENT_PID

The socket is bound with mode 0600 in the trainer's private (0700) directory. Each of the
trainer's threads holds a connection of its own (requests on one are answered in order);
the first is the control connection, whose close ends the sidecar. So does the trainer's
death (its parent pid changes: `kill -9` leaves no orphan server or port), and `stop`.
A call waits in Reverb's slices; a byte arriving on its connection meanwhile (the trainer's
`cancel`, or its close) is its `interrupted()`. Terminal signals go to the trainer alone
(own session), and SIGINT and SIGTERM sent here are ignored: a preemption (a Spot VM's
shutdown, `systemctl stop`, Slurm's `scancel`) signals every process at once, and the trainer
then saves its final checkpoint through this process, which must outlive it.

Each message is bounded before it is read (`Sidecar.limits`): until `serve` gives the row
layout, a control message's few bytes; then the rows all tables hold together, with their
priorities and table masks. A larger one is refused in one line on stderr and its connection
closed. On its way out the sidecar removes its private directory (the trainer's
`jaxreplay-sidecar-*`), also when the trainer was killed and could not.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import signal
import socket
import sys
import threading
import time

import numpy as np

from jaxreplay.replay import wire
from jaxreplay.replay.rows import RowLayout
from jaxreplay.replay.tables import LimiterState, RateLimit, TableDef, Tables

_PARENT_POLL_S = 0.2
PRIVATE_PREFIX = "jaxreplay-sidecar-"  # the trainer's private directory, which holds the socket


def row_limit(defs) -> int:
    """The most rows one message may carry: what the tables hold together (an insert of more
    would evict its own rows; the trainer sends larger ones in parts)."""
    return sum(d.max_size for d in defs)


def message_limits(defs, layout: RowLayout) -> tuple[int, int]:
    """(header, payload) bytes a message may declare once the tables are known: `row_limit` rows,
    each with its priority (8 bytes) or key (8) and a mask byte per table."""
    return wire.CONTROL_BYTES, row_limit(defs) * (layout.nbytes + 8 + len(defs))


class Sidecar:
    """The one ReverbServer this process hosts, and the calls that reach it."""

    def __init__(self):
        self.server = None
        self.done = threading.Event()
        self.limits = (wire.CONTROL_BYTES, 0)  # control messages alone, until serve or connect

    def call(self, op: str, h: dict, arrays: dict, interrupted) -> tuple[dict, dict]:
        if op == "serve":
            return self._serve(h)
        if op == "connect":
            return self._connect(h)
        s = self.server
        if s is None:
            raise RuntimeError(f"{op} before serve")
        if op == "states":
            return {"states": {k: dataclasses.asdict(v) for k, v in s.states(interrupted).items()}}, {}
        if op == "insert":  # rows packed by the trainer (rows.py), as Reverb stores them
            also = {k[5:]: v for k, v in arrays.items() if k.startswith("also/")}
            s.insert_packed(h["table"], arrays.get("packed"), arrays["priorities"], also=also or None,
                            timeout_s=h["timeout_s"], interrupted=interrupted)
            return {}, {}
        if op == "sample":  # rows left packed, for the trainer to unpack
            known = h.get("known")
            packed, info = s.sample_packed(h["table"], h["n"], timeout_s=h["timeout_s"], interrupted=interrupted,
                                           known=None if known is None else LimiterState(**known))
            out = {"packed": packed, **{f"info/{k}": np.asarray(v) for k, v in info._asdict().items()}}
            return {}, out
        if op == "delete":
            s.delete(h["table"], arrays["keys"])
            return {}, {}
        if op == "describe":
            return {"text": s.describe()}, {}
        if op == "checkpoint":
            return {"name": s.checkpoint()}, {}
        if op == "prune":
            return {"removed": s.prune(set(h["keep"]))}, {}
        if op == "admits":  # Reverb's own C++ limiter on the live table (the differential tests)
            table = next(t for t in s.reverb_tables if t.name == h["table"])
            can = table.can_insert if h["what"] == "insert" else table.can_sample
            return {"admits": bool(can(h["k"]))}, {}
        if op == "stop":
            self.stop()
            return {}, {}
        raise ValueError(f"unknown sidecar call {op!r}")

    def _serve(self, h: dict) -> tuple[dict, dict]:
        from importlib.metadata import version

        from jaxreplay.replay.reverb_backend import ReverbServer
        if self.server is not None:
            raise RuntimeError("serve called twice")
        defs = tuple(TableDef(**{**d, "rate_limit": RateLimit(**d["rate_limit"])}) for d in h["defs"])
        spec = {name: (tuple(shape), np.dtype(dtype)) for name, shape, dtype in h["item_spec"]}
        layout = RowLayout(spec)  # a spec that cannot be laid out is refused here, before Reverb starts
        self.server = ReverbServer(Tables("reverb", defs, spec), port=h["port"], timeout_s=h["timeout_s"],
                                   checkpoint_root=h["checkpoint_root"], restore_from=h["restore_from"])
        self.limits = message_limits(defs, layout)
        return {"port": self.server.port, "table": self.server.table, "reverb": version("dm-reverb"),
                "python": sys.version.split()[0]}, {}

    def _connect(self, h: dict) -> tuple[dict, dict]:
        """Only a Reverb client, to a server elsewhere (`h["address"]`): the sidecar's client mode,
        measured for multi-host jobs (benchmarks/replay_remote.py)."""
        from importlib.metadata import version

        from jaxreplay.replay.reverb_backend import ReverbClient
        if self.server is not None:
            raise RuntimeError("connect after serve or connect")
        spec = {name: (tuple(shape), np.dtype(dtype)) for name, shape, dtype in h["item_spec"]}
        defs = tuple(TableDef(**{**d, "rate_limit": RateLimit(**d["rate_limit"])}) for d in h["defs"])
        self.server = ReverbClient(h["address"], spec, timeout_s=h["timeout_s"])
        self.limits = message_limits(defs, RowLayout(spec))
        return {"port": None, "table": h["table"], "reverb": version("dm-reverb"),
                "python": sys.version.split()[0]}, {}

    def stop(self) -> None:
        if self.server is not None:
            getattr(self.server, "stop", self.server.close)()  # a server stops; a client closes
            self.server = None
        self.done.set()


def serve_connection(sidecar: Sidecar, conn: socket.socket, control: bool) -> None:
    """Answers `conn`'s requests in order until it closes; the control connection's close ends the sidecar."""
    try:
        while not sidecar.done.is_set():
            try:
                header, arrays = wire.recv(conn, waiting=lambda: sidecar.done.is_set() and _raise_closed(),
                                           limits=sidecar.limits)
            except wire.TooLarge as e:
                print(f"jaxreplay sidecar: refused {e}; closing that connection", file=sys.stderr, flush=True)
                try:
                    wire.send(conn, {"ok": False, "error": "MessageTooLarge", "message": str(e)})
                except OSError:
                    pass
                return
            except (wire.WireError, OSError):
                return
            op = header.get("op")
            if op == "cancel":  # arrived after its call had ended
                continue
            try:
                reply, out = sidecar.call(op, header, arrays, interrupted=lambda: wire.readable(conn))
                wire.send(conn, {"ok": True, **reply}, out)
            except Exception as e:  # noqa: BLE001 - the trainer raises it again
                try:
                    wire.send(conn, {"ok": False, "error": type(e).__name__, "message": str(e)})
                except OSError:
                    return
    finally:
        conn.close()
        if control:
            sidecar.done.set()


def _raise_closed():
    raise wire.WireError("the sidecar is stopping")


def main(argv: list[str]) -> int:
    path, parent = argv[0], int(argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the trainer's final save goes through this process
    sidecar = Sidecar()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    mask = os.umask(0o177)
    try:
        listener.bind(path)  # mode 0600
    finally:
        os.umask(mask)
    listener.listen(8)
    listener.settimeout(_PARENT_POLL_S)
    print("ready", flush=True)
    connections = 0
    try:
        while not sidecar.done.is_set() and os.getppid() == parent:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            conn.setblocking(True)
            threading.Thread(target=serve_connection, args=(sidecar, conn, connections == 0),
                             name=f"sidecar-conn-{connections}", daemon=True).start()
            connections += 1
    finally:
        listener.close()
        try:
            os.unlink(path)
        except OSError:
            pass
        sidecar.stop()
        private = os.path.dirname(os.path.abspath(path))
        if os.path.basename(private).startswith(PRIVATE_PREFIX):
            shutil.rmtree(private, ignore_errors=True)  # its link to the package included: nothing is imported after
    return 0


if __name__ == "__main__":
    # A Python whose numpy cannot run Reverb fails on import above; anything else is said on stdout's one line.
    try:
        code = main(sys.argv[1:])
    except BaseException as e:  # noqa: BLE001 - the trainer reads this line
        print(f"error {type(e).__name__}: {e}", flush=True)
        code = 2
    sys.stdout.flush()
    os._exit(code)  # daemon threads may still sit in Reverb's C++ calls
