"""`jaxreplay eval`: the unbiased pass@k estimator, and pass@1 / pass@k of a run's Orbax checkpoint
equal to those of the same weights exported as a Hugging Face directory."""

import json
import shutil
from math import comb
from pathlib import Path

import numpy as np
import pytest

from gcs_emulator import bucket, gcs_emulator  # noqa: F401 - fixtures
from jaxreplay.cli import main
from jaxreplay.config import load_config
from jaxreplay.learn.learner import make_optimizer
from jaxreplay.models.transformer import init_params
from jaxreplay.rollout.rollouts import row_spec
from jaxreplay.tasks.registry import make_task
from jaxreplay.train.checkpoint import Checkpointer
from jaxreplay.train.driver import train
from jaxreplay.train.eval import pass_at_k
from jaxreplay.train.run import checkpoint_tree

ROOT = Path(__file__).resolve().parents[1]

# A tiny model warm-started on one-digit sums: accuracy well above 0 and below 1.
RUN = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
    "model.d_ff=64", "task.min_digits=1", "task.max_digits=1", "task.eval_size=40", "warmstart.steps=300",
    "warmstart.learning_rate=3e-3", "train.batch_size=16", "train.prompts_per_step=4", "train.group_size=4",
    "train.eval_every=2", "replay.max_size=64", "replay.min_size_to_sample=32", "checkpoint.every=2",
    "train.steps=2", "run.progress_bar=false",
]


@pytest.mark.parametrize("n", [1, 2, 5, 10, 16])
def test_pass_at_k_is_the_unbiased_estimator(n):
    """1 - C(n-c, k) / C(n, k): the chance that k of the n samples, drawn without replacement, hold a correct one."""
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(1 - comb(n - c, k) / comb(n, k), abs=1e-12)
    assert pass_at_k(n, 0, 1) == 0.0 and pass_at_k(n, n, 1) == 1.0


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(10, 2, 5) == pytest.approx(1 - 56 / 252)
    with pytest.raises(ValueError, match="0 < k <= n"):
        pass_at_k(4, 1, 8)


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, object]:
    """(run dir, config) of a tiny warm-started run of 2 steps; tests only read it."""
    run_dir = tmp_path_factory.mktemp("eval") / "run"
    config = load_config(ROOT / "configs" / "demo.yaml", [*RUN, f"run.dir={run_dir}"])
    train(config, log=lambda _: None)
    return run_dir, config


@pytest.mark.slow
def test_eval_of_a_checkpoint_equals_eval_of_its_hf_export(trained, tmp_path, capsys):
    from jaxreplay.models.hf import save_hf_model

    run_dir, config = trained
    config_file = run_dir / "config.yaml"

    out = tmp_path / "from_checkpoint.json"
    assert main(["eval", str(config_file), "--checkpoint", str(run_dir), "--k", "1,4", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    results = json.loads(out.read_text())
    assert printed == {k: v for k, v in results.items() if k != "correct_per_problem"}
    assert results["step"] == 2 and results["problems"] == 40
    assert results["pass@1_t0.1_settings"] == {"temperature": 0.1, "top_p": 0.95, "samples_per_problem": 1}
    assert results["pass@k_t1.0_settings"] == {"temperature": 1.0, "top_p": 1.0, "samples_per_problem": 4}
    correct = np.array(results["correct_per_problem"])
    assert results["pass@k_t1.0"]["1"] == pytest.approx(correct.mean() / 4)
    assert results["pass@k_t1.0"]["4"] == pytest.approx((correct > 0).mean())
    assert 0 < results["pass@1_t0.1"] < 1 and results["pass@k_t1.0"]["1"] <= results["pass@k_t1.0"]["4"]

    # The same weights, restored with the optimizer state and everything else, then exported.
    task = make_task(config.task)
    graphdef, params = init_params(config.model, config.run.seed)
    like = checkpoint_tree(params, make_optimizer(config.train).init(params), None, row_spec(config, task.prompt_len),
                  config.rollouts_per_step)
    state, _ = Checkpointer(run_dir / "checkpoints", keep=2).restore(like)
    hf_dir = save_hf_model(tmp_path / "hf", config.model, state["params"])
    out_hf = tmp_path / "from_hf.json"
    assert main(["eval", str(config_file), "--hf", str(hf_dir), "--k", "1,4", "--out", str(out_hf)]) == 0
    from_hf = json.loads(out_hf.read_text())
    for key in ("pass@1_t0.1", "pass@k_t1.0", "correct_per_problem"):
        assert from_hf[key] == results[key]


def _results(path: Path) -> dict:
    return {k: v for k, v in json.loads(path.read_text()).items() if k not in ("seconds", "checkpoint")}


@pytest.mark.slow
def test_eval_and_export_of_a_run_dir_read_its_config_yaml(trained, tmp_path, capsys):
    """`eval RUN_DIR` and `export RUN_DIR` are the older `CONFIG --checkpoint RUN_DIR` forms with
    the run's config.yaml: the same results, the same files. The run's model is not the demo's,
    so a wrong config could not restore it."""
    run_dir, _ = trained
    config_file = str(run_dir / "config.yaml")
    assert main(["eval", str(run_dir), "--out", str(tmp_path / "new.json")]) == 0
    assert main(["eval", config_file, "--checkpoint", str(run_dir), "--out", str(tmp_path / "old.json")]) == 0
    new = _results(tmp_path / "new.json")
    assert new == _results(tmp_path / "old.json") and new["step"] == 2 and new["problems"] == 40
    assert json.loads((tmp_path / "new.json").read_text())["checkpoint"] == str(run_dir / "checkpoints")

    assert main(["export", str(run_dir), "--out", str(tmp_path / "hf_new")]) == 0
    assert main(["export", config_file, "--checkpoint", str(run_dir), "--out", str(tmp_path / "hf_old")]) == 0
    files = sorted(p.name for p in (tmp_path / "hf_new").iterdir())
    assert "config.json" in files and files == sorted(p.name for p in (tmp_path / "hf_old").iterdir())
    for name in files:
        assert (tmp_path / "hf_new" / name).read_bytes() == (tmp_path / "hf_old" / name).read_bytes(), name



@pytest.mark.slow
def test_export_of_a_policy_without_adapters_removes_an_earlier_exports_adapters(trained, tmp_path):
    """Exporting into a directory that an earlier LoRA export filled leaves no adapter of that policy
    beside this one's weights: PEFT's two files go, the folder with them when nothing else is in it."""
    from jaxreplay.models.hf import PEFT_CONFIG, PEFT_WEIGHTS
    from jaxreplay.tools.export import ADAPTER_DIR

    run_dir, _ = trained
    for out, keep in [(tmp_path / "only_adapters", None), (tmp_path / "with_notes", "notes.txt")]:
        adapter = out / ADAPTER_DIR
        adapter.mkdir(parents=True)
        for name in (PEFT_CONFIG, PEFT_WEIGHTS) + ((keep,) if keep else ()):
            (adapter / name).write_text("from an earlier export")
        assert main(["export", str(run_dir), "--out", str(out)]) == 0
        assert (out / "config.json").is_file()
        if keep is None:
            assert not adapter.exists()
        else:
            assert sorted(p.name for p in adapter.iterdir()) == [keep]

@pytest.mark.slow
@pytest.mark.parametrize("marked", [True, False], ids=["steps marked", "steps unmarked as orbax 0.12.0 leaves them"])
def test_eval_of_a_bucket_run_dir_reads_its_config_yaml(trained, bucket, tmp_path, marked):
    """The same run dir in a bucket (gs://, the GCS emulator): the same results as on disk, also
    where its Orbax marked no step finished on the disk (orbax-checkpoint 0.12.0, the GPU image's)."""
    from jaxreplay import storage

    run_dir, _ = trained
    if not marked:
        shutil.copytree(run_dir, tmp_path / "copy")
        for marker in (tmp_path / "copy").glob("checkpoints/*/commit_success.txt"):
            marker.unlink()
        storage.upload(tmp_path / "copy", bucket)
    else:
        storage.upload(run_dir, bucket)
    assert main(["eval", bucket, "--out", str(tmp_path / "bucket.json")]) == 0
    assert main(["eval", str(run_dir), "--out", str(tmp_path / "disk.json")]) == 0
    assert _results(tmp_path / "bucket.json") == _results(tmp_path / "disk.json")
    assert json.loads((tmp_path / "bucket.json").read_text())["checkpoint"] == f"{bucket}/checkpoints"


def test_eval_needs_exactly_one_source(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["eval", str(ROOT / "configs" / "demo.yaml")])
    assert "one of the arguments --checkpoint --hf is required" in capsys.readouterr().err
    assert main(["eval", str(ROOT / "configs" / "demo.yaml"), "--checkpoint", str(tmp_path)]) == 2
    assert "no complete checkpoint" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["eval", str(ROOT / "configs" / "demo.yaml"), "--hf", str(tmp_path), "--k", "1,0"])
    assert "every k must be >= 1" in capsys.readouterr().err
    for command in (["eval", str(tmp_path)], ["export", str(tmp_path), "--out", str(tmp_path / "out")]):
        with pytest.raises(SystemExit) as e:  # a directory, but no run's: it holds no config.yaml
            main(command)
        assert e.value.code == 2 and capsys.readouterr().err == (
            f"jaxreplay: usage error: {command[0]}: {tmp_path} is a directory without config.yaml, so not a run "
            f"directory; give the run's directory, or a config file and --checkpoint RUN_DIR (see jaxreplay "
            f"{command[0]} --help)\n")


def test_more_samples_per_problem_than_a_sampling_batch_is_a_clear_error():
    from jaxreplay.train.eval import count_correct

    with pytest.raises(ValueError, match=r"16 samples per problem do not fit a sampling batch of 8 rows \(raise --batch\)"):
        count_correct(None, None, None, 16, None, batch=8)


def _jsonl_eval(tmp_path, *extra):
    """`jaxreplay eval --hf` of a tiny model on a dev split with its chat template: the model
    directory given by --hf alone, and no training split on disk (eval never reads it)."""
    from tiny_hf import write_model

    model = write_model(tmp_path / "hf")
    (tmp_path / "dev.jsonl").write_text("".join(json.dumps({"q": f"{i}+{i}=", "a": str(2 * i)}) + "\n"
                                                for i in range(3)))
    out = tmp_path / "results.json"
    overrides = ["task.name=jsonl", f"task.path={tmp_path}/{{split}}.jsonl", "task.prompt_field=q",
                 "task.answer_field=a", "task.chat_template=true", "task.max_prompt_len=48", "warmstart.steps=0",
                 "sampling.max_new_tokens=8", "model.max_seq_len=64", *extra]
    code = main(["eval", str(ROOT / "configs" / "demo.yaml"), *overrides, "--hf", str(model), "--split", "dev",
                 "--k", "1,2", "--batch", "8", "--out", str(out)])
    return code, model, out


def test_eval_of_an_hf_directory_needs_only_hf_and_no_training_split(tmp_path, capsys):
    code, model, out = _jsonl_eval(tmp_path)
    assert code == 0, capsys.readouterr().err
    assert not (tmp_path / "train.jsonl").exists()
    results = json.loads(out.read_text())
    assert (results["task"], results["split"], results["hf"], results["problems"]) == ("jsonl", "dev", str(model), 3)
    assert len(results["correct_per_problem"]) == 3 and results["reward/errors"] == 0
    # Two different pass@1 values (temperature 0.1, and 1.0 within pass@k): each key names its temperature.
    assert "pass@1" not in results and "pass@k" not in results
    assert set(results["pass@k_t1.0"]) == {"1", "2"} and 0 <= results["pass@1_t0.1"] <= 1
    assert results["pass@1_t0.1_settings"]["temperature"] == 0.1
    assert results["pass@k_t1.0_settings"]["temperature"] == 1.0


def test_eval_progress_bar_follows_run_progress_bar(tmp_path, capsys):
    """A bar over every sample drawn (3 problems x (1 + 2) samples), none with run.progress_bar=false."""
    code, _, _ = _jsonl_eval(tmp_path / "on")
    err = capsys.readouterr().err
    assert code == 0 and "eval: 100%" in err and "9/9" in err
    code, _, _ = _jsonl_eval(tmp_path / "off", "run.progress_bar=false")
    assert code == 0 and "eval:" not in capsys.readouterr().err
