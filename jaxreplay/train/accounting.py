"""What a run spent and how it used its data: the quantities replay trades against each other.

Generation and training are timed per rollout, and their ratio mu (the cost of
generating a rollout relative to training on it) is estimated online; the first
call of each in this process is left out, since it compiles (a resumed run compiles
again). The timed seconds and the rollout counts are logged too: `jaxreplay report`
plots wall-clock time without compilation and models cost as trained rollouts plus
mu x generated rollouts. Compute is estimated in FLOPs as
2 x params per token of a forward pass (prefill and decode) and 6 x params per
token trained (forward and backward), attention's quadratic term ignored: at
these sequence lengths it is a rounding error.

Per sampled item: staleness (learner version minus the version that generated it)
and times sampled, as histograms. The share of generated rollouts never trained on
counts rollouts, not items: under positive bias one rollout has an item in each
table, each with its own times-sampled count, so a rollout counts as sampled at the
first sample of its `rollout_id` (the sampled ids are kept as ranges, which
consecutive ids collapse into).

Multi-turn runs also total the errors that ended episodes, per kind (`env/errors_total/*`),
beside the latest actor batch's counts (`env/errors/*`): a rare failure shows over the run.

The counters live in a plain dict (`Progress.accounting`), so checkpoints carry them
and a resumed run continues the same totals.
"""

from __future__ import annotations

from typing import Any, Mapping, MutableMapping, Sequence

import numpy as np

# Histogram bin edges: [0,1), [1,2), [2,4), ... [256, inf). Staleness spans orders of magnitude.
STALENESS_EDGES = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256)
TIMES_SAMPLED_EDGES = (1, 2, 3, 4, 6, 8, 12, 16, 32)
# The metrics that are histograms (bin counts per record), with their bin edges.
HISTOGRAMS = {"staleness/hist": STALENESS_EDGES, "replay/times_sampled_hist": TIMES_SAMPLED_EDGES}

_ZERO = {
    "rollouts_generated": 0, "rollouts_trained": 0, "rollouts_first_sampled": 0, "sampled_id_ranges": [],
    "groups_dropped": 0, "rollouts_evicted": 0,
    "generate_calls": 0, "generate_s": 0.0, "generate_rollouts_timed": 0,
    "train_calls": 0, "train_s": 0.0, "train_rollouts_timed": 0,
    "flops_generate": 0.0, "flops_train": 0.0,
}


def histogram(values: np.ndarray, edges: tuple[int, ...]) -> list[int]:
    """Counts per bin [edges[i], edges[i+1]), the last bin open-ended."""
    idx = np.searchsorted(np.asarray(edges), np.asarray(values), side="right") - 1
    return np.bincount(np.clip(idx, 0, len(edges) - 1), minlength=len(edges)).tolist()


def param_count(params: Any) -> int:
    import jax

    return int(sum(np.prod(np.shape(x)) for x in jax.tree.leaves(params)))


class Accounting:
    """Updates the counters in `state` (a dict, filled in with zeros) as the loop reports work."""

    def __init__(self, n_params: int, state: MutableMapping[str, Any], *, episode_errors: Sequence[str] = ()):
        """`episode_errors`: multi-turn, the kinds of episode error to total (rollout/episodes.py)."""
        self.n_params = n_params
        self._compiled = {"generate": False, "train": False}  # per process: a resume compiles again
        for key, value in _ZERO.items():
            state.setdefault(key, value)
        if episode_errors:
            totals = state.setdefault("episode_errors", {})
            for kind in episode_errors:
                totals.setdefault(kind, 0)
        self.state = state
        self._sampled = from_ranges(state["sampled_id_ranges"])  # sorted rollout ids sampled so far

    def on_generate(self, items: Mapping[str, np.ndarray], seconds: float) -> None:
        """A batch of rollouts generated in `seconds`."""
        s, n = self.state, len(items["reward"])
        s["rollouts_generated"] += n
        s["flops_generate"] += 2.0 * self.n_params * float(np.sum(items["attention_mask"]))
        s["generate_calls"] += 1
        if self._timed("generate"):
            s["generate_s"] += seconds
            s["generate_rollouts_timed"] += n

    def on_episodes(self, errors: Mapping[str, int]) -> None:
        """The error counts, per kind, of a generated batch's episodes (each counted once: here,
        as its batch is generated; an episode in flight at a checkpoint is counted when it completes)."""
        totals = self.state.get("episode_errors", {})
        for kind in totals:
            totals[kind] += int(errors.get(kind, 0))

    def on_drop(self, groups: int) -> None:
        """Groups dropped at insert (`replay.drop_zero_advantage_groups`): generated, never sampled."""
        self.state["groups_dropped"] += groups

    def on_evict(self, rollouts: int) -> None:
        """Items evicted as older than `replay.max_age` (each table's items counted)."""
        self.state["rollouts_evicted"] += rollouts

    def on_train(self, batch: Mapping[str, np.ndarray], times_sampled: np.ndarray, staleness: np.ndarray,
                 seconds: float) -> dict[str, Any]:
        """A learner step on `batch` in `seconds`; returns its per-step metrics."""
        s, n = self.state, len(batch["reward"])
        s["rollouts_trained"] += n
        self._count_first_samples(batch["rollout_id"])
        s["flops_train"] += 6.0 * self.n_params * float(np.sum(batch["attention_mask"]))
        s["train_calls"] += 1
        if self._timed("train"):
            s["train_s"] += seconds
            s["train_rollouts_timed"] += n
        return {
            "staleness/hist": histogram(staleness, STALENESS_EDGES),
            "replay/times_sampled_hist": histogram(times_sampled, TIMES_SAMPLED_EDGES),
            **self.metrics(),
        }

    def _count_first_samples(self, ids: np.ndarray) -> None:
        """Counts the rollouts in `ids` never sampled before (one per rollout, whatever its tables)."""
        new = np.setdiff1d(np.asarray(ids, np.int64), self._sampled)
        if len(new):
            self.state["rollouts_first_sampled"] += len(new)
            self._sampled = np.union1d(self._sampled, new)
            self.state["sampled_id_ranges"] = to_ranges(self._sampled)

    def _timed(self, call: str) -> bool:
        """False for this process's first `call` (it compiles), True after."""
        timed, self._compiled[call] = self._compiled[call], True
        return timed

    @property
    def generate_s_per_rollout(self) -> float:
        s = self.state
        return s["generate_s"] / s["generate_rollouts_timed"] if s["generate_rollouts_timed"] else float("nan")

    @property
    def train_s_per_rollout(self) -> float:
        s = self.state
        return s["train_s"] / s["train_rollouts_timed"] if s["train_rollouts_timed"] else float("nan")

    @property
    def mu(self) -> float:
        """Generation seconds per rollout over training seconds per rollout (nan until both are timed)."""
        return self.generate_s_per_rollout / self.train_s_per_rollout

    def metrics(self) -> dict[str, float]:
        s = self.state
        generated = s["rollouts_generated"]
        return {
            "replay/never_sampled_frac": 1.0 - s["rollouts_first_sampled"] / generated if generated else float("nan"),
            "cost/generate_s_per_rollout": self.generate_s_per_rollout,
            "cost/train_s_per_rollout": self.train_s_per_rollout,
            "cost/mu": self.mu,
            "compute/flops_generate": s["flops_generate"],
            "compute/flops_train": s["flops_train"],
            "compute/flops": s["flops_generate"] + s["flops_train"],
            "rollouts/generated": s["rollouts_generated"],
            "rollouts/trained": s["rollouts_trained"],
            "replay/dropped_groups": s["groups_dropped"],
            "replay/evicted": s["rollouts_evicted"],
            "time/generate_timed_s": s["generate_s"],  # the first call of each process left out
            "time/train_timed_s": s["train_s"],
            **{f"env/errors_total/{kind}": n for kind, n in s.get("episode_errors", {}).items()},
        }


def to_ranges(ids: np.ndarray) -> list[list[int]]:
    """Sorted unique ids as [start, stop) ranges of consecutive ids (what a checkpoint stores)."""
    if not len(ids):
        return []
    breaks = np.flatnonzero(np.diff(ids) != 1) + 1
    starts, stops = ids[np.r_[0, breaks]], ids[np.r_[breaks - 1, len(ids) - 1]] + 1
    return [[int(a), int(b)] for a, b in zip(starts, stops)]


def from_ranges(ranges: list) -> np.ndarray:
    return np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in ranges] or [np.zeros(0, np.int64)])


STALENESS_LABELS = tuple(f"{a}-{b - 1}" if b - a > 1 else f"{a}" for a, b in zip(STALENESS_EDGES, STALENESS_EDGES[1:])) \
    + (f"{STALENESS_EDGES[-1]}+",)
