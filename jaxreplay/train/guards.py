"""Ways a training run stops on purpose: a preemption notice, or updates that stay non-finite.

Both leave the run resumable by the same command: a preemption notice (SIGTERM)
is turned into a flag the loop reads between turns, so the final checkpoint is
written from the loop's own thread, never from inside a half-done step; a streak
of skipped non-finite updates stops the run without writing another checkpoint;
as skipped updates leave params and optimizer state as they were, every
checkpoint holds good ones.
"""

from __future__ import annotations

import signal
import threading


class Preempted(Exception):
    """SIGTERM arrived; the run saved a final checkpoint and stopped."""


class NonFiniteError(RuntimeError):
    """Too many consecutive learner steps had a non-finite loss, gradient or update."""


class PreemptionNotice:
    """Turns SIGTERM into a flag (`is_set()`) until `close()` puts the previous handler back.
    Outside the main thread signals cannot be caught: the flag then never rises and
    SIGTERM keeps its previous meaning."""

    def __init__(self):
        self._event = threading.Event()
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, lambda *_: self._event.set())

    def is_set(self) -> bool:
        return self._event.is_set()

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None


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
