"""Run a script as 2 ranks the way ``torchrun --nproc-per-node 2`` runs it (the same
environment: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), without torchrun's own agent process: under TCG in the QEMU guests
its import of torch alone costs half a minute. Standard library only.

    python3 tests/frameworks/two_ranks.py SCRIPT ARGS...

Exits with the first failing rank's status (the other rank is then stopped), else 0.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def main() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    ranks = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env.setdefault("OMP_NUM_THREADS", "1")
        ranks.append(subprocess.Popen([sys.executable, *sys.argv[1:]], env=env))
    status = 0
    while any(rank.poll() is None for rank in ranks):
        failed = [rank.returncode for rank in ranks if rank.returncode not in (None, 0)]
        if failed:
            status = failed[0]
            for rank in ranks:
                if rank.poll() is None:
                    rank.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    for rank in ranks:
        rank.wait()
    return status or next((rank.returncode for rank in ranks if rank.returncode), 0)


if __name__ == "__main__":
    sys.exit(main())
