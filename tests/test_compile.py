"""`jaxreplay compile`: the real train step and samplers compiled at full shapes without
weights, for the local devices or (where libtpu is installed) a TPU slice."""

import dataclasses
import json
from pathlib import Path

import pytest

from jaxreplay.cli import main
from jaxreplay.config import ConfigError, load_config
from jaxreplay.models.architectures import SHIPPED, architecture_dir
from jaxreplay.models.hf import read_model_config
from jaxreplay.models.transformer import abstract_params, count_params
from jaxreplay.tools.aot import DoesNotFit, Program, Report, check_fits, load_for_compile
from jaxreplay.tools.topology import HBM_GIB, TOPOLOGIES, libtpu_version

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "demo.yaml")
needs_libtpu = pytest.mark.skipif(libtpu_version() is None,
                                  reason="libtpu is not installed on this lane (pip install 'jaxreplay[tpu]')")


@pytest.mark.tier
def test_compile_on_the_local_devices_reports_the_demo_programs(tmp_path, capsys):
    out = tmp_path / "fit.json"
    assert main(["compile", DEMO, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "train step" in printed and "rollout sampler (64 rows)" in printed and "eval sampler (128 rows)" in printed
    report = json.loads(out.read_text())
    assert report["target"] == "local" and report["fits"] is None  # a CPU has no HBM limit
    train, rollout, evaluation, prefill, start, decode = report["programs"]
    # The rollout engine's programs: a pool of 64 slots (the rollout rows), its prefill of the
    # most prompts one call takes (64 / G = 8 groups + 1 entries: 8), and its start of 8 whole
    # groups straight into the pool.
    assert (prefill["name"], start["name"], decode["name"]) == (
        "engine prefill (8 prompts)", "engine start (8 prompts into 64 slots)", "engine decode chunk (64 slots)")
    assert start["alias"] > 0  # the pool is donated
    assert decode["argument"] > report["kv_cache"] and decode["alias"] > 0  # the pool, cache included, is donated
    assert train["name"] == "train step" and train["argument"] > 0 and train["temp"] > 0 and train["flops"] > 0
    assert train["total"] == train["argument"] + train["output"] - train["alias"] + train["temp"]
    assert train["alias"] > 0  # params and optimizer state are donated
    # The samplers run while the optimizer state stays resident: it is counted with them.
    assert rollout["held"] == evaluation["held"] > 0 and train["held"] == 0
    assert report["kv_cache"] > 0
    from benchmarks.fit_table import row  # the docs/benchmarks.md table row of this report

    assert row("demo", report).startswith("| `demo` | local (1 x cpu) | data=1 fsdp=1 tensor=1 | 0.")


def test_a_multi_turn_config_also_compiles_the_engines_largest_answer_prefill(tmp_path):
    """configs/demo_multiturn.yaml: 64 slots and at most 14 tokens an episode, so an answer has at
    most 11 inputs to prefill, and the largest call takes every slot's row with 16 inputs. It
    gathers its rows' cache (with room for the inputs), so its temporaries exceed the pool's cache."""
    out = tmp_path / "fit.json"
    assert main(["compile", str(ROOT / "configs" / "demo_multiturn.yaml"), "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    answers = report["programs"][-1]
    assert answers["name"] == "engine answer prefill (64 rows x 16 tokens)"
    assert answers["alias"] > 0 and answers["temp"] > 2 * report["kv_cache"]  # the pool is donated
    assert main(["compile", str(ROOT / "configs" / "demo_multiturn.yaml"), "--json", str(out),
                 "sampling.max_new_tokens=3"]) == 0  # an answer leaves no room: never prefilled
    assert [p["name"] for p in json.loads(out.read_text())["programs"]][-1] == "engine decode chunk (64 slots)"


def test_with_lora_the_optimizer_state_held_is_the_adapters_alone(tmp_path, capsys):
    """Adam's two float32 moments of the adapters only, r (in + out) per adapted projection and
    layer: with LoRA the base has no optimizer state, on the chips beside the samplers or anywhere."""
    out = tmp_path / "fit.json"
    lora = ["model.lora.targets=[q_proj,v_proj]", "model.lora.rank=4"]
    assert main(["compile", DEMO, "--json", str(out), *lora]) == 0
    report = json.loads(out.read_text())
    d, kv, layers = 128, 2 * 32, 2  # configs/demo.yaml: d_model 128, 2 kv heads of 32, 2 layers
    trainable = layers * 4 * ((d + d) + (d + kv))  # q_proj [d, d], v_proj [d, kv]
    assert f"LoRA rank 4 on q_proj, v_proj: {trainable:,} trainable" in report["model"]
    held = {p["held"] for p in report["programs"] if p["name"] != "train step"}
    assert len(held) == 1 and 2 * 4 * trainable <= held.pop() <= 2 * 4 * trainable + 64  # + Adam's step counts


def test_overrides_may_follow_the_options(tmp_path):
    out = tmp_path / "fit.json"
    assert main(["compile", DEMO, "--json", str(out), "train.batch_size=32", "train.micro_batch_size=8"]) == 0
    assert "micro-batch 8" in json.loads(out.read_text())["shapes"]


def report_with(total_gib: float, hbm_gib: float) -> Report:
    gib = 1 << 30
    program = Program("train step", argument=int(total_gib * gib), output=0, alias=0, temp=0, held=0, compile_s=1.0,
                      flops=None)
    return Report(target="v5e-8", device_kind="TPU v5 lite", n_devices=8, hbm=int(hbm_gib * gib), libtpu="0",
                  mesh="data=1 fsdp=8 tensor=1", model="", shapes="", kv_cache=0, programs=(program,))


def test_a_program_the_tpu_compiler_refuses_is_named_with_its_figures():
    refused = Program("eval sampler (128 rows)", 0, 0, 0, 0, 0, 9.0, None,
                      oom="the TPU compiler needs 20.5G for HLO temporaries, over the 15.75G of HBM it can use")
    report = dataclasses.replace(report_with(1, 16), programs=(refused,))
    with pytest.raises(DoesNotFit, match=r"^eval sampler \(128 rows\) does not fit a TPU v5 lite \(v5e-8, mesh "
                                         r"data=1 fsdp=8 tensor=1\): the TPU compiler needs 20.5G"):
        check_fits(report)


def test_a_program_over_hbm_is_named_in_one_line():
    check_fits(report_with(15.9, 16))
    with pytest.raises(DoesNotFit, match=r"^train step needs 16.50 GiB per device, over the 16.0 GiB HBM of a TPU "
                                         r"v5 lite \(v5e-8, mesh data=1 fsdp=8 tensor=1\)$"):
        check_fits(report_with(16.5, 16))
    assert "fits: NO" in report_with(16.5, 16).lines()


def test_product_names_map_to_the_devices_jax_sees():
    v4 = TOPOLOGIES["v4-8"]
    assert (v4.topology, v4.devices, v4.megacore) == ("v4:2x2x1", 4, True)  # 4 chips of 2 cores: 4 devices
    assert (TOPOLOGIES["v5p-8"].topology, TOPOLOGIES["v5p-8"].devices) == ("v5:2x2x1", 4)
    assert (TOPOLOGIES["v5e-8"].topology, TOPOLOGIES["v5e-8"].devices) == ("v5e:2x4", 8)
    assert (TOPOLOGIES["v6e-8"].topology, TOPOLOGIES["v6e-8"].devices) == ("v6e:2x4", 8)
    assert TOPOLOGIES["v4-128"].devices == 64 and TOPOLOGIES["v5e-256"].topology == "v5e:16x16"
    assert (HBM_GIB["TPU v4"], HBM_GIB["TPU v5 lite"], HBM_GIB["TPU v5"], HBM_GIB["TPU v6 lite"]) == (32, 16, 95, 32)


def test_an_unknown_slice_is_a_config_error(capsys):
    assert main(["compile", DEMO, "--topology", "v9-8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("jaxreplay: config error: --topology: 'v9-8' is not a known TPU slice")
    with pytest.raises(ConfigError, match="mesh.topology"):
        load_config(DEMO, ["mesh.topology=v5e-7"])


@pytest.mark.skipif(libtpu_version() is not None, reason="libtpu is installed: the missing-libtpu error cannot occur")
def test_without_libtpu_the_error_names_the_extra_and_exits_2(capsys):
    """The install is what to change, as with other input at fault: exit 2, one line."""
    assert main(["compile", DEMO, "--topology", "v5e-8"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("jaxreplay: error: compiling for v5e-8 needs libtpu, which the tpu extra installs: "
                                "make venv LANE=tpu") and "pip install 'jaxreplay[tpu]'" in lines[-1]


@pytest.mark.parametrize("name, params", [("qwen2.5-0.5b", 494_032_768), ("qwen2.5-1.5b", 1_543_714_304),
                                          ("qwen2.5-3b", 3_085_938_688), ("qwen2.5-7b", 7_615_616_512),
                                          ("qwen3-0.6b", 596_049_920), ("qwen3-30b-a3b", 30_532_122_624),
                                          ("gemma3-1b", 999_885_952),
                                          ("gemma3-4b", 3_880_263_168)])  # 4B: its language model alone
def test_the_shipped_architectures_are_the_published_models(name, params):
    """The parameter counts the model cards give, from the shipped config.json alone."""
    assert name in SHIPPED
    assert count_params(abstract_params(read_model_config(architecture_dir(name)))) == params


def test_a_config_that_needs_a_model_directory_compiles_from_its_hf_config():
    with pytest.raises(ConfigError, match="model.hf_path"):
        load_config(ROOT / "configs" / "qwen3_0.6b_math.yaml")
    config = load_for_compile(str(ROOT / "configs" / "qwen3_0.6b_math.yaml"), [])
    assert Path(config.model.hf_path) == architecture_dir("qwen3-0.6b")


@needs_libtpu
@pytest.mark.slow
def test_a_tiny_config_compiles_for_a_tpu_slice(tmp_path):
    out = tmp_path / "fit.json"
    assert main(["compile", DEMO, "--topology", "v5e-8", "mesh.fsdp=-1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert (report["device_kind"], report["n_devices"], report["hbm"]) == ("TPU v5 lite", 8, 16 << 30)
    assert report["libtpu"] == libtpu_version() and report["fits"] is True
    assert report["mesh"].startswith("data=1 fsdp=8 tensor=1")
    names = [p["name"] for p in report["programs"]]
    assert names[-3:] == ["engine prefill (8 prompts)", "engine start (8 prompts into 64 slots)",
                          "engine decode chunk (64 slots)"], names


@needs_libtpu
@pytest.mark.slow
def test_a_multi_host_slice_compiles_each_hosts_engine_on_its_own_chips(tmp_path):
    """v5e-16 is 4 hosts of 4 chips: with distributed.enabled each host's engine decodes a
    quarter of the rollout rows on its own 4 chips (no program crosses hosts)."""
    from jaxreplay.tools.topology import host_devices

    assert [(len(host_devices(name)), host_devices(name)[0].device_kind) for name in ("v5e-16", "v4-16")] == \
        [(4, "TPU v5 lite"), (4, "TPU v4")]
    out = tmp_path / "fit.json"
    assert main(["compile", DEMO, "--topology", "v5e-16", "mesh.fsdp=-1", "distributed.enabled=true",
                 "train.prompts_per_step=16", "--json", str(out)]) == 0
    names = [p["name"] for p in json.loads(out.read_text())["programs"]]
    assert names[-3:] == ["engine prefill (4 prompts, each host on its 4 devices)",
                          "engine start (4 prompts into 32 slots, each host on its 4 devices)",
                          "engine decode chunk (32 slots, each host on its 4 devices)"], names


@needs_libtpu
def test_a_v4_8_runs_as_4_megacore_devices():
    from jaxreplay.tools.topology import hbm_bytes, slice_devices

    devices = slice_devices("v4-8")
    assert len(devices) == 4 and devices[0].device_kind == "TPU v4" and hbm_bytes(devices[0]) == 32 << 30


@needs_libtpu
@pytest.mark.slow
def test_a_config_over_hbm_exits_1_naming_the_program(capsys):
    """2M x 1024 float32 embeddings and their Adam moments: 24 GiB on one 16 GiB v5e chip."""
    big = ["model.vocab_size=2000000", "model.d_model=1024", "model.n_heads=8", "model.head_dim=128"]
    assert main(["compile", DEMO, "--topology", "v5e-1", *big]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("jaxreplay: error: does not fit: train step ") and "TPU v5 lite (v5e-1" in last
