"""Bad input through the real CLI: one line naming what is wrong, exit code 2, no traceback.

Every case below is a distinct kind of mistake. The fast ones are refused before JAX does
any work (config loading, validation, the run directory, argument parsing); the slow ones
get as far as a mesh, a dataset or a checkpoint. `--debug` brings the traceback back.
"""

import json
import os
import re
import subprocess
import sys

import pytest

from jaxreplay import ERROR_KINDS
from jaxreplay.train import rundir
from test_train import DEMO, ROOT, TINY

JSONL = ["task.name=jsonl", "task.max_prompt_len=8", "warmstart.steps=0", "model.vocab_size=260",
         "model.max_seq_len=16", "sampling.max_new_tokens=3", "run.progress_bar=false"]


def write_jsonl(directory, train_rows, test_rows=(("1+2=", "3"),)):
    for split, rows in (("train", train_rows), ("test", test_rows)):
        (directory / f"{split}.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": a}) + "\n"
                                                          for p, a in rows))
    return f"task.path={directory}/{{split}}.jsonl"


def corrupt_checkpoint(run_dir):
    """A finalised-looking Orbax step whose files are garbage."""
    step = run_dir / "checkpoints" / "5"
    (step / "state").mkdir(parents=True)
    (step / "state" / "_METADATA").write_text("not json")
    (step / "_CHECKPOINT_METADATA").write_text("{")
    return run_dir


def config_file(tmp_path, text, name="c.yaml"):
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(path)


def alias_bomb():
    """~400 bytes of YAML whose aliases expand to 9**9 (387 million) strings."""
    lines = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        lines.append(f"{name}: &{name} [" + ",".join([f"*{prev}"] * 9) + "]")
    return "\n".join(lines) + "\ntrain: {steps: *i}\n"


def train(tmp_path, *overrides):
    return ["train", str(DEMO), *overrides, f"run.dir={tmp_path / 'run'}"]


# --- The config file -------------------------------------------------------------------------
def case_malformed_yaml(tmp_path):
    return ["train", config_file(tmp_path, "train:\n  steps: [1,\n", "bad.yaml")], "bad.yaml"


def case_missing_config_file(tmp_path):
    return ["train", str(tmp_path / "nope.yaml")], "cannot read config file"


def case_config_is_a_directory(tmp_path):
    return ["train", str(tmp_path)], "is a directory"


def case_config_is_a_fifo(tmp_path):
    os.mkfifo(tmp_path / "fifo.yaml")  # reading it would block until a writer came
    return ["train", str(tmp_path / "fifo.yaml")], "is a FIFO"


def case_config_is_a_device(tmp_path):
    return ["config", "/dev/zero"], "not a regular file"  # reading it would never end


def case_config_not_utf8(tmp_path):
    return ["train", config_file(tmp_path, b"train:\n  steps: \xff\xfe\n", "latin.yaml")], \
        "latin.yaml is not UTF-8"


def case_config_too_large(tmp_path):
    return ["train", config_file(tmp_path, "#" * (2 << 20) + "\n", "big.yaml")], "big.yaml is larger than"


def case_duplicate_section(tmp_path):
    return ["train", config_file(tmp_path, "train:\n  steps: 3\ntrain:\n  steps: 4\n", "dup.yaml")], \
        "duplicate key 'train'"


def case_duplicate_key_in_a_section(tmp_path):
    return ["train", config_file(tmp_path, "train:\n  steps: 3\n  steps: 4\n")], "duplicate key 'steps'"


def case_alias_bomb(tmp_path):
    return ["train", config_file(tmp_path, alias_bomb(), "bomb.yaml")], "bomb.yaml: expands to more than"


def case_yaml_nested_too_deeply(tmp_path):
    return ["train", config_file(tmp_path, "train: " + "[" * 100_000, "deep.yaml")], "deep.yaml"


def case_integer_too_long_to_read(tmp_path):
    return ["train", config_file(tmp_path, "train:\n  steps: " + "9" * 5000 + "\n", "long.yaml")], "long.yaml"


def case_top_level_not_a_mapping(tmp_path):
    return ["train", config_file(tmp_path, "- train\n- replay\n", "list.yaml")], "top level must be a mapping"


def case_section_not_a_mapping(tmp_path):
    return ["train", config_file(tmp_path, "train: 3\n")], "train: expected a mapping"


def case_keys_that_are_not_strings(tmp_path):
    return ["train", config_file(tmp_path, "train: {1: 2, x: 3}\n")], "unknown key train.1"


def case_unknown_key(tmp_path):
    return train(tmp_path, "train.stepz=3"), "unknown key train.stepz"


# --- Overrides and values --------------------------------------------------------------------
def case_override_without_a_value(tmp_path):
    return train(tmp_path, "train.steps"), "train.steps"


def case_override_below_a_value(tmp_path):
    return train(tmp_path, "train.steps.every=3"), "steps is not a section"


def case_duplicate_key_in_an_override(tmp_path):
    return train(tmp_path, "train={steps: 1, steps: 2}"), "duplicate key 'steps'"


def case_wrong_type(tmp_path):
    return train(tmp_path, "train.steps=many"), "train.steps"


def case_not_one_of_the_choices(tmp_path):
    return train(tmp_path, "replay.selector=random"), "replay.selector"


def case_long_value_is_not_echoed_whole(tmp_path):
    return train(tmp_path, "train.steps=" + "x" * 100_000), "train.steps: expected int"


def case_infinite_float(tmp_path):
    return train(tmp_path, "replay.samples_per_insert=.inf"), "replay.samples_per_insert: must be a finite"


def case_nan_float(tmp_path):
    return train(tmp_path, "train.adam_b1=.nan"), "train.adam_b1: must be a finite"


def case_infinite_timeout(tmp_path):
    return train(tmp_path, "replay.timeout_s=.inf"), "replay.timeout_s"


def case_infinite_error_buffer(tmp_path):
    return train(tmp_path, "replay.error_buffer=.inf"), "replay.error_buffer"


def case_infinite_priority_exponent(tmp_path):
    return train(tmp_path, "replay.selector=prioritized", "replay.priority_exponent=.inf"), \
        "replay.priority_exponent"


def case_float_out_of_range(tmp_path):
    return train(tmp_path, "train.adam_b2=1.0"), "train.adam_b2: must be in [0, 1)"


def case_integer_too_large_for_a_float(tmp_path):
    return train(tmp_path, "train.learning_rate=" + "9" * 400), "train.learning_rate"


def case_integer_beyond_32_bits(tmp_path):
    return train(tmp_path, "replay.max_size=1000000000000"), "replay.max_size"


def case_negative_seed(tmp_path):
    return train(tmp_path, "run.seed=-1"), "run.seed"


def case_task_with_no_training_problem(tmp_path):
    return train(tmp_path, "task.min_digits=1", "task.max_digits=1"), "task.eval_size"


def case_deadlocking_limiter(tmp_path):
    return train(tmp_path, "replay.error_buffer=10"), "replay.error_buffer"


def case_model_path_without_a_model(tmp_path):
    return train(tmp_path, f"model.hf_path={tmp_path}"), "model.hf_path"


def case_model_of_an_unsupported_family(tmp_path):
    model = tmp_path / "mixtral"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "mixtral", "num_local_experts": 8}))
    return train(tmp_path, f"model.hf_path={model}"), "unknown architecture model_type='mixtral'"


def case_model_routing_to_more_experts_than_it_has(tmp_path):
    model = tmp_path / "qwen3_moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "qwen3_moe", "num_experts": 4,
                                                   "num_experts_per_tok": 6}))
    return train(tmp_path, f"model.hf_path={model}"), "num_experts_per_tok=6 of num_experts=4"


def case_more_experts_per_token_than_experts(tmp_path):
    return (["train", str(ROOT / "configs" / "demo_moe.yaml"), "model.experts_per_token=9",
             f"run.dir={tmp_path / 'run'}"], "model.experts_per_token: must not exceed model.n_experts (8), got 9")


def case_malformed_address(tmp_path):
    return train(tmp_path, "distributed.coordinator_address=nohost"), "distributed.coordinator_address"


def case_unknown_environment(tmp_path):
    """The shipped environments register on first use: the error names them all the same."""
    return (["train", str(ROOT / "configs" / "demo_multiturn.yaml"), "environment.name=nope",
             f"run.dir={tmp_path / 'run'}"],
            "unknown environment 'nope': known names are agent_loop, calculator, guess_digit, guess_number, skyrl, or give package.module:factory")


def case_sweep_file_with_a_duplicate_key(tmp_path):
    return ["sweep", config_file(tmp_path, f"base: {DEMO}\nout: x\nseeds: [0]\nseeds: [1]\nsettings: {{a: []}}\n",
                                 "sweep.yaml")], "duplicate key 'seeds'"


# --- The run directory -----------------------------------------------------------------------
def case_run_dir_is_a_file(tmp_path):
    (tmp_path / "afile").write_text("")
    return ["train", str(DEMO), f"run.dir={tmp_path / 'afile'}"], "run.dir"


def case_run_dir_under_a_file(tmp_path):
    (tmp_path / "afile").write_text("")
    return ["train", str(DEMO), f"run.dir={tmp_path / 'afile' / 'run'}"], "run.dir"


def case_run_dir_read_only(tmp_path):
    return ["train", str(DEMO), f"run.dir={read_only_dir(tmp_path)}"], "is not writable"


def case_run_dir_with_a_nul_character(tmp_path):
    return ["train", config_file(tmp_path, f'run:\n  dir: "{tmp_path}/a\\0b"\n')], "is not a usable path"


def case_empty_run_dir(tmp_path):
    return ["train", str(DEMO), "run.dir="], "run.dir"


def case_run_dir_in_use(tmp_path):
    return ["train", str(DEMO), f"run.dir={tmp_path}"], f"in use by another run (process {os.getpid()} on"


# --- The command line ------------------------------------------------------------------------
def case_missing_argument(tmp_path):
    return ["train"], "the following arguments are required: config"


def case_bad_flag_value(tmp_path):
    return ["eval", str(DEMO), "--hf", str(tmp_path), "--k", "1,0"], "every k must be >= 1"


def case_theory_with_a_negative_cost(tmp_path):
    return ["theory", "--mu", "-1", "--rho", "0.1", "--alpha", "0.3"], "argument --mu: must be a positive"


FAST = [case_malformed_yaml, case_missing_config_file, case_config_is_a_directory, case_config_is_a_fifo,
        case_config_is_a_device, case_config_not_utf8, case_config_too_large, case_duplicate_section,
        case_duplicate_key_in_a_section, case_alias_bomb, case_yaml_nested_too_deeply, case_integer_too_long_to_read,
        case_top_level_not_a_mapping, case_section_not_a_mapping, case_keys_that_are_not_strings, case_unknown_key,
        case_override_without_a_value, case_override_below_a_value, case_duplicate_key_in_an_override,
        case_wrong_type, case_not_one_of_the_choices, case_long_value_is_not_echoed_whole, case_infinite_float,
        case_nan_float, case_infinite_timeout, case_infinite_error_buffer, case_infinite_priority_exponent,
        case_float_out_of_range, case_integer_too_large_for_a_float, case_integer_beyond_32_bits,
        case_negative_seed, case_task_with_no_training_problem, case_deadlocking_limiter,
        case_model_path_without_a_model, case_model_of_an_unsupported_family,
        case_model_routing_to_more_experts_than_it_has, case_more_experts_per_token_than_experts,
        case_malformed_address, case_unknown_environment,
        case_sweep_file_with_a_duplicate_key,
        case_run_dir_is_a_file, case_run_dir_under_a_file, case_run_dir_read_only, case_run_dir_with_a_nul_character,
        case_empty_run_dir,
        case_run_dir_in_use, case_missing_argument, case_bad_flag_value, case_theory_with_a_negative_cost]


# --- Past the config: a mesh, a dataset, a checkpoint ----------------------------------------
def case_mesh_larger_than_the_machine(tmp_path):
    return ["train", str(DEMO), "mesh.data=3", f"run.dir={tmp_path}"], "mesh.data"


def case_prompt_longer_than_the_context(tmp_path):
    return ["train", str(DEMO), *JSONL, write_jsonl(tmp_path, [("1+1=", "2")]), "task.max_prompt_len=64",
            f"run.dir={tmp_path / 'run'}"], "model.max_seq_len"


def case_dataset_prompt_longer_than_max_prompt_len(tmp_path):
    return ["train", str(DEMO), *JSONL, write_jsonl(tmp_path, [("1+1=", "2"), ("123456789+1=", "123456790")]),
            "task.long_prompts=error", f"run.dir={tmp_path / 'run'}"], "exceeds task.max_prompt_len"


def case_empty_dataset(tmp_path):
    return ["train", str(DEMO), *JSONL, write_jsonl(tmp_path, []), f"run.dir={tmp_path / 'run'}"], \
        "has no usable prompt"


def case_eval_of_a_missing_checkpoint(tmp_path):
    return ["eval", str(DEMO), "--checkpoint", str(tmp_path)], "no complete checkpoint"


def case_eval_of_a_corrupt_checkpoint(tmp_path):
    return ["eval", str(DEMO), "--checkpoint", str(corrupt_checkpoint(tmp_path))], "checkpoint step 5"


def case_resume_from_a_corrupt_checkpoint(tmp_path):
    return ["train", str(DEMO), *TINY, "warmstart.steps=0", f"run.dir={corrupt_checkpoint(tmp_path)}"], \
        "checkpoint step 5"


def case_multi_host_setting_that_sharding_would_change(tmp_path):
    return ["train", str(DEMO), "distributed.enabled=true", "replay.backend=inprocess", "replay.selector=prioritized",
            f"run.dir={tmp_path}"], "replay.selector"


SLOW = [case_mesh_larger_than_the_machine, case_prompt_longer_than_the_context,
        case_dataset_prompt_longer_than_max_prompt_len, case_empty_dataset, case_eval_of_a_missing_checkpoint,
        case_eval_of_a_corrupt_checkpoint, case_resume_from_a_corrupt_checkpoint,
        case_multi_host_setting_that_sharding_would_change]


def read_only_dir(tmp_path):
    """A directory this process cannot write to: permission bits, or (as root, who ignores them) /sys."""
    if os.geteuid() == 0:
        return "/sys"
    path = tmp_path / "read_only"
    path.mkdir()
    path.chmod(0o555)
    return path


def jaxreplay(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "jaxreplay.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout)


def assert_one_line_exit_2(result, named):
    assert result.returncode == 2, result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr[-2000:]
    assert re.match(rf"^jaxreplay: ({'|'.join(ERROR_KINDS)}): \S", lines[0]) and named in lines[0], lines[0]
    assert len(lines[0]) <= 1000, lines[0][:300]
    assert "Traceback" not in result.stderr


def test_at_least_30_kinds_of_bad_input_are_covered():
    assert len(FAST) + len(SLOW) >= 30 and len({f.__name__ for f in FAST + SLOW}) == len(FAST + SLOW)


@pytest.mark.parametrize("case", FAST, ids=lambda f: f.__name__.removeprefix("case_"))
def test_bad_input_is_refused_before_any_work(tmp_path, case):
    """One line, exit code 2, in seconds: nothing started, nothing written to run.dir."""
    args, named = case(tmp_path)
    with rundir.claim(tmp_path):  # for case_run_dir_in_use; no other case trains in tmp_path itself
        result = jaxreplay(*args, timeout=30)
    assert_one_line_exit_2(result, named)
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(f, marks=pytest.mark.tier) if "checkpoint" in f.__name__ else f
                                  for f in SLOW], ids=lambda f: f.__name__.removeprefix("case_"))  # tier: Orbax's errors
def test_bad_input_found_later_is_one_line_too(tmp_path, case):
    args, named = case(tmp_path)
    assert_one_line_exit_2(jaxreplay(*args), named)


def test_debug_shows_the_traceback(tmp_path):
    args, _ = case_malformed_yaml(tmp_path)
    result = jaxreplay("--debug", *args)
    assert result.returncode == 2 and "Traceback" in result.stderr
