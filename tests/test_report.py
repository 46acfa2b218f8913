"""`jaxreplay report` on small synthetic run dirs whose table entries are computed by hand."""

import json

import matplotlib.image
import pytest
import yaml

from jaxreplay.report import group_settings, load_runs, pick_baseline, report

STEPS = (0, 10, 20)


def _run(root, setting, seed, acc, tokens, mode="replay", pass4=None):
    d = root / setting / f"seed{seed}"
    d.mkdir(parents=True)
    config = {"replay": {"mode": mode, "samples_per_insert": 4.0 if setting == "spi4" else 2.0},
              "run": {"seed": seed, "dir": str(d)}}
    (d / "config.yaml").write_text(yaml.safe_dump(config))
    with open(d / "metrics.jsonl", "w") as f:
        for i, step in enumerate(STEPS):
            rec = {"step": step, "eval/accuracy": acc[i]}
            if step:
                rec.update({"tokens/generated": tokens[i], "compute/flops": 10.0 * tokens[i], "entropy": 1.0 - 0.01 * step,
                            "staleness/mean": 2.0, "replay/ratio": 2.0, "cost/mu": 0.5, "time/generate_s": step,
                            "time/train_s": step, "time/replay_s": 0.0, "staleness/hist": [3, 1, 0, 0, 0, 0, 0, 0, 0, 0]})
                if pass4 is not None:
                    rec["eval/pass@4"] = pass4[i]
            f.write(json.dumps(rec) + "\n")
    return d


@pytest.fixture
def sweep_dirs(tmp_path):
    root = tmp_path / "sweep"
    return [
        # Baseline seed-mean curve 0.1, 0.4, 0.5: target 0.5, first reached at step 20, 2000 tokens.
        _run(root, "on_policy", 0, [0.1, 0.3, 0.5], [0, 1000, 2000], mode="on_policy"),
        _run(root, "on_policy", 1, [0.1, 0.5, 0.5], [0, 1000, 2000], mode="on_policy"),
        # Reaches 0.5 at 500 tokens (seed 0) and 1000 tokens (seed 1): 0.25x and 0.5x the baseline.
        _run(root, "spi4", 0, [0.1, 0.6, 0.7], [0, 500, 1000], pass4=[0.2, 0.8, 0.9]),
        _run(root, "spi4", 1, [0.1, 0.2, 0.55], [0, 500, 1000], pass4=[0.2, 0.5, 0.7]),
        _run(root, "spi8", 0, [0.1, 0.2, 0.3], [0, 250, 500]),
    ]


def test_seeds_group_into_settings_and_the_on_policy_one_is_the_baseline(sweep_dirs):
    settings = group_settings(load_runs(sweep_dirs))
    assert [(s.name, len(s.runs)) for s in settings] == [("on_policy", 2), ("spi4", 2), ("spi8", 1)]
    assert pick_baseline(settings, None).name == "on_policy"
    with pytest.raises(ValueError, match="not one of the settings"):
        pick_baseline(settings, "spi16")


def test_table_gives_peak_accuracy_and_cost_to_the_baseline_peak_as_a_ratio(sweep_dirs, tmp_path):
    text = report(sweep_dirs, tmp_path / "out")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines()[2:]}
    header = text.splitlines()[0].split(" | ")
    assert "tokens to baseline peak (0.500), × baseline" in header
    base, spi4, spi8 = rows["on_policy (baseline)"], rows["spi4"], rows["spi8"]
    # Per-seed tokens / 2000: baseline seeds 1.0 and 0.5; spi4 seeds 0.25 and 0.5.
    assert header[4] == "peak pass@4"  # present because some run's eval computed it
    assert base[5] == "0.75 ± 0.25 (2/2 seeds)"
    assert spi4[2] == "0.625 ± 0.075"  # peak eval accuracy, mean ± std over seeds
    assert spi4[4] == "0.8 ± 0.1" and spi8[4] == "n/a"
    assert spi4[5] == "0.375 ± 0.12 (2/2 seeds)"  # tokens
    assert spi4[6] == "0.375 ± 0.12 (2/2 seeds)"  # compute is 10 x tokens in both: the same ratio
    assert spi8[5] == "never reaches 0.500" and spi8[6] == "never reaches 0.500"


def test_report_writes_markdown_and_readable_pngs(sweep_dirs, tmp_path):
    out = tmp_path / "out"
    report(sweep_dirs, out)
    md = (out / "report.md").read_text()
    for name in ("accuracy_vs_tokens", "accuracy_vs_compute", "accuracy_vs_wallclock", "entropy", "staleness",
                 "staleness_hist", "replay_ratio"):
        image = matplotlib.image.imread(out / f"{name}.png")
        assert image.shape[0] > 300 and image.shape[1] > 500, name
        assert image[..., :3].std() > 0.01, f"{name}.png is blank"
        assert f"]({name}.png)" in md


def test_a_folder_without_metrics_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a run dir"):
        load_runs([tmp_path])


def test_pass_at_k_of_the_final_policy_comes_from_eval_json(sweep_dirs, tmp_path):
    # As `jaxreplay eval ... --k 1,4 --out RUN_DIR/eval.json` writes it, for two of the five runs.
    (sweep_dirs[0] / "eval.json").write_text(json.dumps({"pass@1_t0.1": 0.5, "pass@k_t1.0": {"1": 0.4, "4": 0.7}}))
    (sweep_dirs[2] / "eval.json").write_text(json.dumps({"pass@1_t0.1": 0.6, "pass@k_t1.0": {"1": 0.5, "4": 0.9}}))
    lines = report(sweep_dirs, tmp_path / "out").splitlines()
    header = lines[0].split(" | ")
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in lines[2:]}
    col = header.index("final pass@4_t1.0 (jaxreplay eval)")
    assert rows["on_policy (baseline)"][col] == "0.7" and rows["spi4"][col] == "0.9" and rows["spi8"][col] == "n/a"
    # The two pass@1 values (temperatures 0.1 and 1.0) are two columns, each named with its temperature.
    finals = [name for name in header if name.startswith("final pass@")]
    assert finals == ["final pass@1_t0.1 (jaxreplay eval)", "final pass@1_t1.0 (jaxreplay eval)",
                      "final pass@4_t1.0 (jaxreplay eval)"]
    assert rows["spi4"][header.index("final pass@1_t0.1 (jaxreplay eval)")] == "0.6"
    assert rows["spi4"][header.index("final pass@1_t1.0 (jaxreplay eval)")] == "0.5"
