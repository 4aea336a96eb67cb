"""Which CUDA device a loader serves, when it decides, and that making a pool never
stops the batches that arrive meanwhile.

The device choice is tested without a GPU against a stand-in for the four CUDA
state queries numafast.torch.device makes (usable, device count, initialised,
current device), put in that module only: these tests check numafast's decisions
(what it asks, when, and which index it hands on), not CUDA, and nothing here is
a CUDA test. The real registration, on the device chosen, is tested in
test_pool_cuda.py where a GPU is.
"""

from __future__ import annotations

import pickle
import threading
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import numafast  # noqa: E402
import numafast.torch  # noqa: E402
from numafast.pages import local_node  # noqa: E402
from numafast.torch import device as loader_device  # noqa: E402
from numafast.torch.owner_pools import NodePools  # noqa: E402
from sysfs_truth import online_nodes, pagemap_nodes  # noqa: E402
from test_launch_live import LAUNCHER_VARIABLES, snapshot_with_gpus  # noqa: E402

SEMANTICS = pytest.mark.host_only("loader decisions, the same on any kernel")
# The stand-in's device 1 reaches the real registration (PinnedPool checks the index
# against the devices torch sees): on a machine with one GPU, that check refuses it.
STAND_IN_DEVICE_1 = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.device_count() < 2,
    reason="the stand-in's device 1 is registered for real where torch sees a GPU: needs 2 GPUs or none",
)


class CudaState:
    """What CUDA would answer to numafast.torch.device, with every question recorded. Its
    current device is unknown (``None``) until a test sets one: asking then fails
    the test, as asking at construction would initialise CUDA on a real machine."""

    def __init__(self, count: int, *, initialized: bool = False, current: int | None = None) -> None:
        self.count = count
        self.is_initialized = initialized
        self.current = current
        self.asked: list[str] = []
        self.threads: list[str] = []  # the thread that asked each time

    def usable(self) -> bool:
        return True

    def why_not_usable(self) -> str:
        return ""

    def device_count(self) -> int:
        return self.count

    def initialized(self) -> bool:
        return self.is_initialized

    def current_index(self) -> int:
        self.asked.append("current_index")
        self.threads.append(threading.current_thread().name)
        if self.current is None:
            raise AssertionError("the current CUDA device was asked for before the first iteration")
        return self.current


class Samples(torch.utils.data.Dataset):  # type: ignore[type-arg]
    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> Any:
        return torch.full((4,), index)


@pytest.fixture
def no_launcher(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def standing_in(monkeypatch: pytest.MonkeyPatch, state: CudaState) -> CudaState:
    monkeypatch.setattr(loader_device, "cuda", state)
    return state


@SEMANTICS
def test_each_rank_takes_its_local_ranks_gpu_or_else_the_current_one(
    monkeypatch: pytest.MonkeyPatch, no_launcher: None
) -> None:
    monkeypatch.setenv("LOCAL_RANK", "3")
    standing_in(monkeypatch, CudaState(8, current=0))
    assert loader_device.iteration_gpu(None) == 3  # torchrun on an 8-GPU machine
    standing_in(monkeypatch, CudaState(1, current=0))
    assert loader_device.iteration_gpu(None) == 0  # one visible device per rank (Ray Train, CUDA_VISIBLE_DEVICES per rank)
    monkeypatch.delenv("LOCAL_RANK")
    standing_in(monkeypatch, CudaState(4, current=2))
    assert loader_device.iteration_gpu(None) == 2  # no launcher: the current device


@SEMANTICS
def test_what_is_settled_without_initialising_cuda(monkeypatch: pytest.MonkeyPatch, no_launcher: None) -> None:
    standing_in(monkeypatch, CudaState(4))
    assert loader_device.settled_gpu(torch.device("cuda", 2)) == 2
    assert loader_device.settled_gpu(None) is None  # several devices, no launcher: the current one, later
    assert loader_device.settled_gpu(torch.device("cuda")) is None
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert loader_device.settled_gpu(None) == 3
    assert loader_device.settled_gpu(torch.device("cuda")) is None  # 'cuda' is the current device, not the rank's
    monkeypatch.setenv("LOCAL_RANK", "5")  # more ranks than visible devices: each sees its own
    assert loader_device.settled_gpu(None) is None
    standing_in(monkeypatch, CudaState(1))
    assert loader_device.settled_gpu(None) == 0


@SEMANTICS
@STAND_IN_DEVICE_1
def test_building_and_pickling_a_loader_never_asks_for_the_current_device(
    monkeypatch: pytest.MonkeyPatch, no_launcher: None
) -> None:
    state = standing_in(monkeypatch, CudaState(2))
    loader = numafast.torch.NumaLoader(Samples(), batch_size=4)
    pickle.dumps(loader.collate_fn)  # what a spawned worker receives
    assert state.asked == []
    assert loader.node == local_node()  # this machine's topology lists no GPU: the node of the calling thread
    assert not torch.cuda.is_initialized()
    state.current = 1  # the user picks the rank's device after building the loader
    batches = list(loader)
    assert state.asked == ["current_index"]
    assert loader.pools.device == 1  # the pools register through the rank's device, not a fresh thread's 0
    assert [batch.tolist() for batch in batches] == [[[i] * 4 for i in range(4)], [[i] * 4 for i in range(4, 8)]]
    list(loader)
    assert state.asked == ["current_index"]  # once: the device is the loader's from then on


@SEMANTICS
@STAND_IN_DEVICE_1
def test_a_settled_device_is_not_asked_for_at_all(monkeypatch: pytest.MonkeyPatch, no_launcher: None) -> None:
    monkeypatch.setenv("LOCAL_RANK", "1")
    state = standing_in(monkeypatch, CudaState(2))
    loader = numafast.torch.NumaLoader(Samples(), batch_size=4)
    list(loader)
    assert state.asked == []
    assert loader.pools.device == 1


@pytest.mark.numa(nodes=2)
@STAND_IN_DEVICE_1
def test_the_node_follows_the_device_picked_after_the_loader_was_built(
    monkeypatch: pytest.MonkeyPatch, no_launcher: None, tmp_path: Path
) -> None:
    first, second = online_nodes()[:2]
    machine = numafast.Topology.from_sysfs(snapshot_with_gpus(tmp_path, [first, second]))
    monkeypatch.setattr(loader_device, "topology", lambda: machine)
    state = standing_in(monkeypatch, CudaState(2))
    loader = numafast.torch.NumaLoader(Samples(), batch_size=4)
    assert loader.node == first  # a guess: device 0, the current one while CUDA is not initialised
    state.current = 1
    batches = list(loader)
    assert loader.node == second and loader.pools.node == second and loader.pools.device == 1
    assert loader.stats().landed == 2
    assert {pool.node for pool in loader.stats().pools} == {second}
    pages = {node for batch in batches for node in pagemap_nodes(batch.data_ptr(), batch.nbytes)}
    assert pages == {second}  # asked of the kernel (pagemap and the memory blocks), not of the loader


@SEMANTICS
def test_a_batch_is_received_while_a_pool_is_being_made() -> None:
    """A resize makes its pool (for a registered pool: faulted in whole and pinned,
    seconds per GiB) outside the mutex that every batch's receive and copy takes."""
    making = threading.Event()
    proceed = threading.Event()

    class SlowPools(NodePools):
        def _new_pool(self, slot_bytes: int, slots: int) -> numafast.PinnedPool:
            if self.pools:  # the resize, not the first pool
                making.set()
                assert proceed.wait(30)
            return super()._new_pool(slot_bytes, slots)

    pools = SlowPools(local_node(), 2, lock="off")
    try:
        pools.make_room(1 << 16, more=False)
        small = pools.pools[0].slot_bytes
        resizing = threading.Thread(target=pools.make_room, args=(4 * small, False))
        resizing.start()
        assert making.wait(30)
        copied: list[Any] = []
        copier = threading.Thread(target=lambda: copied.append(pools.pin(torch.ones(256))))
        copier.start()
        copier.join(5)
        stuck = copier.is_alive()
        proceed.set()
        resizing.join(30)
        copier.join(30)
        assert not stuck, "a batch waited for the pool being made"
        assert copied[0].tolist() == [1.0] * 256
        assert pools.pools[0].slot_bytes > small and pools.resized == 1
    finally:
        proceed.set()
        pools.close()


@SEMANTICS
def test_a_numpy_integer_is_a_device_index(monkeypatch: pytest.MonkeyPatch) -> None:
    import numpy as np

    standing_in(monkeypatch, CudaState(2))
    assert loader_device.resolve_device(np.int64(1)) == torch.device("cuda", 1)
    with pytest.raises(numafast.InvalidGpuError, match="sees 2 CUDA devices"):
        loader_device.resolve_device(np.int32(2))


@SEMANTICS
def test_once_cuda_is_initialised_the_current_device_wins_over_local_rank_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, no_launcher: None
) -> None:
    """The user's torch.cuda.set_device picks where .to('cuda') copies go: the pools'
    fences must be on that device, whatever LOCAL_RANK says; the disagreement is said."""
    monkeypatch.setenv("LOCAL_RANK", "1")
    standing_in(monkeypatch, CudaState(4, initialized=True, current=2))
    with pytest.warns(RuntimeWarning, match=r"LOCAL_RANK names cuda:1, but this thread's current device is cuda:2"):
        assert loader_device.iteration_gpu(None) == 2
    standing_in(monkeypatch, CudaState(4, initialized=True, current=1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader_device.iteration_gpu(None) == 1  # they agree: nothing said
        assert loader_device.iteration_gpu(torch.device("cuda", 3)) == 3  # the index given
    standing_in(monkeypatch, CudaState(4))
    assert loader_device.iteration_gpu(None) == 1  # not initialised: the launcher's rank, without asking


@SEMANTICS
@STAND_IN_DEVICE_1
def test_pools_no_loader_iteration_settled_take_the_receiving_threads_device(
    monkeypatch: pytest.MonkeyPatch, no_launcher: None
) -> None:
    """A framework's DataLoader over numafast's collate function (no NumaLoader.__iter__ to
    settle the device): pools are made only in the thread that receives the batches (no
    other thread, whose current device would be 0 whatever the rank uses), so the device
    is settled there, the current one (here 1), and every batch arrives."""
    state = standing_in(monkeypatch, CudaState(2, initialized=True, current=1))
    own = numafast.torch.NumaLoader(Samples(), batch_size=2, num_workers=2)
    made = torch.utils.data.DataLoader(own.dataset, batch_size=2, num_workers=2, collate_fn=own.collate_fn)
    batches = [batch.tolist() for batch in made]
    assert batches == [[[i] * 4, [i + 1] * 4] for i in range(0, 8, 2)]
    assert own.pools.device == 1
    assert state.threads and set(state.threads) == {threading.main_thread().name}
