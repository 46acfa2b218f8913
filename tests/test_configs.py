"""Every file in configs/ loads, and the ready configs carry the paper's settings."""

from pathlib import Path

import pytest
import yaml

from jaxreplay.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tiny_hf import write_model

    return write_model(tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_file_loads(path, model_dir):
    """Run configs through load_config (those naming model.hf_path get a model directory, as on the
    command line); sweep files through load_sweep, which loads each run's config."""
    raw = yaml.safe_load(path.read_text())
    if "base" in raw:
        from jaxreplay.research.sweep import load_sweep

        load_sweep(path)
        return
    overrides = [f"model.hf_path={model_dir}"] if "hf_path" in raw.get("model", {}) else []
    load_config(path, overrides)


def test_the_paper_settings(model_dir):
    small = load_config(CONFIGS / "qwen3_0.6b_math.yaml", [f"model.hf_path={model_dir}"])
    t = small.train
    assert (t.group_size, t.batch_size, t.eps_low, t.eps_high, t.kl_coef) == (16, 60, 0.2, 0.2, 0.0)
    assert (t.learning_rate, t.warmup_steps, t.weight_decay) == (3.37e-7, 0, 0.0)
    assert small.sampling.temperature == 1.0 and small.task.name == "math"
    large = load_config(CONFIGS / "qwen2.5_7b_math.yaml", [f"model.hf_path={model_dir}"])
    assert large.train.learning_rate == 6.8e-8 and (large.train.group_size, large.train.batch_size) == (16, 60)
    colab = load_config(CONFIGS / "qwen2.5_0.5b_instruct_gsm8k_colab.yaml", [f"model.hf_path={model_dir}"])
    assert colab.task.name == "gsm8k" and colab.task.chat_template
    assert colab.task.path == "/content/gsm8k/main/{split}-*.parquet"  # the Hub's Parquet: Colab has no TFDS


@pytest.mark.parametrize("name", ["qwen3_0.6b_math.yaml", "qwen2.5_7b_math.yaml",
                                  "qwen2.5_0.5b_instruct_gsm8k_colab.yaml"])
def test_the_model_configs_ask_for_a_model_directory(name):
    with pytest.raises(ConfigError, match="model.hf_path"):
        load_config(CONFIGS / name)
