"""samples_per_insert from the mu a run measures: set before the table exists, kept on resume."""

import json
import math
from pathlib import Path

import pytest
import yaml

from jaxreplay.config import ConfigError, load_config
from jaxreplay.train.driver import train

DEMO = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
TINY = [
    "model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
    "model.d_ff=64", "task.eval_size=32", "warmstart.steps=2", "train.batch_size=16", "train.prompts_per_step=4",
    "train.group_size=4", "train.eval_every=4", "replay.max_size=64", "replay.min_size_to_sample=32",
    "checkpoint.every=4", "run.progress_bar=false", "replay.calibrate_steps=2", "replay.cost_rho=0.2",
]


@pytest.mark.slow
def test_calibrated_ratio_follows_the_cost_model_and_survives_resume(tmp_path):
    lines = []
    config = load_config(DEMO, [*TINY, "train.steps=4", f"run.dir={tmp_path}"])
    first = train(config, log=lines.append)
    record = json.loads((tmp_path / "calibration.json").read_text())
    assert record["mu"] > 0
    # y = sqrt(mu / (rho + 1/x)) with the window x = N/R = 64/16 = 4 actor steps.
    assert record["samples_per_insert"] == pytest.approx(math.sqrt(record["mu"] / (0.2 + 1 / 4)), abs=1e-3)
    assert first["replay/samples_per_insert_target"] == record["samples_per_insert"]
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["replay"]["samples_per_insert"] == record["samples_per_insert"]
    assert any(line.startswith("calibration: mu") for line in lines)

    # Resume (more steps): the Reverb table was built with the saved ratio, so it is reused, not re-measured
    # (a new measurement would differ, and the restored limiter would then not match the config).
    before = (tmp_path / "calibration.json").read_text()
    resumed = train(load_config(DEMO, [*TINY, "train.steps=6", f"run.dir={tmp_path}"]), log=lambda _: None)
    assert resumed["steps"] == 6
    assert resumed["replay/samples_per_insert_target"] == record["samples_per_insert"]
    assert (tmp_path / "calibration.json").read_text() == before


def test_calibration_keys_are_validated():
    with pytest.raises(ConfigError, match="replay.cost_rho"):
        load_config(None, ["replay.cost_rho=0"])
    with pytest.raises(ConfigError, match="replay.calibrate_steps"):
        load_config(None, ["replay.calibrate_steps=-1"])
