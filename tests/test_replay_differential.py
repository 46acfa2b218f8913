"""The in-process replay backend against real Reverb: the same seeded operations on both.

Reverb runs either in this process (the Reverb lane) or in its sidecar process (the default
lane, Python 3.12+, with `make venv-sidecar`): each test runs once per way, where it can.
Limiter decisions are compared with Reverb's own C++ limiter (`reverb.Table.can_insert`
/ `can_sample` on the live table) before a checkpoint, and with the server's counters
after a restore (the table object goes stale then); contents are compared exactly
under fifo/lifo, and sampling frequencies under uniform/prioritized by chi-square.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

from scipy import stats  # noqa: E402

from jaxreplay.config import load_config  # noqa: E402
from jaxreplay.replay.reader import RolloutReader
from jaxreplay.replay.server import serve
from jaxreplay.replay.sidecar import SidecarServer
from jaxreplay.replay.tables import ReplayTimeoutError, TableDef, build_tables
from jaxreplay.replay.tables import Tables, min_size_limit  # noqa: E402
from jaxreplay.replay.writer import RolloutWriter
from replay_rows import SPEC, rollouts  # noqa: E402

pytestmark = [pytest.mark.timeout(180, method="thread")]

# Where Reverb runs: in this process (needs dm-reverb here), or in its sidecar (needs its Python).
WHERE = [pytest.param("in_process", marks=pytest.mark.needs_reverb),
         pytest.param("sidecar", marks=pytest.mark.needs_sidecar)]


def reverb_server(where: str, tables: Tables, **kwargs):
    """(a Reverb server for `tables`, run `where`; Reverb's own limiter's answer `admits(what, k)` on its live table)."""
    if where == "sidecar":
        server = SidecarServer(tables, **kwargs)
        return server, lambda what, k: server.admits(tables.defs[0].name, what, k)
    from jaxreplay.replay.reverb_backend import ReverbServer
    server = ReverbServer(tables, **kwargs)
    live = server.reverb_tables[0]
    return server, lambda what, k: live.can_insert(k) if what == "insert" else live.can_sample(k)

SEQUENCES = {
    "fifo": ("replay.selector=fifo", "replay.samples_per_insert=2", "replay.error_buffer=4"),
    "lifo": ("replay.selector=lifo", "replay.samples_per_insert=0.5", "replay.error_buffer=3"),
    "fifo_max_times_sampled": ("replay.selector=fifo", "replay.samples_per_insert=1.5", "replay.error_buffer=4",
                               "replay.max_times_sampled=2"),
    "uniform": ("replay.selector=uniform", "replay.samples_per_insert=3", "replay.error_buffer=5"),
    "on_policy": ("replay.mode=on_policy", "replay.error_buffer=4"),
}
SMALL = ("train.batch_size=4", "train.prompts_per_step=2", "train.group_size=2", "replay.max_size=10",
         "replay.min_size_to_sample=4")


@contextlib.contextmanager
def both(where, cfg, checkpoint_root, restore=(None, None)):
    """(reverb server, its live table's limiter answers, in-process server) for `cfg`."""
    rv, admits = reverb_server(where, build_tables(cfg, SPEC, "reverb"), checkpoint_root=checkpoint_root / "reverb",
                               restore_from=restore[0])
    with rv, serve(build_tables(cfg, SPEC, "inprocess"), checkpoint_root=checkpoint_root / "inprocess",
                   restore_from=restore[1]) as ip:
        yield rv, admits, ip


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("name", sorted(SEQUENCES))
def test_same_operations_same_decisions_counters_and_fifo_lifo_contents(name, where, tmp_path):
    cfg = load_config(None, [*SMALL, *SEQUENCES[name]])
    rng = np.random.default_rng(sum(map(ord, name)))
    next_id, decisions, restore = 0, {"insert": [0, 0], "sample": [0, 0]}, (None, None)
    for phase in range(2):  # phase 1 continues from phase 0's checkpoints
        with both(where, cfg, tmp_path, restore) as (rv, admits, ip):
            servers = (rv, ip)
            writers = [RolloutWriter(s, SPEC, timeout_s=5) for s in servers]
            readers = [RolloutReader(s, timeout_s=5) for s in servers]
            for step in range(60):
                states = [s.states()[s.table] for s in servers]
                assert _counters(states[0]) == _counters(states[1]), (phase, step)
                op, k = ("insert", "sample")[int(rng.integers(2))], int(rng.integers(1, 5))
                admitted = [st.can_insert(k) if op == "insert" else st.can_sample_at_once(k) for st in states]
                if phase == 0:  # Reverb's own limiter, while the live table is the served one
                    cpp = admits(op, k)
                    assert cpp == (states[1].can_insert(k) if op == "insert" else states[1].can_sample(k)), step
                assert admitted[0] == admitted[1], (phase, step, op, k)
                decisions[op][admitted[1]] += 1
                if not admitted[1]:
                    if op == "sample" and not states[1].can_sample(1):
                        for r in readers:  # blocked on both: each times out
                            r._timeout_s = 0.05
                            with pytest.raises(ReplayTimeoutError):
                                r.sample(1)
                            r._timeout_s = 5
                    continue
                if op == "insert":
                    for w in writers:
                        w.insert(rollouts(range(next_id, next_id + k)))
                    next_id += k
                else:
                    got = [r.sample(k) for r in readers]
                    if cfg.replay.selector != "uniform" or cfg.replay.mode == "on_policy":
                        np.testing.assert_array_equal(got[0][0]["policy_version"], got[1][0]["policy_version"])
                        for field in ("times_sampled", "probabilities", "table_size"):
                            np.testing.assert_array_equal(getattr(got[0][1], field), getattr(got[1][1], field))
            restore = (rv.checkpoint(), ip.checkpoint())
    assert all(min(v) > 0 for v in decisions.values()), decisions  # both branches exercised


def _counters(state):
    return (state.size, state.inserts, state.samples, state.deletes, state.min_diff, state.max_diff)


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("selector,exponent", [("uniform", 1.0), ("prioritized", 1.0), ("prioritized", 0.5)])
def test_sampling_frequencies_agree_with_reverb(selector, exponent, where, tmp_path):
    n, draws = 6, 3000
    definition = TableDef("rollouts", selector, 16, min_size_limit(1), priority_exponent=exponent)
    priorities = np.arange(1.0, n + 1)
    expected = priorities ** (exponent if selector == "prioritized" else 0.0)
    expected = expected / expected.sum()
    counts = []
    for backend in ("reverb", "inprocess"):
        tables = Tables(backend, (definition,), SPEC)
        with (reverb_server(where, tables)[0] if backend == "reverb" else serve(tables, seed=0)) as server:
            RolloutWriter(server, SPEC, timeout_s=5).insert(rollouts(range(n)), priorities=priorities)
            reader = RolloutReader(server, timeout_s=5)
            batches = [reader.sample(300) for _ in range(draws // 300)]
            ids = np.concatenate([b["policy_version"] for b, _ in batches])
            probs = np.concatenate([info.probabilities for _, info in batches])
            np.testing.assert_allclose(probs, expected[ids], rtol=1e-6)  # reported probabilities agree exactly
            counts.append(np.bincount(ids, minlength=n))
    for c in counts:  # each backend matches the selector's distribution
        assert stats.chisquare(c, expected * draws).pvalue > 1e-4, (c, expected * draws)
    # and the two samples come from one distribution
    assert stats.chi2_contingency(np.stack(counts)).pvalue > 1e-4, counts


@pytest.mark.parametrize("where", WHERE)
@pytest.mark.parametrize("selector", ["uniform", "fifo"])
def test_a_snapshot_advanced_by_the_callers_own_moves_is_what_the_server_reports(selector, where, tmp_path):
    """The colocated loop, the table's only client, takes one snapshot and then adds its own
    inserts and samples to it (`after_insert` / `after_sample`) instead of asking again; on
    both backends that must equal the server's counters, FIFO eviction at max_size included,
    and a reader deciding on the snapshot must decide as on fresh state."""
    cfg = load_config(None, [*SMALL, f"replay.selector={selector}", "replay.samples_per_insert=2",
                             "replay.error_buffer=6"])
    with both(where, cfg, tmp_path) as (rv, _, ip):
        for server in (rv, ip):
            writer, reader = RolloutWriter(server, SPEC, timeout_s=5), RolloutReader(server, timeout_s=5)
            derived, next_id = server.states()[server.table], 0
            for step in range(40):
                snapshot = {server.table: derived}
                assert reader.can_sample(4, snapshot) == reader.can_sample(4), step
                if derived.can_sample_at_once(4):
                    batch, _ = reader.sample(4, snapshot)
                    assert len(batch["reward"]) == 4
                    derived = derived.after_sample(4)
                else:
                    n = next(k for k in (3, 2, 1) if derived.can_insert(k))
                    writer.insert(rollouts(range(next_id, next_id + n)))
                    next_id += n
                    derived = derived.after_insert(n)
                assert derived == server.states()[server.table], (step, derived.describe(), server.describe())
            assert derived.deletes > 0 and derived.samples > 0  # the window slid and was sampled


def test_samples_that_may_delete_items_are_not_derived_locally():
    cfg = load_config(None, [*SMALL, "replay.max_times_sampled=2"])
    with serve(build_tables(cfg, SPEC, "inprocess")) as server:
        with pytest.raises(ValueError, match="max_times_sampled"):
            server.states()[server.table].after_sample(1)
