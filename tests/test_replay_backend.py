"""The backend protocol (jaxreplay/replay/backend.py): both backends serve it, only the
Reverb adapter touches Reverb, and checkpoints are named relative to their root, so a
copied run directory restores from its own copy."""

from __future__ import annotations

import ast
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from jaxreplay.config import load_config
from jaxreplay.replay.backend import Backend, Client
from jaxreplay.replay.backend import checkpoint_path
from jaxreplay.replay.reader import RolloutReader
from jaxreplay.replay.server import serve
from jaxreplay.replay.tables import build_tables
from jaxreplay.replay.writer import RolloutWriter

pytestmark = pytest.mark.timeout(60, method="thread")

PACKAGE = Path(__file__).resolve().parents[1] / "jaxreplay"
ADAPTER = PACKAGE / "replay" / "reverb_backend.py"
SPEC = {"tokens": ((3,), np.int32), "reward": ((), np.float32), "policy_version": ((), np.int32)}
# on_policy: a lifo queue of max(B, R) = 4 rows, each sampled once, so draining it reads its contents in order
QUEUE = ("replay.mode=on_policy", "train.batch_size=4", "train.prompts_per_step=2", "train.group_size=2")
BACKENDS = ["inprocess", pytest.param("reverb", marks=pytest.mark.needs_reverb)]


def rollouts(ids):
    ids = np.asarray(list(ids), np.int32)
    return {"tokens": np.stack([ids, ids + 1, ids + 2], axis=1), "reward": np.ones(len(ids), np.float32),
            "policy_version": ids}


def _imports(path: Path) -> set[str]:
    """The top-level packages `path` imports, wherever in the file."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def test_only_the_adapter_imports_reverb_and_only_compat_tensorflow():
    """TensorFlow is imported only to hide accelerators from it (compat.set_tf_cpu_only), which the
    Reverb adapter and TFDS (tasks/datasets.py; tensorflow_datasets is its own package) both call."""
    offenders = {str(p.relative_to(PACKAGE)): sorted(_imports(p) & {"reverb", "tensorflow"})
                 for p in PACKAGE.rglob("*.py") if p != ADAPTER}
    assert {k: v for k, v in offenders.items() if v} == {"compat.py": ["tensorflow"]}
    assert "reverb" in _imports(ADAPTER)  # the scan sees imports inside functions


def test_no_replay_module_but_the_adapter_checks_a_backends_type():
    """`type(e).__name__`, an exception's name in a message, checks no type and is allowed."""
    calls = {}
    for p in (PACKAGE / "replay").glob("*.py"):
        if p == ADAPTER:
            continue
        tree = ast.parse(p.read_text())
        naming = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "__name__"}
        found = [n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and id(n) not in naming
                 and isinstance(n.func, ast.Name) and n.func.id in ("isinstance", "hasattr", "type")]
        if found:
            calls[p.name] = found
    assert calls == {}


@pytest.mark.parametrize("backend", BACKENDS)
def test_both_backends_serve_the_protocol(backend, tmp_path):
    with serve(build_tables(load_config(None, list(QUEUE)), SPEC, backend), checkpoint_root=tmp_path) as server:
        assert isinstance(server, Backend) and isinstance(server, Client)
        RolloutWriter(server, SPEC, timeout_s=5).insert(rollouts(range(3)))
        assert server.states()[server.table].inserts == 3 and "inserts=3" in server.describe()
        if backend == "reverb":  # a client of a server elsewhere: the data path, not the server's duties
            from jaxreplay.replay.reverb_backend import ReverbClient
            client = ReverbClient(server.address, SPEC, timeout_s=5)
            assert isinstance(client, Client) and not isinstance(client, Backend)
            batch, info = RolloutReader(client, timeout_s=5).sample(1)
            assert batch["policy_version"].tolist() == [2] and info.times_sampled.tolist() == [1]
            client.close()


def _drain(server) -> tuple[list[int], list[int]]:
    """Every row left in the queue, freshest first: (ids, keys)."""
    n = server.states()[server.table].size
    batch, info = RolloutReader(server, timeout_s=5).sample(n)
    return batch["policy_version"].tolist(), info.keys.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_copied_checkpoint_root_restores_with_the_original_deleted(backend, tmp_path):
    """The checkpoint's name is relative: the copy restores its own items and limiter
    counters, which a stored absolute path would have looked for in the deleted original."""
    tables = build_tables(load_config(None, list(QUEUE)), SPEC, backend)
    original, copy = tmp_path / "a" / "replay", tmp_path / "b" / "replay"
    with serve(tables, checkpoint_root=original) as server:
        writer = RolloutWriter(server, SPEC, timeout_s=5)
        writer.insert(rollouts(range(4)))
        RolloutReader(server, timeout_s=5).sample(1)  # takes 3, the freshest
        writer.insert(rollouts([4]))
        name, saved = server.checkpoint(), server.states()
        expected = _drain(server)
    assert not os.path.isabs(name) and (original / name).is_dir()
    assert expected[0] == [4, 2, 1, 0]
    shutil.copytree(original.parent, copy.parent)
    shutil.rmtree(original.parent)
    with serve(tables, checkpoint_root=copy, restore_from=name) as restored:
        assert restored.states() == saved  # sizes and limiter counters (inserts 5, samples 1)
        assert _drain(restored) == expected
        assert restored.prune(keep={name}) == [] and (copy / name).is_dir()
        assert [Path(p).name for p in restored.prune(keep=set())] == [name]


def test_checkpoint_names_resolve_against_the_root_and_absolute_paths_stay_as_they_are(tmp_path):
    assert checkpoint_path(str(tmp_path), "c1") == str(tmp_path / "c1")
    assert checkpoint_path(str(tmp_path / "other"), str(tmp_path / "c1")) == str(tmp_path / "c1")  # older runs
    with pytest.raises(ValueError, match="relative to a checkpoint_root"):
        checkpoint_path(None, "c1")
