"""Episodes played by an outside agent loop (`environment.name: agent_loop`, tasks/agent_loop.py).

The engine's side is that of the built-in episodes (`EpisodeRunner`): a group is G rows of one
prompt, a row that ends its turn keeps its slot and K/V, and what comes after the turn is fed onto
the row, attended and never trained. Here what comes after a turn is the harness's next call: its
prompt must extend the episode's ids so far (the first prompt, every turn's ids as the engine drew
them, the harness's own tokens), and the ids past them are the harness's, put onto the row. So an
episode is one row with the engine's draws in its loss mask (each with its behaviour log-prob and
version) and the harness's tokens out of it, and no id is ever re-tokenised.

Rules, each written down once (docs/serving.md):
- a group's prompt is its lowest row's first call's, once all G harnesses have called (or ended, or
  `timeout` passed): the G harnesses play one item and seed, so they should agree;
- a call whose prompt does not extend its episode's ids (a first call unlike its group's, a client
  that re-rendered earlier turns) is refused and counted (`env/errors/rerendered_prompt`); the
  episode goes on, and a call that does extend them may follow;
- a call past `max_turns` model turns gets an empty turn (finish `length`): the episode is truncated;
- the harness's return value is the episode's reward; a harness that raises, or leaves its row
  waiting past `timeout`, ends the episode with reward 0 (`exception`, `timeout`, counted);
- draws never depend on when a call comes: a row's turn is drawn from the episode's ids with the
  row's keys as soon as it has them, and handed to the call when it comes.

Thread-safe: `call` runs on the server's thread, the TurnTaker methods on the actor's, harnesses on
their own threads.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import secrets
import threading
import time
from typing import Any, Callable, Optional

import numpy as np

from jaxreplay.rollout.episodes import RERENDERED
from jaxreplay.tasks.agent_loop import Endpoint, Harness


@dataclasses.dataclass(frozen=True)
class Turn:
    """A model turn as a call gets it back: the ids the engine drew and their log-probs."""

    tokens: list
    logprobs: list
    finish_reason: str  # "stop": it ended on a turn-end id; "length": the episode's budget (or turns) ran out


class Refused(Exception):
    """A call the episode cannot take; `kind` names why (the server maps it to a status)."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


Reply = Callable[[Any], None]  # called once with a Turn or a Refused, from any thread; must not block


@dataclasses.dataclass
class _Episode:
    tag: Any
    row: int
    id: str
    ids: Optional[list] = None  # what the next call's prompt must extend; None until the group's prompt is chosen
    first_prompt: Optional[list] = None  # its first call's prompt, before then
    call: Optional[Reply] = None  # a call waiting for its turn
    turn: Optional[Turn] = None  # a turn drawn before its call came
    parked: bool = False  # the engine holds the row after a turn, waiting for the next call (or the end)
    parked_at: float = 0.0
    over: bool = False  # the row draws no more
    broken: bool = False  # its harness never called in time: the row ends at its first turn
    finished: bool = False  # the harness returned or raised
    reward: float = 0.0
    turns: int = 0
    truncated: bool = False


@dataclasses.dataclass
class _Group:
    episodes: list
    errors: collections.Counter = dataclasses.field(default_factory=collections.Counter)


class OutsideEpisodes:
    """The engine's `TurnTaker` for agent-loop episodes, and the desk their calls come to (`call`)."""

    def __init__(self, harness: Harness, *, group_size: int, prompt_len: int, max_turns: int, timeout: float,
                 pad_id: int = 0, model_id: str = "jaxreplay", lockstep: bool = False):
        """`lockstep`: the engine decodes no chunk while a harness owes its next call (see `answers`)."""
        self.harness, self.group_size, self.prompt_len, self.lockstep = harness, group_size, prompt_len, lockstep
        self.max_turns, self.timeout, self.model_id = max_turns, float(timeout), model_id
        self.base_url, self.token, self.pad_id = "", None, pad_id  # the first two set once the server is bound
        self._lock = threading.Condition()
        self._groups: dict[Any, _Group] = {}
        self._by_id: dict[str, _Episode] = {}
        self._ready: list[tuple[Any, int, Optional[list[int]]]] = []
        self._prefix = secrets.token_hex(4)  # ids from an earlier runner (a restart) are never taken for these
        self._count = itertools.count()
        self._closed = False
        self.on_close: Callable[[], None] = lambda: None
        self.calls = 0  # calls answered with a turn (the server's /health)

    # -- the actor's side --------------------------------------------------------------

    def open(self, tag: Any, item: Any, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """Starts G harnesses on (item, seed) and waits (up to `timeout`) for their first calls: the
        group's prompt, left-padded [P] ids and mask."""
        episodes = [_Episode(tag, j, f"{self._prefix}-{next(self._count)}-{tag}-{j}") for j in range(self.group_size)]
        with self._lock:
            self._groups[tag] = group = _Group(episodes)
            for ep in episodes:
                self._by_id[ep.id] = ep
        for ep in episodes:
            threading.Thread(target=self._play, args=(ep, item, seed), name=f"harness-{ep.id}", daemon=True).start()
        deadline = time.monotonic() + self.timeout
        with self._lock:
            while not all(ep.first_prompt is not None or ep.finished for ep in episodes):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._lock.wait(left)
            prompt = next((ep.first_prompt for ep in episodes if ep.first_prompt is not None), [])
            for ep in episodes:
                ep.ids = list(prompt)
                if ep.first_prompt is None:  # its harness did not call in time, or ended first
                    ep.broken = True
                    group.errors["timeout"] += not ep.finished  # one that raised is counted as it ends
                elif ep.first_prompt != prompt:
                    self._refuse_rerendered(group, ep, ep.call)
                    ep.call = None
        tokens = np.full((self.prompt_len,), self.pad_id, np.int32)
        mask = np.zeros((self.prompt_len,), bool)
        if prompt:
            tokens[-len(prompt):], mask[-len(prompt):] = prompt, True
        return tokens, mask

    def ended(self, tag: Any, row: int, turn_ids: np.ndarray, cut: bool,
              logprobs: Optional[np.ndarray] = None) -> None:
        with self._lock:
            ep = self._groups[tag].episodes[row]
            lps = [] if logprobs is None else [float(x) for x in logprobs]
            turn = Turn([int(i) for i in turn_ids], lps, "length" if cut else "stop")
            if not cut:
                ep.turns += 1
            if cut:
                ep.over, ep.truncated = True, True
            if ep.broken:
                ep.over = True
                if not cut:
                    self._ready.append((tag, row, None))
                return
            if ep.call is not None:
                self._deliver(ep, turn)
            else:
                ep.turn = turn
            if not cut:
                ep.parked, ep.parked_at = True, time.monotonic()
                if ep.finished:
                    self._end(ep)

    def answers(self, wait: float) -> list[tuple[Any, int, Optional[list[int]]]]:
        """The calls (and ends) come since the last call. With `lockstep`, first waits (up to
        `timeout`) until no row waits on a harness that still plays: a row then never resumes a
        chunk later because its harness was slow, under newer weights, and a run's draws (so its
        resume) are the same whatever the harnesses' latency, as with a zero-latency environment
        (`environment.workers: 0`); every row waits for the slowest harness."""
        with self._lock:
            if self.lockstep:
                deadline = time.monotonic() + self.timeout
                while self._owed() and time.monotonic() < deadline:
                    self._lock.wait(max(0.0, deadline - time.monotonic()))
            elif not self._ready and wait > 0:
                self._lock.wait(wait)
            now = time.monotonic()
            for group in self._groups.values():
                for ep in group.episodes:
                    if ep.parked and ep.call is None and now - ep.parked_at > self.timeout:
                        group.errors["timeout"] += 1  # its harness neither called again nor ended in time
                        ep.reward = 0.0
                        self._end(ep)
            out, self._ready = self._ready, []
            return out

    def result(self, tag: Any) -> dict[str, Any]:
        """The group's episodes once every row is complete, as `EpisodeRunner.result`: rewards [G]
        (the harnesses' returns), turns [G], truncated [G], error counts. Waits up to `timeout` for
        harnesses still finishing (a row cut by the token limit)."""
        deadline = time.monotonic() + self.timeout
        with self._lock:
            group = self._groups.pop(tag)
            while not all(ep.finished for ep in group.episodes) and time.monotonic() < deadline:
                self._lock.wait(max(0.0, deadline - time.monotonic()))
            for ep in group.episodes:
                if not ep.finished:
                    group.errors["timeout"] += 1
                    ep.reward = 0.0
                self._by_id.pop(ep.id, None)
        return {"reward": np.asarray([ep.reward for ep in group.episodes], np.float32),
                "turns": np.asarray([ep.turns for ep in group.episodes], np.int32),
                "truncated": np.asarray([ep.truncated for ep in group.episodes], bool),
                "errors": dict(group.errors)}

    def forget(self) -> None:
        """Drops every open episode (a restart or resume plays them again): their calls are refused."""
        with self._lock:
            for group in self._groups.values():
                for ep in group.episodes:
                    if ep.call is not None:
                        ep.call(Refused("gone", "the trainer restarted this episode; its harness plays it again"))
                        ep.call = None
                    ep.over = True
                    self._by_id.pop(ep.id, None)
            self._groups.clear()
            self._ready.clear()
            self._lock.notify_all()

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.forget()
        self.on_close()

    # -- the server's side --------------------------------------------------------------

    def call(self, episode_id: str, prompt: list[int], reply: Reply) -> None:
        """A harness's call: `reply` gets the turn drawn after `prompt`, now or when the engine has
        drawn it, or a `Refused` (then the episode is as it was)."""
        with self._lock:
            ep = self._by_id.get(episode_id)
            if self._closed or ep is None:
                return reply(Refused("unknown", f"no open episode {episode_id!r} (unknown, scored, or restarted)"))
            if ep.broken:
                return reply(Refused("over", f"episode {episode_id!r} is over: its first call came after "
                                             f"{self.timeout:g} s (environment.step_timeout_s)"))
            if ep.call is not None or (ep.ids is None and ep.first_prompt is not None):
                return reply(Refused("busy", f"episode {episode_id!r} has a call in flight; one at a time"))
            group = self._groups[ep.tag]
            if ep.ids is None:  # a first call: the group's prompt is chosen in `open`
                if len(prompt) > self.prompt_len:
                    return reply(Refused("too_long", f"an episode's first prompt is {len(prompt)} tokens; the run's "
                                                     f"prompts take at most {self.prompt_len} (task.max_prompt_len)"))
                ep.first_prompt, ep.call = list(prompt), reply
                self._lock.notify_all()
                return None
            if ep.over and ep.turn is None:
                return reply(Refused("over", f"episode {episode_id!r} is over: its token budget ran out"))
            if not ep.parked or ep.turn is not None:  # its turn is being drawn, or was drawn: the same prompt
                if prompt != ep.ids:
                    return self._refuse_rerendered(group, ep, reply)
                if ep.turn is not None:
                    turn, ep.turn = ep.turn, None
                    ep.call = reply
                    return self._deliver(ep, turn)
                ep.call = reply
                return None
            if len(prompt) <= len(ep.ids) or prompt[:len(ep.ids)] != ep.ids:
                return self._refuse_rerendered(group, ep, reply)
            if ep.turns >= self.max_turns:  # the turn limit: an empty turn, the episode truncated
                ep.truncated = True
                ep.ids = list(prompt)
                reply(Turn([], [], "length"))
                return self._end(ep)
            suffix = list(prompt[len(ep.ids):])
            ep.ids, ep.call, ep.parked = list(prompt), reply, False
            self._ready.append((ep.tag, ep.row, suffix))
            self._lock.notify_all()
            return None

    def in_flight(self) -> int:
        with self._lock:
            return sum(ep.call is not None for ep in self._by_id.values())

    # -- inside the lock -----------------------------------------------------------------

    def _owed(self) -> bool:
        return any(ep.parked and not ep.finished and ep.call is None
                   for group in self._groups.values() for ep in group.episodes)

    def _deliver(self, ep: _Episode, turn: Turn) -> None:
        reply, ep.call = ep.call, None
        ep.ids = ep.ids + turn.tokens
        self.calls += 1
        reply(turn)

    def _refuse_rerendered(self, group: _Group, ep: _Episode, reply: Optional[Reply]) -> None:
        group.errors[RERENDERED] += 1
        if reply is not None:
            reply(Refused(RERENDERED, f"the prompt does not extend episode {ep.id}'s earlier {len(ep.ids)} ids (its "
                                      f"first prompt, each turn's ids as returned, the client's own tokens): earlier "
                                      f"turns were re-rendered? Send token ids (docs/serving.md)"))

    def _end(self, ep: _Episode) -> None:
        """A parked row's episode ends: the engine takes it out."""
        if ep.parked:
            ep.parked = False
            self._ready.append((ep.tag, ep.row, None))
        ep.over = True
        self._lock.notify_all()

    def _play(self, ep: _Episode, item: Any, seed: int) -> None:
        endpoint = Endpoint(base_url=self.base_url, model=self.model_id, episode_id=ep.id, token=self.token)
        reward, failed = 0.0, False
        try:
            reward = float(self.harness(item, seed, endpoint))
        except Exception:  # noqa: BLE001 - a harness's failure ends its episode, counted
            failed = True
        with self._lock:
            ep.finished, ep.reward = True, reward
            group = self._groups.get(ep.tag)
            if group is None or group.episodes[ep.row] is not ep:  # forgotten while it played
                return
            if failed and not ep.broken:
                group.errors["exception"] += 1
            if ep.call is not None:  # it left a call unanswered: nobody is waiting for it
                ep.call = None
            if ep.parked:
                self._end(ep)
            self._lock.notify_all()
