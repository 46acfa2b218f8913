"""The engine thread: the one owner of the rollout engines and the device.

HTTP handlers never touch an engine. They hand a `Generation` to `EngineWorker.submit` (a queue)
and hear back through the generation's `notify` callback, which the thread calls between chunks
with each choice's ids and log-probs so far; the callback must not block (the server's puts onto
an asyncio queue), so a slow or stuck client never holds the thread.

The engine draws with one temperature/top-k/top-p, fixed when its programs compile, and takes
groups of a fixed size. Requests differ in both, so the worker keeps one `JaxEngine` per draw
(greedy, temperature, top_k, top_p), built on first use, at most `max_engines` at once (an idle
one gives its place up), each of group size 1: choice i of a request is its own group, its key
fold_in(key(seed), i), so the same seed gives the same tokens whatever else runs beside it. A
request's own limits (max_tokens below the engine's, stop strings, stop ids) are checked between
chunks on what the engine drew, and end its rows there (`JaxEngine.stop`); the ids a response
returns are always a prefix of those the engine drew, with their log-probs as drawn.
"""

from __future__ import annotations

import dataclasses
import queue
import secrets
import threading
import time
from typing import Any, Callable, Optional, Sequence

import jax
import numpy as np

from jaxreplay.rollout.engine import JaxEngine, PromptGroup


@dataclasses.dataclass(frozen=True)
class Draw:
    """How tokens are drawn: one engine each. Greedy: argmax, log-probs at temperature 1."""

    greedy: bool
    temperature: float
    top_k: int
    top_p: float

    @staticmethod
    def of(temperature: float, top_k: int, top_p: float) -> "Draw":
        if temperature == 0:
            return Draw(True, 1.0, 0, 1.0)
        return Draw(False, float(temperature), int(top_k), float(top_p))


@dataclasses.dataclass
class Choice:
    tokens: list = dataclasses.field(default_factory=list)
    logprobs: list = dataclasses.field(default_factory=list)
    versions: list = dataclasses.field(default_factory=list)  # filled when the engine hands the row back
    finish_reason: Optional[str] = None  # "stop", "length", "abort" once finished
    stop_text: Optional[str] = None  # the stop string that ended it


@dataclasses.dataclass
class Generation:
    """One prompt's n completions, as the engine thread sees a request. `notify(index, choice)`
    is called on that thread after each chunk that changed choice `index`, and must not block."""

    prompt: list[int]
    n: int
    draw: Draw
    max_tokens: int
    notify: Callable[[int, Choice], None]
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset = frozenset()
    seed: Optional[int] = None
    id: str = dataclasses.field(default_factory=lambda: secrets.token_hex(8))
    choices: list = dataclasses.field(default_factory=list)
    cancelled: bool = False

    def __post_init__(self):
        self.choices = [Choice() for _ in range(self.n)]
        if self.seed is None:
            self.seed = secrets.randbits(62)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)


class EngineWorker:
    """Owns the engines (one per `Draw`) on one thread. `make_engine(draw)` builds an engine of
    group size 1 for it; `decode(ids)` gives text, for stop strings."""

    def __init__(self, make_engine: Callable[[Draw], JaxEngine], *, prompt_len: int, pad_id: int,
                 stop_ids: Sequence[int], decode: Callable[[Sequence[int]], str], max_engines: int = 4,
                 idle_wait_s: float = 0.05):
        self.make_engine, self.prompt_len, self.pad_id, self.decode = make_engine, prompt_len, pad_id, decode
        self.stop_ids = frozenset(int(i) for i in stop_ids)  # the engines' own: a row that ends on one stopped
        self.max_engines, self.idle_wait_s = max_engines, idle_wait_s
        self.engines: dict[Draw, JaxEngine] = {}
        self.inbox: queue.Queue = queue.Queue()
        self._live: dict[str, Generation] = {}  # submitted, not finished
        self._backlog: list[Generation] = []  # waiting for an engine of their draw
        self._closing = threading.Event()
        self._abort_at: Optional[float] = None
        self.error: Optional[str] = None  # why the thread stopped, if it failed
        self.tokens_drawn = 0
        self.cancelled_rows = 0  # rows stopped because their client left (or timed out)
        self._thread = threading.Thread(target=self._run, name="jaxreplay-engine", daemon=True)

    # -- the HTTP side (any thread) ------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def submit(self, gen: Generation) -> None:
        self.inbox.put(("submit", gen))

    def cancel(self, gen: Generation) -> None:
        """The client left: its rows stop and their slots free at the next chunk boundary."""
        self.inbox.put(("cancel", gen))

    def update_weights(self, params, version: int) -> None:
        self.inbox.put(("weights", (params, version)))

    def load(self) -> int:
        """Generations submitted and not finished (approximate: read without a lock)."""
        return len(self._live) + self.inbox.qsize()

    def close(self, grace_s: float, timeout_s: float) -> bool:
        """Takes no more work; generations in flight get `grace_s` to finish, then end as
        "abort". Waits up to `timeout_s` for the thread; False if it did not stop."""
        self._abort_at = time.monotonic() + grace_s
        self._closing.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- the engine thread ---------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                busy = any(e.pending() for e in self.engines.values())
                self._take_inbox(0.0 if busy else self.idle_wait_s)
                if self._closing.is_set():
                    if not self._live and self.inbox.empty():
                        return
                    if time.monotonic() >= self._abort_at:
                        self._abort_all()
                        return
                self._place_backlog()
                for engine in list(self.engines.values()):
                    if engine.pending():
                        engine.step()
                        self._observe(engine)
        except Exception as e:  # the device failed: every open request hears it, and /health says so
            self.error = f"{type(e).__name__}: {e}"
            self._abort_all()

    def _take_inbox(self, wait: float) -> None:
        try:
            item = self.inbox.get(timeout=wait) if wait > 0 else self.inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, value = item
            if kind == "submit":
                self._live[value.id] = value
                self._backlog.append(value)
            elif kind == "cancel":
                self._cancel(value)
            elif kind == "weights":
                for engine in self.engines.values():
                    engine.update_weights(*value)
                self._weights = value
            try:
                item = self.inbox.get_nowait()
            except queue.Empty:
                return

    _weights: Optional[tuple] = None

    def _cancel(self, gen: Generation) -> None:
        gen.cancelled = True
        if gen in self._backlog:
            self._backlog.remove(gen)
        engine = self.engines.get(gen.draw)
        if engine is not None:
            engine.stop([(gen.id, i) for i in range(gen.n)])
        for c in gen.choices:
            self.cancelled_rows += c.finish_reason is None
            c.finish_reason = c.finish_reason or "abort"
        self._live.pop(gen.id, None)

    def _engine_for(self, draw: Draw) -> Optional[JaxEngine]:
        if draw in self.engines:
            return self.engines[draw]
        if len(self.engines) >= self.max_engines:
            idle = [d for d, e in self.engines.items() if not e.pending()]
            if not idle:
                return None  # waits until an engine drains
            del self.engines[idle[0]]
        engine = self.make_engine(draw)
        if self._weights is not None:
            engine.update_weights(*self._weights)
        self.engines[draw] = engine
        return engine

    def _place_backlog(self) -> None:
        waiting = []
        for gen in self._backlog:
            engine = self._engine_for(gen.draw)
            if engine is None:
                waiting.append(gen)
                continue
            p, n = self.prompt_len, len(gen.prompt)
            tokens = np.full((p,), self.pad_id, np.int32)
            tokens[p - n:] = gen.prompt
            mask = np.arange(p) >= p - n
            key = jax.random.key(gen.seed)
            engine.submit([PromptGroup((gen.id, i), tokens, mask, jax.random.fold_in(key, i)) for i in range(gen.n)])
        self._backlog = waiting

    def _observe(self, engine: JaxEngine) -> None:
        """After a chunk: each live row's ids so far against its request's limits; rows that
        reach one are ended in the engine; finished rows handed back complete their choice."""
        ended = []
        for (tag, _), (tokens, logprobs) in engine.progress().items():
            if self._update(tag, tokens, logprobs, finished=False):
                ended.append(tag)
        if ended:
            engine.stop(ended)
        for group in engine.collect():
            r = group.rollout
            row = r.completion_mask[0]
            tokens, logprobs = r.tokens[0][row], r.logprobs[0][row]
            gen = self._live.get(group.tag[0])
            if gen is not None:
                choice = gen.choices[group.tag[1]]
                choice.versions = group.token_versions[0][:len(tokens)].tolist()
            self._update(group.tag, tokens, logprobs, finished=True)

    def _update(self, tag, tokens: np.ndarray, logprobs: np.ndarray, *, finished: bool) -> bool:
        """Takes a row's ids so far into its choice; True when the request's own limits end it."""
        gen = self._live.get(tag[0])
        if gen is None:
            return False
        index = tag[1]
        choice = gen.choices[index]
        if choice.finish_reason is not None:
            return False
        tokens, logprobs = [int(t) for t in tokens], [float(x) for x in logprobs]
        reason = None
        cut = _stop_id_at(tokens, gen.stop_token_ids)
        if cut is not None:
            tokens, reason = tokens[:cut + 1], "stop"
        if gen.stop:
            at, text = self._stop_string_at(tokens, gen.stop, len(choice.tokens))
            if at is not None:
                tokens, reason, choice.stop_text = tokens[:at + 1], "stop", text
        if reason is None and len(tokens) >= gen.max_tokens:
            tokens, reason = tokens[:gen.max_tokens], "length"
        if reason is None and finished:
            stopped = bool(tokens) and tokens[-1] in self.stop_ids
            reason = "stop" if stopped else "length"
        self.tokens_drawn += len(tokens) - len(choice.tokens)
        choice.tokens, choice.logprobs = tokens, logprobs[:len(tokens)]
        choice.finish_reason = reason
        gen.notify(index, choice)
        if gen.finished:
            self._live.pop(gen.id, None)
        return reason is not None and not finished

    def _stop_string_at(self, tokens: list[int], stops: tuple[str, ...], seen: int):
        """(index of the token whose text completes a stop string, the string), or (None, None).
        Tokens before `seen` were checked already."""
        for k in range(max(0, seen - 1), len(tokens)):
            text = self.decode(tokens[:k + 1])
            for s in stops:
                if s in text:
                    return k, s
        return None, None

    def _abort_all(self) -> None:
        for gen in list(self._live.values()):
            for i, c in enumerate(gen.choices):
                if c.finish_reason is None:
                    c.finish_reason = "abort"
                    gen.notify(i, c)
        self._live.clear()
        self._backlog.clear()
        self.engines.clear()  # their pools go with them


def _stop_id_at(tokens: list[int], stop_ids: frozenset) -> Optional[int]:
    return next((k for k, t in enumerate(tokens) if t in stop_ids), None)
