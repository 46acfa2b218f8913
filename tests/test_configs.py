"""Every file in configs/ loads, and the ready configs carry the paper's settings."""

from pathlib import Path

import pytest
import yaml

from jaxreplay.config import ConfigError, load_config

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# The LoRA configs for real models, and the slice each is sized for (compile-checked: docs/memory.md)
LORA_CONFIGS = {"qwen2.5_1.5b_instruct_gsm8k_colab_lora.yaml": ("qwen2.5-1.5b", "v5e-1"),
                "qwen2.5_3b_instruct_gsm8k_colab_lora.yaml": ("qwen2.5-3b", "v5e-1"),
                "pod_v5e-8_qwen2.5_7b_gsm8k_lora.yaml": ("qwen2.5-7b", "v5e-8"),
                "gemma3_1b_it_gsm8k_colab_lora.yaml": ("gemma3-1b", "v5e-1")}


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
                                  "qwen2.5_0.5b_instruct_gsm8k_colab.yaml", *LORA_CONFIGS])
def test_the_model_configs_ask_for_a_model_directory(name):
    with pytest.raises(ConfigError, match="model.hf_path"):
        load_config(CONFIGS / name)


@pytest.mark.parametrize("name", sorted(LORA_CONFIGS))
def test_the_lora_configs_train_adapters_on_a_bfloat16_base(name, model_dir, tmp_path):
    """Every projection adapted on a frozen bfloat16 base, at a higher rate than full fine-tuning's,
    labelled as compile-checked (none has been trained here)."""
    architecture, topology = LORA_CONFIGS[name]
    raw = yaml.safe_load((CONFIGS / name).read_text())
    assert (raw["model"]["hf_config"], raw["mesh"]["topology"]) == (architecture, topology)
    assert "COMPILE-CHECKED ONLY" in (CONFIGS / name).read_text().split("\nmodel:")[0]
    config = load_config(CONFIGS / name, [f"model.hf_path={model_dir}", f"task.path={tmp_path}/{{split}}.parquet"])
    lora = config.model.lora
    assert set(lora.targets) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert (lora.rank, lora.alpha) == (16, 32.0) and config.model.param_dtype == "bfloat16"
    full = load_config(CONFIGS / "qwen2.5_0.5b_instruct_gsm8k_colab.yaml", [f"model.hf_path={model_dir}"])
    assert config.train.learning_rate == pytest.approx(10 * full.train.learning_rate)
