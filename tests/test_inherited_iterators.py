"""A process forked from one that iterated a loader whose iterator numafast found
forking (a loader NumaLoader iterates through, as Accelerate's; a framework's copy over
numafast's collate function) leaves the parent's workers alone, and gets right batches;
and a worker's normal end does not hide the error a batch raised on its arrival. Every
sample carries its index; every batch is checked by content. Every wait is bounded (the
loaders' ``timeout``, the child's answer)."""

from __future__ import annotations

import gc
import os
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info  # noqa: E402

import numafast.torch  # noqa: E402
from test_loader_isolation import in_forked_child  # noqa: E402
from test_worker_start import Wrapper  # noqa: E402

pytestmark = pytest.mark.host_only("loader semantics in forked processes: nothing the kernel's nodes change")

COUNT, SIZE = 24, 4
TIMEOUT_S = 5  # on each batch: what a loader whose workers were taken from it waits, then fails


class Tagged(Dataset):  # type: ignore[type-arg]
    """Sample i: (a tensor full of i, i)."""

    def __len__(self) -> int:
        return COUNT

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return torch.full((512,), float(index)), index


def wrong(batches: list[Any], first: int = 0) -> list[str]:
    """What is wrong with ``batches`` (each ``(values, indices)``), batch ``first`` onwards of
    an epoch in order: empty where every batch is right."""
    said = [] if len(batches) == COUNT // SIZE - first else [f"{len(batches)} batches"]
    for number, batch in enumerate(batches, start=first):
        expected = list(range(number * SIZE, (number + 1) * SIZE))
        if not isinstance(batch, (list, tuple)) or len(batch) != 2:
            said.append(f"batch {number} is a {type(batch).__name__}")
            continue
        values, indices = batch
        if indices.tolist() != expected or not torch.equal(values[:, 0], indices.to(values.dtype)):
            said.append(f"batch {number} has samples {indices.tolist()}, not {expected}")
    return said


def cloned(batches: Any) -> list[Any]:
    return [[part.clone() for part in batch] if isinstance(batch, (list, tuple)) else batch for batch in batches]


def test_a_child_dropping_an_inherited_iterator_of_a_loader_iterated_through_leaves_the_parents_epoch_whole() -> None:
    """The parent is mid-epoch over NumaLoader(accelerate-like loader) as it forks; the
    child drops what it inherited (a rebinding, a collection). torch's shutdown ran there
    on the parent's workers (their shared done event set): the parent waited for batches
    that never came."""
    inner = DataLoader(Tagged(), batch_size=SIZE, num_workers=2, timeout=TIMEOUT_S)
    loader = numafast.torch.NumaLoader(Wrapper(inner))
    assert loader._through is not None
    iterator = iter(loader)
    first = cloned([next(iterator)])

    def drop() -> str:
        nonlocal iterator
        iterator = None
        gc.collect()
        return ""

    assert in_forked_child(drop) == "ok"
    rest = cloned(iterator)
    assert wrong(first + rest) == []


def test_a_child_iterating_an_inherited_persistent_loader_iterated_through_gets_right_batches_and_the_parent_too() -> None:
    """The loader NumaLoader iterates through keeps a persistent iterator, whose workers
    are the parent's: reset in the child, it sent them the child's epoch and waited on
    their queue (failing after ``timeout``). The child gets workers of its own."""
    inner = DataLoader(Tagged(), batch_size=SIZE, num_workers=2, timeout=TIMEOUT_S, persistent_workers=True)
    loader = numafast.torch.NumaLoader(Wrapper(inner))
    assert wrong(cloned(loader)) == []
    parents = [worker.pid for worker in inner._iterator._workers]

    def epochs() -> str:
        said = []
        for epoch in range(2):
            said += [f"epoch {epoch}: {what}" for what in wrong(cloned(loader))]
        mine = [worker.pid for worker in inner._iterator._workers]
        if set(mine) & set(parents):
            said.append(f"the child's iterator has the parent's workers {mine}")
        return "\n".join(said)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert in_forked_child(epochs) == "ok"
    assert wrong(cloned(loader)) == []  # the parent's workers serve its next epoch
    assert [worker.pid for worker in inner._iterator._workers] == parents


def test_a_child_iterating_an_inherited_persistent_copy_over_numafasts_collate_gets_right_batches() -> None:
    """A framework's copy of a NumaLoader (a DataLoader over its collate function) with
    persistent workers, iterated in a forked child."""
    loader = numafast.torch.NumaLoader(Tagged(), batch_size=SIZE, num_workers=2)
    made = DataLoader(loader.dataset, batch_size=SIZE, num_workers=2, collate_fn=loader.collate_fn,
                      timeout=TIMEOUT_S, persistent_workers=True)  # fmt: skip
    assert wrong(cloned(made)) == []

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert in_forked_child(lambda: "\n".join(wrong(cloned(made)))) == "ok"
    assert wrong(cloned(made)) == []


class OneWorkerEndsFirst(IterableDataset):  # type: ignore[type-arg]
    """Worker 0 has no samples (torch ends it: exit status 0); worker 1's one sample, sent
    once worker 0 is gone, reopens a file by path where it is unpickled, and that file is
    missing: the consumer's error is that FileNotFoundError."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __iter__(self) -> Any:
        info = get_worker_info()
        assert info is not None
        if info.id == 0:
            (self.folder / "ended").write_text(str(os.getpid()))
            return iter(())
        deadline = time.monotonic() + 10
        while not (self.folder / "ended").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        other = Path(f"/proc/{(self.folder / 'ended').read_text()}/stat")
        while time.monotonic() < deadline:  # gone, or a zombie
            try:
                if other.read_bytes().rpartition(b")")[2].split()[0] in (b"Z", b"X"):
                    break
            except OSError:
                break
            time.sleep(0.01)
        return iter([(torch.zeros(4), Reopened(self.folder / "missing"))])


class Reopened:
    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return open, (str(self.path),)


def as_they_come(samples: list[Any]) -> list[Any]:
    return samples


def test_a_worker_that_ended_normally_does_not_hide_a_batchs_own_error(tmp_path: Path) -> None:
    loader = numafast.torch.NumaLoader(OneWorkerEndsFirst(tmp_path), batch_size=1, num_workers=2, timeout=20,
                                       collate_fn=as_they_come)  # fmt: skip
    began = time.monotonic()
    with pytest.raises(FileNotFoundError, match="missing"):
        for _batch in loader:
            pass
    assert time.monotonic() - began < 15
