"""The Hugging Face bridge's files and stop ids, on directories made here (no torch needed):
which weight files an export leaves and the loader picks, exports that would overwrite their
own sources, corrupt or escaping weight files, configs transformers rejects, file modes."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
from flax import nnx
from tiny_hf import write_model

from jaxreplay.cli import main
from jaxreplay.compat import value_of
from jaxreplay.config import ModelConfig
from jaxreplay.models import init_params
from jaxreplay.models.hf import HFModelError, load_hf_model, save_hf_model
from jaxreplay.models.tokenizer import load_tokenizer

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
    (lambda c: json.dumps({**c, "head_dim": 7}), r"rejected by transformers: .*`head_dim`=7"),
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
    assert ours == [f"jaxreplay: error: HFModelError: {message}"] and "Traceback" not in err


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
