"""Each loader's batches are its own, in every process: two loaders over one dataset
count and hold only their own batches, and a process forked from one that iterated a
NumaLoader (Lightning's ``ddp_fork``, a notebook launcher) gets right batches from the
inherited loader and from a new one, in pools of its own, while the parent goes on
unharmed. Every sample carries its index; every batch is checked by content."""

from __future__ import annotations

import copy
import os
import pickle
import select
import subprocess
import sys
import time
from typing import Any

import pytest

from sysfs_truth import online_nodes

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import numafast.torch  # noqa: E402
from numafast import _process  # noqa: E402
from numafast.torch.worker_collate import SlotCollate  # noqa: E402

NODES = online_nodes()
SEMANTICS = pytest.mark.host_only("loader semantics, the same on any kernel; worker processes cost seconds under TCG")


class Tagged(Dataset):  # type: ignore[type-arg]
    """Sample i: (a tensor full of i, i)."""

    def __init__(self, count: int, size: int = 2048) -> None:
        self.count, self.size = count, size

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return torch.full((self.size,), float(index)), index


def wrong_batches(batches: list[Any], expected: list[list[int]]) -> list[str]:
    """What is wrong with ``batches``, each ``(values, indices)``, against the indices
    ``expected`` batch by batch (empty: every batch is right)."""
    wrong = []
    if len(batches) != len(expected):
        wrong.append(f"{len(batches)} batches, {len(expected)} expected")
    for number, (batch, indices) in enumerate(zip(batches, expected)):
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            wrong.append(f"batch {number} is a {type(batch).__name__}: {batch!r:.200}")
            continue
        values, got = batch
        if got.tolist() != indices:
            wrong.append(f"batch {number} has samples {got.tolist()}, not {indices}")
        elif not torch.equal(values, torch.tensor(indices, dtype=values.dtype)[:, None].expand_as(values)):
            wrong.append(f"batch {number}'s values are not its samples' {indices}")
    return wrong


def in_order(count: int, batch_size: int) -> list[list[int]]:
    return [list(range(start, min(start + batch_size, count))) for start in range(0, count, batch_size)]


@SEMANTICS
def test_two_loaders_over_one_dataset_each_count_and_hold_only_their_own_batches() -> None:
    """A train and an eval loader over one dataset, iterated zipped: two loaders, not one
    found again by its dataset (each used to count the other's batches too)."""
    dataset = Tagged(64)
    train = numafast.torch.NumaLoader(dataset, batch_size=4, num_workers=2, node=NODES[0])
    evaluate = numafast.torch.NumaLoader(dataset, batch_size=8, num_workers=1, node=NODES[0], max_pinned_bytes=1 << 26)
    assert train.pools is not evaluate.pools
    train_batches, eval_batches = [], []
    for train_batch, eval_batch in zip(train, evaluate):
        train_batches.append([part.clone() for part in train_batch])
        eval_batches.append([part.clone() for part in eval_batch])
    assert wrong_batches(train_batches, in_order(64, 4)[:8]) == []
    assert wrong_batches(eval_batches, in_order(64, 8)) == []
    # zip takes a 9th train batch before it finds the eval loader done; train's second worker
    # may have sent its next two (the 10th, the 12th) ahead of it, which torch keeps
    arrived = train.stats().batches
    assert 9 <= arrived <= 11 and evaluate.stats().batches == 8, (train.stats(), evaluate.stats())
    assert train.stats().max_pinned_bytes != evaluate.stats().max_pinned_bytes == 1 << 26
    assert wrong_batches([[part.clone() for part in batch] for batch in evaluate], in_order(64, 8)) == []
    assert train.stats().batches == arrived and evaluate.stats().batches == 16


@SEMANTICS
def test_a_loader_made_again_from_a_numaloaders_collate_function_still_shares_its_pools() -> None:
    """What a framework copies (the collate function) still finds the pools."""
    dataset = Tagged(24)
    loader = numafast.torch.NumaLoader(dataset, batch_size=4, num_workers=2, node=NODES[0])
    again = numafast.torch.NumaLoader(dataset, batch_size=4, num_workers=2, collate_fn=loader.collate_fn,
                                      node=NODES[0])  # fmt: skip
    assert again.pools is loader.pools and isinstance(again.collate_fn, SlotCollate)
    assert wrong_batches([[part.clone() for part in batch] for batch in again], in_order(24, 4)) == []


def in_forked_child(check: Any, timeout_s: float = 120.0) -> str:
    """Run ``check()`` (what it finds wrong, as a string; empty: nothing) in a child forked
    now, as Lightning's ddp_fork forks a rank; the child's answer, up to a NUL (the child's
    own workers may hold the pipe open after it), or why there is none."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        said = b"child: raised"
        try:
            os.close(read_end)
            said = (check() or "ok").encode()
        except BaseException as error:  # noqa: BLE001 - said to the parent
            said = f"child raised {error!r}".encode()
        finally:
            os.write(write_end, said[:60000].replace(b"\0", b"?") + b"\0")
            os._exit(0)
    os.close(write_end)
    chunks = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if select.select([read_end], [], [], 0.5)[0]:
            chunk = os.read(read_end, 65536)
            chunks.append(chunk)
            if not chunk or chunk.endswith(b"\0"):
                break
    else:
        os.kill(pid, 9)
        chunks.append(b" (timed out)")
    os.close(read_end)
    os.waitpid(pid, 0)
    return b"".join(chunks).rstrip(b"\0").decode() or "child: no answer"


def cloned(loader: Any) -> list[Any]:
    return [[part.clone() for part in batch] for batch in loader]


def leases_out(loader: Any) -> int:
    return sum(pool.stats().leased for pool in loader.pools.pools)


@SEMANTICS
@pytest.mark.parametrize("persistent", [False, True], ids=["workers-per-epoch", "persistent-workers"])
def test_forked_ranks_get_their_own_pools_and_right_batches_and_the_parent_goes_on(persistent: bool) -> None:
    """A ddp_fork-style run: the parent peeks at a loader and iterates it, then forks two
    ranks; each iterates the inherited loader and a new one (every batch right, landed in
    pools of the rank's own), and the parent's next epochs are right and leak nothing."""
    count, size = 48, 4
    dataset = Tagged(count)
    loader = numafast.torch.NumaLoader(dataset, batch_size=size, num_workers=2, node=NODES[0],
                                       persistent_workers=persistent)  # fmt: skip
    peeked = next(iter(loader))  # a notebook user's look at the first batch
    assert wrong_batches([peeked], in_order(count, size)[:1]) == []
    assert wrong_batches(cloned(loader), in_order(count, size)) == []
    parent_pools = loader.pools

    def rank() -> str:
        wrong = []
        for name, used in (("inherited", loader), ("new", numafast.torch.NumaLoader(
                dataset, batch_size=size, num_workers=2, node=NODES[0]))):  # fmt: skip
            for epoch in range(2):
                batches = list(used)  # kept, as a consumer may: each must still be its own
                wrong += [f"{name} loader, epoch {epoch}: {what}" for what in wrong_batches(batches, in_order(count, size))]
                if used.pools is parent_pools or any(
                    pool.contains(part.data_ptr()) for batch in batches for part in batch for pool in parent_pools.pools
                ):
                    wrong.append(f"{name} loader, epoch {epoch}: landed in the parent's pools")
                if used.stats().landed < 1:
                    wrong.append(f"{name} loader, epoch {epoch}: nothing landed in the rank's own pools: {used.stats()}")
                del batches
        wrong += [] if wrong_batches([peeked], in_order(count, size)[:1]) == [] else ["the peeked batch changed"]
        return "\n".join(wrong)

    answers = [in_forked_child(rank) for _rank in range(2)]
    assert answers == ["ok", "ok"], answers
    assert loader.pools is parent_pools and leases_out(loader) == 0
    before = loader.stats().batches
    for _epoch in range(2):
        assert wrong_batches(cloned(loader), in_order(count, size)) == []
    assert loader.stats().batches == before + 2 * len(loader) and leases_out(loader) == 0
    assert wrong_batches([peeked], in_order(count, size)[:1]) == []


@SEMANTICS
def test_a_dataloader_over_numafasts_collate_inherited_by_a_forked_process_gives_right_batches() -> None:
    """A DataLoader a framework made over a NumaLoader's collate function, iterated in a
    forked child: its workers must not lease the parent's slots; the batches come as the
    stock loader's, with one warning saying why."""
    count, size = 24, 4
    dataset = Tagged(count)
    loader = numafast.torch.NumaLoader(dataset, batch_size=size, num_workers=2, node=NODES[0])
    made = DataLoader(dataset, batch_size=size, num_workers=2, collate_fn=loader.collate_fn)
    assert wrong_batches(cloned(made), in_order(count, size)) == []

    def child() -> str:
        return "\n".join(wrong_batches(cloned(made), in_order(count, size)))

    assert in_forked_child(child) == "ok"
    assert leases_out(loader) == 0
    assert wrong_batches(cloned(made), in_order(count, size)) == []


@SEMANTICS
@pytest.mark.parametrize("workers", [0, 2])
def test_a_deep_copy_of_a_dataloader_over_numafasts_collate_lands_in_the_same_pools_and_keeps_them(
    workers: int,
) -> None:
    """A framework's DataLoader over a NumaLoader's collate function, deep-copied in the
    same process: the copy lands its batches in the loader's pools, says nothing, and
    keeps those pools in use once the loader is gone. Its collate function lost the
    pools in the copy: it warned that the loader had gone to another process and, with
    no workers, copied every batch."""
    import gc
    import warnings

    count, size = 24, 4
    dataset = Tagged(count)
    loader = numafast.torch.NumaLoader(dataset, batch_size=size, num_workers=2, node=NODES[0])
    pools = loader.pools
    made = DataLoader(dataset, batch_size=size, num_workers=workers, collate_fn=loader.collate_fn)
    pickled = pickle.dumps(made.collate_fn)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copied = copy.deepcopy(made)
        assert wrong_batches(cloned(copied), in_order(count, size)) == []
        assert loader.stats().landed >= len(copied) - 2 * workers, loader.stats()  # a worker's first may be copied in
        del loader, made
        gc.collect()
        assert numafast.torch.close_idle_pools() == 0  # in use by the copy: not idle
        landed = pools.stats().landed
        assert wrong_batches(cloned(copied), in_order(count, size)) == []
        assert pools.stats().landed >= landed + len(copied) - 2 * workers and not pools.closed
        del copied
        gc.collect()
    assert numafast.torch.close_idle_pools() == 1 and pools.closed
    late = pickle.loads(pickled)  # a copy made once the pools are closed collates as without numafast
    _process.done_once.discard("collating after the pools closed")  # said once per process: each case says it
    with pytest.warns(RuntimeWarning, match="made after the loader's pools were closed"):
        assert wrong_batches([late([dataset[index] for index in range(size)])], in_order(count, size)[:1]) == []


KEEPING_UNDER_A_LOW_NOFILE = """
import resource, sys, torch
from torch.utils.data import Dataset
import numafast.torch
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
class Tagged(Dataset):
    def __len__(self): return 600
    def __getitem__(self, i): return torch.full((4096,), float(i)), i
loader = numafast.torch.NumaLoader(Tagged(), batch_size=2, num_workers=2, max_pinned_bytes=int(sys.argv[1]))
kept, raised = [], ""
try:
    for values, index in loader:
        kept.append((values, index))
except Exception as error:
    raised = f"{type(error).__name__}: {error}"
wrong = [n for n, (v, i) in enumerate(kept) if i.tolist() != [2 * n, 2 * n + 1] or not torch.equal(v[:, 0], i.to(v.dtype))]
print(len(kept), len(wrong), loader.stats().unpinned, raised, sep="|")
"""


@SEMANTICS
@pytest.mark.parametrize("max_pinned_bytes", [1 << 30, 300_000], ids=["pools-grow", "past-the-cap"])
def test_a_consumer_keeping_every_batch_under_ulimit_n_128_gets_right_batches_or_a_clear_error(
    max_pinned_bytes: int,
) -> None:
    """Out of descriptors (every kept batch that arrives unpinned holds one, as torch
    shares it), the consumer gets right batches, then an error naming the open-files
    limit; never a wrong batch (a lease freed because /proc could not be opened)."""
    done = subprocess.run([sys.executable, "-W", "ignore", "-c", KEEPING_UNDER_A_LOW_NOFILE, str(max_pinned_bytes)],
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    kept, wrong, unpinned, raised = done.stdout.strip().splitlines()[-1].split("|", 3)
    assert int(wrong) == 0, done.stdout
    if raised:
        assert "ulimit -n" in raised and int(unpinned) > 0, raised
    else:
        assert int(kept) == 300, done.stdout
