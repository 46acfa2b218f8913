"""Multi-host SPMD: two processes on localhost stand in for a TPU pod (2 CPU devices each).

Every process inserts its own rollouts and samples its share of each global batch, and all
take the same learner steps. Replay is sharded (each process keeps its own shard; the
limiter decides from the summed counters) or, where Reverb is installed and asked for,
one Reverb table served by process 0.
"""

import importlib.util
import json
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest

from jaxreplay.config import ConfigError, load_config
from conftest import cpu_devices_env

HAVE_REVERB = importlib.util.find_spec("reverb") is not None
needs_reverb = pytest.mark.needs_reverb  # tests/conftest.py skips it where dm-reverb is not installed

ROOT = Path(__file__).resolve().parents[1]

# A tiny policy that a 300-step warm start brings to a few correct one-digit sums, so
# groups of 8 samples have rewards that differ and the learner's gradients are not zero.
TINY = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
    "model.d_ff=64", "task.min_digits=1", "task.max_digits=1", "task.eval_size=16",
    "warmstart.steps=300", "warmstart.learning_rate=0.01", "warmstart.batch_size=32",
    "train.steps=4", "train.batch_size=16", "train.prompts_per_step=4", "train.group_size=8",
    "train.warmup_steps=0", "train.eval_every=100",
    "replay.max_size=64", "replay.min_size_to_sample=8", "replay.samples_per_insert=1",
    "mesh.data=-1", "run.progress_bar=false",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(run_dir: Path, num_processes: int, timeout_s: float, coordination_timeout_s: float = 60,
            per_process: Optional[dict[int, list[str]]] = None) -> list[subprocess.CompletedProcess]:
    """Runs `jaxreplay train` once per process, as a pod's workers would; kills all past the timeout."""
    common = [*TINY, f"run.dir={run_dir}", "distributed.enabled=true", f"distributed.num_processes={num_processes}",
              f"distributed.coordinator_address=127.0.0.1:{_free_port()}",
              f"distributed.timeout_s={coordination_timeout_s}"]
    procs = [
        subprocess.Popen([sys.executable, "-m", "jaxreplay.cli", "--debug", "train", "configs/demo.yaml", *common,
                          f"distributed.process_id={i}", *(per_process or {}).get(i, [])], cwd=ROOT,
                         env=cpu_devices_env(2), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(num_processes)
    ]
    deadline = time.monotonic() + timeout_s
    results = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            results.append(subprocess.CompletedProcess(p.args, p.returncode, out))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results


def _assert_all_succeeded(results: list[subprocess.CompletedProcess], run_dir: Path) -> None:
    """Every process exited 0; otherwise every process's tail and the native log's, since the
    first to fail is often not the one that reports it (a peer sees only a closed connection)."""
    if any(r.returncode != 0 for r in results):
        tails = [f"--- process {i} (exit {r.returncode}):\n{r.stdout[-2500:]}" for i, r in enumerate(results)]
        native = run_dir / "native.log"
        if native.exists():
            tails.append(f"--- {native.name}:\n{native.read_text()[-2500:]}")
        pytest.fail("not every process succeeded:\n" + "\n".join(tails))


# Sharded replay: `auto` picks it where Reverb is not installed; on the Reverb lane it is asked for.
SHARDED = [] if not HAVE_REVERB else ["replay.backend=inprocess"]


@pytest.mark.slow
@pytest.mark.parametrize("backend, overrides", [
    ("inprocess", SHARDED),  # ShardedReplay
    # CentralReplay: in process on the Reverb lane; through sidecars on the default tier (process 0's
    # serves the table, process 1's holds only a Reverb client to its port)
    pytest.param("reverb", ["replay.backend=reverb"], marks=pytest.mark.reverb),
])
def test_two_processes_train_the_same_params_at_the_target_replay_ratio(tmp_path, backend, overrides):
    results = _launch(tmp_path, num_processes=2, timeout_s=400,
                      per_process={i: ["replay.samples_per_insert=2", *overrides] for i in range(2)})
    _assert_all_succeeded(results, tmp_path)

    processes = [json.loads((tmp_path / f"process-{i}.json").read_text()) for i in range(2)]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [p["replay/backend"] for p in processes] == [backend, backend]
    # Every process took every learner step, and the params moved, identically on both.
    assert [p["steps"] for p in processes] == [4, 4]
    assert processes[0]["params_sha256"] == processes[1]["params_sha256"]
    assert processes[0]["params_sha256"] != processes[0]["params_sha256_start"]
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(m["grad_norm"] > 0 for m in metrics if m["step"] > 0)  # step 0: the evaluation at the start
    # The table holds the rollouts of both: each inserted its own, as many as the other,
    # and sampled half of every batch of 16; the limiter counted both.
    inserted = [p["rows_inserted"] for p in processes]
    assert inserted[0] > 0 and inserted[0] == inserted[1]
    assert summary["replay/inserts"] == sum(inserted)
    assert [p["rows_sampled"] for p in processes] == [4 * 8, 4 * 8]
    assert summary["replay/samples"] == 4 * 16
    assert summary["replay/samples_per_insert_target"] == 2.0
    assert abs(summary["replay/ratio"] / 2.0 - 1) <= 0.1, summary["replay/ratio"]


@pytest.mark.slow
@pytest.mark.reverb
def test_two_processes_on_one_reverb_table_resume_from_its_checkpoint(tmp_path):
    """Process 0's Reverb checkpoint, taken in its sidecar with each step's (default tier), restores the table's counters on a rerun of the same command with more steps."""
    if HAVE_REVERB:
        pytest.skip("the Reverb lane's Orbax cannot save from several processes (docs/pods.md): nothing to resume")
    first = ["replay.backend=reverb", "checkpoint.every=2"]
    _assert_all_succeeded(_launch(tmp_path, num_processes=2, timeout_s=400,
                                  per_process={i: first for i in range(2)}), tmp_path)
    results = _launch(tmp_path, num_processes=2, timeout_s=400,
                      per_process={i: [*first, "train.steps=6"] for i in range(2)})
    _assert_all_succeeded(results, tmp_path)
    assert "resumed from step 4" in results[0].stdout, results[0].stdout[-3000:]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["replay/backend"] == "reverb"
    assert summary["replay/samples"] == 6 * 16  # the first run's 4 batches of 16 were restored with the table
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 6


@pytest.mark.tier
@pytest.mark.slow
def test_a_process_that_fails_ends_the_job_in_seconds_not_timeouts(tmp_path):
    """Process 1 starts from other weights: placing them on the global mesh fails (JAX's check
    that every process passes the same value; whichever process compares first raises, the
    other is ended by the failed peer), and both exit long before the 600 s coordination timeout."""
    start = time.monotonic()
    results = _launch(tmp_path, num_processes=2, timeout_s=400, coordination_timeout_s=600,
                      per_process={1: ["run.seed=1"]})
    elapsed = time.monotonic() - start
    assert [r.returncode != 0 for r in results] == [True, True]
    assert elapsed < 300, f"the job took {elapsed:.0f}s to fail"
    raised = [i for i, r in enumerate(results) if f"jaxreplay: error: process {i}: AssertionError" in r.stdout]
    assert raised, [r.stdout[-1500:] for r in results]
    assert "Traceback" in (tmp_path / f"process-{raised[0]}.error").read_text()
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("override, key", [
    ("distributed.coordinator_address=localhost", "distributed.coordinator_address"),
    ("distributed.replay_address=host:99999", "distributed.replay_address"),
    ("distributed.process_id=2", "distributed.process_id"),
    ("distributed.timeout_s=0", "distributed.timeout_s"),
])
def test_bad_distributed_settings_are_rejected_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config("configs/demo.yaml", ["distributed.num_processes=2", override])


# A small sharded table: shards of 8 rows, batches of 4 per process, 4 rows per process per act.
SHARD_CFG = ["train.steps=6", "train.batch_size=8", "train.prompts_per_step=2", "train.group_size=4",
             "replay.max_size=16", "replay.min_size_to_sample=4", "replay.samples_per_insert=2"]


def _start_workers(out: Path, per_process: list[list[str]], worker: str = "sharded_replay_worker.py",
                   devices: int = 1) -> list[subprocess.CompletedProcess]:
    """A worker script of tests/ on 2 processes joined by a real coordination service."""
    address = f"127.0.0.1:{_free_port()}"
    env = cpu_devices_env(devices)
    procs = [subprocess.Popen([sys.executable, str(ROOT / "tests" / worker), str(i), "2", address,
                               str(out), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i, args in enumerate(per_process)]
    try:
        outputs = [p.communicate(timeout=120)[0] for p in procs]
        return [subprocess.CompletedProcess(p.args, p.returncode, out) for p, out in zip(procs, outputs)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _run_sharded_workers(out: Path, overrides: list[str]) -> list[dict]:
    _assert_all_succeeded(_start_workers(out, [overrides, overrides]), out)
    return [json.loads((out / f"process-{i}.json").read_text()) for i in range(2)]


@pytest.mark.tier
@pytest.mark.slow
def test_back_to_back_gathers_of_unequal_sizes_keep_every_process_in_step(tmp_path):
    """Every process's rows, and global arrays read whole, many times over on 2 devices per process:
    no device runs ahead into the next gather (gloo aborted such jobs on jax 0.4.34's CPU client)."""
    results = _start_workers(tmp_path, [["400"], ["400"]], worker="gather_worker.py", devices=2)
    _assert_all_succeeded(results, tmp_path)
    for i in range(2):
        assert json.loads((tmp_path / f"process-{i}.json").read_text()) == {"rounds": 400, "wrong": []}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("sharded")
    return out, _run_sharded_workers(out, SHARD_CFG)


def test_sharded_replay_decides_alike_on_every_process_from_the_summed_counters(sharded_run):
    _, reports = sharded_run
    turns = reports[0]["turns"]
    # The same global state, hence the same move, on both processes at every turn.
    assert turns == reports[1]["turns"]
    assert {t["move"]["kind"] for t in turns} == {"act", "insert", "learn"}
    # Each turn's counters are both processes' calls so far, not one shard's.
    inserts = samples = 0
    for t in turns:
        assert (t["state"]["inserts"], t["state"]["samples"]) == (inserts, samples)
        assert t["state"]["max_size"] == 16 and t["state"]["samples_per_insert"] == 2.0
        inserts += 2 * t["move"].get("rows", 0)
        samples += 8 * (t["move"]["kind"] == "learn")
    final = reports[0]["final"]
    assert (final["inserts"], final["samples"]) == (inserts, samples)
    for report in reports:
        assert report["local"]["inserts"] == report["inserted"] == inserts // 2
        assert report["local"]["samples"] == samples // 2 and report["local"]["max_size"] == 8
        assert report["final"] == final


def test_each_process_samples_only_its_own_shard_and_checkpoints_it(sharded_run):
    out, reports = sharded_run
    for pid, report in enumerate(reports):
        assert len(report["samples"]) == 6
        seen = 0  # rows this process had inserted when it took each batch
        batches = iter(report["samples"])
        for t in report["turns"]:
            seen += t["move"].get("rows", 0)
            if t["move"]["kind"] == "learn":
                batch = next(batches)
                assert batch["origin"] == [pid] * 4  # B / P rows, all from this process
                # ... from its shard: its freshest 8 rows (FIFO eviction per shard)
                assert all(max(0, seen - 8) <= s < seen for s in batch["serial"]), (seen, batch)
        # A shard checkpoints and restores on its own, items and counters.
        assert report["restored_local"] == report["local"]
        assert report["restored_final"] == report["final"]
    assert sorted(p.name for p in (out / "replay").iterdir()) == ["shard-0", "shard-1"]


@pytest.fixture
def without_reverb(monkeypatch):
    """The default tier: `import reverb` would fail, so `replay.backend=auto` is in-process."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "reverb" else real(name, *a))


MULTI = ["distributed.enabled=true", "distributed.num_processes=2", "train.batch_size=16",
         "replay.max_size=64", "replay.min_size_to_sample=16"]


@pytest.mark.parametrize("backend", ["auto", "inprocess"])
@pytest.mark.parametrize("overrides, key", [
    (["replay.selector=prioritized"], "replay.selector"),
    (["replay.positive_fraction=0.25"], "replay.positive_fraction"),
    (["replay.max_times_sampled=2"], "replay.max_times_sampled"),  # uniform
    (["replay.selector=fifo"], "replay.selector"),  # each shard would repeat its own oldest row
    (["replay.selector=lifo", "replay.max_times_sampled=2"], "replay.max_times_sampled"),
    (["replay.max_size=63"], "replay.max_size"),
])
def test_sharded_replay_rejects_settings_whose_meaning_would_change(without_reverb, backend, overrides, key):
    with pytest.raises(ConfigError, match=rf"^{key}: .*sharded replay"):
        load_config("configs/demo.yaml", [*MULTI, f"replay.backend={backend}", *overrides])


@pytest.mark.parametrize("overrides", [
    [], ["replay.mode=on_policy", "replay.selector=prioritized"],  # the on-policy queue ignores the selector
])
def test_sharded_replay_accepts_settings_that_keep_their_meaning(without_reverb, overrides):
    config = load_config("configs/demo.yaml", [*MULTI, *overrides])
    assert config.replay.backend == "auto"


def test_one_process_keeps_every_selector_on_the_in_process_backend(without_reverb):
    assert load_config("configs/demo.yaml", ["replay.selector=prioritized"]).replay.selector == "prioritized"


@needs_reverb
def test_auto_is_the_central_reverb_table_where_reverb_is_installed():
    """It keeps the settings sharding would change; positive bias is not supported multi-host yet."""
    assert load_config("configs/demo.yaml", [*MULTI, "replay.selector=prioritized"]).replay.selector == "prioritized"
    with pytest.raises(ConfigError, match="^replay.positive_fraction: .*not supported multi-host yet"):
        load_config("configs/demo.yaml", [*MULTI, "replay.positive_fraction=0.25"])


@needs_reverb
def test_processes_that_resolve_the_backend_differently_stop_with_a_config_error(tmp_path):
    """As `auto` would where only some hosts have Reverb: both name the key instead of waiting on each other."""
    results = _start_workers(tmp_path, [["--open", "replay.backend=inprocess"], ["--open", "replay.backend=reverb"]])
    for result in results:
        assert result.returncode != 0
        assert "ConfigError: replay.backend: " in result.stdout, result.stdout[-2000:]
        assert "different backends: inprocess on process 0, reverb on process 1" in result.stdout


@pytest.mark.slow
def test_every_process_takes_the_leaders_calibrated_ratio(tmp_path):
    """replay.calibrate_steps multi-host: all processes measure together (the calls are collective),
    the leader's figures set one samples_per_insert for the whole job, recorded once."""
    results = _launch(tmp_path, num_processes=2, timeout_s=400,
                      per_process={i: ["replay.calibrate_steps=1", *SHARDED] for i in range(2)})
    _assert_all_succeeded(results, tmp_path)
    calibration = json.loads((tmp_path / "calibration.json").read_text())
    targets = [json.loads((tmp_path / f"process-{i}.json").read_text())["replay/samples_per_insert_target"]
               for i in range(2)]
    assert targets == [calibration["samples_per_insert"]] * 2
    assert "calibration: mu" in results[0].stdout


@pytest.mark.slow
def test_two_processes_train_released_weights(tmp_path):
    """model.hf_path multi-host: every process reads its shards of the HF weights onto the global mesh."""
    import yaml
    from tiny_hf import write_model

    write_model(tmp_path / "hf")
    for split in ("train", "test"):
        (tmp_path / f"{split}.jsonl").write_text(
            "".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(8)))
    hf = [f"model.hf_path={tmp_path / 'hf'}", "model.max_seq_len=48", "task.name=jsonl",
          f"task.path={tmp_path}/{{split}}.jsonl", "task.reward=exact_match", "task.chat_template=true",
          "task.max_prompt_len=40", "sampling.max_new_tokens=2", "warmstart.steps=0", *SHARDED]
    run = tmp_path / "run"
    results = _launch(run, num_processes=2, timeout_s=400, per_process={i: hf for i in range(2)})
    _assert_all_succeeded(results, run)
    assert f"loaded {tmp_path / 'hf'}" in results[0].stdout
    processes = [json.loads((run / f"process-{i}.json").read_text()) for i in range(2)]
    assert [p["steps"] for p in processes] == [4, 4]
    assert processes[0]["params_sha256"] == processes[1]["params_sha256"]
    recorded = yaml.safe_load((run / "config.yaml").read_text())["model"]
    assert recorded["d_model"] == 32 and recorded["hf_path"] == str(tmp_path / "hf")  # the architecture it ran
