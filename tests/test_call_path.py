"""A batch's path, followed call by call, stays in few modules: in the worker from its
collate function to its message, in the owner from the message's arrival to the batch.

The path is the sequence of numafast modules that run (a call enters the callee's
module, a return the caller's; code generated for a class, as a dataclass's
``__init__``, counts as its module's), consecutive visits to one module merged. A
*return* is a visit to a module the path left before: each is a hop a reader of the
code follows back and forth. Measured with ``sys.setprofile`` in a real loader's
worker and in its owner, on batches after the first pools are made.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from sysfs_truth import online_nodes

torch = pytest.importorskip("torch")

from torch.utils.data import Dataset  # noqa: E402

from numafast.torch import NumaLoader, worker_collate  # noqa: E402
from numafast.torch.owner_pools import SHRINK_EVERY  # noqa: E402

NODE = online_nodes()[0]
MOST_RETURNS = 3
FIRST_TRACED = 5  # the batches before make and list the pools (a new loader's first ones are copied in)
BATCHES = 12


class Tagged(Dataset[Any]):
    """Sample i: an image filled with i and the label i."""

    def __len__(self) -> int:
        return BATCHES * 8

    def __getitem__(self, index: int) -> tuple[Any, int]:
        return torch.full((3, 32, 32), float(index)), index


def as_dicts(samples: list[tuple[Any, int]]) -> dict[str, Any]:
    """A collate function of the user's: a dict of a stacked image and a label tensor."""
    return {"image": torch.stack([image for image, _ in samples]), "label": torch.tensor([i for _, i in samples])}


class ModulePath:
    """The numafast modules that run, in order (see the module's docstring)."""

    def __init__(self) -> None:
        self.modules: list[str] = []

    def __call__(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            module = _numafast_module(frame)
        elif event == "return" and frame.f_back is not None:
            module = _numafast_module(frame.f_back)
        else:
            return
        if module is not None and (not self.modules or self.modules[-1] != module):
            self.modules.append(module)

    def returns(self) -> int:
        seen: set[str] = set()
        count = 0
        for module in self.modules:
            count += module in seen
            seen.add(module)
        return count


def _numafast_module(frame: FrameType) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name if isinstance(name, str) and name.startswith("numafast") else None


def followed(call: Callable[[], Any]) -> tuple[Any, ModulePath]:
    path = ModulePath()
    sys.setprofile(path)
    try:
        return call(), path
    finally:
        sys.setprofile(None)


@pytest.mark.parametrize("collate_fn", [None, as_dicts], ids=["collated-into-the-slot", "users-collate-packed"])
def test_a_batch_returns_to_a_module_it_left_at_most_three_times(
    collate_fn: Callable[[Any], Any] | None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    collate = worker_collate.SlotCollate.__call__
    made = [0]

    def traced(self: worker_collate.SlotCollate, samples: Any) -> Any:
        made[0] += 1
        if made[0] < FIRST_TRACED:
            return collate(self, samples)
        message, path = followed(lambda: collate(self, samples))
        (tmp_path / f"worker-{made[0]}.json").write_text(json.dumps([type(message).__name__, path.modules]))
        return message

    monkeypatch.setattr(worker_collate.SlotCollate, "__call__", traced)  # before the fork: the worker has it
    extra = {} if collate_fn is None else {"collate_fn": collate_fn}
    loader = NumaLoader(Tagged(), batch_size=8, num_workers=1, node=NODE, multiprocessing_context="fork", **extra)
    owner: list[tuple[int, list[str]]] = []
    for number, batch in enumerate(_traced_batches(loader, owner), 1):
        images, labels = (batch["image"], batch["label"]) if collate_fn else batch
        expected = list(range(8 * (number - 1), 8 * number))
        assert labels.tolist() == expected
        assert images[:, 0, 0, 0].tolist() == [float(i) for i in expected]
    assert len(owner) == BATCHES - FIRST_TRACED + 1

    for number in range(FIRST_TRACED, BATCHES + 1):
        kind, modules = json.loads((tmp_path / f"worker-{number}.json").read_text())
        assert kind == "SlotBatch", f"batch {number} was not landed in a slot by its worker: the case was not met"
        path = ModulePath()
        path.modules = modules
        assert path.returns() <= MOST_RETURNS, f"worker, batch {number}: {' -> '.join(modules)}"
    for number, modules in owner:
        arrival = modules[modules.index("numafast.torch.message") :]  # from the message's arrival on
        path = ModulePath()
        path.modules = arrival
        # Every SHRINK_EVERY batches the receiving thread also looks for grown pools to release.
        assert path.returns() <= MOST_RETURNS + (number % SHRINK_EVERY == 0), f"owner, batch {number}: {' -> '.join(arrival)}"


def _traced_batches(loader: NumaLoader[Any], owner: list[tuple[int, list[str]]]) -> Any:
    """``loader``'s batches, the owner's path followed for each from FIRST_TRACED on."""
    batches = iter(loader)
    for number in range(1, BATCHES + 1):
        if number < FIRST_TRACED:
            yield next(batches)
            continue
        batch, path = followed(lambda: next(batches))
        owner.append((number, path.modules))
        yield batch
