"""The warm-start cache: keyed by the settings that produce it, shared by the runs of a sweep, written whole."""

import contextlib
import io
import json
from pathlib import Path

import jax
import numpy as np

from jaxreplay.config import load_config
from jaxreplay.models.transformer import init_params
from jaxreplay.tasks.registry import make_task
from jaxreplay.train.warmstart import (
    _identity, _publish, cache_key, cache_root, supervised_warm_start, warm_start, warmstart_settings)

TINY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "model.n_kv_heads=1", "model.head_dim=16",
        "model.d_ff=64", "task.eval_size=32", "warmstart.steps=3", "warmstart.batch_size=8", "run.progress_bar=false"]


def config(run_dir, *overrides):
    return load_config(None, [*TINY, f"run.dir={run_dir}", *overrides])


def start(cfg, lines=None):
    """What a run does first: fresh params, then the (cached) warm start. `lines` gets the warnings,
    which go to stderr, never to the progress log."""
    graphdef, params = init_params(cfg.model, cfg.run.seed)
    progress, stderr = [], io.StringIO()
    with contextlib.redirect_stderr(stderr):
        out = warm_start(graphdef, params, make_task(cfg.task), cfg, log=progress.append)
    assert not [line for line in progress if "warning" in line], progress
    if lines is not None:
        lines.extend(line for line in stderr.getvalue().splitlines() if line.startswith("warning: "))
    return out


def same(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))


def entries(root):
    return sorted(p.name for p in root.iterdir())


def test_runs_with_the_same_settings_compute_one_warm_start(tmp_path):
    first, cached_first = start(config(tmp_path / "sweep" / "a"))
    second, cached_second = start(config(tmp_path / "sweep" / "b", "train.steps=7", "replay.samples_per_insert=4"))
    assert (cached_first, cached_second) == (False, True)
    assert same(first, second)
    cfg = config(tmp_path / "sweep" / "a")
    graphdef, params = init_params(cfg.model, cfg.run.seed)
    assert same(second, supervised_warm_start(graphdef, params, make_task(cfg.task), cfg))  # the cached = the fresh
    root = tmp_path / "sweep" / ".warmstart-cache"
    assert Path(cache_root(cfg)) == root and entries(root) == [cache_key(cfg)]  # one entry, no temporary left over
    assert json.loads((root / cache_key(cfg) / "settings.json").read_text())["run.seed"] == 0


def test_a_changed_seed_misses_the_cache(tmp_path):
    start(config(tmp_path / "a"))
    params, cached = start(config(tmp_path / "b", "run.seed=1"))
    assert not cached
    assert len(entries(tmp_path / ".warmstart-cache")) == 2


def test_the_key_is_the_settings_that_produce_the_warm_start(tmp_path):
    base = config(tmp_path / "a")
    key = cache_key(base)
    for unrelated in ["run.dir=elsewhere/b", f"warmstart.cache_dir={tmp_path}", "train.steps=9", "train.loss=tis",
                      "replay.selector=fifo", "model.hf_config=qwen3-0.6b", "run.progress_bar=true"]:
        assert cache_key(config(tmp_path / "a", unrelated)) == key, unrelated
    for setting in ["run.seed=3", "model.d_ff=96", "model.param_dtype=bfloat16", "task.max_digits=3",
                    "task.data_seed=5", "warmstart.steps=4", "warmstart.learning_rate=0.01",
                    "warmstart.teacher_carry_error=0.5", "sampling.max_new_tokens=6"]:
        assert cache_key(config(tmp_path / "a", setting)) != key, setting
    assert "cache_dir" not in warmstart_settings(base)["warmstart"]


def test_a_damaged_entry_is_recomputed_with_a_warning(tmp_path):
    cfg = config(tmp_path / "a", f"warmstart.cache_dir={tmp_path / 'cache'}")
    fresh, _ = start(cfg)
    entry = tmp_path / "cache" / cache_key(cfg)
    for damage in ["params", "settings.json"]:
        target = entry / damage
        if target.is_dir():
            for f in target.rglob("*"):
                if f.is_file():
                    f.write_bytes(b"\0garbage")
        else:
            target.write_text('{"run.seed": 99}')
        lines = []
        params, cached = start(cfg, lines)
        assert not cached and same(params, fresh), damage
        assert len(lines) == 1 and lines[0].startswith("warning: the cached warm start") and "recomputing" in lines[0]
        again, cached = start(cfg)  # the recomputed entry replaced the damaged one
        assert cached and same(again, fresh)
    assert entries(tmp_path / "cache") == [cache_key(cfg)]


def largest_data_file(entry: Path) -> Path:
    """Where the array chunks are: the largest file of the entry's OCDBT params."""
    return max((f for f in (entry / "params").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_an_entry_whose_array_bytes_changed_or_were_cut_short_is_recomputed_and_replaced(tmp_path):
    """Orbax reads a changed byte inside an array chunk back without a word: the entry's checksums catch it."""
    cfg = config(tmp_path / "a", f"warmstart.cache_dir={tmp_path / 'cache'}")
    fresh, _ = start(cfg)
    entry = tmp_path / "cache" / cache_key(cfg)
    for damage, why in [(flip_a_byte, "does not match the checksum saved with it"), (truncate, "OUT_OF_RANGE")]:
        damage(largest_data_file(entry))
        lines = []
        params, cached = start(cfg, lines)
        assert not cached and same(params, fresh), damage.__name__
        assert len(lines) == 1, lines
        assert lines[0].startswith(f"warning: the cached warm start {entry} is damaged (") and why in lines[0]
        assert lines[0].endswith("recomputing it and replacing the entry") and "\n" not in lines[0]
        again, cached = start(cfg)  # the recomputed entry replaced the damaged one
        assert cached and same(again, fresh)
    assert entries(tmp_path / "cache") == [cache_key(cfg)]  # nothing set aside or half-written left over


def test_of_two_runs_replacing_a_damaged_entry_the_first_rename_wins(tmp_path):
    cfg = config(tmp_path / "a")
    params, _ = start(cfg)
    entry = Path(cache_root(cfg)) / cache_key(cfg)
    flip_a_byte(largest_data_file(entry))
    damaged = _identity(str(entry))  # both runs found this entry damaged and recomputed it
    _publish(entry, warmstart_settings(cfg), params, replace=damaged)  # the first to finish replaces it
    (entry / "marker").write_text("first writer")
    _publish(entry, warmstart_settings(cfg), params, replace=damaged)  # the second keeps the first's
    assert (entry / "marker").read_text() == "first writer"
    assert entries(entry.parent) == [entry.name]
    lines = []
    assert start(cfg, lines)[1] and lines == []


def test_a_second_writer_keeps_the_entry_that_appeared_meanwhile(tmp_path):
    cfg = config(tmp_path / "a")
    params, _ = start(cfg)
    entry = Path(cache_root(cfg)) / cache_key(cfg)
    (entry / "marker").write_text("first writer")
    _publish(entry, warmstart_settings(cfg), params, replace=False)  # computed concurrently, finished second
    assert (entry / "marker").read_text() == "first writer"
    assert entries(entry.parent) == [entry.name]
    assert start(cfg)[1]


def test_no_warm_start_steps_caches_nothing(tmp_path):
    cfg = config(tmp_path / "a", "warmstart.steps=0")
    graphdef, params = init_params(cfg.model, 0)
    out, cached = warm_start(graphdef, params, make_task(cfg.task), cfg)
    assert out is params and not cached and not Path(cache_root(cfg)).exists()


def test_an_unwritable_cache_warns_and_the_run_goes_on(tmp_path):
    (tmp_path / "blocker").write_text("not a directory")
    lines = []
    params, cached = start(config(tmp_path / "a", f"warmstart.cache_dir={tmp_path / 'blocker' / 'cache'}"), lines)
    assert not cached and len(lines) == 1 and lines[0].startswith("warning: cannot cache the warm start")


def test_runs_differing_only_in_the_pool_size_start_from_identical_params_with_fixed_splits(tmp_path):
    """Issue 49: the warm start has its own split, so task.train_size changes neither it nor its cache entry."""
    fixed = ("task.splits=fixed", "task.warmstart_size=200")
    small, cached_small = start(config(tmp_path / "sweep" / "a", *fixed, "task.train_size=64"))
    full, cached_full = start(config(tmp_path / "sweep" / "b", *fixed, "task.train_size=512"))
    assert (cached_small, cached_full) == (False, True)
    assert same(small, full)
    assert len(entries(tmp_path / "sweep" / ".warmstart-cache")) == 1
    cfg = config(tmp_path / "sweep" / "b", *fixed, "task.train_size=512")
    graphdef, params = init_params(cfg.model, cfg.run.seed)
    assert same(full, supervised_warm_start(graphdef, params, make_task(cfg.task), cfg))  # not just the same key
