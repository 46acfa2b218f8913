"""One process of tests/test_multihost.py's gather check, run as
`python tests/gather_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR OUT_DIR ROUNDS` on 2 CPU devices.

Each round gathers host rows of eight different sizes from every process
(`Placement.every_process`), then reads a global array whole (`placement.fetched`): many
back-to-back gathers of unequal sizes, where a local device that ran ahead into the next
gather would pair its collectives with a peer's previous one. Writes what it saw to
OUT_DIR/process-<id>.json.
"""

import json
import sys
from pathlib import Path

import jax
import numpy as np

from jaxreplay.config import DistributedConfig, MeshConfig
from jaxreplay.models import sharding
from jaxreplay.train import distributed
from jaxreplay.train.placement import Placement, fetched

SIZES = (1, 3, 8, 10, 17, 40, 64, 101)


def main(pid: int, nproc: int, address: str, out: Path, rounds: int) -> None:
    distributed.initialize(DistributedConfig(enabled=True, coordinator_address=address, num_processes=nproc,
                                             process_id=pid, timeout_s=60))
    mesh = sharding.make_mesh(MeshConfig(data=-1))
    placement = Placement("multihost", mesh, mesh, pid, nproc)
    wrong = []
    for i in range(rounds):
        rows = {f"rows{n}": np.full((n, 2), 1000 * i + pid, np.int32) for n in SIZES}
        every = placement.every_process(rows)
        expected = {k: np.concatenate([np.full_like(v, 1000 * i + p) for p in range(nproc)]) for k, v in rows.items()}
        wrong += [f"round {i}: {k}" for k in rows if not np.array_equal(every[k], expected[k])]
        whole = np.arange(8 * (i % 5 + 1), dtype=np.float32)
        spread = jax.make_array_from_callback(whole.shape, sharding.batch_sharding(mesh), lambda index: whole[index])
        wrong += [f"round {i}: fetched"] * (not np.array_equal(fetched(spread), whole))
    (out / f"process-{pid}.json").write_text(json.dumps({"rounds": rounds, "wrong": wrong[:10]}))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(sys.argv[5]))
