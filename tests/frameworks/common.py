"""What every framework script shares: the dataset, the tiny model, and the recorder
that writes, per rank, the sample ids of each training step and what the kernel says
about each batch (its mapping in /proc/self/maps and smaps, whether its pages are
mlocked and on which nodes, from pagemap and kpageflags),
plus what the DataLoader workers said about themselves (CPUs, memory policy).

A script runs as one rank of a 2-rank job, with numafast (``--numafast``) or
without; it writes ``<out>/<name>.rank<R>.json``. tests/test_frameworks.py compares
the runs with and without numafast and checks the placement facts.

Nothing here is numafast's own code but the stats it reports and the raw
get_mempolicy(2) mirror (numafast._libnuma); the rest is asked of the kernel through
tests/sysfs_truth.py.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from sysfs_truth import kib, pagemap_nodes, pages_mlocked, smaps_of  # noqa: E402

SAMPLES = 96
BATCH = 8
WORKERS = 2
EPOCHS = 2
SEED = 1234
SHAPE = (3, 32, 32)
POOL_NAME = re.compile(r"numafast-pool-node(\d+)")


# ---------------------------------------------------------------- data and model


class Numbered(Dataset):  # type: ignore[type-arg]
    """Sample i: {"x": a 3x32x32 float tensor full of i, "id": i, "pid": the process that made it}.

    In a DataLoader worker, each sample it makes also writes the worker's CPUs and
    memory policy to ``<records>/worker-<parent pid>-<pid>.json``: the file says what
    they were at its last sample (numafast binds a worker that a framework started at
    its first batch, once that batch's samples are made)."""

    def __init__(self, records: str | None = None) -> None:
        self.records = records

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.records is not None and torch.utils.data.get_worker_info() is not None:
            _record_worker(self.records)
        return {"x": torch.full(SHAPE, float(index)), "id": index, "pid": os.getpid()}


def _record_worker(records: str) -> None:
    pid = os.getpid()
    from numafast import _libnuma

    mode, nodes = _libnuma.get_mempolicy()  # this thread's policy, get_mempolicy(2)
    info = {"pid": pid, "ppid": os.getppid(), "cpus": sorted(os.sched_getaffinity(0)), "policy_mode": mode,
            "policy_nodes": list(nodes), "worker_id": torch.utils.data.get_worker_info().id}
    path = Path(records, f"worker-{os.getppid()}-{pid}.json")
    partial = path.with_name(f".{path.name}.partial")  # renamed whole: the rank may read the records at any time
    partial.write_text(json.dumps(info))
    os.replace(partial, path)


def make_loader(records: str | None, **options: Any) -> DataLoader:  # type: ignore[type-arg]
    """The user's DataLoader: batch 8, 2 workers, shuffled with a fixed seed."""
    settings: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, "num_workers": WORKERS,
                                "generator": torch.Generator().manual_seed(SEED)}
    settings.update(options)
    return DataLoader(Numbered(records), **settings)


class Tiny(torch.nn.Module):
    """One linear layer; forward returns {"loss": ...} (the shape HF's Trainer wants)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(SHAPE[0] * SHAPE[1] * SHAPE[2], 1)

    def forward(self, x: torch.Tensor, id: Any = None, pid: Any = None) -> dict[str, torch.Tensor]:  # noqa: A002
        return {"loss": self.layer(x.flatten(1).float() / SAMPLES).pow(2).mean()}


# ---------------------------------------------------------------- the one-line change


def numa_options(rank: int) -> dict[str, Any]:
    """NumaLoader's options for this rank: FRAMEWORK_NODES="1,2" puts rank r's loader on
    node r-th of the list (the guest test); unset, NumaLoader picks its own node."""
    nodes = os.environ.get("FRAMEWORK_NODES")
    return {"node": int(nodes.split(",")[rank])} if nodes else {}


def wrap(loader: Any, rank: int) -> Any:
    import numafast.torch

    return numafast.torch.NumaLoader(loader, **numa_options(rank))


def loader_stats(loader: Any) -> dict[str, Any] | None:
    """numafast's stats for ``loader`` as a dict, or {"error": ...}, or None where it
    carries no numafast. numafast.torch.loader_stats(loader) where numafast offers it,
    else the loader's own .stats() (a NumaLoader)."""
    numafast_torch = sys.modules.get("numafast.torch")
    if loader is None or numafast_torch is None:
        return None  # a run without numafast never imports it
    try:
        function = getattr(numafast_torch, "loader_stats", None)
        if function is not None:
            stats = function(loader)
        elif type(loader).__name__ == "NumaLoader" and callable(getattr(loader, "stats", None)):
            stats = loader.stats()
        else:
            return None
    except Exception as error:  # noqa: BLE001
        return {"error": f"{type(error).__name__}: {error}"}
    if stats is None:
        return None
    fields = asdict(stats) if is_dataclass(stats) else dict(vars(stats))
    fields.pop("pools", None)
    return {"source": f"loader_stats({type(loader).__name__})", **fields}


# ---------------------------------------------------------------- what the kernel says


def _maps_line(address: int, pid: int | str = "self") -> tuple[int, int, int, str] | None:
    """(start, end, inode, name) of the mapping holding ``address``."""
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        low, high = (int(x, 16) for x in fields[0].split("-"))
        if low <= address < high:
            return low, high, int(fields[4]), fields[5] if len(fields) > 5 else ""
    return None


def _maps_inode(pid: int, inode: int) -> bool | None:
    """Whether process ``pid`` maps a file with this inode; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return None
    return any(len(fields) > 4 and fields[4] == str(inode) for fields in (line.split(maxsplit=5) for line in text.splitlines()))


def where(tensor: torch.Tensor, worker_pids: list[int]) -> dict[str, Any]:
    """Where a batch tensor's bytes are, asked of /proc/self/maps, smaps and pagemap."""
    address, length = tensor.data_ptr(), tensor.nbytes  # a collated batch is contiguous
    line = _maps_line(address)
    fact: dict[str, Any] = {"address": address, "bytes": length, "mapping": None, "in_pool": False, "node": None,
                            "locked": False, "pages_nodes": None, "workers_map_it": {}}
    if line is None:
        return fact
    low, high, inode, name = line
    match = POOL_NAME.search(name)
    smaps = smaps_of(address)
    size, rss = (kib(smaps[k]) if k in smaps else 0 for k in ("Size", "Rss"))
    locked, pss = (kib(smaps[k]) if k in smaps else 0 for k in ("Locked", "Pss"))
    flags = smaps.get("VmFlags", "").split()
    fact.update(mapping=name, in_pool=match is not None, node=int(match.group(1)) if match else None,
                mapping_bytes=high - low, rss_bytes=rss, pss_bytes=pss, locked_bytes=locked, vmflags=" ".join(flags))
    try:  # a VM_LOCKED mapping ("lo"), every page of the batch in it present and mlocked
        fact["locked"] = "lo" in flags and address + length <= high and pages_mlocked(address, length)
    except (PermissionError, OSError) as error:
        fact["locked_error"] = f"{type(error).__name__}: {error}"
    try:
        fact["pages_nodes"] = sorted({n for n in pagemap_nodes(address, length) if n is not None})
    except (PermissionError, KeyError, OSError) as error:
        fact["pages_nodes_error"] = f"{type(error).__name__}: {error}"
    if match is not None:
        # The DataLoader workers that made the batch map the same memfd: they wrote it.
        fact["workers_map_it"] = {str(pid): _maps_inode(pid, inode) for pid in worker_pids}
    return fact


# ---------------------------------------------------------------- the records of one rank


class Recorder:
    """Per step: the sample ids and where the batch is; per epoch: numafast's stats."""

    def __init__(self, args: argparse.Namespace, rank: int, world: int) -> None:
        self.args, self.rank, self.world = args, rank, world
        self.steps: list[dict[str, Any]] = []
        self.epochs: dict[int, dict[str, Any]] = {}
        self.loaders: list[str] = []
        self.notes: list[str] = []

    def step(self, batch: Any, epoch: int) -> None:
        x, ids, pids = _fields(batch)
        in_epoch = sum(1 for s in self.steps if s["epoch"] == epoch)
        record: dict[str, Any] = {"epoch": epoch, "step": in_epoch, "ids": [int(i) for i in ids.tolist()]}
        # The batch is whole: row k of x is full of id k.
        record["content_ok"] = bool(torch.equal(x, ids.to(x.dtype).view(-1, 1, 1, 1).expand_as(x)))
        workers = sorted({int(p) for p in pids.tolist()})
        record["worker_pids"] = workers
        record["x"] = where(x, workers)
        record["ids_where"] = where(ids, [])
        self.steps.append(record)

    def loader_seen(self, loader: Any) -> None:
        """The loader object the framework iterates (its type, to report)."""
        self.loaders.append(f"{type(loader).__module__}.{type(loader).__qualname__}")

    def epoch_end(self, epoch: int, loader: Any, own: Any = None) -> None:
        self.epochs[epoch] = {"stats": loader_stats(loader), "own_stats": loader_stats(own),
                              "loader": f"{type(loader).__module__}.{type(loader).__qualname__}"}

    def write(self, error: str | None = None) -> None:
        workers = []
        records = Path(self.args.out)
        for path in sorted(records.glob(f"worker-{os.getpid()}-*.json")):
            workers.append(json.loads(path.read_text()))
        out = {
            "framework": self.args.name, "numafast": self.args.numafast, "rank": self.rank, "world": self.world,
            "pid": os.getpid(), "steps": self.steps, "epochs": {str(k): v for k, v in self.epochs.items()},
            "workers": workers, "loaders": sorted(set(self.loaders)), "notes": self.notes, "error": error,
            "nodes_env": os.environ.get("FRAMEWORK_NODES"), "loader_stats_available": _has_loader_stats(),
            "numafast_from": getattr(sys.modules.get("numafast"), "__file__", None),
        }
        path = records / f"{self.args.name}.rank{self.rank}.json"
        path.write_text(json.dumps(out, indent=1))


def _has_loader_stats() -> bool:
    return getattr(sys.modules.get("numafast.torch"), "loader_stats", None) is not None


def _fields(batch: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if isinstance(batch, dict) or hasattr(batch, "keys"):
        return batch["x"], batch["id"], batch["pid"]
    return batch[0], batch[1], batch[2]


def arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, help="directory for the JSON records (and the workers' own)")
    parser.add_argument("--name", required=True, help="the records' file name stem")
    parser.add_argument("--numafast", action="store_true", help="add numafast (the user's one-line change)")
    parser.add_argument("--variant", default="", help="a framework-specific variant")
    return parser.parse_args(argv)


def run_recorded(recorder: Recorder, body: Any) -> None:
    """Run ``body()``, then write the records, with the error if it raised (and raise it)."""
    try:
        body()
    except BaseException:
        recorder.write(error=traceback.format_exc())
        raise
    recorder.write()
