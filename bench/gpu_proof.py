"""The GPU proof: one command that runs numafast's CUDA paths for real and measures what
they are for, on whatever machine it is given.

``python3 bench/gpu_proof.py [--json FILE]`` (on a GPU machine without network:
``bash bench/gpu-proof.sh``, which installs the wheel that bench/gpu-kit.sh built
here). In this order, each a row of the table it prints, and of the JSON:

1. the machine: Python, torch and CUDA versions, the GPUs and their NUMA nodes;
2. the CUDA tests (tests/test_pool_cuda.py, test_torch_device.py,
   test_cuda_registration.py, test_cuda_retiring.py) and the README's ``gpu`` blocks,
   by pytest, each file in a process of its own (a file must not find CUDA initialised
   by another), from a copy of tests/ so that the numafast imported is the installed
   one; with a GPU also the loader, pin, frameworks and slot-pressure tests, which then
   run with registration and fences on. Where torch sees a GPU, a file whose tests all
   skip fails;
3. per size (1, 16, 256 MiB), host-to-device and device-to-host GB/s from pageable
   memory, from ``tensor.pin_memory()`` and from a slot a NumaLoader batch landed
   in, timed with CUDA events, medians (goal: a slot >= 0.95x ``pin_memory()`` and
   >= 1.5x pageable, host to device);
4. the seconds to register a GiB with CUDA, alone and as a whole pool (fault-in on
   the node, lock, register);
5. end to end, a consumer on the GPU: NumaLoader with ``device=`` against
   ``DataLoader(pin_memory=True)`` plus ``.to(device, non_blocking=True)``, rounds
   alternated, samples/s and the main process's CPU per batch (goal: >= 1.0x);
   both consumers checksum every batch on the GPU, and the row fails where any differ;
6. the CUDA contexts this process holds, as the driver lists them (nvidia-smi):
   one, on the device used, none on any other (skipped, saying so, in a PID namespace
   of its own, whose pids nvidia-smi does not list).

It prints what /sys/devices/system/node and /sys/bus/pci hold first. Every subprocess
it starts is killed with its whole process group at its timeout.

Without a GPU it runs what needs none (1, and 2, whose CUDA tests then skip) and
prints every GPU row as skipped with the reason; CI runs it so
(tests/test_gpu_proof.py). Exit status 1 when a test or a correctness check
failed; missed speed goals are reported, not fatal (pass ``--strict`` to make them so).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import signal
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
CUDA_TESTS = ("tests/test_pool_cuda.py", "tests/test_torch_device.py", "tests/test_cuda_registration.py",
              "tests/test_cuda_retiring.py", "tests/test_readme.py")
# Files that run without CUDA too, run again where torch sees a GPU: register='auto' turns
# registration and fences on for every pool they make.
CUDA_ON_TESTS = ("tests/test_torch_loader.py", "tests/test_torch_pin.py", "tests/test_frameworks.py",
                 "tests/test_slot_pressure.py")
TESTS_TIMEOUT_S = 300
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


def run_group(command: list[str], timeout: float, **options: Any) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` in a session of its own, whose whole process group (DataLoader
    workers, nested pytest children) is killed at ``timeout``: TimeoutExpired then."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True, **options) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr) from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


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


def sysfs_listing() -> dict[str, list[str]]:
    """What /sys/devices/system/node and /sys/bus/pci hold (display controllers, class
    0x03, by address): printed first, so that a proof whose topology finds no GPU says why."""
    nodes = Path("/sys/devices/system/node")
    pci = Path("/sys/bus/pci/devices")
    listing = {
        "/sys/devices/system/node": sorted(path.name for path in nodes.iterdir()) if nodes.is_dir() else [],
        "/sys/bus/pci/devices (class 0x03)": [],
    }
    if pci.is_dir():
        for device in sorted(pci.iterdir()):
            with contextlib.suppress(OSError):
                if (device / "class").read_text().startswith("0x03"):
                    node = (device / "numa_node").read_text().strip() if (device / "numa_node").exists() else "?"
                    listing["/sys/bus/pci/devices (class 0x03)"].append(f"{device.name} (numa_node {node})")
    for where, entries in listing.items():
        print(f"{where}: {' '.join(entries) or 'nothing'}", flush=True)
    return listing


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


def test_file(tree: str, name: str, gpu: bool) -> tuple[dict[str, int], str]:
    """pytest over one file in a process of its own: its counts, and why it failed ('' when
    it did not). Where torch sees a GPU, a file whose tests all skipped failed."""
    environment = {**os.environ, "NUMAFAST_README_ONLY": "gpu"}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", name]
    try:
        done = run_group(command, TESTS_TIMEOUT_S, cwd=tree, env=environment)
    except subprocess.TimeoutExpired as error:
        print(str(error.stdout or "")[-6000:], flush=True)
        return {}, f"{name} still running after {TESTS_TIMEOUT_S} s: stopped with its process group"
    counts = {kind: int(number) for number, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", done.stdout)}
    why = ""
    if done.returncode not in (0, 5):  # 5: nothing collected
        why = f"{name} failed"
    elif gpu and not counts.get("passed"):
        why = f"{name}: every test skipped while torch sees a GPU"
    if why:
        print(done.stdout[-6000:], done.stderr[-3000:], sep="\n", flush=True)
    return counts, why


def cuda_tests(proof: Proof) -> None:
    """pytest over the CUDA tests and the README's gpu blocks (with a GPU, also the files
    that then run with CUDA on), each file alone, from a copy of the tree without
    numafast/ beside tests/ (the installed numafast is what runs)."""
    gpu = gpu_problem() is None
    counts: dict[str, int] = {}
    failures: list[str] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="numafast-gpu-proof-") as tree:
        for name in ("tests", "README.md", "pyproject.toml"):
            source = REPO / name
            if source.is_dir():
                shutil.copytree(source, Path(tree) / name, ignore=shutil.ignore_patterns("__pycache__", "fixtures"))
            else:
                shutil.copyfile(source, Path(tree) / name)
        for name in (*CUDA_TESTS, *(CUDA_ON_TESTS if gpu else ())):
            file_counts, why = test_file(tree, name, gpu)
            for kind, number in file_counts.items():
                counts[kind] = counts.get(kind, 0) + number
            if why:
                failures.append(why)
    took = time.perf_counter() - started
    summary = ", ".join(f"{number} {kind}" for kind, number in counts.items())
    status = "failed" if failures else "passed"
    proof.add("CUDA tests and README gpu blocks", status, "; ".join([f"{summary} in {took:.0f} s", *failures]),
              counts=counts, seconds=round(took, 1), failures=failures)  # fmt: skip


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

    import numafast

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
        if len(numafast.topology().nodes) == 1:  # where the slot's memory is cannot matter
            detail += "; one NUMA node: a slot and pin_memory() sit on the same node, so no locality gain shows (~1.0x)"
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
        """Work on the GPU, and the batch's checksum there (its bytes and labels, summed in int64)."""
        image, label = batch
        checksum = image.sum(dtype=torch.int64) * 1_000_003 + label.sum()
        return (image.float() / 255).mean(dim=(1, 2, 3)).sum(), checksum

    def stock_round() -> tuple[float, float]:
        return run(stock, lambda batch: [part.to(target, non_blocking=True) for part in batch])

    def numa_round() -> tuple[float, float]:
        return run(numa, lambda batch: batch)

    def run(loader: Any, to_device: Callable[[Any], Any]) -> tuple[float, float]:
        """samples/s, and the main process's CPU seconds per batch (all its threads: the
        stock pin thread, numafast's receive and side-stream copies; not the workers).
        Every batch's checksum goes to ``checksums[loader]``, one list per round."""
        started, cpu = time.perf_counter(), time.process_time()
        total = torch.zeros((), device=target)
        sums = []
        for batch in loader:
            work, checksum = consume(to_device(batch))
            total += work
            sums.append(checksum)
        torch.cuda.synchronize(target)
        took = time.perf_counter() - started, (time.process_time() - cpu) / len(sums)
        checksums.setdefault(id(loader), []).append(torch.stack(sums).cpu())
        return SAMPLES_PER_ROUND / took[0], took[1]

    checksums: dict[int, list[Any]] = {}

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
    reference = checksums[id(stock)][0]
    differing = sum(not torch.equal(reference, sums) for sums in [*checksums[id(stock)], *checksums[id(numa)]])
    status = "failed" if differing else "goal met" if ratio >= LOADER_GOAL else "goal missed"
    proof.add("end to end, samples/s", status,
              f"NumaLoader(device=) {rates['numafast']:.0f}, DataLoader(pin_memory=True)+.to() {rates['stock']:.0f}: "
              f"{ratio:.2f}x; main-process CPU per batch {cpu['numafast'] * 1e6:.0f} vs {cpu['stock'] * 1e6:.0f} us; "
              f"{stats.landed} of {stats.batches} batches landed; "
              + (f"{differing} rounds' batch checksums differ from the stock loader's first" if differing else
                 f"every round's {len(reference)} batch checksums identical"),
              checksums_differing=differing,
              samples_per_second=rates, cpu_seconds_per_batch=cpu, ratio=ratio, landed=stats.landed,
              batches=stats.batches, rounds=results)  # fmt: skip
    del stock, numa


# ---------------------------------------------------------------- 6. contexts


def contexts(proof: Proof, device: int) -> None:
    import torch

    if shutil.which("nvidia-smi") is None:
        proof.add("CUDA contexts of this process", "skipped", "nvidia-smi is not on PATH")
        return
    listing = run_group(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader"],
                        60).stdout  # fmt: skip
    mine = [line.split(",")[1].strip() for line in listing.splitlines()
            if line.strip() and line.split(",")[0].strip() == str(os.getpid())]  # fmt: skip
    used = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
    if not mine:
        proof.add("CUDA contexts of this process", "skipped", f"nvidia-smi lists no process {os.getpid()}: this "
                  "process runs in a PID namespace of its own (a container), whose pids the driver does not list; "
                  "not checked", listing=listing)  # fmt: skip
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
    sysfs = sysfs_listing()
    machine(proof)
    proof.rows[-1].values["sysfs"] = sysfs
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
