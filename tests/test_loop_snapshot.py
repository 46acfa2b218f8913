"""The colocated loop decides every turn on a limiter snapshot it keeps itself (one
`server_info` RPC, then its own moves added): each decision must be the one fresh
server state gives, for every reader kind the loop drives."""

from __future__ import annotations

import pytest

from jaxreplay.config import load_config
from jaxreplay.replay.reader import reader_for
import jaxreplay.train.driver as driver
from jaxreplay.train.metrics import read_metrics
from test_train import DEMO, TINY

pytestmark = pytest.mark.slow


class FreshStateCheck:
    """The loop's reader, checking each snapshot the loop hands it against the server's
    state at that moment (a spy around the real reader; the server is real)."""

    def __init__(self, reader, server):
        self._reader, self._server, self.checked = reader, server, 0

    def _check(self, snapshot):
        fresh = self._server.states()
        assert snapshot is not None
        for name, state in snapshot.items():
            assert state == fresh[name], (state.describe(), fresh[name].describe())
        self.checked += 1

    def can_sample(self, batch_size, snapshot=None):
        self._check(snapshot)
        decision = self._reader.can_sample(batch_size, snapshot)
        assert decision == self._reader.can_sample(batch_size)  # as on fresh state
        return decision

    def sample(self, batch_size, snapshot=None):
        self._check(snapshot)
        return self._reader.sample(batch_size, snapshot)


@pytest.mark.parametrize("overrides", [
    pytest.param((), marks=pytest.mark.tier),  # one table: after the first snapshot the loop asks the server no more
    pytest.param(("replay.positive_fraction=0.25",), marks=pytest.mark.tier),  # two tables: after each insert and step
    pytest.param(("replay.max_times_sampled=1", "replay.samples_per_insert=2"), marks=pytest.mark.tier),  # over turns
    ("replay.backend=inprocess",),
], ids=["plain", "positive_bias", "max_times_sampled", "inprocess"])
def test_every_turn_decides_on_the_servers_current_state(tmp_path, monkeypatch, overrides):
    spies = []

    def spying_reader_for(server, config, **kwargs):
        spies.append(FreshStateCheck(reader_for(server, config, **kwargs), server))
        return spies[-1]

    monkeypatch.setattr(driver, "reader_for", spying_reader_for)
    config = load_config(DEMO, [*TINY, f"run.dir={tmp_path}", "train.steps=6", "warmstart.steps=0", *overrides])
    summary = driver.train(config, log=lambda _: None)
    assert summary["steps"] == 6
    assert spies and spies[0].checked >= 2 * 6  # a can_sample and a sample per step, at least
    assert summary["replay/samples"] == 6 * config.train.batch_size
    # Replay calls are timed: the step records' unrounded seconds (the summary's two decimals read 0.0 when six
    # in-process steps spend under 5 ms in replay).
    assert read_metrics(tmp_path)[-1]["time/replay_s"] > 0
