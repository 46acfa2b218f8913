"""One process of tests/test_multihost.py's sharded-replay checks, run as
`python tests/sharded_replay_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR OUT_DIR [--open] [key=value ...]`.

It drives a `ShardedReplay` through the multi-host scheduler's moves (`scheduler.next_move`)
for `train.steps` learner steps, inserting made-up rows tagged with this process's id,
then checkpoints its shard and restores it; it writes what it saw to OUT_DIR/process-<id>.json.
With --open it only opens the view `replay.backend` asks for (`open_replay`) and writes its kind.
"""

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from jaxreplay.config import DistributedConfig, load_config
from jaxreplay.replay.limiter import next_move
from jaxreplay.replay.multiprocess import ShardedReplay, open_replay
from jaxreplay.train import distributed

SPEC = {"origin": ((), np.int32), "serial": ((), np.int32), "reward": ((), np.float32)}


def main(pid: int, nproc: int, address: str, out: Path, overrides: list[str]) -> None:
    distributed.initialize(DistributedConfig(enabled=True, coordinator_address=address, num_processes=nproc,
                                             process_id=pid, timeout_s=60))
    coord = distributed.Coordinator(60)
    config = load_config(None, [o for o in overrides if o != "--open"])
    if "--open" in overrides:
        replay = open_replay(config, SPEC, coord)
        replay.stop()
        (out / f"process-{pid}.json").write_text(json.dumps({"view": type(replay).__name__}))
        return
    b, per_act = config.train.batch_size, config.rollouts_per_step // nproc
    replay = ShardedReplay(config, SPEC, coord, checkpoint_root=out / "replay")
    turns, samples, serial, pending, steps, turn = [], [], 0, 0, 0, 0
    while steps < config.train.steps:
        turn += 1
        view = replay.view(f"turn/{turn}", pending)
        move = next_move(view.state, view.pending, view.state.can_sample_at_once(b), nproc)
        turns.append({"state": dataclasses.asdict(view.state), "pending": view.pending, "move": move._asdict()})
        if move.kind == "insert":
            k = move.rows
            replay.insert({"origin": np.full(k, pid, np.int32), "serial": np.arange(serial, serial + k, dtype=np.int32),
                           "reward": np.zeros(k, np.float32)})
            serial, pending = serial + k, pending - k
        elif move.kind == "learn":
            batch, _ = replay.sample(b // nproc)
            samples.append({"origin": batch["origin"].tolist(), "serial": batch["serial"].tolist()})
            steps += 1
        else:
            pending = per_act
    final = replay.view("final")
    local = replay.local()
    restored = ShardedReplay(config, SPEC, coord, checkpoint_root=out / "replay", restore_from=replay.checkpoint())
    report = {"turns": turns, "samples": samples, "inserted": serial,
              "final": dataclasses.asdict(final.state), "local": dataclasses.asdict(local),
              "restored_local": dataclasses.asdict(restored.local()),
              "restored_final": dataclasses.asdict(restored.view("restored").state)}
    (out / f"process-{pid}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5:])
