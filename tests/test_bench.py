"""``numafast bench`` on any kernel: bad input refused before anything is measured,
the JSON schema's round trip, the text table, the health checks, the heat maps,
and Ctrl-C leaving nothing behind. The multi-node runs are in test_bench_live.py.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

import numafast
from numafast.cli import main
from numafast.cli.bench import parse_size
from numafast.cli.bench.health import check_local_ratio, h2d_failures, local_ratio_failures
from numafast.cli.bench.result import MATRICES, SCHEMA, BenchResult, check_document
from numafast.cli.bench.in_progress import Run, Unmeasurable, check_threads
from numafast.cli.bench.settings import Settings
from numafast.cli.bench.table import render, render_matrix
from sysfs_truth import node_cpus, node_meminfo, online_nodes

TESTS = Path(__file__).resolve().parent
ENV = {**os.environ, "PYTHONPATH": f"{TESTS.parent}:{TESTS}"}
FORMATTING = "formatting and schema checks of a hand-written result: nothing kernel-specific"


def bench_cli(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["bench", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# ---------------------------------------------------------------- bad input, refused before measuring


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--nodes", "4095"], "numafast bench: node 4095 does not exist; nodes here: "),
        (["--expect-h2d", "20"], "numafast bench: --expect-h2d needs CUDA (the h2d_gbps matrix): no CUDA device here"),
        (["--matrix", "d2h_gbps"], "numafast bench: d2h_gbps needs CUDA: no CUDA device here"),
        # Refused as the options are read (argparse: exit status 2, the usage first).
        (["--nodes", "3-1"], "argument --nodes: node list '3-1' is neither a number nor a range A-B with A <= B"),
        (["--threads", "0"], "argument --threads: '0': give an integer >= 1"),
        (["--repetitions", "0"], "argument --repetitions: '0': give an integer from 1 to 10000"),
        (["--repetitions", "99999999999999999999"], "argument --repetitions: '99999999999999999999': give an integer from 1 to 10000"),
        (["--expect-local-ratio", "0.5"], "argument --expect-local-ratio: '0.5': give a finite number >= 1"),
        (["--expect-local-ratio", "inf"], "argument --expect-local-ratio: 'inf': give a finite number >= 1"),
        (["--expect-h2d", "-1"], "argument --expect-h2d: '-1': give a finite number > 0"),
    ],
)
def test_bad_input_is_a_clear_error(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    if "CUDA" in message and numafast.topology().gpus:
        pytest.skip("this machine has a GPU: the CUDA errors are for machines without one")
    try:
        code, out, err = bench_cli(capsys, *args)
    except SystemExit as exit:
        code, out, err = exit.code, *capsys.readouterr()
    assert code == (2 if message.startswith("argument") else 1) and out == ""
    assert message in err, err


@pytest.mark.parametrize("repetitions", [0, 10_001, 2**40, 2**64])
def test_python_api_refuses_repetitions_out_of_range_before_measuring(repetitions: int) -> None:
    message = f"repetitions must be a whole number from 1 to 10000, not {repetitions}"
    with pytest.raises(ValueError, match=re.escape(message)):
        numafast.bench(repetitions=repetitions, matrices=["latency_ns"], quick=True)


def test_python_api_takes_one_matrix_name_and_names_what_matrices_takes() -> None:
    assert list(numafast.bench(matrices="latency_ns", quick=True, repetitions=1).matrices) == ["latency_ns"]
    with pytest.raises(TypeError, match=r"matrices must be a matrix name or a list of them \(latency_ns, read_gbps"):
        numafast.bench(matrices=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="matrix 'read': choose among latency_ns, read_gbps"):
        numafast.bench(matrices=["read"])


def test_python_api_refuses_bad_thresholds() -> None:
    for ratio in (0.5, float("inf"), float("nan"), True, "3"):
        with pytest.raises(ValueError, match=re.escape(f"expected local ratio {ratio!r}: give a finite number >= 1")):
            check_local_ratio(ratio)


def largest_llc() -> int:
    """The largest total of distinct last-level caches of one node, from sysfs (0: unknown)."""
    largest = 0
    for node in online_nodes():
        caches: dict[str, int] = {}
        for cpu in node_cpus(node):
            indexes = sorted(Path(f"/sys/devices/system/cpu/cpu{cpu}/cache").glob("index*"))
            data = [i for i in indexes if (i / "type").read_text().strip() in ("Unified", "Data")]
            if not data:
                return 0
            top = max(data, key=lambda i: int((i / "level").read_text()))
            caches[(top / "shared_cpu_list").read_text()] = int((top / "size").read_text().strip().rstrip("K")) << 10
        largest = max(largest, sum(caches.values()))
    return largest


def test_a_size_below_four_times_the_cache_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    llc = largest_llc()
    if not llc:
        pytest.skip("sysfs gives no last-level cache size here")
    code, out, err = bench_cli(capsys, "--size", "2M")
    assert code == 1 and out == ""
    assert f"size 2 MiB is below 4x the last-level cache ({llc >> 20} MiB)" in err, err
    assert f"give at least {4 * llc >> 20} MiB (STREAM's rule), or --quick" in err


@pytest.mark.host_only("the plot's checks are not kernel-specific (and matplotlib is slow to import under TCG)")
def test_an_unwritable_plot_path_fails_before_any_other_check(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    # --nodes 4095 is refused by the run itself: the plot error coming first shows that
    # nothing was validated, let alone measured, before the path was tried.
    for path, why in [(tmp_path / "missing" / "x.png", "No such file or directory"), (tmp_path, "Is a directory")]:
        code, out, err = bench_cli(capsys, "--plot", str(path), "--nodes", "4095")
        assert code == 1 and out == ""
        assert err == f"numafast bench: cannot write the plot to {path}: {why}\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.host_only("the plot's checks are not kernel-specific")
def test_plot_without_matplotlib_names_the_extra(tmp_path: Path) -> None:
    code = "import sys; sys.modules['matplotlib'] = None; from numafast.cli import main; sys.exit(main(sys.argv[1:]))"
    target = tmp_path / "x.png"
    result = subprocess.run([sys.executable, "-c", code, "bench", "--plot", str(target)], capture_output=True,
                            text=True, cwd=TESTS.parent, env=ENV, timeout=300)  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert result.stderr == "numafast bench: --plot needs matplotlib: pip install numafast[plot] (or pip install matplotlib)\n"
    assert not target.exists()


@pytest.mark.parametrize(("text", "size"), [("134217728", 1 << 27), ("128M", 1 << 27), ("128MiB", 1 << 27), ("1g", 1 << 30), ("64KB", 1 << 16)])
def test_sizes_parse_in_powers_of_1024(text: str, size: int) -> None:
    assert parse_size(text) == size


def test_buffers_no_node_can_hold_leave_every_cell_explained_and_fail(capsys: pytest.CaptureFixture[str]) -> None:
    too_big = 2 * max(node_meminfo(n)["MemTotal"] for n in online_nodes())
    code, out, err = bench_cli(capsys, "--matrix", "read_gbps", "--size", str(too_big))
    assert code == 1
    assert f"  [a] node {online_nodes()[0]}: node {online_nodes()[0]} has " in out
    assert "bytes free" in out and f"{too_big} bytes asked for" in out
    assert err == "numafast bench: FAILED no cell could be measured (the reasons are in the output)\n"


def test_threads_that_left_their_cpu_fail_the_placement_check() -> None:
    node = online_nodes()[0]
    cpu = node_cpus(node)[0]
    assert check_threads([(cpu, cpu, cpu, True)], node) == [cpu]
    for placed, why in [
        ((cpu, cpu, cpu + 1, True), f"ran on cpu {cpu} before and {cpu + 1} after timing"),
        ((cpu, cpu, cpu, False), "affinity not only that CPU"),
    ]:
        with pytest.raises(Exception, match="placement check failed: ") as raised:
            check_threads([placed], node)
        assert why in str(raised.value)


@pytest.mark.host_only("replays sysfs snapshots")
def test_rows_and_columns_that_cannot_be_measured_say_why() -> None:
    fixtures = TESTS / "fixtures"
    settings = Settings(nodes=[0], matrices=["latency_ns"], size=8 << 20, threads=None, repetitions=None,
                        quick=True, copy_by="destination")  # fmt: skip
    # sparse-nodes: node 5 has CPUs and no memory, node 252 memory and no CPUs; the process may use CPUs 0-7.
    with Run(settings, numafast.Topology.from_sysfs(fixtures / "sparse-nodes"), None) as run:
        assert run.memory_problem(5) == "node 5 has no memory"
        assert run.memory_problem(252) is None and run.cpus_of(4) == [4, 5]
        with pytest.raises(Unmeasurable, match="^node 252 has no CPUs$"):
            run.cpus_of(252)
    # container-cgroup1: a cpuset with CPUs 0-1,8-9 (node 0's) and memory on node 0 only.
    container = numafast.Topology.from_sysfs(fixtures / "container-cgroup1")
    with Run(settings, container, None) as run:
        assert run.memory_problem(1) == "node 1 is outside the memory nodes this process may use (0: its cpuset's mems)"
        with pytest.raises(Unmeasurable, match=r"^node 1's CPUs 4-7,12-15 are all outside the CPUs this process may use \(0-1,8-9: "):
            run.cpus_of(1)
        assert run.cpus_of(0) == [0, 1, 8, 9]


# ---------------------------------------------------------------- a real run on this host, through the API


@pytest.fixture(scope="module")
def host_result() -> BenchResult:
    return numafast.bench(quick=True)


@pytest.mark.host_only("the guests round-trip their own multi-node runs (test_bench_live.py)")
def test_api_result_round_trips_its_json(host_result: BenchResult) -> None:
    document = json.loads(host_result.to_json())
    check_document(document)
    assert document["schema"] == SCHEMA and document["version"] == numafast.__version__
    assert BenchResult.from_json(host_result.to_json()).to_dict() == document
    assert set(document["matrices"]) == {"latency_ns", "read_gbps", "copy_gbps", "node_copy_gbps"}
    for name, matrix in document["matrices"].items():
        assert matrix["bytes"] == document["settings"]["size"] == 8 << 20
        for i, row in enumerate(matrix["rows"]):
            for j, col in enumerate(matrix["cols"]):
                assert matrix["values"][i][j] is not None or f"{row},{col}" in matrix["missing"], (name, row, col)


@pytest.mark.host_only("the guests check their own runs' placement (test_bench_live.py)")
def test_api_threads_ran_where_pinned(host_result: BenchResult) -> None:
    allowed = sorted(os.sched_getaffinity(0))
    for name, matrix in host_result.matrices.items():
        for key, placement in matrix.placement.items():
            row, col = map(int, key.split(","))
            assert placement["cpu_node"] == (col if name == "node_copy_gbps" else row)
            assert set(placement["cpus"]) <= set(node_cpus(placement["cpu_node"])) & set(allowed), key


def largest_cache_in_sysfs() -> int | None:
    """The largest cache of any CPU here, in bytes, read from sysfs without numafast; None when none is listed."""
    sizes = []
    for size in Path("/sys/devices/system/cpu").glob("cpu[0-9]*/cache/index[0-9]*/size"):
        text = size.read_text().strip()
        sizes.append(int(text[:-1]) << 10 if text.endswith("K") else int(text[:-1]) << 20 if text.endswith("M") else int(text))
    return max(sizes, default=None)


@pytest.mark.host_only("the guests run --quick for placement, not figures (test_bench_live.py)")
def test_a_quick_run_within_the_cache_says_it_measured_the_cache(host_result: BenchResult) -> None:
    largest = largest_cache_in_sysfs()
    if largest is not None and 4 * largest <= host_result.settings["size"]:
        pytest.skip(f"8 MiB buffers are 4x this machine's largest cache ({largest >> 10} KiB): they measure memory")
    lines = list(render(host_result))
    assert lines[2].startswith(("CACHE, NOT MEMORY: buffers of 8 MiB are under 4x the ", "sysfs does not give the last-level cache"))
    titles = [line for line in lines if line.startswith(("latency_ns", "read_gbps", "copy_gbps", "node_copy_gbps"))]
    assert len(titles) == 4 and all(" [cache] (" in title for title in titles), titles


@pytest.mark.host_only("drawing is not kernel-specific")
def test_plot_draws_a_png(host_result: BenchResult, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from numafast.cli.bench.plot import draw

    draw(host_result, tmp_path / "bench.png")
    data = (tmp_path / "bench.png").read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000


# ---------------------------------------------------------------- schema, table and health checks on a written result

ROWS = [0, 1, 2]


def written_result() -> dict[str, Any]:
    """A 3-node result as the schema writes it: node 2 is memory only (no CPUs)."""
    matrix = {
        "unit": "GB/s", "better": "higher", "description": MATRICES["read_gbps"].description, "row_kind": "cpu_node", "rows": ROWS,
        "col_kind": "memory_node", "cols": ROWS, "values": [[20.0, 10.0, 5.0], [9.0, 18.0, 4.5], [None, None, None]],
        "missing": {f"2,{c}": "node 2 has no CPUs" for c in ROWS}, "threads": [[2, 2, 2], [2, 2, 2], [0, 0, 0]],
        "bytes": 1 << 27, "repetitions": 10, "warmup": 1, "statistic": "best", "per_repetition": 1 << 27,
        "per_repetition_unit": "bytes", "placement": {},
    }  # fmt: skip
    latency = {**copy.deepcopy(matrix), "unit": "ns", "better": "lower", "description": MATRICES["latency_ns"].description,
               "values": [[100.0, 150.0, 400.0], [140.0, 90.0, 380.0], [None, None, None]],
               "per_repetition": 1 << 21, "per_repetition_unit": "loads", "repetitions": 5}  # fmt: skip
    return {
        "schema": SCHEMA, "version": numafast.__version__, "created": "2026-01-01T00:00:00Z",
        "settings": {"nodes": ROWS, "size": 1 << 27, "threads": None, "repetitions": None, "quick": False, "copy_by": "destination"},
        "machine": {"hostname": "box", "cpu_model": "CPU", "thp": "madvise", "allowed_cpus": [0, 1, 2, 3],
                    "nodes": [{"id": n, "cpus": [] if n == 2 else [2 * n, 2 * n + 1], "llc_bytes": 0 if n == 2 else 32 << 20} for n in ROWS]},
        "matrices": {"latency_ns": latency, "read_gbps": matrix},
    }  # fmt: skip


@pytest.mark.host_only(FORMATTING)
def test_written_result_round_trips() -> None:
    document = written_result()
    assert BenchResult.from_dict(document).to_dict() == document


@pytest.mark.host_only(FORMATTING)
@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda d: d.update(schema="numafast.bench/0"), "schema 'numafast.bench/0': this numafast reads numafast.bench/1"),
        (lambda d: d["matrices"]["read_gbps"]["missing"].pop("2,1"), r"null cells without a reason \['2,1'\]"),
        (lambda d: d["matrices"]["read_gbps"]["values"][0].__setitem__(1, None), r"without a reason \['0,1'\]"),
        (lambda d: d["matrices"]["read_gbps"]["values"][0].__setitem__(1, "fast"), "cell 0,1 holds 'fast'"),
        (lambda d: d["matrices"]["read_gbps"]["values"].pop(), "values is not 3 rows of 3 columns"),
        (lambda d: d["matrices"]["read_gbps"].update(unit="MB/s"), "unit 'MB/s', expected 'GB/s'"),
        (lambda d: d["matrices"]["read_gbps"].pop("repetitions"), "matrix read_gbps: no 'repetitions'"),
        (lambda d: d["matrices"].update(triad_gbps={}), "matrix 'triad_gbps': not one of latency_ns"),
    ],
)
def test_schema_refuses_a_damaged_document(damage: Any, message: str) -> None:
    document = written_result()
    damage(document)
    with pytest.raises(ValueError, match=message):
        BenchResult.from_dict(document)


@pytest.mark.host_only(FORMATTING)
def test_table_has_units_ratios_and_reasons() -> None:
    lines = list(render(BenchResult.from_dict(written_result())))
    assert lines[0] == "numafast bench 0.1.0 on box: CPU, 3 nodes, 4 allowed CPUs, LLC per node 32 MiB, THP madvise"
    latency = lines.index("latency_ns (ns, lower is better): 2 threads per cell, best of 5 after 1 warm-up")
    assert lines[latency + 1 : latency + 6] == [
        "  cpu\\mem      0      1      2   remote/local",
        "        0  100.0  150.0  400.0   1.50-4.00",
        "        1  140.0   90.0  380.0   1.56-4.22",
        "        2    [a]    [a]    [a]",
        "  [a] node 2 has no CPUs (cells 2,0 2,1 2,2)",
    ]
    read = lines.index("read_gbps (GB/s, higher is better): 2 threads per cell, best of 10 after 1 warm-up")
    assert lines[read + 2] == "        0  20.00  10.00   5.00   0.25-0.50"


@pytest.mark.host_only(FORMATTING)
@pytest.mark.parametrize(
    ("size", "llc", "note"),
    [
        (8 << 20, 32 << 20, "CACHE, NOT MEMORY: buffers of 8 MiB are under 4x the 32 MiB last-level cache, so the matrices "
                            "marked [cache] measured the caches; for memory give --size 128M (or drop --quick)"),
        (127 << 20, 32 << 20, "CACHE, NOT MEMORY: buffers of 127 MiB are under 4x the 32 MiB last-level cache"),
        (128 << 20, 32 << 20, None),
        (8 << 20, None, "sysfs does not give the last-level cache's size here, so buffers of 8 MiB may have measured the caches"),
    ],
)
def test_table_says_when_buffers_fit_the_cache(size: int, llc: int | None, note: str | None) -> None:
    document = written_result()
    document["settings"].update(size=size, quick=True)
    for node in document["machine"]["nodes"]:
        node["llc_bytes"] = llc if node["cpus"] else 0
    lines = list(render(BenchResult.from_dict(document)))
    if note is None:
        assert not any("cache" in line for line in lines[2:]), lines
        return
    assert lines[2].startswith(note), lines[2]
    assert lines[4] == "latency_ns [cache] (ns, lower is better): 2 threads per cell, best of 5 after 1 warm-up"


@pytest.mark.host_only(FORMATTING)
def test_local_ratio_check_names_each_cell_worse_than_allowed() -> None:
    result = BenchResult.from_dict(written_result())
    assert local_ratio_failures(result, 5) == []
    assert local_ratio_failures(result, 4) == [
        "latency_ns[1,2]: 380.00 ns is 4.22x worse than the local 90.00 ns of row 1 (expected at most 4x)",
    ]
    assert local_ratio_failures(result, 3.9)[:2] == [
        "latency_ns[0,2]: 400.00 ns is 4.00x worse than the local 100.00 ns of row 0 (expected at most 3.9x)",
        "latency_ns[1,2]: 380.00 ns is 4.22x worse than the local 90.00 ns of row 1 (expected at most 3.9x)",
    ]
    assert "read_gbps[0,2]: 5.00 GB/s is 4.00x worse than the local 20.00 GB/s of row 0" in local_ratio_failures(result, 3.9)[2]


@pytest.mark.host_only(FORMATTING)
def test_h2d_check_reads_the_documented_matrix() -> None:
    document = written_result()
    with pytest.raises(ValueError, match="this run measured no h2d_gbps matrix"):
        h2d_failures(BenchResult.from_dict(document), 20)
    # The schema's GPU x host-node shape (rows: memory nodes, columns: CUDA devices);
    # written data for the check's logic only: this machine measures no GPU.
    document["matrices"]["h2d_gbps"] = {
        **document["matrices"]["read_gbps"], "description": MATRICES["h2d_gbps"].description, "row_kind": "memory_node", "col_kind": "cuda_device", "cols": [0, 1],
        "values": [[24.0, 11.0], [12.0, 23.5], [22.0, 22.0]], "missing": {}, "threads": [[1, 1]] * 3,
        "statistic": "median", "streams": 1,
    }  # fmt: skip
    result = BenchResult.from_dict(document)
    assert result.to_dict() == document
    assert h2d_failures(result, 20) == [
        "h2d_gbps[0,1]: 11.00 GB/s from node 0 to GPU 1, below the expected 20 GB/s",
        "h2d_gbps[1,0]: 12.00 GB/s from node 1 to GPU 0, below the expected 20 GB/s",
    ]
    # Each row is compared with each GPU's own node, from the machine summary.
    document["machine"]["gpus"] = [{"index": 0, "address": "0000:3b:00.0", "node": 0},
                                   {"index": 1, "address": "0000:af:00.0", "node": 1}]  # fmt: skip
    lines = [line.rstrip() for line in render_matrix(BenchResult.from_dict(document).matrices["h2d_gbps"],
                                                     {0: 0, 1: 1})]  # fmt: skip
    assert lines[0].startswith("h2d_gbps (GB/s, higher is better): 1 thread per cell, 1 stream, median of")
    assert lines[2].endswith("0.47") and lines[3].endswith("0.50") and lines[4].endswith("0.92-0.94"), lines


# ---------------------------------------------------------------- Ctrl-C

# The child snapshots its own placement, runs the command in-process until the test
# interrupts it, then reports what is left: every thread and its CPUs, its memory
# policy, the bound mappings in its numa_maps (the bench's buffers are mbind'ed).
# A joined thread can linger in /proc/self/task for a moment while the kernel reaps
# it, so the threads are read again until only the first ones remain (or 10 s pass:
# a thread still there then was never ended).
INTERRUPTED_CHILD = """
import json, os, signal, sys, time
# As at a terminal: a runner started in the background (nohup, `&` without job
# control) hands its children SIGINT ignored, and Python then raises no KeyboardInterrupt.
signal.signal(signal.SIGINT, signal.default_int_handler)
import numpy  # the bench imports it as it starts: its BLAS's threads, made then, are not the bench's
from numafast.cli import main
from sysfs_truth import numa_maps, thread_cpus_of_process, thread_policy
def state():
    return {"threads": {str(tid): cpus for tid, cpus in thread_cpus_of_process().items()}, "policy": thread_policy(),
            "bound": sorted(hex(a) for a, (policy, _) in numa_maps().items() if policy.startswith("bind"))}
before = state()
code = main(["bench", "--quick", "--repetitions", sys.argv[1]])
deadline = time.monotonic() + 10
while set(state()["threads"]) - set(before["threads"]) and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"code": code, "before": before, "after": state()}))
"""


@pytest.mark.host_only("one node shows the child's own cleanup as well (its buffers are mbind'ed there too); a child costs ~20 s under TCG")
def test_ctrl_c_frees_every_buffer_and_leaves_placement_as_it_was() -> None:
    # Enough repetitions that the run is still measuring when the signal comes (each
    # cell's loops run to their end first).
    child = subprocess.Popen([sys.executable, "-c", INTERRUPTED_CHILD, "100"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd=TESTS.parent, env=ENV)  # fmt: skip
    try:
        # Measuring has begun once the kernel shows a bound mapping (the first buffer).
        deadline = time.monotonic() + 240
        while "bind:" not in Path(f"/proc/{child.pid}/numa_maps").read_text():
            assert child.poll() is None and time.monotonic() < deadline, child.communicate()
            time.sleep(0.05)
        time.sleep(0.2)
        child.send_signal(signal.SIGINT)
        out, err = child.communicate(timeout=240)
    finally:
        child.kill()
    assert child.returncode == 0, err
    assert "Traceback" not in err and err.endswith("numafast bench: interrupted; every buffer was freed\n"), err
    report = json.loads(out.splitlines()[-1])
    assert report["code"] == 130
    assert report["after"] == report["before"] and report["after"]["bound"] == [], report


@pytest.mark.host_only("reads the package's sources")
def test_bench_modules_import_one_way() -> None:
    # Every import between the bench package's modules, at module level or inside a
    # function: the graph must have no cycle (gpu.py and measure.py imported each other).
    from import_graph import import_cycles

    assert import_cycles(Path(numafast.__file__).parent / "cli" / "bench", "numafast.cli.bench") == []


@pytest.mark.host_only("measures")
@pytest.mark.skipif(len(online_nodes()) > 1, reason="with one node there is no remote cell to compare")
def test_a_local_ratio_check_with_nothing_to_compare_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = bench_cli(capsys, "--quick", "--matrix", "read_gbps", "--expect-local-ratio", "3")
    assert code == 0 and "read_gbps" in out
    assert "numafast bench: --expect-local-ratio checked nothing: no row has both a local and a measured remote cell" in err
