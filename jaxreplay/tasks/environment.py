"""Multi-turn environments: the protocol an environment answers the policy through, and the
registry a config names one from.

An episode is `reset(item, seed)` (the first observation), then one `step(turn_text)` per model
turn until a `Step` says `done`. Environments are plain Python objects: they may block (a tool, a
sandbox, a game engine), so the rollout stage runs their steps off the decode loop with a timeout.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import multiprocessing
import multiprocessing.connection
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Protocol, Sequence


@dataclass(frozen=True)
class Message:
    """One message the environment says: the chat format renders it into tokens."""

    role: str  # "system" | "user" | "tool"
    content: str
    name: Optional[str] = None  # the tool's name, for role "tool"


# The values of Step.info["error"] the rollout stage counts in metrics.
STEP_ERRORS = ("exception", "timeout", "malformed_tool_call")


@dataclass(frozen=True)
class Step:
    """The environment's answer to one model turn."""

    observation: tuple[Message, ...] = ()  # what the environment says next; () when done
    reward: float = 0.0
    done: bool = False
    info: Mapping[str, Any] = field(default_factory=dict)  # info["error"] in STEP_ERRORS is counted in metrics


class Environment(Protocol):
    def reset(self, item: Any, seed: int) -> tuple[Message, ...]:
        """The episode's first observation for task item `item`; `seed` fixes any randomness."""
        ...

    def step(self, turn_text: str) -> Step:
        """The answer to the model's decoded turn (its text is for the environment only, never trained)."""
        ...


_ENVIRONMENTS: dict[str, Callable[..., Environment]] = {}


def register_environment(name: str, factory: Callable[..., Environment]) -> None:
    """Makes `name` available to configs; `factory(**options)` returns a fresh environment."""
    if name in _ENVIRONMENTS and _ENVIRONMENTS[name] is not factory:
        raise ValueError(f"environment {name!r} is already registered")
    _ENVIRONMENTS[name] = factory


def environment_names() -> tuple[str, ...]:
    return tuple(sorted(_ENVIRONMENTS))


def make_environment(name: str, options: Optional[Mapping[str, Any]] = None) -> Environment:
    """A fresh environment `name` (see `resolve`), built with the config's options."""
    return resolve(name)(**dict(options or {}))


# -- names a config can give ----------------------------------------------------------------------

# Environments shipped with the package, imported (and so registered) when first named.
BUILTIN = {"guess_digit": "jaxreplay.tasks.guess", "calculator": "jaxreplay.tasks.tools",
           "skyrl": "jaxreplay.tasks.skyrl_env", "guess_number": "jaxreplay.tasks.guess_number"}


def resolve(name: str) -> Callable[..., Environment]:
    """The factory `name` names: a registered name, a shipped one (imported on first use), or
    `package.module:factory` (imported; how a worker process finds a user's environment)."""
    if name not in _ENVIRONMENTS and name in BUILTIN:
        importlib.import_module(BUILTIN[name])
    if name not in _ENVIRONMENTS and ":" in name:
        module, _, attr = name.partition(":")
        try:
            return getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"environment {name!r}: cannot import it ({e})") from None
    if name not in _ENVIRONMENTS:
        known = ", ".join(sorted(set(BUILTIN) | set(_ENVIRONMENTS)))  # the shipped ones register on first use
        raise ValueError(f"unknown environment {name!r}: known names are {known}, or give package.module:factory "
                         f"(e.g. mypkg.envs:MyEnv)")
    return _ENVIRONMENTS[name]


# -- the worker pool ------------------------------------------------------------------------------


def _error_step(kind: str, detail: str = "") -> Step:
    """What an episode gets when its environment raised or timed out: it ends there."""
    return Step(observation=(), reward=0.0, done=True, info={"error": kind, "detail": detail})


def _call(env: Environment, method: str, args: tuple) -> Any:
    out = getattr(env, method)(*args)
    if method == "reset":
        out = tuple(out)
        if not all(isinstance(m, Message) for m in out):
            raise TypeError(f"reset returned {out!r}, not Messages")
    elif not isinstance(out, Step):
        raise TypeError(f"step returned {type(out).__name__}, not a Step")
    return out


class EnvPool:
    """Environment instances and the workers that run their steps, off the decode loop.

    `workers` 0: every call runs at once in the caller's thread (deterministic, no timeout: for
    zero-latency environments and tests). Threads (`processes` False): steps run in `workers`
    threads; one past `timeout` seconds ends its episode with info error "timeout", but the
    thread cannot be killed, so an environment that may block forever belongs in processes.
    Processes: `workers` spawned processes, each instance living on one of them (id % workers),
    so a stateful environment keeps its state; a step past its timeout kills its process, which
    is restarted, and every instance it held ends its episode with "timeout". An exception
    ends the episode with info error "exception". Nothing here raises for what an environment does.
    """

    def __init__(self, name: str, options: Optional[Mapping[str, Any]] = None, *, workers: int = 0,
                 processes: bool = False, timeout: float = 30.0):
        if workers < 0 or timeout <= 0:
            raise ValueError(f"workers ({workers}) must be >= 0 and timeout ({timeout}) positive")
        self.name, self.options = name, dict(options or {})
        self.workers, self.processes, self.timeout = workers, bool(processes and workers), float(timeout)
        self._next_id = 0
        self._done: list[tuple[int, Step]] = []
        if self.processes:
            self._procs = [_Worker(name, self.options) for _ in range(workers)]
        else:
            self._factory = resolve(name)
            self._envs: dict[int, Environment] = {}
            self._pending: dict[int, tuple[concurrent.futures.Future, float]] = {}
            self._executor = (concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="env")
                              if workers else None)

    def create(self) -> int:
        """A new instance's id (built where it will run, at its first reset)."""
        self._next_id += 1
        return self._next_id - 1

    def reset(self, ids: Sequence[int], item: Any, seed: int) -> list[Optional[tuple[Message, ...]]]:
        """reset(item, seed) on every instance in `ids`, waiting (each call within the timeout):
        their first observations, None where it raised or timed out."""
        if self.processes:
            return self._procs_call([(i, "reset", (item, seed)) for i in ids])
        out: list[Optional[tuple[Message, ...]]] = []
        for i in ids:
            env = self._envs[i] = self._factory(**self.options)
            if self._executor is None:
                try:
                    out.append(_call(env, "reset", (item, seed)))
                except Exception:  # noqa: BLE001 - an environment's failure ends its episode, counted
                    out.append(None)
                continue
            future = self._executor.submit(_call, env, "reset", (item, seed))
            try:
                out.append(future.result(timeout=self.timeout))
            except Exception:  # noqa: BLE001 - raised or timed out (the thread is left to finish)
                out.append(None)
        return out

    def step(self, env_id: int, text: str) -> None:
        """Starts step(text) on instance `env_id`; its Step comes back from `results`."""
        if self.processes:
            self._procs[env_id % len(self._procs)].send(env_id, "step", (text,))
        elif self._executor is None:
            try:
                step = _call(self._envs[env_id], "step", (text,))
            except Exception as e:  # noqa: BLE001
                step = _error_step("exception", f"{type(e).__name__}: {e}")
            self._done.append((env_id, step))
        else:
            self._pending[env_id] = (self._executor.submit(_call, self._envs[env_id], "step", (text,)),
                                     time.monotonic())

    def results(self, wait: float = 0.0) -> list[tuple[int, Step]]:
        """Steps finished since the last call, waiting up to `wait` seconds for the first one
        when none has; steps past their timeout come back as info error "timeout"."""
        deadline = time.monotonic() + wait
        while True:
            if self.processes:
                for w in self._procs:
                    self._done.extend((env_id, value) for env_id, _, value in w.poll(self.timeout))
            elif self._executor is not None:
                now = time.monotonic()
                for env_id, (future, started) in list(self._pending.items()):
                    if future.done():
                        e = future.exception()
                        step = future.result() if e is None else _error_step("exception", f"{type(e).__name__}: {e}")
                    elif now - started > self.timeout:
                        step = _error_step("timeout", f"step took over {self.timeout:g} s")
                        self._envs.pop(env_id, None)  # its thread may never come back: the instance is dropped
                    else:
                        continue
                    del self._pending[env_id]
                    self._done.append((env_id, step))
            if self._done or time.monotonic() >= deadline:
                out, self._done = self._done, []
                return out
            if self.processes:
                _wait_any([w for w in self._procs], min(0.05, max(0.0, deadline - time.monotonic())))
            else:
                pending = [f for f, _ in self._pending.values()]
                concurrent.futures.wait(pending, timeout=min(0.05, max(0.0, deadline - time.monotonic())),
                                        return_when=concurrent.futures.FIRST_COMPLETED) if pending else \
                    time.sleep(max(0.0, min(0.05, deadline - time.monotonic())))

    def busy(self) -> int:
        """Steps started and not yet returned by `results`."""
        if self.processes:
            return sum(len(w.pending) for w in self._procs) + len(self._done)
        return len(self._pending) + len(self._done)

    def close(self, env_id: int) -> None:
        """Drops instance `env_id` (its episode is over)."""
        if self.processes:
            self._procs[env_id % len(self._procs)].send(env_id, "close", (), reply=False)
        else:
            self._envs.pop(env_id, None)

    def shutdown(self) -> None:
        if self.processes:
            for w in self._procs:
                w.stop()
        elif self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)

    def _procs_call(self, calls: Sequence[tuple[int, str, tuple]]) -> list:
        """Synchronous calls on the worker processes (resets): each result, None on failure."""
        for env_id, method, args in calls:
            self._procs[env_id % len(self._procs)].send(env_id, method, args)
        out = {}
        while len(out) < len(calls):
            for w in self._procs:
                for env_id, method, value in w.poll(self.timeout):
                    if method == "reset":
                        out[env_id] = value
                    else:  # a step of another instance on the same worker
                        self._done.append((env_id, value))
            if len(out) < len(calls):
                _wait_any(self._procs, 0.01)
        return [out[env_id] for env_id, _, _ in calls]


def _wait_any(workers: Sequence["_Worker"], seconds: float) -> None:
    conns = [w.conn for w in workers if w.pending]
    if conns:
        multiprocessing.connection.wait(conns, timeout=seconds)
    else:
        time.sleep(seconds)


class _Worker:
    """One worker process and the calls sent to it, answered in order."""

    def __init__(self, name: str, options: Mapping[str, Any]):
        self.name, self.options = name, options
        self.pending: list[tuple[int, str]] = []  # (env id, method), in the order sent
        self.since = 0.0  # when the head call began (sent, or the one before it answered)
        self._start()

    def _start(self) -> None:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that runs JAX
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_worker_main, args=(child, self.name, self.options), daemon=True)
        self.process.start()
        child.close()

    def send(self, env_id: int, method: str, args: tuple, *, reply: bool = True) -> None:
        if reply and not self.pending:
            self.since = time.monotonic()
        self.conn.send((env_id, method, args))
        if reply:
            self.pending.append((env_id, method))

    def poll(self, timeout: float) -> list[tuple[int, str, Any]]:
        """(env id, method, value) of the answers that arrived; on a timeout the process is killed and restarted, and every call
        waiting on it is answered with the timeout (resets: None)."""
        out = []
        while self.pending and self.conn.poll():
            try:
                env_id, ok, value = self.conn.recv()
            except (EOFError, OSError):
                break
            _, method = self.pending.pop(0)
            self.since = time.monotonic()
            out.append((env_id, method,
                        value if ok else (None if method == "reset" else _error_step("exception", value))))
        dead = not self.process.is_alive()
        if self.pending and (dead or time.monotonic() - self.since > timeout):
            kind = "exception" if dead else "timeout"
            self.process.kill()
            self.process.join(timeout=5)
            for env_id, method in self.pending:
                out.append((env_id, method,
                            None if method == "reset" else _error_step(kind, f"worker process lost ({kind})")))
            self.pending = []
            self._start()
        return out

    def stop(self) -> None:
        try:
            self.conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self.process.join(timeout=2)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(timeout=5)


def _worker_main(conn, name: str, options: Mapping[str, Any]) -> None:
    """A worker process: builds instances at their reset and answers calls in order."""
    factory = resolve(name)
    envs: dict[int, Environment] = {}
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        env_id, method, args = msg
        if method == "close":
            envs.pop(env_id, None)
            continue
        try:
            if method == "reset":
                envs[env_id] = factory(**options)
            value, ok = _call(envs[env_id], method, args), True
        except Exception as e:  # noqa: BLE001 - reported to the pool, which counts it
            value, ok = f"{type(e).__name__}: {e}", False
        conn.send((env_id, ok, value))
