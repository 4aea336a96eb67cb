"""The GPU proof: one command that runs numafast's CUDA paths for real and measures what
they are for, on whatever machine it is given.

``python3 bench/gpu_proof.py [--json FILE]`` (on a GPU machine without network:
``bash bench/gpu-proof.sh``, which installs the wheel that bench/gpu-kit.sh built
here). In this order, each a row of the table it prints, and of the JSON:

1. the machine: Python, torch and CUDA versions, the GPUs and their NUMA nodes;
2. the CUDA tests (tests/test_pool_cuda.py, test_torch_device.py,
   test_cuda_registration.py) and the README's ``gpu`` blocks, by pytest, from a copy
   of tests/ so that the numafast imported is the installed one;
3. per size (1, 16, 256 MiB), host-to-device and device-to-host GB/s from pageable
   memory, from ``tensor.pin_memory()`` and from a slot a NumaLoader batch landed
   in, timed with CUDA events, medians (goal: a slot >= 0.95x ``pin_memory()`` and
   >= 1.5x pageable, host to device);
4. the seconds to register a GiB with CUDA, alone and as a whole pool (fault-in on
   the node, lock, register);
5. end to end, a consumer on the GPU: NumaLoader with ``device=`` against
   ``DataLoader(pin_memory=True)`` plus ``.to(device, non_blocking=True)``, rounds
   alternated, samples/s and the main process's CPU per batch (goal: >= 1.0x);
6. the CUDA contexts this process holds, as the driver lists them (nvidia-smi):
   one, on the device used, none on any other.

Without a GPU it runs what needs none (1, and 2, whose CUDA tests then skip) and
prints every GPU row as skipped with the reason; CI runs it so
(tests/test_gpu_proof.py). Exit status 1 when a test or a correctness check
failed; missed speed goals are reported, not fatal (pass ``--strict`` to make them so).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
MIB = 1 << 20
GIB = 1 << 30
SIZES_MIB = (1, 16, 256)
CUDA_TESTS = ("tests/test_pool_cuda.py", "tests/test_torch_device.py", "tests/test_cuda_registration.py")
SLOT_OVER_PINNED_GOAL = 0.95
SLOT_OVER_PAGEABLE_GOAL = 1.5
LOADER_GOAL = 1.0
# The end-to-end loaders: images as a vision pipeline's workers hand them over.
IMAGE_SHAPE = (3, 224, 224)
SAMPLES_PER_ROUND = 4096
BATCH = 64
WORKERS = 4
PAIRS = 3


@dataclass
class Row:
    """One line of the proof: a check (passed / failed / skipped) or a measurement."""

    name: str
    status: str
    detail: str = ""
    values: dict[str, Any] = field(default_factory=dict)


@dataclass
class Proof:
    rows: list[Row] = field(default_factory=list)

    def add(self, name: str, status: str, detail: str = "", **values: Any) -> Row:
        row = Row(name, status, detail, values)
        self.rows.append(row)
        print(f"{name:<44} {status:<9} {detail}", flush=True)
        return row

    def failed(self, *, strict: bool) -> list[Row]:
        bad = {"failed", "goal missed"} if strict else {"failed"}
        return [row for row in self.rows if row.status in bad]


def gpu_problem() -> str | None:
    """Why this machine cannot run the GPU rows; None when it can."""
    try:
        import torch
    except ImportError:
        return "PyTorch is not installed"
    if torch.version.cuda is None:
        return f"this PyTorch ({torch.__version__}) is built without CUDA"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False (no device visible, or no driver)"
    return None


# ---------------------------------------------------------------- 1. the machine


def node_of_gpu(index: int) -> int | None:
    """The NUMA node of CUDA device ``index``; None where the topology does not say (a
    virtual machine's GPU without a node)."""
    import numafast

    try:
        return numafast.topology().node_of_gpu(index)
    except numafast.InvalidGpuError:
        return None


def machine(proof: Proof) -> None:
    import numafast

    values: dict[str, Any] = {
        "python": platform.python_version(),
        "kernel": platform.release(),
        "numafast": str(Path(numafast.__file__).parent),
        "nodes": [node.id for node in numafast.topology().nodes],
    }
    try:
        import torch

        values["torch"] = torch.__version__
        values["cuda"] = torch.version.cuda
        values["gpus"] = [
            {"index": index, "name": torch.cuda.get_device_name(index), "node": node_of_gpu(index)}
            for index in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)
        ]
    except ImportError:
        values["torch"] = None
    gpus = ", ".join(f"cuda:{g['index']} {g['name']} (node {g['node']})" for g in values.get("gpus", [])) or "no GPU"
    proof.add("machine", "measured", f"Python {values['python']}, torch {values.get('torch')}, CUDA {values.get('cuda')}, "
              f"{len(values['nodes'])} NUMA node(s), {gpus}", **values)  # fmt: skip


# ---------------------------------------------------------------- 2. the tests


def cuda_tests(proof: Proof) -> None:
    """pytest over the CUDA tests and the README's gpu blocks, from a copy of the tree
    without numafast/ beside tests/ (the installed numafast is what runs)."""
    with tempfile.TemporaryDirectory(prefix="numafast-gpu-proof-") as tree:
        for name in ("tests", "README.md", "pyproject.toml"):
            source = REPO / name
            if source.is_dir():
                shutil.copytree(source, Path(tree) / name, ignore=shutil.ignore_patterns("__pycache__", "fixtures"))
            else:
                shutil.copyfile(source, Path(tree) / name)
        environment = {**os.environ, "NUMAFAST_README_ONLY": "gpu"}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *CUDA_TESTS,
                   "tests/test_readme.py"]  # fmt: skip
        started = time.perf_counter()
        try:
            done = subprocess.run(command, cwd=tree, env=environment, capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as error:
            proof.add("CUDA tests and README gpu blocks", "failed", "still running after 300 s: stopped")
            print(str(error.stdout or "")[-6000:], flush=True)
            return
    took = time.perf_counter() - started
    counts = {kind: int(number) for number, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", done.stdout)}
    summary = ", ".join(f"{number} {kind}" for kind, number in counts.items())
    status = "passed" if done.returncode == 0 else "failed"
    proof.add("CUDA tests and README gpu blocks", status, f"{summary} in {took:.0f} s", counts=counts,
              seconds=round(took, 1))  # fmt: skip
    if done.returncode != 0:
        print(done.stdout[-6000:], done.stderr[-3000:], sep="\n", flush=True)


# ---------------------------------------------------------------- 3. transfers


def timed_copies(copy: Callable[[], None], repetitions: int) -> float:
    """The median seconds of ``copy`` (queued on the current stream), by CUDA events."""
    import torch

    copy()  # warm-up
    seconds = []
    for _ in range(repetitions):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()
        end.record()
        end.synchronize()
        seconds.append(start.elapsed_time(end) / 1e3)
    return statistics.median(seconds)


def landed_slot(nbytes: int, device: int) -> Any:
    """A host batch of ``nbytes`` that a NumaLoader worker collated into a slot, and the loader."""
    import torch

    import numafast.torch

    class OneBuffer(torch.utils.data.Dataset):  # type: ignore[misc]
        def __len__(self) -> int:
            return 1

        def __getitem__(self, index: int) -> Any:
            return torch.ones(nbytes, dtype=torch.uint8)

    torch.cuda.set_device(device)
    loader = numafast.torch.NumaLoader(OneBuffer(), batch_size=1, num_workers=1)
    batches = list(loader)
    for _ in range(2):  # the first batch sized the pool and was copied in; later ones land
        if loader.stats().landed:
            break
        batches = list(loader)
    return batches[0][0], loader


def transfers(proof: Proof, device: int) -> None:
    import torch

    target = torch.device("cuda", device)
    for size in SIZES_MIB:
        nbytes = size * MIB
        repetitions = 30 if size < 64 else 10
        on_device = torch.empty(nbytes, dtype=torch.uint8, device=target)
        slot, loader = landed_slot(nbytes, device)
        landed = loader.stats().landed > 0 and slot.is_pinned()
        sources = {
            "pageable": torch.ones(nbytes, dtype=torch.uint8),
            "pin_memory()": torch.ones(nbytes, dtype=torch.uint8).pin_memory(),
            "NumaLoader slot": slot,
        }
        rates: dict[str, dict[str, float]] = {}
        for name, host in sources.items():
            h2d = timed_copies(lambda host=host: on_device.copy_(host, non_blocking=True), repetitions)
            d2h = timed_copies(lambda host=host: host.copy_(on_device, non_blocking=True), repetitions)
            rates[name] = {"h2d_gbps": nbytes / h2d / 1e9, "d2h_gbps": nbytes / d2h / 1e9}
        slot_h2d = rates["NumaLoader slot"]["h2d_gbps"]
        over_pinned = slot_h2d / rates["pin_memory()"]["h2d_gbps"]
        over_pageable = slot_h2d / rates["pageable"]["h2d_gbps"]
        met = landed and over_pinned >= SLOT_OVER_PINNED_GOAL and over_pageable >= SLOT_OVER_PAGEABLE_GOAL
        detail = "; ".join(f"{name} {r['h2d_gbps']:.1f} / {r['d2h_gbps']:.1f}" for name, r in rates.items())
        proof.add(f"H2D / D2H GB/s, {size} MiB", "goal met" if met else "goal missed",
                  f"{detail}; slot/pinned {over_pinned:.2f}x, slot/pageable {over_pageable:.2f}x"
                  + ("" if landed else "; the batch did not land in a registered slot"),
                  bytes=nbytes, rates=rates, slot_over_pinned=over_pinned, slot_over_pageable=over_pageable,
                  landed=landed)  # fmt: skip
        del slot, sources, on_device, loader


# ---------------------------------------------------------------- 4. registration


def registration(proof: Proof, device: int) -> None:
    import numafast
    from numafast import cuda

    node = node_of_gpu(device)
    node = numafast.pages.local_node() if node is None else node
    with numafast.PinnedPool(node, GIB, 1, lock="off", register="off") as pool:  # faulted in on the node
        region = pool._resources.region
        started = time.perf_counter()
        registered = cuda.Registration(region.address, region.size, device=device, unit=GIB,
                                       head=numafast._libnuma.slot_table_bytes(1))  # fmt: skip
        alone = time.perf_counter() - started
        registered.unregister()
    started = time.perf_counter()
    with numafast.PinnedPool(node, GIB, 1, device=device) as pool:
        whole = time.perf_counter() - started
        assert pool.registered
    proof.add("register 1 GiB, s", "measured", f"cudaHostRegister alone {alone:.3f} s; a whole pool (fault-in on "
              f"node {node}, lock, register) {whole:.3f} s", register_seconds=alone, pool_seconds=whole)  # fmt: skip


# ---------------------------------------------------------------- 5. end to end


def loaders_end_to_end(proof: Proof, device: int) -> None:
    import torch

    import numafast.torch

    target = torch.device("cuda", device)
    torch.cuda.set_device(device)
    images = torch.randint(0, 255, (64, *IMAGE_SHAPE), dtype=torch.uint8)

    class Images(torch.utils.data.Dataset):  # type: ignore[misc]
        def __len__(self) -> int:
            return SAMPLES_PER_ROUND

        def __getitem__(self, index: int) -> Any:
            return images[index % len(images)], index

    def consume(batch: Any) -> Any:
        image, label = batch
        return (image.float() / 255).mean(dim=(1, 2, 3)).sum() + label.sum()  # work on the GPU

    def stock_round() -> tuple[float, float]:
        return run(stock, lambda batch: [part.to(target, non_blocking=True) for part in batch])

    def numa_round() -> tuple[float, float]:
        return run(numa, lambda batch: batch)

    def run(loader: Any, to_device: Callable[[Any], Any]) -> tuple[float, float]:
        """samples/s, and the main process's CPU seconds per batch (all its threads: the
        stock pin thread, numafast's receive and side-stream copies; not the workers)."""
        started, cpu = time.perf_counter(), time.process_time()
        total = torch.zeros((), device=target)
        batches = 0
        for batch in loader:
            total += consume(to_device(batch))
            batches += 1
        torch.cuda.synchronize(target)
        return SAMPLES_PER_ROUND / (time.perf_counter() - started), (time.process_time() - cpu) / batches

    options = {"batch_size": BATCH, "num_workers": WORKERS, "persistent_workers": True, "shuffle": False}
    stock = torch.utils.data.DataLoader(Images(), pin_memory=True, **options)
    numa = numafast.torch.NumaLoader(Images(), device=target, **options)
    stock_round(), numa_round()  # warm-up: workers started, pools made and sized
    results: dict[str, list[tuple[float, float]]] = {"stock": [], "numafast": []}
    for pair in range(PAIRS):
        order = [("stock", stock_round), ("numafast", numa_round)]
        for name, round_ in order if pair % 2 == 0 else reversed(order):
            results[name].append(round_())
    rates = {name: statistics.median(r for r, _ in rounds) for name, rounds in results.items()}
    cpu = {name: statistics.median(c for _, c in rounds) for name, rounds in results.items()}
    ratio = rates["numafast"] / rates["stock"]
    stats = numa.stats()
    proof.add("end to end, samples/s", "goal met" if ratio >= LOADER_GOAL else "goal missed",
              f"NumaLoader(device=) {rates['numafast']:.0f}, DataLoader(pin_memory=True)+.to() {rates['stock']:.0f}: "
              f"{ratio:.2f}x; main-process CPU per batch {cpu['numafast'] * 1e6:.0f} vs {cpu['stock'] * 1e6:.0f} us; "
              f"{stats.landed} of {stats.batches} batches landed",
              samples_per_second=rates, cpu_seconds_per_batch=cpu, ratio=ratio, landed=stats.landed,
              batches=stats.batches, rounds=results)  # fmt: skip
    del stock, numa


# ---------------------------------------------------------------- 6. contexts


def contexts(proof: Proof, device: int) -> None:
    import torch

    if shutil.which("nvidia-smi") is None:
        proof.add("CUDA contexts of this process", "skipped", "nvidia-smi is not on PATH")
        return
    listing = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60).stdout  # fmt: skip
    mine = [line.split(",")[1].strip() for line in listing.splitlines()
            if line.strip() and line.split(",")[0].strip() == str(os.getpid())]  # fmt: skip
    used = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
    if not mine:
        proof.add("CUDA contexts of this process", "skipped", f"nvidia-smi lists no process {os.getpid()} (another "
                  "PID namespace?)", listing=listing)  # fmt: skip
        return
    ok = mine == [used]
    proof.add("CUDA contexts of this process", "passed" if ok else "failed",
              f"{len(mine)} context(s): {', '.join(mine) or 'none listed'}; the device used is {used}",
              contexts=mine, device_uuid=used)  # fmt: skip


# ---------------------------------------------------------------- the run


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write every row to this file as JSON")
    parser.add_argument("--device", type=int, default=None, help="the CUDA device (default: the last one visible)")
    parser.add_argument("--strict", action="store_true", help="a missed speed goal fails the run too")
    parser.add_argument("--no-tests", action="store_true", help="measure only (the tests take a minute or two)")
    args = parser.parse_args(argv)
    proof = Proof()
    started = time.perf_counter()
    machine(proof)
    if not args.no_tests:
        cuda_tests(proof)
    problem = gpu_problem()
    gpu_rows = [("H2D / D2H GB/s", transfers), ("register 1 GiB, s", registration),
                ("end to end, samples/s", loaders_end_to_end), ("CUDA contexts of this process", contexts)]  # fmt: skip
    if problem is not None:
        for name, _ in gpu_rows:
            proof.add(name, "skipped", f"needs a CUDA GPU: {problem}")
    else:
        import torch

        device = torch.cuda.device_count() - 1 if args.device is None else args.device
        for name, measure in gpu_rows:
            try:
                measure(proof, device)
            except Exception as error:  # noqa: BLE001 - a failed row, reported; the others still run
                proof.add(name, "failed", f"{type(error).__name__}: {error}")
    took = time.perf_counter() - started
    failed = proof.failed(strict=args.strict)
    print(f"gpu proof: {len(proof.rows)} rows, {len(failed)} failed, in {took:.0f} s", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"seconds": took, "rows": [asdict(row) for row in proof.rows]}, indent=1,
                                        default=str))  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
