"""The actor streams through the rollout engine (`sampling.engine: continuous`): groups enter the
table as they complete, the learner steps while rows are mid-sequence and those rows continue
under the new weights, each token keeping the log-prob of the distribution it was drawn from;
the limiter's refusals stop the refills; runs are reproducible, stop between chunks and resume
with rows in flight."""

from __future__ import annotations

import functools
import json
import signal
import subprocess

import jax
import numpy as np
import pytest

from jaxreplay.config import ConfigError, load_config, validate
from jaxreplay.models.transformer import apply, init_cache, init_params
from jaxreplay.rollout.actor import make_streaming_actor, waiting_bound
from jaxreplay.rollout.sampling import filter_logits
from jaxreplay.tasks.registry import make_task
from jaxreplay.train.metric_keys import KEYS as DOCUMENTED_KEYS
from jaxreplay.train.metrics import read_metrics

from conftest import cpu_devices_env
from test_crash import assert_every_checkpoint_restores, checkpoint_steps, cli, logged_step, wait_for_step
from test_resume import _finish, _job, needs_multiprocess_checkpoints
from test_signals import Command, assert_one_line
from test_train import DEMO, LEARNING, ROOT, TINY, run

STREAM = ["sampling.engine=continuous", "sampling.engine_chunk_steps=2"]
K = 2  # decode steps per chunk: the demo's 5-token completions span three chunks


def test_engine_settings_are_checked_by_the_actor():
    with pytest.raises(ConfigError, match="sampling.engine_slots: 3 slots cannot hold one group"):
        validate(load_config(DEMO, [*STREAM, "sampling.engine_slots=3"]))
    validate(load_config(DEMO, [*STREAM, "distributed.enabled=true"]), local=False)  # multi-host: each process its pool
    with pytest.raises(ConfigError, match="sampling.engine_chunk_steps"):
        validate(load_config(DEMO, ["sampling.engine_chunk_steps=0"]))
    validate(load_config(DEMO, STREAM))


CONFIG = load_config(DEMO, [*TINY, *STREAM, "sampling.temperature=0.7"])
TASK = make_task(CONFIG.task)
GRAPHDEF, PARAMS = init_params(CONFIG.model, 0)


@functools.lru_cache(maxsize=None)
def weights(version: int):
    """Version v: the init plus noise seeded by v, so that every version draws differently."""
    leaves, treedef = jax.tree.flatten(PARAMS)
    keys = jax.random.split(jax.random.key(100 + version), len(leaves))
    return jax.tree.unflatten(treedef, [x + 0.3 * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


def test_rows_the_learner_overtakes_keep_the_log_prob_of_each_tokens_own_distribution():
    """New weights before every chunk (version = chunk), as a learner stepping between chunks.
    An instrumented re-run of each row, one token at a time with the model's own KV cache: the
    prompt and the first token under the version the row records first, token t >= 1 under
    the version of the chunk that drew it (rows decode K tokens a chunk from the one they were
    placed in, which `last_version` and the row's length give)."""
    tok = TASK.tokenizer
    actor = make_streaming_actor(GRAPHDEF, CONFIG, TASK, PARAMS, stop_ids=tok.eos_ids, pad_id=tok.pad_id,
                                 live_vocab=tok.vocab_size)
    rows = []
    for version in range(12):
        got, stats = actor.advance(weights(version), version)
        assert stats["position"].started - len(stats["position"].in_flight) == sum(len(r["reward"]) for r in rows) \
            // CONFIG.train.group_size + stats["groups"]
        if got is not None:
            rows.append(got)
    rows = {k: np.concatenate([r[k] for r in rows]) for k in rows[0]}
    p, n_new = TASK.prompt_len, CONFIG.sampling.max_new_tokens
    mixed = np.flatnonzero(rows["policy_version"] != rows["last_version"])
    assert len(mixed) >= 8, "the fixture should change the weights under some rows"
    assert (rows["policy_version"] <= rows["last_version"]).all()
    step = jax.jit(lambda params, tok, pos, mask, cache, index: apply(GRAPHDEF, params, tok, pos, mask, cache, index))
    log_prob = lambda logits, token: jax.nn.log_softmax(
        filter_logits(logits, temperature=0.7, live_vocab=tok.vocab_size))[token]
    for r in mixed[:8]:
        tokens, mask, n = rows["tokens"][r], rows["attention_mask"][r], int(rows["completion_mask"][r].sum())
        placed = int(rows["last_version"][r]) - (n - 2) // K
        versions = [int(rows["policy_version"][r])] + [placed + (t - 1) // K for t in range(1, n)]
        cache = init_cache(CONFIG.model, 1, p + n_new)
        logits, cache = step(weights(versions[0]), tokens[None, :p], np.maximum(np.cumsum(mask[:p]) - 1, 0)[None],
                             mask[None], cache, 0)
        want = [log_prob(logits[0, -1], tokens[p])]
        for t in range(1, n):
            pos = np.array([[int(mask[:p].sum()) + t - 1]])
            logits, cache = step(weights(versions[t]), tokens[None, p + t - 1:p + t], pos, mask[None], cache, p + t - 1)
            want.append(log_prob(logits[0, -1], tokens[p + t]))
        np.testing.assert_allclose(rows["logprobs"][r, p:p + n], np.asarray(want), rtol=1e-5, atol=1e-5)



def streamed(actor, chunks: int) -> dict[int, dict]:
    """Rows by rollout id over `chunks` chunks under the version-0 weights."""
    out = {}
    for _ in range(chunks):
        rows, _ = actor.advance(weights(0), 0)
        for i, rid in enumerate([] if rows is None else rows["rollout_id"]):
            out[int(rid)] = {k: v[i] for k, v in rows.items()}
    return out


def test_a_resumed_actor_submits_the_groups_in_flight_again_and_draws_them_alike():
    """What a checkpoint holds of the actor is its position: a fresh actor resumed there first
    regenerates the groups that were in flight (same keys: under unchanged weights, the same
    tokens), then continues the prompt stream where it stood."""
    tok = TASK.tokenizer
    make = lambda: make_streaming_actor(GRAPHDEF, CONFIG, TASK, PARAMS, stop_ids=tok.eos_ids, pad_id=tok.pad_id,
                                        live_vocab=tok.vocab_size)
    straight = make()
    before = streamed(straight, 1)
    position = straight.position
    assert position.in_flight, "the fixture should stop with groups mid-sequence"
    after = streamed(straight, 8)
    resumed = make()
    resumed.resume(position)
    again = streamed(resumed, 8)
    g = CONFIG.train.group_size
    in_flight_ids = {rid for rid in after if (rid // g) in {actor_group(straight, k) for k in position.in_flight}}
    assert in_flight_ids and in_flight_ids <= set(again), "every group in flight is regenerated"
    assert not set(before) & set(again), "groups completed before the checkpoint are not generated again"
    for rid in set(after) & set(again):
        np.testing.assert_array_equal(after[rid]["tokens"], again[rid]["tokens"])
        np.testing.assert_allclose(after[rid]["logprobs"], again[rid]["logprobs"], atol=1e-5)


def actor_group(actor, k: int) -> int:
    """Group k of the actor's stream as a global group number (rollout id // G)."""
    step, prompt = actor._where(k)
    return step * CONFIG.train.prompts_per_step + prompt

def untimed(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith(("time/", "cost/"))}


@pytest.mark.slow
def test_two_streaming_runs_with_the_same_seed_are_identical_and_waiting_rollouts_stay_bounded(tmp_path):
    """Chunk and refill decisions depend on the table and the tokens, never the clock. The
    schedule decodes a chunk only when no rollout waits for the table, so at most one chunk's
    completed groups wait (`waiting_bound`) however often the limiter refuses inserts."""
    settings = [*STREAM, "replay.selector=uniform", "train.steps=8", *LEARNING]
    first, _ = run(tmp_path, *settings, name="first")
    second, _ = run(tmp_path, *settings, name="second")
    a, b = read_metrics(first.run.dir), read_metrics(second.run.dir)
    assert sum(r["grad_norm"] > 0 for r in a[1:]) >= 3, "the runs must actually learn for this to test anything"
    for ra, rb in zip(a, b, strict=True):
        assert untimed(ra) == untimed(rb)
        assert ra.keys() <= DOCUMENTED_KEYS, f"add to jaxreplay/train/metric_keys.py: {ra.keys() - DOCUMENTED_KEYS}"
    waiting = [r["rollouts/waiting_max"] for r in a[1:]]
    assert 0 < max(waiting) <= waiting_bound(first), waiting
    assert any(r["engine/groups_in_flight"] for r in a[1:]), "the learner should step while rows are mid-sequence"
    assert any(r["batch/version_min"] < r["batch/version_max"] for r in a[1:])


@pytest.mark.reverb
@pytest.mark.slow
def test_a_streaming_run_on_the_reverb_server_keeps_the_limiters_window(tmp_path):
    """The engine's groups enter a real Reverb table as they complete, carrying both version
    fields; Reverb's rate limiter decides every insert and sample, so the table never runs
    ahead of the window, and the learner samples rows drawn under more than one version.
    In process on the Reverb lane, through Reverb's sidecar on the default lane."""
    config, _ = run(tmp_path, *STREAM, "replay.backend=reverb", "replay.selector=uniform", "train.steps=8")
    records = read_metrics(config.run.dir)
    assert [r["step"] for r in records] == list(range(9))
    for r in records[1:]:
        assert r.keys() <= DOCUMENTED_KEYS, f"add to jaxreplay/train/metric_keys.py: {r.keys() - DOCUMENTED_KEYS}"
        diff = r["replay/inserts"] * config.replay.samples_per_insert - r["replay/samples"]
        offset = config.replay.samples_per_insert * config.replay.min_size_to_sample
        assert abs(diff - offset) <= config.error_buffer
        assert 0 < r["rollouts/waiting_max"] <= waiting_bound(config) or r["rollouts/waiting_max"] == 0
    assert records[-1]["replay/samples"] == 8 * config.train.batch_size
    assert any(r["engine/groups_in_flight"] for r in records[1:]), "the learner should step while rows are mid-sequence"
    assert any(r["batch/version_min"] < r["batch/version_max"] for r in records[1:])


def progress_at(run_dir, step: int) -> dict:
    """The checkpoint's `Progress`, as Orbax wrote it (JSON)."""
    for path in (run_dir / "checkpoints" / str(step)).rglob("*"):
        if path.is_file() and b"engine_in_flight" in path.read_bytes()[:100_000]:
            return json.loads(path.read_text())
    raise AssertionError(f"no progress in checkpoint {step}")


# A random policy rarely says EOS: completions run long, each group decoding over many chunks.
LONG = [*STREAM, "sampling.engine_chunk_steps=8", "warmstart.steps=0", "model.max_seq_len=160",
        "sampling.max_new_tokens=150", "checkpoint.every=1000", "train.steps=60"]


@pytest.mark.slow
def test_sigterm_during_a_long_generation_checkpoints_between_chunks_and_the_rows_in_flight_resume(tmp_path):
    """Each move of the colocated schedule decodes one chunk, and the stop signal is read between
    moves: a SIGTERM while groups are mid-sequence saves at once (the checkpoint records the
    groups in flight) and exits 143. The same command resumes: those groups are submitted again
    from their first token under the checkpoint's weights, and every step is recorded once."""
    run_dir = tmp_path / "run"
    command = Command(cli(run_dir, *LONG))
    wait_for_step(command.proc, run_dir, 2)
    command.proc.send_signal(signal.SIGTERM)
    status, stdout, stderr = command.finish()
    assert status == 128 + signal.SIGTERM, stderr[-2000:]
    step = logged_step(run_dir)
    assert_one_line(stderr, f"jaxreplay: stopped: SIGTERM: checkpoint at step {step} in ")
    assert checkpoint_steps(run_dir) == [step]
    saved = progress_at(run_dir, step)
    assert saved["engine_in_flight"], "the SIGTERM should land while groups are mid-sequence"
    assert saved["engine_started"] > max(saved["engine_in_flight"])
    assert assert_every_checkpoint_restores(run_dir) == [step]

    rerun = subprocess.run(cli(run_dir, *LONG[:-1], f"train.steps={step + 2}"), cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert f"resumed from step {step} " in rerun.stdout
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(step + 3))


@pytest.mark.slow
def test_a_disaggregated_streaming_run_bounds_its_waiting_rollouts_and_takes_weights_between_chunks(tmp_path):
    """The actor thread decodes a chunk only once the limiter admitted what it holds, and takes
    the learner's latest published weights before every chunk."""
    run_dir = tmp_path / "run"
    overrides = [*STREAM, "mesh.actor_devices=1", "train.steps=8", "train.weight_sync_every=1", "warmstart.steps=0"]
    result = subprocess.run(cli(run_dir, *overrides), cwd=ROOT, env=cpu_devices_env(2), capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "disaggregated: actor mesh" in result.stdout
    records = read_metrics(run_dir)[1:]
    assert [r["step"] for r in records] == list(range(1, 9))
    config = load_config(run_dir / "config.yaml")
    assert 0 < max(r["rollouts/waiting_max"] for r in records) <= waiting_bound(config)
    assert max(r["weights/version_at_actor"] for r in records) >= 2


@pytest.mark.slow
@needs_multiprocess_checkpoints
def test_a_two_process_streaming_job_stops_on_sigterm_and_resumes_every_processs_groups_in_flight(tmp_path):
    """Multi-host: each process streams through its own pool into its own shard; the processes
    complete groups at different chunks, and every one takes the agreed moves (each inserts what
    it has, all decode a chunk when none has rows waiting). A SIGTERM saves every process's
    engine position in the leader's checkpoint and all exit 143; the same command resumes each
    process from its own position and records every step once."""
    run_dir = tmp_path / "run"
    stream = [*STREAM, "checkpoint.every=1000", "distributed.timeout_s=120"]
    procs = _job(run_dir, *stream, "train.steps=400")
    try:
        wait_for_step(procs[0], run_dir, 2)
        procs[1].send_signal(signal.SIGTERM)  # one process's signal stops every process (agreed)
    finally:
        results = _finish(procs, 240)
    assert [rc for rc, _ in results] == [143, 143], [out[-2000:] for _, out in results]
    step = logged_step(run_dir)
    assert checkpoint_steps(run_dir) == [step]
    saved = progress_at(run_dir, step)
    positions = saved["engine_positions"]
    assert len(positions) == 2 and all(started > 0 for started, _ in positions), positions
    assert any(in_flight for _, in_flight in positions), "the SIGTERM should land while groups are mid-sequence"

    results = _finish(_job(run_dir, *stream, f"train.steps={step + 1}"), 240)
    assert [rc for rc, _ in results] == [0, 0], [out[-2000:] for _, out in results]
    assert f"resumed from step {step} " in results[0][1]
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(step + 2))
