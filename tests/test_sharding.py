"""Meshes from config and the logical-axis rules; the 8-device equivalence suite runs in a subprocess."""

import subprocess
import sys
from pathlib import Path

import jax
import pytest
from jax.sharding import PartitionSpec

from jaxreplay.compat import abstract_mesh, is_variable, logical_axes, value_of
from jaxreplay.config import ConfigError, MeshConfig, ModelConfig, load_config
from jaxreplay.models import sharding
from jaxreplay.models.transformer import abstract_params
from conftest import cpu_devices_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("override, key", [
    ("mesh.data=0", "mesh.data"),
    ("mesh.tensor=-2", "mesh.tensor"),
    ("mesh.fsdp=-1", None),
    ("mesh.actor_devices=-1", "mesh.actor_devices"),
    ("mesh.actor_tensor=0", "mesh.actor_tensor"),
    ("train.weight_sync_every=0", "train.weight_sync_every"),
])
def test_mesh_config_validation_names_the_key(override, key):
    if key is None:
        assert load_config(None, [override]).mesh.fsdp == -1
    else:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(None, [override])


def test_at_most_one_mesh_size_is_the_rest():
    with pytest.raises(ConfigError, match=r"mesh\.tensor: only one mesh size may be -1"):
        load_config(None, ["mesh.data=-1", "mesh.tensor=-1"])
    with pytest.raises(ConfigError, match=r"mesh\.actor_tensor"):
        load_config(None, ["mesh.actor_devices=3", "mesh.actor_tensor=2"])


@pytest.mark.parametrize("sizes, n, want", [
    ((1, 1, 1), 8, (1, 1, 1)),
    ((-1, 1, 1), 8, (8, 1, 1)),
    ((2, -1, 2), 8, (2, 2, 2)),
    ((1, 4, -1), 8, (1, 4, 2)),
])
def test_mesh_shape_resolves_the_rest(sizes, n, want):
    assert sharding.mesh_shape(MeshConfig(*sizes), n) == want


@pytest.mark.parametrize("sizes, key", [((4, 4, 1), "mesh.data"), ((3, -1, 1), "mesh.fsdp"), ((1, 1, 16), "mesh.tensor")])
def test_a_mesh_that_does_not_fit_the_devices_is_a_config_error(sizes, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        sharding.mesh_shape(MeshConfig(*sizes), 8)


def test_default_mesh_fits_one_device():
    mesh = sharding.make_mesh(MeshConfig())
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert mesh.devices.size == 1


@pytest.mark.tier
def test_every_parameter_has_logical_axes_with_a_rule():
    for cfg in (ModelConfig(), ModelConfig(tie_embeddings=False, attention_bias=True, qk_norm=True)):
        leaves = jax.tree.leaves(abstract_params(cfg), is_leaf=is_variable)
        for leaf in leaves:
            axes = logical_axes(leaf)
            assert axes is not None and len(axes) == len(value_of(leaf).shape)
            assert all(a in sharding.RULES for a in axes)


def test_logical_spec_skips_mesh_axes_that_do_not_divide_or_are_taken():
    mesh = abstract_mesh({"data": 2, "fsdp": 2, "tensor": 4})
    assert sharding.logical_spec(mesh, ("embed", "mlp"), (128, 384)) == PartitionSpec("fsdp", "tensor")
    # 2 kv heads x 1 (head_dim folded in): tensor=4 does not divide 2, so kv heads stay whole.
    assert sharding.logical_spec(mesh, ("batch", "length", "kv_heads", "head_dim"), (8, 16, 2, 32)) == \
        PartitionSpec(("data", "fsdp"), None, None, None)
    # fsdp already splits the batch, so embed may not reuse it.
    assert sharding.logical_spec(mesh, ("batch", "length", "embed"), (8, 16, 128)) == \
        PartitionSpec(("data", "fsdp"), None, None)
    with pytest.raises(ValueError, match="no sharding rule"):
        sharding.logical_spec(mesh, ("embedding",), (128,))


@pytest.mark.tier
def test_sharded_equals_single_device_on_8_host_devices():
    """Runs tests/test_sharding_multidevice.py where XLA sees 8 CPU devices."""
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_sharding_multidevice.py"],
        cwd=ROOT, env=cpu_devices_env(8), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout[-2000:]
