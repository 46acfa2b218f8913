"""Bad input through the real CLI: one line naming what is wrong, exit code 2, no traceback.

Each case stops before any training; `--debug` brings the traceback back.
"""

import json
import subprocess
import sys

import pytest

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


def case_malformed_yaml(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: [1,\n")
    return ["train", str(bad)], "bad.yaml"


def case_wrong_type(tmp_path):
    return ["train", str(DEMO), "train.steps=many", f"run.dir={tmp_path}"], "train.steps"


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


CASES = [case_malformed_yaml, case_wrong_type, case_mesh_larger_than_the_machine, case_prompt_longer_than_the_context,
         case_dataset_prompt_longer_than_max_prompt_len, case_empty_dataset, case_eval_of_a_missing_checkpoint,
         case_eval_of_a_corrupt_checkpoint, case_resume_from_a_corrupt_checkpoint,
         case_multi_host_setting_that_sharding_would_change]


def jaxreplay(*args):
    return subprocess.run([sys.executable, "-m", "jaxreplay.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda f: f.__name__.removeprefix("case_"))
def test_bad_input_is_one_line_naming_it_with_exit_code_2(tmp_path, case):
    args, named = case(tmp_path)
    result = jaxreplay(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("jaxreplay: ") and named in last, last
    assert "Traceback" not in result.stderr


def test_debug_shows_the_traceback(tmp_path):
    args, _ = case_malformed_yaml(tmp_path)
    result = jaxreplay("--debug", *args)
    assert result.returncode == 2 and "Traceback" in result.stderr
