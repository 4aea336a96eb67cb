"""At interpreter exit, a pool whose slots are still held waits for the copies that may
read them, for numafast.pool.EXIT_WAIT_S at most (issue 45): past it, the memory stays
registered and mapped (never unregistered under a running copy), said once. Needs a
CUDA device; skipped without one.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA device (this machine has none): the exit wait polls CUDA events of copies in flight",
        allow_module_level=True,
    )

import numafast  # noqa: E402

GPU_NODE = numafast.topology().node_of_gpu(0)
NODE = GPU_NODE if GPU_NODE is not None else numafast.pages.local_node()
# A busy-wait kernel (torch.cuda._sleep, private to torch) of some seconds: far past the wait given.
SPIN_CYCLES = 8_000_000_000

STUCK_AT_EXIT = """
import json, sys, time, warnings, torch, numafast, numafast.pool
numafast.pool.EXIT_WAIT_S = 0.2
pool = numafast.PinnedPool(int(sys.argv[1]), 64 << 20, 1)
host = torch.frombuffer(pool.acquire(), dtype=torch.uint8).fill_(9)
torch.cuda._sleep(int(sys.argv[2]))  # the copy below waits behind this
device = host.to("cuda", non_blocking=True)
started = time.monotonic()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    numafast.pool._close_at_exit()  # the consumer still holds the slot, a copy reads it
waited = time.monotonic() - started
copied_then = torch.cuda.current_stream().query()
torch.cuda.synchronize()
print(json.dumps({"waited_s": waited, "copied_then": copied_then, "registered": pool.registered,
                  "nines": bool((device == 9).all()), "said": [str(w.message) for w in caught]}))
"""


def test_at_exit_a_copy_that_does_not_end_leaves_the_held_pool_registered_and_says_so() -> None:
    done = subprocess.run([sys.executable, "-c", STUCK_AT_EXIT, str(NODE), str(SPIN_CYCLES)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["waited_s"] < 2.0  # the wait ended, long before the kernel did
    assert report["copied_then"] is False and report["registered"] is True
    assert report["nines"] is True  # the copy read registered memory to its end
    assert len(report["said"]) == 1 and "left registered" in report["said"][0]
