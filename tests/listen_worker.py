"""One process of tests/test_faults.py's listening-address check, run as
`python tests/listen_worker.py PROCESS_ID NUM_PROCESSES COORDINATOR OUT_DIR [OVERRIDE...]` on CPU
("{port}" in an override is the coordinator's port).

Joins a real 2-process job through `distributed.initialize` (gloo), then process 0 reads from
the OS (/proc/net/tcp and tcp6) every socket listening on the coordinator's port and writes
them to OUT_DIR/listening.json; both wait for that at a barrier before they leave.
"""

import ipaddress
import json
import sys
from pathlib import Path

from jaxreplay.config import load_config
from jaxreplay.train import distributed

LISTEN = "0A"  # the TCP state column of /proc/net/tcp


def listening(port: int) -> list[str]:
    """"host:port" of every TCP socket listening on `port`, as the kernel reports them."""
    found = []
    for table, size in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 16)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.split(":")
            if state != LISTEN or int(hex_port, 16) != port:
                continue
            raw = bytes.fromhex(address)  # 32-bit words in host (little-endian) order
            raw = b"".join(raw[i:i + 4][::-1] for i in range(0, size, 4))
            ip = ipaddress.ip_address(raw)
            ip = getattr(ip, "ipv4_mapped", None) or ip  # gRPC binds 127.0.0.1 as [::ffff:127.0.0.1]
            found.append(f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}")
    return sorted(found)


def main(pid: int, nproc: int, address: str, out: Path, overrides: list[str]) -> None:
    port = int(address.rsplit(":", 1)[1])
    overrides = [o.replace("{port}", str(port)) for o in overrides]
    config = load_config(None, ["distributed.enabled=true", f"distributed.coordinator_address={address}",
                                f"distributed.num_processes={nproc}", f"distributed.process_id={pid}",
                                "distributed.timeout_s=60", *overrides])
    distributed.initialize(config.distributed)
    coordinator = distributed.Coordinator(60)
    if pid == 0:
        (out / "listening.json").write_text(json.dumps({"port": port, "listening": listening(port)}))
    coordinator.barrier("read")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), sys.argv[5:])
