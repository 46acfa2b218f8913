"""Ways a training run stops on purpose: a stop signal, or updates that stay non-finite.

Both leave the run resumable by the same command. A stop signal (SIGTERM, a
preemption notice; SIGINT, Ctrl-C) is turned into a flag that the run reads between
its moves, so the final checkpoint is written from the loop's own thread, never from
inside a half-done step, and no KeyboardInterrupt lands inside a library (XLA's gc
callback swallows one). A second SIGTERM changes nothing (the save goes on); a
second Ctrl-C aborts at once, leaving the latest complete checkpoint the latest. A
streak of skipped non-finite updates stops the run without writing another
checkpoint; as skipped updates leave params and optimizer state as they were, every
checkpoint holds good ones.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import signal
import socket
import sys
import threading
from typing import Callable, Optional

from jaxreplay import error_line

# The exit status and the word of the one line each stop signal ends a command with.
EXIT_CODE = {signal.SIGTERM: 128 + signal.SIGTERM, signal.SIGINT: 128 + signal.SIGINT}
KIND = {signal.SIGTERM: "stopped", signal.SIGINT: "interrupted"}


class Preempted(Exception):
    """A stop signal arrived; the run saved a final checkpoint where it had trained anything,
    and stopped. `signum`: the signal (the exit status is 128 + it)."""

    def __init__(self, message: str, signum: int = signal.SIGTERM):
        super().__init__(message)
        self.signum = signal.Signals(signum)

    @property
    def exit_code(self) -> int:
        return EXIT_CODE[self.signum]

    @property
    def kind(self) -> str:
        """The word of the command's last line: `jaxreplay: stopped: ...` or `jaxreplay: interrupted: ...`."""
        return KIND[self.signum]


class NonFiniteError(RuntimeError):
    """Too many consecutive learner steps had a non-finite loss, gradient or update."""


_process: Optional["PreemptionNotice"] = None  # the notice the command installed for the whole process
_open: list["PreemptionNotice"] = []  # notices whose handlers are installed, oldest first
_aborting = threading.Lock()  # held by the one `abort` that ends the process
_agreements = itertools.count()  # names each multi-process agreement; every process counts alike


class PreemptionNotice:
    """Turns stop signals into a flag (`is_set()`, `signum`) until `close()` puts the previous
    handlers back.

    `signals`: SIGTERM alone by default (a library call leaves Ctrl-C to its caller); the
    CLI takes SIGINT too, with `abort_on_second_sigint`, and installs its notice for the
    whole process (`for_process`), so that no stage, teardown included, is left with a
    signal's default action. A notice made while that one is open shares it, and its
    `close()` leaves it open. Outside the main thread signals cannot be caught: the flag
    then never rises and the signals keep their previous meaning."""

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM,), abort_on_second_sigint: bool = False):
        self._shared = _process
        self._previous: dict[int, object] = {}
        if self._shared is not None:
            return
        self._event = threading.Event()
        self._lock = threading.RLock()  # a handler may interrupt another on the main thread
        self._signum: Optional[signal.Signals] = None
        self._signals, self._abort, self._calls = set(signals), abort_on_second_sigint, 0
        self._wakeup: Optional[tuple[socket.socket, socket.socket]] = None
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._previous[s] = signal.signal(s, self._receive)
            _open.append(self)
            if abort_on_second_sigint:
                self._watch_deliveries()

    def _watch_deliveries(self) -> None:
        """Python runs a handler only between bytecodes of the main thread, which may spend minutes
        in one native call (an XLA compile); the interpreter also writes each signal's number to a
        wakeup fd as it arrives, so a thread reading it sees every delivery at once."""
        reader, writer = socket.socketpair()
        writer.setblocking(False)
        if signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False) != -1:  # another's: left to it
            signal.set_wakeup_fd(-1)
            reader.close()
            writer.close()
            return
        self._wakeup = (reader, writer)
        threading.Thread(target=self._watch, args=(reader,), name="jaxreplay-signals", daemon=True).start()

    def _watch(self, reader: socket.socket) -> None:
        seen = 0  # deliveries read so far: a lower bound of the signals received, never a double count
        while True:
            try:
                data = reader.recv(64)
            except OSError:
                return
            if not data:
                return
            for signum in data:
                if signum in self._signals:
                    self._note(signum, earlier=seen)
                    seen += 1

    def _receive(self, signum: int, frame=None) -> None:
        """The Python handler (the main thread, between bytecodes; it may see two deliveries as one)."""
        self._calls += 1
        self._note(signum, earlier=self._calls - 1)

    def _note(self, signum: int, earlier: int) -> None:
        with self._lock:
            if self._signum is None:
                self._signum = signal.Signals(signum)
        self._event.set()
        if earlier and signum == signal.SIGINT and self._abort:
            abort(f"Ctrl-C again after {describe(self._signum)}: aborted without waiting for the checkpoint; "
                  "the latest complete checkpoint stays the latest, and the same command resumes from it")

    @classmethod
    def for_process(cls) -> "PreemptionNotice":
        """The command's notice: SIGTERM and SIGINT, kept until the process exits."""
        global _process
        if _process is None:
            _process = cls((signal.SIGTERM, signal.SIGINT), abort_on_second_sigint=True)
            atexit.unregister(_ignore_sigterm_at_exit)
            atexit.register(_ignore_sigterm_at_exit)
        return _process

    @classmethod
    def reclaim(cls) -> None:
        """Installs the process notice's handlers again, after a library took a signal for itself
        (`jax.distributed.initialize`: JAX's preemption service sets a flag of its own on SIGTERM,
        which nothing here reads, and the run would go on)."""
        if _process is not None:
            for s in _process._previous:
                signal.signal(s, _process._receive)

    @classmethod
    def release_process(cls) -> None:
        """Puts back the handlers `for_process` replaced: for a command run in-process (tests)."""
        global _process
        notice, _process = _process, None
        if notice is not None:
            notice.close()

    def is_set(self) -> bool:
        return self._shared.is_set() if self._shared is not None else self._event.is_set()

    @property
    def signum(self) -> Optional[signal.Signals]:
        """The first stop signal received, if any."""
        return self._shared.signum if self._shared is not None else self._signum

    def close(self) -> None:
        if self._shared is not None or self is _process:
            return
        for s, previous in self._previous.items():
            signal.signal(s, previous)
        self._previous = {}
        if self._wakeup is not None:
            signal.set_wakeup_fd(-1)
            reader, writer = self._wakeup
            with contextlib.suppress(OSError):
                reader.shutdown(socket.SHUT_RDWR)  # ends the watcher's recv
            reader.close()
            writer.close()
            self._wakeup = None
        if self in _open:
            _open.remove(self)


def _ignore_sigterm_at_exit() -> None:
    """The interpreter's shutdown puts every Python handler back to the default action, which for
    SIGTERM kills the process (status -15) while it tears down; by then the exit status is decided,
    so later SIGTERMs are ignored. atexit hooks run last-registered first: this one, registered
    when the command starts, runs after the others, just before that reset."""
    if _process is not None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


def describe(signum: Optional[int]) -> str:
    """How a line names the signal: `SIGTERM`, `SIGINT (Ctrl-C)`."""
    if signum is None:
        return "no signal"
    return "SIGINT (Ctrl-C)" if signum == signal.SIGINT else signal.Signals(signum).name


def abort(why: str) -> None:
    """Ends the process at once with exit status 130 and one line: no cleanup, no traceback.
    What was written stays (every checkpoint is renamed into place only when whole). Of two
    callers at once (the handler and the wakeup-fd thread, seeing the same Ctrl-C), one acts."""
    if not _aborting.acquire(blocking=False):
        return
    with contextlib.suppress(Exception):
        sys.stdout.flush()
    with contextlib.suppress(Exception):
        clear = "\r\x1b[K" if sys.stderr.isatty() else ""  # a progress bar's half-drawn line, on a terminal
        sys.stderr.write(clear + error_line("interrupted", why) + "\n")
        sys.stderr.flush()
    os._exit(EXIT_CODE[signal.SIGINT])


def pending() -> Optional[signal.Signals]:
    """The first stop signal an open notice holds, if any: what the stages poll between steps."""
    return next((n.signum for n in _open if n.signum is not None), None)


def stop_poll(coordinator=None) -> Callable[[], Optional[signal.Signals]]:
    """What a stage (warm start, evaluation) calls between its steps: the stop signal pending.
    Given the job's `distributed.Coordinator`, it is every process's, agreed through JAX's
    coordination service, so all stop at the same step: every process must then call it at
    the same points, as SPMD code does."""
    if coordinator is None:
        return pending
    return lambda: agreed(coordinator.gather(f"notice/{next(_agreements)}", str(int(pending() or 0))))


def agreed(signals: list[str]) -> Optional[signal.Signals]:
    """The signal every process stops for: the first process's (in process order) that has one."""
    return next((signal.Signals(int(s)) for s in signals if int(s)), None)


class NonFiniteStreak:
    """Counts consecutive skipped (non-finite) updates; raises at `limit` in a row."""

    def __init__(self, limit: int):
        self.limit = limit
        self.streak = 0

    def update(self, nonfinite: bool, step: int) -> None:
        self.streak = self.streak + 1 if nonfinite else 0
        if self.streak >= self.limit:
            raise NonFiniteError(
                f"{self.streak} consecutive learner steps (up to step {step}) had a non-finite loss, gradient or "
                f"update and were skipped (train.max_nonfinite_steps={self.limit}); the checkpoints hold the last good "
                "params: lower train.learning_rate or check the rewards before resuming")
