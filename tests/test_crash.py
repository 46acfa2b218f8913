"""Crash safety of the colocated loop: SIGKILL anywhere, SIGTERM, non-finite updates.

Real `jaxreplay train` processes on the tiny model of test_train, with the
deterministic replay settings of its exact-resume test (a narrow window, FIFO batches
or the in-process server's seeded draws), so a killed-and-restarted run can be
compared with a straight one number for number.
"""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from jaxreplay.config import load_config
from jaxreplay.learn.learner import make_optimizer
from jaxreplay.models.transformer import init_params
from jaxreplay.replay.server import serve
from jaxreplay.replay.tables import build_tables
from jaxreplay.rollout.actor import waiting_capacity
from jaxreplay.rollout.rollouts import row_spec
from jaxreplay.tasks.registry import make_task
from jaxreplay.train.checkpoint import Checkpointer
from jaxreplay.train.driver import train
from jaxreplay.train.metrics import read_metrics
from jaxreplay.train.run import checkpoint_tree

from test_train import DEMO, LEARNING, ROOT, TINY

DETERMINISTIC = ["replay.selector=fifo", "train.batch_size=4", "replay.samples_per_insert=1",
                 "replay.error_buffer=3", "replay.max_size=16", "replay.min_size_to_sample=16", *LEARNING]
EVERY = 2
STEPS = 40  # five kills, each a few steps past the checkpoint it resumed from, come well before the end
KILL = [*TINY, *DETERMINISTIC, f"train.steps={STEPS}", f"checkpoint.every={EVERY}", "checkpoint.keep=2",
        "train.eval_every=1000"]


def cli(run_dir: Path, *overrides: str) -> list[str]:
    return [sys.executable, "-m", "jaxreplay.cli", "train", str(DEMO), *KILL, *overrides, f"run.dir={run_dir}"]


def logged_step(run_dir: Path) -> int:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return -1
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")]  # a torn last line is skipped
    return max((json.loads(line)["step"] for line in lines), default=-1)


def checkpoint_steps(run_dir: Path) -> list[int]:
    """Finalised Orbax steps (a killed write stays a tmp directory with a longer name)."""
    directory = run_dir / "checkpoints"
    return sorted(int(p.name) for p in directory.iterdir() if p.name.isdigit()) if directory.exists() else []


def restored_state(run_dir: Path, step: int):
    config = load_config(run_dir / "config.yaml")
    _, params = init_params(config.model, 0)
    like = checkpoint_tree(params, make_optimizer(config.train).init(params), None,
                  row_spec(config, make_task(config.task).prompt_len), waiting_capacity(config))
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=config.checkpoint.keep)
    try:
        return checkpointer.restore(like, step=step)[0]
    finally:
        checkpointer.close()


def assert_every_checkpoint_restores(run_dir: Path) -> list[int]:
    """Every kept Orbax step restores, and so does the Reverb checkpoint it names,
    with the counters it was saved with. Returns the steps."""
    config = load_config(run_dir / "config.yaml")
    task = make_task(config.task)
    spec = row_spec(config, task.prompt_len)
    _, params = init_params(config.model, 0)
    like = checkpoint_tree(params, make_optimizer(config.train).init(params), None, spec, waiting_capacity(config))
    checkpointer = Checkpointer(run_dir / "checkpoints", keep=config.checkpoint.keep)
    try:
        steps = checkpoint_steps(run_dir)
        for step in steps:
            _, progress = checkpointer.restore(like, step=step)
            assert progress.learner_step == progress.policy_version == step
            with serve(build_tables(config, spec), checkpoint_root=run_dir / "replay",
                       restore_from=progress.replay_checkpoint) as server:
                assert server.states()[server.table].samples == step * config.train.batch_size
    finally:
        checkpointer.close()
    return steps


def where_killed(run_dir: Path) -> str:
    """What the leftovers say the run was doing when killed."""
    orbax = [p.name for p in (run_dir / "checkpoints").iterdir()] if (run_dir / "checkpoints").exists() else []
    replay = list((run_dir / "replay").iterdir()) if (run_dir / "replay").exists() else []
    if any("tmp" in name for name in orbax):
        return "orbax write"
    if any("-staging-" in p.name and any(p.iterdir()) for p in replay):
        return "replay write"
    if len([p for p in replay if not p.name.startswith(".")]) > len([n for n in orbax if n.isdigit()]):
        return "checkpoint write, replay saved (Orbax step not yet begun, or old steps being pruned)"
    return "generation, insert or train step"


def wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout_s: float = 240) -> None:
    deadline = time.monotonic() + timeout_s
    while logged_step(run_dir) < step:
        assert proc.poll() is None, f"the run ended (rc {proc.returncode}) before step {step}"
        assert time.monotonic() < deadline, f"no step {step} within {timeout_s}s"
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("backend", [pytest.param("reverb", marks=pytest.mark.needs_reverb), "inprocess"])
def test_a_run_killed_five_times_ends_like_a_straight_run(tmp_path, backend):
    """SIGKILL at 5 moments drawn from a seeded RNG: a few steps into each leg, then a
    random moment within the next 50 ms (a few steps of the tiny model), which lands in
    generation, a train step or a checkpoint write (every second step). Each restart
    with the same command resumes from the latest complete checkpoint (or starts over,
    if killed before the first), losing at most `checkpoint.every` steps.

    In process, what the learner samples comes from the server's seeded RNG, checkpointed
    with its table: there the uniform selector draws, and the run must end with exactly
    the params, optimizer state and losses of the straight run. Reverb's draws are not
    seeded: its runs take FIFO batches, the same in both."""
    if backend == "reverb":
        pytest.importorskip("reverb", reason="the reverb extra is not installed")
    settings = [f"replay.backend={backend}", *(["replay.selector=uniform"] if backend == "inprocess" else [])]
    straight = tmp_path / "straight"
    subprocess.run(cli(straight, *settings), check=True, cwd=ROOT, timeout=600, capture_output=True)

    killed = tmp_path / "killed"
    rng = np.random.default_rng(6)
    lost, where = [], []
    for _ in range(5):
        resumed_from = max(checkpoint_steps(killed), default=0)
        # The last leg's rows past its checkpoint are still in metrics.jsonl (this leg rewrites
        # them): only a step beyond them shows that this leg has resumed and trained.
        target = max(resumed_from, logged_step(killed)) + int(rng.integers(1, 4))
        proc = subprocess.Popen(cli(killed, *settings), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_step(proc, killed, target)
            # Checkpoint writes take most of a tiny model's time: after an odd step (no
            # checkpoint follows) kill at once, in the next generation or train step.
            time.sleep(rng.uniform(0.0, 0.02) if target % 2 else rng.uniform(0.0, 0.05))
        finally:
            proc.kill()
            proc.wait(timeout=60)
        reached = logged_step(killed)
        assert reached < STEPS, "the run finished before it was killed"
        where.append(where_killed(killed))
        saved = assert_every_checkpoint_restores(killed)
        assert max(saved, default=0) >= resumed_from  # none yet: a kill before the first checkpoint
        lost.append(reached - max(saved, default=0))
        assert 0 <= lost[-1] <= EVERY, (reached, saved)
    print(f"kills survived: {len(lost)}; steps lost per kill: {lost}; killed during: {where}")
    assert max(checkpoint_steps(killed)) >= 4 * EVERY, "the legs did not each train past a checkpoint"

    result = subprocess.run(cli(killed, *settings), cwd=ROOT, timeout=600, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    a, b = (json.loads((d / "summary.json").read_text()) for d in (straight, killed))
    for key in ("steps", "replay/inserts", "replay/samples", "tokens/generated", "tokens/trained"):
        assert a[key] == b[key], key
    assert [r["step"] for r in read_metrics(killed)] == list(range(STEPS + 1))  # each step once, in order
    ra, rb = read_metrics(straight)[-1], read_metrics(killed)[-1]
    assert ra["policy_version"] == rb["policy_version"] == STEPS
    assert ra["loss"] == pytest.approx(rb["loss"], rel=1e-6)  # same params, same batch
    assert assert_every_checkpoint_restores(killed) == [STEPS - 2, STEPS]
    # Killed writes leave nothing behind: no Orbax tmp steps, no staging dirs of dead Reverb servers.
    assert sorted(p.name for p in (killed / "checkpoints").iterdir()) == [str(STEPS - 2), str(STEPS)]
    assert len([p for p in (killed / "replay").iterdir()]) == 2
    if backend == "inprocess":
        assert [r["loss"] for r in read_metrics(straight)[1:]] == [r["loss"] for r in read_metrics(killed)[1:]]
        a, b = restored_state(straight, STEPS), restored_state(killed, STEPS)
        for x, y in zip(jax.tree.leaves((a["params"], a["opt_state"])), jax.tree.leaves((b["params"], b["opt_state"]))):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.tier
@pytest.mark.slow
def test_sigterm_saves_a_final_checkpoint_and_exits_143(tmp_path):
    proc = subprocess.Popen(cli(tmp_path, "checkpoint.every=1000"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step(proc, tmp_path, 3)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGTERM, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith("jaxreplay: stopped: SIGTERM: checkpoint at step ")
    reached = logged_step(tmp_path)
    assert assert_every_checkpoint_restores(tmp_path) == [reached]


@pytest.mark.slow
def test_non_finite_updates_are_skipped_then_stop_the_run_with_good_checkpoints(tmp_path):
    """A learning rate that overflows float32 makes every update after step 8 non-finite:
    each is skipped (params and optimizer state unchanged) and counted, and the third
    in a row stops the run before its checkpoint."""
    good = [*KILL, "train.max_nonfinite_steps=3", "train.warmup_steps=0", f"run.dir={tmp_path}"]
    train(load_config(DEMO, [*good, "train.steps=8"]), log=lambda _: None)  # checkpoints at 2, 4, 6, 8
    from jaxreplay.train.guards import NonFiniteError

    with pytest.raises(NonFiniteError, match="3 consecutive learner steps"):
        train(load_config(DEMO, [*good, "train.steps=16", "train.learning_rate=1e39"]), log=lambda _: None)
    records = read_metrics(tmp_path)
    assert [r["nonfinite"] for r in records[1:]] == [0] * 8 + [1, 1, 1]
    assert [r["train/nonfinite_steps"] for r in records[9:]] == [1, 2, 3]
    assert assert_every_checkpoint_restores(tmp_path) == [8, 10]  # none at 11, where it stopped
    at_8, at_10 = (restored_state(tmp_path, step) for step in (8, 10))
    for x, y in zip(*(jax.tree.leaves((s["params"], s["opt_state"])) for s in (at_8, at_10))):
        assert np.isfinite(x).all()
        np.testing.assert_array_equal(x, y)


# A second client of a run's table: it takes every sample the limiter admits.
GREEDY_CLIENT = ("import sys, reverb\n"
                 "client = reverb.Client(sys.argv[1])\n"
                 "while True:\n"
                 "    client._client.NewSampler('rollouts', 1, 1).GetNextTrajectory()\n")


@pytest.mark.needs_reverb
@pytest.mark.slow
def test_a_pinned_port_refuses_a_second_run_and_a_second_client_ends_the_run(tmp_path):
    """Run A serves on a pinned replay.port. A second run there is refused at once with
    one line naming the port (gRPC's SO_REUSEPORT would let it bind, and clients would be
    split between the two). A second client sampling A's table takes samples A's loop
    counted on: A's sampler then waits in Reverb with no timeout of its own; A must end
    with one line saying another client uses its table, not hang."""
    pytest.importorskip("reverb", reason="the reverb extra is not installed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "jaxreplay.cli", "train", str(DEMO), *TINY, "replay.backend=reverb",
            f"replay.port={port}", "replay.timeout_s=5", "train.steps=100000", "checkpoint.every=1000",
            "train.eval_every=1000"]
    run_a = subprocess.Popen([*args, f"run.dir={tmp_path / 'a'}"], cwd=ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True)
    client = None
    try:
        wait_for_step(run_a, tmp_path / "a", 1)
        run_b = subprocess.run([*args, f"run.dir={tmp_path / 'b'}"], cwd=ROOT, capture_output=True, text=True,
                               timeout=120)
        assert run_b.returncode == 2, run_b.stderr
        assert run_b.stderr.strip().splitlines()[-1] == (
            f"jaxreplay: error: replay.port: {port} is in use by another jaxreplay run (pid {run_a.pid}); "
            "choose another port, or 0 for a free one")
        assert not (tmp_path / "b" / "metrics.jsonl").exists()

        client = subprocess.Popen([sys.executable, "-c", GREEDY_CLIENT, f"localhost:{port}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, stderr = run_a.communicate(timeout=120)
    finally:
        run_a.kill()
        if client is not None:
            client.kill()
            client.wait(timeout=60)
    assert run_a.returncode == 1, stderr
    assert "Traceback" not in stderr
    assert stderr.strip().splitlines()[-1].startswith(
        "jaxreplay: error: table 'rollouts' was changed by another client")


@pytest.mark.needs_reverb
def test_a_dead_reverb_server_ends_inserts_and_samples_within_the_timeout():
    """What a learner or actor sees when the server it talks to is gone (disaggregated
    and multi-host runs): ReplayTimeoutError after the timeout, not a hang."""
    pytest.importorskip("reverb", reason="the reverb extra is not installed")
    from jaxreplay.replay.reader import reader_for
    from jaxreplay.replay.tables import ReplayTimeoutError
    from jaxreplay.replay.writer import writer_for

    config = load_config(DEMO, ["replay.backend=reverb", "replay.timeout_s=2"])
    spec = row_spec(config, make_task(config.task).prompt_len)
    server = serve(build_tables(config, spec), timeout_s=2)
    writer, reader = writer_for(server, config, spec), reader_for(server, config)
    server.stop()
    rows = {k: np.zeros((4, *shape), dtype) for k, (shape, dtype) in spec.items()}
    for call, limit_s in [(lambda: writer.insert(rows), 2 * 2 + 2), (lambda: reader.sample(4), 2 + 2)]:
        start = time.monotonic()
        with pytest.raises(ReplayTimeoutError, match="did not report its tables within 2s"):
            call()
        assert time.monotonic() - start < limit_s
