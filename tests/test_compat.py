"""The compatibility layer gives both dependency tiers one API, and reports which tier runs."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxreplay import compat
from jaxreplay.config import MeshConfig
from jaxreplay.models import sharding

pytestmark = pytest.mark.tier


class TwoLayers(nnx.Module):
    def __init__(self):
        self.kernel = compat.param(jnp.ones((4, 8)), ("embed", "mlp"))
        self.layers = compat.module_list([nnx.Linear(2, 2, rngs=nnx.Rngs(0)) for _ in range(2)])


def test_params_carry_logical_axes_and_are_not_placed_at_creation():
    # Flax 0.12 would shard eagerly and fail without a mesh in context; we place later.
    _, params = nnx.split(TwoLayers(), nnx.Param)
    leaf = params["kernel"]
    assert compat.is_variable(leaf)
    assert compat.logical_axes(leaf) == ("embed", "mlp")
    np.testing.assert_array_equal(compat.value_of(leaf), np.ones((4, 8)))
    assert set(params["layers"]) == {0, 1}  # submodule lists index like lists on both tiers


def test_param_shardings_place_by_logical_axes():
    _, params = nnx.split(TwoLayers(), nnx.Param)
    mesh = sharding.make_mesh(MeshConfig(data=1, fsdp=1, tensor=1))
    placed = sharding.shard_params(params, mesh)
    assert compat.value_of(placed["kernel"]).sharding.mesh.shape == mesh.shape
    assert compat.logical_axes(placed["kernel"]) == ("embed", "mlp")  # metadata survives placement


def test_abstract_mesh_has_the_sizes_asked_for():
    mesh = compat.abstract_mesh({"data": 2, "fsdp": 1, "tensor": 4})
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tensor": 4}


def test_version_flag_reports_the_running_tier():
    out = subprocess.run([sys.executable, "-m", "jaxreplay.cli", "--version"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert f"jax {jax.__version__}," in out.stdout and f"numpy {np.__version__}," in out.stdout
    assert f"python {sys.version.split()[0]}," in out.stdout
