"""The Hugging Face bridge's files and stop ids, on directories made here (no torch needed):
which weight files an export leaves and the loader picks, exports that would overwrite their
own sources, corrupt or escaping weight files, configs transformers rejects, file modes, and
several stop ids from sampler to reward."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx
from tiny_hf import write_char_tokenizer, write_model

from jaxreplay.cli import main
from jaxreplay.compat import value_of, with_value
from jaxreplay.config import ModelConfig, load_config
from jaxreplay.models.errors import HFModelError
from jaxreplay.models.hf import load_hf_model, save_hf_model
from jaxreplay.models.tokenizer import load_tokenizer
from jaxreplay.models.transformer import init_params
from jaxreplay.rollout.actor import Actor
from jaxreplay.rollout.sampling import completion_ids, make_run_samplers
from jaxreplay.tasks.datasets import DatasetTask
from jaxreplay.train.eval import count_correct, eval_sampler_factory

ROOT = Path(__file__).resolve().parents[1]
CFG = ModelConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                  max_seq_len=64, attention_bias=True)
SMALL_SHARDS = 20_000  # bytes: CFG's ~50k float32 parameters take several shards


def params_of(seed: int):
    return init_params(CFG, seed)[1]


def flat(params) -> dict:
    return {p: np.asarray(value_of(v)) for p, v in nnx.to_flat_state(params)}


def assert_same(a, b) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for p in fa:
        np.testing.assert_array_equal(fa[p], fb[p], err_msg=str(p))


def weight_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.iterdir() if "safetensors" in p.name)


def snapshot(path: Path) -> dict[str, tuple[bytes, int]]:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(path.iterdir())}


# ----------------------------------------------------------------------------------
# Which weight files: an export leaves only its own, the loader picks as transformers does


def test_reexport_leaves_only_its_own_weight_files(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "README.md").write_text("notes")  # not a weight file: never touched
    (out / "adapter_model.safetensors").write_bytes(b"not ours")
    keep = {"README.md", "adapter_model.safetensors"}

    save_hf_model(out, CFG, params_of(1), max_shard_bytes=SMALL_SHARDS)  # sharded ...
    shards = [n for n in weight_files(out) if n.startswith("model-")]
    assert len(shards) > 2 and (out / "model.safetensors.index.json").is_file()
    save_hf_model(out, CFG, params_of(2))  # ... then one file: the shards and the index go
    assert weight_files(out) == ["adapter_model.safetensors", "model.safetensors"]
    assert_same(load_hf_model(out)[2], params_of(2))

    save_hf_model(out, CFG, params_of(3), max_shard_bytes=SMALL_SHARDS)  # one file, then sharded
    assert "model.safetensors" not in weight_files(out)
    assert_same(load_hf_model(out)[2], params_of(3))
    save_hf_model(out, CFG, params_of(4), max_shard_bytes=2 * SMALL_SHARDS)  # fewer shards than before
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(weight_files(out)) == {*index["weight_map"].values(), "model.safetensors.index.json",
                                      "adapter_model.safetensors"}
    assert_same(load_hf_model(out)[2], params_of(4))
    assert keep <= {p.name for p in out.iterdir()} and (out / "README.md").read_text() == "notes"


def test_loader_picks_weight_files_in_transformers_order(tmp_path):
    """transformers 5 reads config.json's `transformers_weights` if set, else model.safetensors,
    else model.safetensors.index.json; so does the loader, whatever else the directory holds."""
    both = save_hf_model(tmp_path / "both", CFG, params_of(1))
    sharded = save_hf_model(tmp_path / "sharded", CFG, params_of(2), max_shard_bytes=SMALL_SHARDS)
    for f in sharded.iterdir():
        if f.name.startswith("model"):
            shutil.copy(f, both / f.name)
    assert_same(load_hf_model(both)[2], params_of(1))  # model.safetensors before the index

    config = json.loads((both / "config.json").read_text())
    (both / "config.json").write_text(json.dumps({**config, "transformers_weights": "model.safetensors.index.json"}))
    assert_same(load_hf_model(both)[2], params_of(2))

    (both / "config.json").write_text(json.dumps(config))
    (both / "model.safetensors").unlink()
    assert_same(load_hf_model(both)[2], params_of(2))
    for f in both.glob("model*"):
        f.rename(both / f"old-{f.name}")  # weights under other names are not read, as transformers reads none
    with pytest.raises(HFModelError, match=r"holds no safetensors weights \(neither model\.safetensors nor "
                                           r"model\.safetensors\.index\.json\)"):
        load_hf_model(both)


# ----------------------------------------------------------------------------------
# An export over its own sources is refused before anything is written


def test_export_onto_its_own_base_directory_is_refused_before_writing(tmp_path):
    src = write_model(tmp_path / "src")
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 2]}))
    cfg, _, params = load_hf_model(src)
    before = snapshot(src)
    tokenizer = load_tokenizer(src)
    for target in (src, tmp_path / "link"):  # the directory itself, or another name for it
        if target != src:
            target.symlink_to(src, target_is_directory=True)
        with pytest.raises(HFModelError, match=r"it is the directory of the base model the export reads"):
            save_hf_model(target, cfg, params, tokenizer=tokenizer, base=src, max_shard_bytes=SMALL_SHARDS)
        assert snapshot(src) == before
    other = save_hf_model(tmp_path / "tok_only", cfg, params)
    with pytest.raises(HFModelError, match=r"it is the directory of the tokenizer the export reads"):
        save_hf_model(src, cfg, params, tokenizer=load_tokenizer(src))
    assert snapshot(src) == before and other.is_dir()
    (tmp_path / "file").write_text("x")
    with pytest.raises(HFModelError, match=r"it is a file, not a directory"):
        save_hf_model(tmp_path / "file", cfg, params)


# ----------------------------------------------------------------------------------
# Corrupt and escaping weight files: one line naming the file and a tensor


def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[:len(data) // 2])


def test_truncated_or_garbage_single_file_names_the_file_and_a_tensor(tmp_path):
    path = save_hf_model(tmp_path / "m", CFG, params_of(0))
    _truncate(path / "model.safetensors")
    with pytest.raises(HFModelError, match=r"model\.safetensors: cannot read tensor model\.embed_tokens\.weight: "
                                           r".*incomplete metadata") as e:
        load_hf_model(path)
    assert str(path / "model.safetensors") in str(e.value) and "\n" not in str(e.value)
    (path / "model.safetensors").write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(HFModelError, match=r"model\.safetensors: cannot read tensor \S+: .*header"):
        load_hf_model(path)
    (path / "model.safetensors").write_bytes(b"")
    with pytest.raises(HFModelError, match=r"model\.safetensors: cannot read tensor \S+: .*header too small"):
        load_hf_model(path)


def test_truncated_shard_is_named_with_a_tensor_it_holds(tmp_path):
    path = save_hf_model(tmp_path / "m", CFG, params_of(0), max_shard_bytes=SMALL_SHARDS)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    bad = sorted(set(weight_map.values()))[1]
    _truncate(path / bad)
    with pytest.raises(HFModelError, match=rf"{bad}: cannot read tensor (\S+): ") as e:
        load_hf_model(path)
    tensor = str(e.value).split("cannot read tensor ")[1].split(":")[0]
    assert weight_map[tensor] == bad


def test_index_pointing_a_tensor_at_the_wrong_shard(tmp_path):
    path = save_hf_model(tmp_path / "m", CFG, params_of(0), max_shard_bytes=SMALL_SHARDS)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, f in sorted(index["weight_map"].items()) if f == shards[0])
    index["weight_map"][name] = shards[-1]
    index_file.write_text(json.dumps(index))
    with pytest.raises(HFModelError, match=rf"{shards[-1]} does not hold tensor {name.replace('.', '[.]')}, which "
                                           r"model\.safetensors\.index\.json puts there"):
        load_hf_model(path)


@pytest.mark.parametrize("escape", ["../outside.safetensors", "ABSOLUTE", "sub/../../outside.safetensors"])
def test_index_file_names_must_stay_inside_the_model_directory(tmp_path, escape):
    path = save_hf_model(tmp_path / "m", CFG, params_of(0), max_shard_bytes=SMALL_SHARDS)
    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.copy(path / first, tmp_path / "outside.safetensors")  # a readable file: only the check stops it
    escape = str(tmp_path / "outside.safetensors") if escape == "ABSOLUTE" else escape
    index["weight_map"] = {n: (escape if f == first else f) for n, f in index["weight_map"].items()}
    index_file.write_text(json.dumps(index))
    with pytest.raises(HFModelError, match=r"weight_map\['\S+'\]: '.*outside\.safetensors' is outside the model "
                                           r"directory"):
        load_hf_model(path)


# ----------------------------------------------------------------------------------
# Configs transformers rejects: one line naming config.json, exit 2 through the CLI


@pytest.mark.parametrize("edit, says", [
    # transformers 5.24 rejects an odd head_dim itself; 5.17 (the GPU-image set) leaves it to us.
    (lambda c: json.dumps({**c, "head_dim": 7}), r"(rejected by transformers: .*`head_dim`=7|head_dim=7 must be even)"),
    (lambda c: json.dumps({**c, "num_attention_heads": "two"}), r"rejected by transformers: .*num_attention_heads"),
    (lambda c: json.dumps([c]), r"not a JSON object"),
    (lambda c: b"\xff\xfe{}", r"not UTF-8 text"),
])
def test_bad_config_json_is_one_line_naming_it(tmp_path, edit, says):
    path = write_model(tmp_path / "m", tokenizer=False)
    text = edit(json.loads((path / "config.json").read_text()))
    (path / "config.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(HFModelError, match=rf"^{re.escape(str(path / 'config.json'))}: {says}") as e:
        load_hf_model(path)
    assert "\n" not in str(e.value)


def test_config_transformers_rejects_is_one_line_exit_2_through_the_cli(tmp_path, capsys):
    path = write_model(tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "head_dim": 7}))
    with pytest.raises(HFModelError) as e:
        load_hf_model(path)
    message = str(e.value)

    assert main(["eval", str(ROOT / "configs" / "demo.yaml"), "--hf", str(path)]) == 2
    err = capsys.readouterr().err
    ours = [line for line in err.splitlines() if line.startswith("jaxreplay:")]
    assert ours == [f"jaxreplay: error: {message}"] and "Traceback" not in err


# ----------------------------------------------------------------------------------
# File modes


def test_exported_files_get_the_usual_permissions(tmp_path):
    src = write_model(tmp_path / "src")
    (src / "generation_config.json").write_text(json.dumps({"eos_token_id": [4, 2]}))
    cfg, _, params = load_hf_model(src)
    old = os.umask(0o022)
    try:
        for out, shard in ((tmp_path / "one", 1 << 30), (tmp_path / "sharded", SMALL_SHARDS)):
            save_hf_model(out, cfg, params, tokenizer=load_tokenizer(src), base=src, max_shard_bytes=shard)
            modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
            assert "model.safetensors" in modes or "model.safetensors.index.json" in modes
            assert set(modes.values()) == {"0o644"}, modes
    finally:
        os.umask(old)


# ----------------------------------------------------------------------------------
# Several stop ids: the sampler, the reward and the learner's mask agree


def uniform_model(path: Path, generation_eos) -> Path:
    """A model whose next token is uniform over its 101 ids (final norm scale 0: all logits 0),
    so completions meet every stop id, with the char tokenizer (EOS <|im_end|> = 4)."""
    cfg = ModelConfig(vocab_size=101, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16, d_ff=64,
                      max_seq_len=64, attention_bias=True)
    _, params = init_params(cfg, 0)
    flat_params = {tuple(p): v for p, v in nnx.to_flat_state(params)}
    scale = flat_params[("final_norm", "scale")]
    flat_params[("final_norm", "scale")] = with_value(scale, jax.numpy.zeros_like(value_of(scale)))
    save_hf_model(path, cfg, nnx.from_flat_state(flat_params))
    write_char_tokenizer(path)
    if generation_eos is not None:
        (path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return path


class RecordingTask(DatasetTask):
    """A dataset task that keeps the completion ids each reward call saw."""

    seen: list

    def reward(self, problem, completion_ids):
        self.seen.append([int(i) for i in completion_ids])
        return super().reward(problem, completion_ids)


def recording_task(config, tokenizer) -> RecordingTask:
    records = {split: [(f"{i}+{i}=", str(2 * i)) for i in range(8)] for split in ("train", "test")}
    task = RecordingTask(config.task, tokenizer, records=records)
    task.seen = []
    return task


def test_every_stop_id_ends_a_completion_for_sampler_reward_and_learner(tmp_path):
    path = uniform_model(tmp_path / "m", [4, 2])
    tok = load_tokenizer(path)
    assert tok.eos_ids == (4, 2)
    config = load_config(None, [
        f"model.hf_path={path}", "model.max_seq_len=64", "task.name=jsonl", f"task.path={tmp_path}/{{split}}.jsonl",
        "task.reward=exact_match", "task.max_prompt_len=16", "warmstart.steps=0", "sampling.max_new_tokens=24",
        "train.prompts_per_step=4", "train.group_size=8", "train.batch_size=16", "replay.max_size=64",
        "replay.min_size_to_sample=16"])
    cfg, graphdef, params = load_hf_model(path, max_seq_len=64)
    config = dataclasses.replace(config, model=cfg)  # as the loop does with model.hf_path
    task = recording_task(config, tok)
    sample_fn, _ = make_run_samplers(graphdef, config, stop_ids=tok.eos_ids, pad_id=tok.pad_id)
    items, _ = Actor(config, task, sample_fn).act(params, 0, 0)

    n_new, ended_on = 24, {4: 0, 2: 0}
    for row, seen in enumerate(task.seen):
        mask = items["completion_mask"][row]
        assert seen == items["tokens"][row][mask].tolist()  # the reward saw exactly what the learner trains on
        stops = [i for i, t in enumerate(seen) if t in (4, 2)]
        if len(seen) < n_new:
            assert stops == [len(seen) - 1]  # ended on its first stop id, which the reward saw too
            ended_on[seen[-1]] += 1
        else:
            assert stops in ([], [n_new - 1])
        assert (items["tokens"][row][16 + len(seen):] == tok.pad_id).all()
    assert ended_on[2] > 0 and ended_on[4] > 0, ended_on

    # Evaluation samples with the same stop ids.
    eval_task = recording_task(config, tok)
    sampler_fn = eval_sampler_factory(graphdef, cfg, n_new, tok)
    count_correct(params, eval_task, sampler_fn(temperature=1.0, top_p=1.0), 4, jax.random.PRNGKey(0), batch=32)
    assert any(len(seen) < n_new and seen[-1] == 2 for seen in eval_task.seen)
    for seen in eval_task.seen:
        assert [t for t in seen[:-1] if t in (4, 2)] == []


def test_stop_ids_come_from_config_json_without_a_generation_config(tmp_path):
    """transformers' generate stops on config.json's eos_token_id when there is no generation_config.json."""
    path = uniform_model(tmp_path / "m", None)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 3]}))
    assert load_tokenizer(path).eos_ids == (4, 2, 3)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    assert load_tokenizer(path).eos_ids == (4, 1)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": ["x"]}))
    with pytest.raises(HFModelError, match=r"generation_config\.json: eos_token_id must be a token id"):
        load_tokenizer(path)


def test_an_export_without_a_base_keeps_every_stop_id(tmp_path):
    src = uniform_model(tmp_path / "src", [4, 2])
    cfg, _, params = load_hf_model(src)
    out = save_hf_model(tmp_path / "out", cfg, params, tokenizer=load_tokenizer(src))
    assert not (out / "generation_config.json").exists()
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [4, 2]
    assert load_tokenizer(out).eos_ids == (4, 2)
