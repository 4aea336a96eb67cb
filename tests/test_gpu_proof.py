"""bench/gpu_proof.py, the one command that proves the GPU paths, as CI runs it: on a
machine without a GPU it runs what needs none (the machine's description, the CUDA
tests, which skip, and the README's gpu blocks, which skip) and says of every GPU
row that it was skipped and why. On a GPU machine the proof is run whole by
bench/gpu-proof.sh, not from here."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parent.parent
GPU_ROWS = ["H2D / D2H GB/s", "register 1 GiB, s", "end to end, samples/s", "CUDA contexts of this process"]


@pytest.mark.host_only("runs a nested pytest; nothing kernel-specific")
@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the proof runs whole: bash bench/gpu-proof.sh")
def test_without_a_gpu_the_proof_runs_what_needs_none_and_skips_each_gpu_row_saying_why(tmp_path: Path) -> None:
    report = tmp_path / "proof.json"
    environment = {**os.environ, "PYTHONPATH": str(REPO)}  # this checkout's numafast, as the other tests use
    done = subprocess.run([sys.executable, str(REPO / "bench/gpu_proof.py"), "--json", str(report)],
                          capture_output=True, text=True, timeout=600, env=environment)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {row["name"]: row for row in json.loads(report.read_text())["rows"]}
    assert list(rows) == ["machine", "CUDA tests and README gpu blocks", *GPU_ROWS]
    assert rows["machine"]["values"]["nodes"] and rows["machine"]["values"]["torch"] == torch.__version__
    tests = rows["CUDA tests and README gpu blocks"]
    assert tests["status"] == "passed" and tests["values"]["counts"]["passed"] > 0
    assert tests["values"]["counts"]["skipped"] > 0  # the CUDA tests and gpu blocks, each with its reason
    for name in GPU_ROWS:
        assert rows[name]["status"] == "skipped" and rows[name]["detail"].startswith("needs a CUDA GPU: "), rows[name]
        assert name in done.stdout  # the table, on stdout
    assert done.stdout.startswith("/sys/devices/system/node: ")  # what the topology is read from, first
    assert rows["machine"]["values"]["sysfs"]["/sys/devices/system/node"]


def gpu_proof() -> Any:
    spec = importlib.util.spec_from_file_location("gpu_proof", REPO / "bench/gpu_proof.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_proof", module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.host_only("runs a nested pytest; nothing kernel-specific")
def test_where_torch_sees_a_gpu_a_test_file_whose_tests_all_skip_fails(tmp_path: Path) -> None:
    (tmp_path / "test_skipping.py").write_text(
        "import pytest\n\n@pytest.mark.skip(reason='no gpu in its sysfs')\ndef test_gpu_block():\n    pass\n"
    )
    proof = gpu_proof()
    counts, why = proof.test_file(str(tmp_path), "test_skipping.py", gpu=True)
    assert counts == {"skipped": 1} and why == "test_skipping.py: every test skipped while torch sees a GPU"
    assert proof.test_file(str(tmp_path), "test_skipping.py", gpu=False) == ({"skipped": 1}, "")


@pytest.mark.host_only("processes only")
def test_a_command_past_its_timeout_is_killed_with_its_whole_process_group(tmp_path: Path) -> None:
    pids = tmp_path / "child.pid"
    command = [sys.executable, "-c", f"import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', "
               f"'import time; time.sleep(600)']); open({str(pids)!r}, 'w').write(str(child.pid)); time.sleep(600)"]
    with pytest.raises(subprocess.TimeoutExpired):
        gpu_proof().run_group(command, 5)
    child = int(pids.read_text())
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
        assert time.monotonic() < deadline, "the grandchild outlived the timeout"
        time.sleep(0.05)
