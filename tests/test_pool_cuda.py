"""The CUDA paths of pinned pools, for real: registration, event-guarded reuse of a slot
while a copy still reads it, NumaLoader's side-stream copies and the pin_memory hook
driven by PyTorch's own pin thread. They need a CUDA device and are skipped without one.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import threading
import time
from typing import Any

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip(
        "needs a CUDA device (this machine has none): registration, event-guarded slot reuse and "
        "side-stream copies are only tested where a GPU is",
        allow_module_level=True,
    )

import numafast  # noqa: E402
import numafast.torch  # noqa: E402

MIB = 1 << 20
GPU_NODE = numafast.topology().node_of_gpu(0)
NODE = GPU_NODE if GPU_NODE is not None else numafast.pages.local_node()
# A busy-wait kernel long enough that a copy queued after it is surely still in flight.
SPIN_CYCLES = 2_000_000_000


def test_a_pool_registers_its_memory_and_unregisters_it() -> None:
    with numafast.PinnedPool(NODE, 8 * MIB, 2) as pool:
        assert pool.registered and pool.locked
        stats = pool.stats()
        assert stats.bytes_registered == stats.bytes_mapped == numafast._libnuma.slot_table_bytes(2) + 16 * MIB
        tensor = torch.frombuffer(pool.acquire(), dtype=torch.uint8)
        assert tensor.is_pinned()  # CUDA itself says the memory is page-locked for it
        pool._resources.unpin()  # what closing does once the last slot is back
        assert not tensor.is_pinned()
        del tensor


def test_registration_in_chunks_pins_every_slot_and_unpins_them_all() -> None:
    from numafast import cuda

    with numafast.PinnedPool(NODE, 3 * MIB, 6, register="off") as pool:
        region = pool._resources.region
        registration = cuda.Registration(
            region.address, region.size, device=0, unit=pool._slots.table.stride,
            head=numafast._libnuma.slot_table_bytes(6), limit=8 * MIB,
        )
        assert len(registration.ranges) == 3  # two 3 MiB slots a piece
        slots = [pool.acquire() for _ in range(6)]
        tensors = [torch.frombuffer(slot, dtype=torch.uint8) for slot in slots]
        assert all(tensor.is_pinned() for tensor in tensors)
        device = [tensor.fill_(index).to("cuda", non_blocking=True) for index, tensor in enumerate(tensors)]
        torch.cuda.synchronize()
        assert all(bool((copy == index).all()) for index, copy in enumerate(device))
        registration.unregister()
        assert not any(tensor.is_pinned() for tensor in tensors)
        del tensors, slots


def test_a_slot_is_not_reused_while_a_copy_from_it_is_in_flight() -> None:
    stream = torch.cuda.Stream()
    with numafast.PinnedPool(NODE, 64 * MIB, 1) as pool:
        host = torch.frombuffer(pool.acquire(), dtype=torch.uint8)
        host.fill_(1)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(SPIN_CYCLES)  # the copy below waits behind this
            device = host.to("cuda", non_blocking=True)
        numafast.torch.record_stream(host, stream)
        del host  # given back while the copy has not even started
        assert pool.stats().in_flight == 1
        with pytest.raises(numafast.PoolExhaustedError, match="1 in flight on the GPU"):
            pool.acquire(timeout=0)
        again = torch.frombuffer(pool.acquire(timeout=60), dtype=torch.uint8)  # waits for the event
        again.fill_(2)  # only now may the slot be overwritten
        assert bool((device == 1).all())
        assert pool.stats().in_flight == 0


def test_the_current_stream_guards_a_slot_without_record_stream() -> None:
    with numafast.PinnedPool(NODE, 64 * MIB, 1) as pool:
        host = torch.frombuffer(pool.acquire(), dtype=torch.uint8)
        host.fill_(3)
        torch.cuda._sleep(SPIN_CYCLES)
        device = host.to("cuda", non_blocking=True)
        del host
        again = torch.frombuffer(pool.acquire(timeout=60), dtype=torch.uint8)
        again.fill_(4)
        assert bool((device == 3).all())


class Images(torch.utils.data.Dataset):  # type: ignore[misc]
    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": torch.full((3, 64, 64), float(index)), "label": index}


def test_numa_loader_copies_batches_to_the_device_on_a_side_stream() -> None:
    stock = list(torch.utils.data.DataLoader(Images(), batch_size=4, num_workers=2))
    loader = numafast.torch.NumaLoader(torch.utils.data.DataLoader(Images(), batch_size=4, num_workers=2), device="cuda:0")
    assert loader.node == NODE
    ours = list(loader)
    assert len(ours) == len(stock)
    for left, right in zip(stock, ours):
        assert right["image"].device.type == "cuda" and torch.equal(left["image"], right["image"].cpu())
        assert torch.equal(left["label"], right["label"].cpu())
    torch.cuda.synchronize()
    del ours
    gc.collect()
    stats = loader.stats()
    assert sum(s.in_use for s in stats.pools) == 0 and all(s.bytes_registered for s in stats.pools)
    assert stats.landed > 0  # the workers collated into registered slots


class ManyImages(Images):
    def __len__(self) -> int:
        return 400


def test_workers_keep_landing_batches_once_every_slot_has_been_fenced() -> None:
    """With CUDA, a slot given back is fenced until the copies reading it are done, and
    workers lease only free slots: the owner must free fenced slots as their copies end
    (settle, reap), or after one pass over the slots every batch waits a second for room
    and is copied by the main process. 100 batches, each consumed and dropped."""
    loader = numafast.torch.NumaLoader(
        torch.utils.data.DataLoader(ManyImages(), batch_size=4, num_workers=2), device="cuda:0"
    )
    started = time.monotonic()
    for batch in loader:
        torch.cuda.current_stream().synchronize()  # the consumer's step
        del batch
    took = time.monotonic() - started
    stats = loader.stats()
    assert stats.batches == 100 and stats.fallbacks.get("no free slot", 0) == 0, (stats, took)
    assert stats.landed >= 95 and sum(pool.slots for pool in stats.pools) <= 2 * loader.pools.slots, stats


def test_the_hook_pins_in_pytorchs_own_pin_thread() -> None:
    loader = torch.utils.data.DataLoader(Images(), batch_size=4, num_workers=2, pin_memory=True)
    hook = numafast.torch.pin_memory_hook(loader)
    assert hook.installed and hook.node == NODE, hook.reason
    batches = list(loader)
    assert hook.pools is not None
    for index, batch in enumerate(batches):
        assert isinstance(batch, dict) and batch["image"].is_pinned()
        assert any(pool.contains(batch["image"].data_ptr()) for pool in hook.pools.pools)
        assert bool((batch["image"][0] == 4 * index).all())
    stats = hook.stats()
    assert stats is not None and stats.landed > 0  # torch's pin step copied nothing for those
    hook.remove()


def test_a_loader_a_framework_makes_with_pin_memory_lands_once_torchs_pin_step_copies_nothing() -> None:
    """What a framework does with a NumaLoader (Accelerate, Ray Train): a new DataLoader from
    its attributes, here with pin_memory=True as the HF Trainer's default: PyTorch's pin
    thread finds the tensors pinned already (registered) and hands them on as they are."""
    own = numafast.torch.NumaLoader(torch.utils.data.DataLoader(Images(), batch_size=4, num_workers=2))
    made = torch.utils.data.DataLoader(own.dataset, batch_size=4, num_workers=2, collate_fn=own.collate_fn,
                                       pin_memory=True)  # fmt: skip
    batches = list(made)
    for batch in batches:
        assert batch["image"].is_pinned() and own.pools.holds(batch["image"].data_ptr())
    stats = numafast.torch.loader_stats(made)
    assert stats is not None and stats.batches == len(batches) and stats.landed > 0


def test_bench_measures_every_node_to_every_gpu_from_pinned_node_local_buffers() -> None:
    result = numafast.bench(matrices=["h2d_gbps", "d2h_concurrent_gbps"], quick=True)
    gpus = list(range(torch.cuda.device_count()))
    for name, streams in (("h2d_gbps", 1), ("d2h_concurrent_gbps", 4)):
        matrix = result.matrices[name]
        assert matrix.cols == gpus and matrix.streams == streams and matrix.statistic == "median"
        for row, values in zip(matrix.rows, matrix.values):
            for col, value in zip(matrix.cols, values):
                key = f"{row},{col}"
                assert (value is not None and value > 0) or key in matrix.missing
                if value is not None:
                    assert matrix.placement[key]["buffers"]["host"]["node"] == row


FRESH_LOADER = """
import json, os, pickle, shutil, subprocess, sys, torch, numafast.torch

class Images(torch.utils.data.Dataset):
    def __len__(self):
        return 24
    def __getitem__(self, index):
        return {"image": torch.full((3, 64, 64), float(index)), "label": index}

def contexts():
    if shutil.which("nvidia-smi") is None:
        return None
    listing = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60, check=True).stdout
    return sorted(uuid.strip() for line in listing.splitlines() if line.strip()
                  for pid, uuid in [line.split(",")] if int(pid) == os.getpid())

device = int(sys.argv[1])
loader = numafast.torch.NumaLoader(torch.utils.data.DataLoader(Images(), batch_size=4, num_workers=2), device="cuda")
pickle.dumps(loader.collate_fn)
built = {"initialized": torch.cuda.is_initialized(), "contexts": contexts() or []}
torch.cuda.set_device(device)  # the rank's device, picked after the loader was built, as scripts do
sums = [batch["image"].sum().item() for batch in loader]
print(json.dumps({"built": built, "device": str(loader.device), "pools": loader.pools.device, "sums": sums,
                  "registered": [pool.device for pool in loader.pools.pools], "contexts": contexts(),
                  "uuid": "GPU-" + str(torch.cuda.get_device_properties(device).uuid)}))
"""


def test_a_loader_touches_cuda_only_when_iterated_and_only_on_the_ranks_device() -> None:
    """In a fresh process: building and pickling a loader create no CUDA context (and
    leave torch's CUDA uninitialised); iterating creates one, on the device current
    then, through which its pools registered (the last device where there are several)."""
    device = torch.cuda.device_count() - 1
    environment = {key: value for key, value in os.environ.items() if key != "LOCAL_RANK"}
    done = subprocess.run([sys.executable, "-c", FRESH_LOADER, str(device)],
                          capture_output=True, text=True, timeout=300, env=environment)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report["built"] == {"initialized": False, "contexts": []}
    assert report["device"] == f"cuda:{device}" and report["pools"] == device
    assert report["registered"] and set(report["registered"]) == {device}
    assert report["sums"] == [float(sum(range(4 * i, 4 * i + 4)) * 3 * 64 * 64) for i in range(6)]
    if report["contexts"]:  # none listed: nvidia-smi, in another PID namespace, lists no pid of this one
        assert report["contexts"] == [report["uuid"]]  # one context, on the rank's device alone


def test_a_pool_made_in_another_thread_registers_through_the_device_it_names() -> None:
    made: list[numafast.PinnedPool] = []
    device = torch.cuda.device_count() - 1
    maker = threading.Thread(target=lambda: made.append(numafast.PinnedPool(NODE, MIB, 2, device=device)))
    maker.start()
    maker.join(120)
    with made[0] as pool:
        assert pool.registered and pool.device == device
        host = torch.frombuffer(pool.acquire(), dtype=torch.uint8).fill_(7)
        assert host.is_pinned()
        assert bool((host.to(f"cuda:{device}", non_blocking=True) == 7).all())
        del host
    with pytest.raises(numafast.InvalidGpuError, match="sees"):
        numafast.PinnedPool(NODE, MIB, 2, device=torch.cuda.device_count())


def test_batches_keep_arriving_while_a_registered_pool_is_made() -> None:
    """A resize to 512 MiB slots faults in and registers a GiB in the thread making it,
    outside the mutex every batch takes: copies into the current pool go on meanwhile,
    each taking far less than the making does."""
    pools = numafast.torch.owner_pools.NodePools(NODE, 2)
    pools.device = 0
    pools.make_room(MIB, more=False)
    started = time.perf_counter()
    making = threading.Thread(target=pools.make_room, args=(400 * MIB, False))
    making.start()
    waits = []
    while making.is_alive():
        before = time.perf_counter()
        batch = pools.pin(torch.ones(1024))
        waits.append(time.perf_counter() - before)
        del batch
    took = time.perf_counter() - started
    try:
        assert pools.pools[0].slot_bytes >= 400 * MIB and pools.pools[0].registered
        assert len(waits) > 1 and max(waits) < took / 4, (max(waits), took)
    finally:
        pools.close()


def test_a_refused_registration_leaves_the_pool_unregistered_and_no_error_for_the_next_kernel() -> None:
    """register='auto' where cudaHostRegister refuses (here: the memory is registered
    already, by someone else): the pool goes on unregistered with one warning, and the
    refusal is not reported by the next kernel launched in this thread."""
    from numafast import cuda
    from numafast import pool as pool_module

    with numafast.PinnedPool(NODE, MIB, 2, register="off") as pool:
        region = pool._resources.region
        elsewhere = cuda.Registration(region.address, region.size, device=0)
        try:
            numafast._process.done_once.discard("pools unregistered")
            with pytest.warns(RuntimeWarning, match="said once"):
                fences = pool_module._register(pool._resources, 0, pool_module.RegisterMode.AUTO, MIB, 2)
            assert fences is None and pool._resources.registration is None
            assert torch.ones(4, device="cuda:0").add_(1).sum().item() == 8.0  # a kernel launch, its check clean
        finally:
            elsewhere.unregister()


AT_EXIT = """
import json, sys, torch, numafast, numafast.pool
pool = numafast.PinnedPool(int(sys.argv[1]), 64 << 20, 1)
host = torch.frombuffer(pool.acquire(), dtype=torch.uint8).fill_(9)
torch.cuda._sleep(int(sys.argv[2]))  # the copy below waits behind this
device = host.to("cuda", non_blocking=True)
numafast.pool._close_at_exit()  # the consumer still holds the slot: unregistered now
print(json.dumps({"copied": torch.cuda.current_stream().query(), "registered": pool.registered,
                  "nines": bool((device == 9).all())}))
"""


def test_at_exit_a_held_pool_is_unregistered_only_once_the_copies_reading_it_are_done() -> None:
    done = subprocess.run([sys.executable, "-c", AT_EXIT, str(NODE), str(SPIN_CYCLES)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.splitlines()[-1])
    assert report == {"copied": True, "registered": False, "nines": True}


def test_slots_given_back_and_a_pool_closed_during_a_graph_capture_leave_the_capture_whole() -> None:
    """A slot comes back, and numafast settles, at any bytecode boundary of the main
    thread: inside a capture too (torch's default capture mode, "global"). Its fence is
    recorded and asked only after the capture; a pool closed inside is released after."""
    with numafast.PinnedPool(NODE, MIB, 1) as kept, numafast.PinnedPool(NODE, MIB, 1) as closing:
        host = torch.frombuffer(kept.acquire(), dtype=torch.uint8).fill_(1)
        copy = host.to("cuda", non_blocking=True)
        static = torch.zeros(4, device="cuda")
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            static.add_(1)
            del host
            kept.settle()  # what the pending call runs
            closing.close()
            static.mul_(2)
        assert closing.stats().bytes_mapped > 0  # released once the capture is over
        graph.replay()
        torch.cuda.synchronize()
        assert static.tolist() == [2.0] * 4 and bool((copy == 1).all())
        again = kept.acquire(timeout=60)  # the fence, recorded after the capture, is done
        del again
        assert closing.settle() is True and closing.stats().bytes_mapped == 0
