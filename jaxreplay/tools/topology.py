"""TPU slices by product name: the devices JAX sees on each, and their HBM, on any host.

libtpu describes a slice's chips without the chips being there
(`jax.experimental.topologies.get_topology_desc`), and XLA's TPU compiler then runs on
the CPU: `jaxreplay compile --topology v5e-8` compiles for a slice from a laptop.

A product name counts TensorCores for v4 and v5p (v4-8: 4 chips of 2 cores) and chips
for v5e and v6e (v5e-8: 8 chips of 1 core). JAX sees one device per chip on all four:
v4 and v5p run their two cores as one "megacore" device. The HBM per device comes from
`HBM_GIB`, keyed by `device_kind`, since a topology description does not report it.

Compiled memory figures depend on the libtpu version: the `tpu` extra installs the libtpu
that the tier's `jax[tpu]` pins (constraints/default.txt), and `jaxreplay compile` prints it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
from typing import Any, Optional

from jaxreplay.config import Config, ConfigError, owner_check


@dataclasses.dataclass(frozen=True)
class Slice:
    name: str  # product name, e.g. v5e-8
    topology: str  # libtpu's topology name, e.g. v5e:2x4
    devices: int  # devices JAX sees: one per chip
    megacore: bool  # two TensorCores per chip run as one device (v4, v5p)


def _slices() -> dict[str, Slice]:
    cube = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4", 128: "4x4x8", 256: "4x8x8",
            512: "8x8x8", 1024: "8x8x16", 2048: "8x16x16"}  # chips -> 3D torus (v4, v5p)
    grid = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8", 128: "8x16", 256: "16x16"}  # 2D (v5e, v6e)
    table = {}
    for product, prefix in (("v4", "v4"), ("v5p", "v5")):
        for chips, shape in cube.items():
            name = f"{product}-{2 * chips}"
            table[name] = Slice(name, f"{prefix}:{shape}", chips, megacore=True)
    for product in ("v5e", "v6e"):
        for chips, shape in grid.items():
            name = f"{product}-{chips}"
            table[name] = Slice(name, f"{product}:{shape}", chips, megacore=False)
    return table


TOPOLOGIES: dict[str, Slice] = _slices()

# HBM per device (what JAX calls a device) in GiB, by `device_kind`.
HBM_GIB = {
    "TPU v2": 8,  # per core: JAX sees both cores of a chip
    "TPU v3": 16,  # per core
    "TPU v4": 32,  # per chip (megacore)
    "TPU v5 lite": 16,  # v5e
    "TPU v5": 95,  # v5p, per chip (megacore)
    "TPU v5p": 95,
    "TPU v6 lite": 32,  # v6e (Trillium)
    "TPU v6e": 32,
}


@owner_check
def validate_topology(c: Config) -> None:
    """`mesh.topology`'s part of `config.validate`: a slice this table knows."""
    name = c.mesh.topology
    if name is not None and name not in TOPOLOGIES:
        raise ConfigError(f"mesh.topology: {name!r} is not a known TPU slice (e.g. {', '.join(list(TOPOLOGIES)[:6])}, "
                          f"...; see jaxreplay/tools/topology.py)")


class MissingLibtpu(RuntimeError):
    """Compiling for a TPU slice needs libtpu, which the `tpu` extra installs: the install, not
    the config, is what to change (exit status 2, as for other input at fault)."""

    kind = "error"


def libtpu_version() -> Optional[str]:
    """The installed libtpu's version, or None."""
    try:
        return importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        return None


def slice_devices(name: str) -> list[Any]:
    """The devices of TPU slice `name` as JAX sees them, described by libtpu without a TPU."""
    if name not in TOPOLOGIES:
        raise ConfigError(f"--topology: {name!r} is not a known TPU slice (e.g. {', '.join(list(TOPOLOGIES)[:8])}, "
                          f"...; see jaxreplay/tools/topology.py)")
    if libtpu_version() is None:
        raise MissingLibtpu(f"compiling for {name} needs libtpu, which the tpu extra installs: make venv LANE=tpu "
                            f"(then .venv-tpu/bin/jaxreplay), or pip install 'jaxreplay[tpu]' -c "
                            f"constraints/default.txt (the lane's constraints, so that libtpu matches jax)")
    from jax.experimental import topologies

    spec = TOPOLOGIES[name]
    chip_config = {"chip_config_name": "megacore"} if spec.megacore else {}
    devices = list(topologies.get_topology_desc(platform="tpu", topology_name=spec.topology, **chip_config).devices)
    if len(devices) != spec.devices:
        raise RuntimeError(f"libtpu describes {spec.topology} as {len(devices)} devices, expected {spec.devices}")
    return devices


def host_devices(name: str) -> list[Any]:
    """One host's devices of slice `name`, described as a slice of their own (v5e-16: a v5e-4),
    which is what each host's process-local programs run on. XLA's TPU compiler compiles for a
    whole topology's device ids, not for one host's subset of a larger one."""
    devices = slice_devices(name)
    hosts = len({d.process_index for d in devices})
    spec = TOPOLOGIES[name]
    per_host = spec.devices // hosts * (2 if spec.megacore else 1)
    return slice_devices(f"{name.split('-')[0]}-{per_host}")


def hbm_bytes(device: Any) -> Optional[int]:
    """Memory per device: the `HBM_GIB` table for TPUs, the runtime's limit for GPUs, None for the host CPU."""
    if device.platform == "tpu":
        if device.device_kind not in HBM_GIB:
            raise RuntimeError(f"no HBM size known for {device.device_kind!r}: add it to topology.HBM_GIB")
        return HBM_GIB[device.device_kind] << 30
    if device.platform == "gpu":
        return (device.memory_stats() or {}).get("bytes_limit")
    return None
