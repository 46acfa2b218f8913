"""Reverb beside current JAX: a Reverb server in a Python 3.11 sidecar process, behind `Backend`.

dm-reverb 0.14.0 runs only on Python 3.10/3.11 with TensorFlow 2.15 and numpy < 2, which
current JAX cannot share a process with. So where `reverb` is not importable, `serve`
starts sidecar_main.py under a Python that has it (`replay.reverb_python`, else
`.venv-sidecar` from `make venv-sidecar`, else one found as the Makefile finds Pythons)
and this class forwards every protocol call to it: Reverb's own server, selectors, rate
limiter and checkpoints, nothing re-implemented here. The sidecar imports this
checkout's own jaxreplay modules (a link to the package is its only path entry besides
its environment), so both sides always run the same code.

The wire (wire.py): JSON headers and raw array bytes over a Unix socket of mode 0600 in a
0700 directory; nothing new listens on a network. Reverb's gRPC port, inside the
sidecar, keeps its all-interfaces bind (docs/security.md).

Every call is bounded: the call's own timeout (insert, sample) or `timeout_s` (the rest)
plus `_GRACE_S`. A call still unanswered `_OVERDUE_S` past its own timeout is said in one
line on stderr (what it waits for, when it gives up); at the bound the hung sidecar is
killed at once (a polite `stop` would only wait on it again) and the call ends in
`ReplayTimeoutError`. A dead sidecar ends the call in `SidecarError` naming it.
`interrupted()` is checked every `WAIT_SLICE_S` while waiting; once true the sidecar is told
to stop waiting (`cancel`) and its `ReplayInterrupted` comes back. An insert of more rows than
the tables hold together is sent in parts: the sidecar refuses a larger message (sidecar_main).
"""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Mapping, Optional

import numpy as np

from jaxreplay import warn
from jaxreplay.config import ConfigError
from jaxreplay.replay import wire
from jaxreplay.replay.backend import SampleInfo
from jaxreplay.replay.ports import PortInUseError
from jaxreplay.replay.rows import RowLayout
from jaxreplay.replay.sidecar_main import PRIVATE_PREFIX, row_limit
from jaxreplay.replay.tables import (
    WAIT_SLICE_S, Interrupted, LimiterState, ReplayInterrupted, ReplayTimeoutError, Tables, TableSharedError)

SIDECAR_VENV = ".venv-sidecar"  # `make venv-sidecar`
INSTALL = ("run `make venv-sidecar` in the jaxreplay checkout (it needs a Python 3.11: `uv python install 3.11`), "
           "or set replay.reverb_python to a Python 3.10/3.11 with dm-reverb==0.14.0 and tensorflow-cpu==2.15.1")
_GRACE_S = 5.0  # past a call's own timeout, for the sidecar to answer it
_OVERDUE_S = 1.0  # past a call's own timeout, its answer is overdue: said once, on stderr
_START_S = 120.0  # importing TensorFlow and starting Reverb, on a busy machine
_PROBE = ("import sys, importlib.util as u, importlib.metadata as m\n"
          "ok = sys.version_info[:2] in ((3, 10), (3, 11)) and all(u.find_spec(x) for x in ('reverb', 'tensorflow', 'yaml'))\n"
          "print(m.version('dm-reverb') if ok else '')")
_ERRORS = {"ReplayTimeoutError": ReplayTimeoutError, "ReplayInterrupted": ReplayInterrupted,
           "TableSharedError": TableSharedError, "PortInUseError": PortInUseError,
           "FileNotFoundError": FileNotFoundError, "ValueError": ValueError, "KeyError": KeyError,
           "NotImplementedError": NotImplementedError}


class SidecarError(RuntimeError):
    """The Reverb sidecar could not start, died, or broke the wire: the run ends in one line (exit 2)."""

    kind = "error"


# --- finding its Python ---------------------------------------------------------------

def candidates() -> list[str]:
    """Pythons that may run the sidecar, in order: the sidecar venv and the Reverb lane's venv
    beside this checkout and in the working directory, then Python 3.11 as the Makefile finds it."""
    roots = dict.fromkeys([Path(__file__).resolve().parents[2], Path.cwd()])
    found = [str(root / venv / "bin" / "python") for root in roots for venv in (SIDECAR_VENV, ".venv-reverb")]
    found += [p for p in (shutil.which("python3.11"), shutil.which("python3.10")) if p]
    pyenv = os.environ.get("PYENV_ROOT") or os.path.expanduser("~/.pyenv")
    found += sorted(glob.glob(os.path.join(pyenv, "versions", "3.11.*", "bin", "python3.11")), reverse=True)
    if shutil.which("uv"):
        try:
            uv = subprocess.run(["uv", "python", "find", "--system", "3.11"], capture_output=True, text=True,
                                timeout=30)
            found += [uv.stdout.strip()] if uv.returncode == 0 and uv.stdout.strip() else []
        except (OSError, subprocess.TimeoutExpired):
            pass
    return [p for p in dict.fromkeys(found) if os.access(p, os.X_OK)]


@functools.cache
def reverb_version(python: str) -> str:
    """dm-reverb's version under `python` where it can run the sidecar, else ""."""
    try:
        probe = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True, timeout=60,
                               env={**os.environ, "PYTHONPATH": ""})
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return probe.stdout.strip() if probe.returncode == 0 else ""


def find_python(configured: str = "") -> tuple[str, str]:
    """(the Python that runs the sidecar, its dm-reverb version); `ConfigError` saying what to
    install where there is none."""
    if configured:
        if version := reverb_version(configured):
            return configured, version
        raise ConfigError(f"replay.reverb_python: {configured} cannot run the Reverb sidecar (it needs Python "
                          f"3.10/3.11 with dm-reverb, TensorFlow and PyYAML): {INSTALL}")
    for python in candidates():
        if version := reverb_version(python):
            return python, version
    raise ConfigError(f"replay.backend: reverb needs dm-reverb, which Python {sys.version_info.major}."
                      f"{sys.version_info.minor} cannot import, and no Python with it was found for its sidecar: "
                      f"{INSTALL}")


# --- the server -----------------------------------------------------------------------

class SidecarServer:
    """The `Backend` protocol served by Reverb in a sidecar process (see the module's docstring)."""

    def __init__(self, tables: Tables, *, python: str = "", port: int = 0,
                 checkpoint_root: Optional[str | os.PathLike] = None,
                 restore_from: Optional[str | os.PathLike] = None, timeout_s: float = 60.0,
                 connect: str = ""):
        """As `ReverbServer`; python: the sidecar's interpreter ("": `find_python`). connect: a
        Reverb server's host:port; the sidecar then holds only a Reverb client to it (the
        `Client` protocol: states, insert, sample, delete; `port` is None)."""
        self.python, self.reverb_version = find_python(python)
        self._timeout_s = timeout_s
        self._layout = RowLayout(tables.item_spec)
        self._max_rows = row_limit(tables.defs)  # per message: the sidecar refuses more
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[socket.socket] = []
        self._dir = tempfile.mkdtemp(prefix=PRIVATE_PREFIX)  # 0700; the sidecar removes it as it exits
        self._socket = os.path.join(self._dir, "s")
        self._proc = None
        self._stopped = False
        try:
            os.symlink(Path(__file__).resolve().parents[1], os.path.join(self._dir, "jaxreplay"))
            env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "XLA_", "JAX_"))}
            # Bytecode in a cache of its own: importing TensorFlow from source costs seconds each start.
            env.update(PYTHONPATH=self._dir, JAXREPLAY_NATIVE_LOG=os.environ.get("JAXREPLAY_NATIVE_LOG", "stderr"),
                       CUDA_VISIBLE_DEVICES="", TF_CPP_MIN_LOG_LEVEL="2",
                       PYTHONPYCACHEPREFIX=os.path.join(tempfile.gettempdir(), f"jaxreplay-sidecar-pycache-{os.getuid()}"))
            self._proc = subprocess.Popen(
                [self.python, "-m", "jaxreplay.replay.sidecar_main", self._socket, str(os.getpid())],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env, cwd=self._dir,
                start_new_session=True)  # Ctrl-C reaches the trainer, which then checkpoints through the sidecar
            self._await_ready()
            spec = [[k, list(shape), np.dtype(dtype).str] for k, (shape, dtype) in tables.item_spec.items()]
            defs = [dataclasses.asdict(d) for d in tables.defs]  # its row layout bounds each message (sidecar_main)
            if connect:
                reply, _ = self._call("connect", {"address": connect, "item_spec": spec, "table": tables.defs[0].name,
                                                  "defs": defs, "timeout_s": timeout_s}, timeout_s=_START_S)
            else:
                reply, _ = self._call("serve", {
                    "defs": defs, "item_spec": spec, "port": port,
                    "checkpoint_root": None if checkpoint_root is None else os.path.abspath(checkpoint_root),
                    "restore_from": None if restore_from is None else os.fspath(restore_from), "timeout_s": timeout_s,
                }, timeout_s=_START_S)
            self.port, self._table = reply["port"], reply["table"]
            self.sidecar_python = reply["python"]
        except BaseException:
            self.stop()
            raise

    @property
    def pid(self) -> int:
        return self._proc.pid

    def banner(self) -> str:
        """Which Reverb serves the tables, in one line."""
        return (f"dm-reverb {self.reverb_version} in a sidecar process (pid {self.pid}, Python {self.sidecar_python}, "
                f"{self.python}; Reverb's port {self.port})")

    # --- Backend ---

    @property
    def table(self) -> str:
        return self._table

    def states(self, interrupted: Interrupted = None) -> dict[str, LimiterState]:
        reply, _ = self._call("states", {}, timeout_s=self._timeout_s, interrupted=interrupted)
        return {k: LimiterState(**v) for k, v in reply["states"].items()}

    def insert(self, table: str, rows: Mapping[str, np.ndarray], priorities: np.ndarray, *,
               also: Optional[Mapping[str, np.ndarray]] = None, timeout_s: float,
               interrupted: Interrupted = None) -> None:
        n = len(priorities)
        if n > self._max_rows:  # more rows than one message may carry: in parts, within the one timeout
            deadline = time.monotonic() + timeout_s
            for start in range(0, n, self._max_rows):
                part = slice(start, start + self._max_rows)
                self.insert(table, {k: v[part] for k, v in rows.items()}, priorities[part],
                            also={t: m[part] for t, m in (also or {}).items()} or None,
                            timeout_s=max(deadline - time.monotonic(), 0.0), interrupted=interrupted)
            return
        arrays = {"packed": self._layout.pack(rows)} if n else {}  # one array, as Reverb stores it
        arrays["priorities"] = np.asarray(priorities, np.float64)
        arrays.update({f"also/{t}": np.asarray(m, bool) for t, m in (also or {}).items()})
        self._call("insert", {"table": table, "timeout_s": timeout_s}, arrays, timeout_s=timeout_s,
                   interrupted=interrupted)

    def sample(self, table: str, n: int, *, timeout_s: float, interrupted: Interrupted = None,
               known: Optional[LimiterState] = None) -> tuple[dict[str, np.ndarray], SampleInfo]:
        header = {"table": table, "n": int(n), "timeout_s": timeout_s,
                  "known": None if known is None else dataclasses.asdict(known)}
        _, arrays = self._call("sample", header, timeout_s=timeout_s, interrupted=interrupted)
        batch = self._layout.unpack(arrays["packed"])
        info = SampleInfo(**{f: arrays[f"info/{f}"] for f in SampleInfo._fields})
        return batch, info

    def delete(self, table: str, keys: np.ndarray) -> None:
        self._call("delete", {"table": table}, {"keys": np.asarray(keys, np.uint64)}, timeout_s=self._timeout_s)

    def describe(self) -> str:
        return self._call("describe", {}, timeout_s=self._timeout_s)[0]["text"]

    def evict(self, table: str, below_version: int) -> int:
        raise NotImplementedError("replay.max_age needs replay.backend=inprocess: Reverb reports no item keys "
                                  "at insert, so its stale items could only be found by sampling them")

    def checkpoint(self) -> str:
        """As `Backend.checkpoint`: Reverb writes it under `checkpoint_root`, from the sidecar."""
        return self._call("checkpoint", {}, timeout_s=self._timeout_s)[0]["name"]

    def prune(self, keep: set[str]) -> list[str]:
        return self._call("prune", {"keep": sorted(keep)}, timeout_s=self._timeout_s)[0]["removed"]

    def admits(self, table: str, what: str, k: int) -> bool:
        """Reverb's own C++ limiter's answer on the live table: may `k` items be inserted or
        sampled (`what`)? The differential tests compare the in-process limiter with it."""
        return self._call("admits", {"table": table, "what": what, "k": int(k)}, timeout_s=self._timeout_s)[0]["admits"]

    def stop(self) -> None:
        """Stops Reverb and ends the sidecar (killed if it does not end in time); idempotent."""
        if self._stopped:
            return
        self._stopped = True
        proc = self._proc
        if proc is not None and proc.poll() is None:
            try:
                self._call("stop", {}, timeout_s=min(self._timeout_s, 30.0), stopping=True)
            except Exception:  # noqa: BLE001 - a dead or hung sidecar is killed below
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if proc is not None and proc.stdout is not None:
            proc.stdout.close()
        with self._lock:
            for conn in self._connections:
                conn.close()
            self._connections.clear()
        shutil.rmtree(self._dir, ignore_errors=True)

    def close(self) -> None:
        """As `ReverbClient.close` (a sidecar in client mode): ends the sidecar."""
        self.stop()

    def __enter__(self) -> "SidecarServer":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- the wire ---

    def _await_ready(self) -> None:
        """Waits for the sidecar's "ready" line, or says in one line why it did not come."""
        deadline = time.monotonic() + _START_S
        out = self._proc.stdout
        while time.monotonic() < deadline:
            if select.select([out], [], [], WAIT_SLICE_S)[0]:
                line = out.readline().decode(errors="replace").strip()
                if line == "ready":
                    return
                if line:
                    raise SidecarError(f"the Reverb sidecar ({self.python}) could not start: {line}; {INSTALL}")
            if self._proc.poll() is not None:
                raise SidecarError(f"the Reverb sidecar ({self.python}) exited with {self._exit_status()} before it "
                                   f"was ready (its stderr is in the run's native.log); {INSTALL}")
        raise SidecarError(f"the Reverb sidecar ({self.python}) was not ready within {_START_S:g}s")

    def _connection(self) -> socket.socket:
        """This thread's connection (each thread has its own; the first made is the control one)."""
        conn = getattr(self._local, "conn", None)
        if conn is None:
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.settimeout(self._timeout_s)
            try:
                conn.connect(self._socket)
            except OSError as e:
                conn.close()
                raise self._dead("connect") from e
            conn.settimeout(None)
            with self._lock:
                self._connections.append(conn)
            self._local.conn = conn
        return conn

    def _drop(self, conn: socket.socket) -> None:
        """Forgets a connection whose state is unknown (a call on it timed out or failed)."""
        self._local.conn = None
        with self._lock:
            if conn in self._connections and len(self._connections) > 1:  # the control one ends the sidecar
                self._connections.remove(conn)
                conn.close()

    def _call(self, op: str, header: dict, arrays: Optional[dict] = None, *, timeout_s: float,
              interrupted: Interrupted = None, stopping: bool = False) -> tuple[dict, dict]:
        if self._stopped and not stopping:
            raise SidecarError(f"the Reverb sidecar was stopped ({op} after stop)")
        conn = self._connection()
        start = time.monotonic()
        overdue, deadline = start + timeout_s + _OVERDUE_S, start + timeout_s + _GRACE_S
        cancelled, said = [], []

        def waiting() -> None:
            if self._proc.poll() is not None:
                raise self._dead(op)
            if not cancelled and interrupted is not None and interrupted():
                wire.send(conn, {"op": "cancel"})
                cancelled.append(True)
            if not said and time.monotonic() >= overdue:
                said.append(True)
                left = deadline - time.monotonic()
                until = time.strftime("%H:%M:%S", time.localtime(time.time() + left))
                warn(f"the Reverb sidecar (pid {self._proc.pid}) has not answered {op} within its {timeout_s:g}s; "
                     f"waiting {left:.1f}s more (until {until}), then it is killed as hung")

        try:
            wire.send(conn, {"op": op, **header}, arrays)
            reply, out = wire.recv(conn, deadline, waiting, WAIT_SLICE_S)
        except TimeoutError:
            self._drop(conn)
            self._kill()
            raise ReplayTimeoutError(f"the Reverb sidecar (pid {self._proc.pid}) did not answer {op} within "
                                     f"{timeout_s + _GRACE_S:g}s (hung?); it was killed") from None
        except OSError as e:  # wire.WireError included: the sidecar closed the connection
            self._drop(conn)
            raise self._dead(op) from e
        if reply.get("ok"):
            return reply, out
        kind, message = reply.get("error", "Exception"), reply.get("message", "")
        if kind in _ERRORS:
            raise _ERRORS[kind](message)
        raise SidecarError(f"the Reverb sidecar failed in {op}: {kind}: {message}")

    def _kill(self) -> None:
        """Ends a hung sidecar at once: SIGKILL reaches a stopped process too."""
        if self._proc.poll() is None:
            self._proc.kill()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass

    def _dead(self, op: str) -> SidecarError:
        try:
            self._proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            pass
        return SidecarError(f"the Reverb sidecar (pid {self._proc.pid}, {self.python}) "
                            f"{'exited with ' + self._exit_status() if self._proc.poll() is not None else 'broke its connection'}"
                            f" during {op}; the run's last checkpoint resumes it")

    def _exit_status(self) -> str:
        code = self._proc.returncode
        if code is not None and code < 0:
            return f"signal {signal.Signals(-code).name}"
        return f"code {code}"
