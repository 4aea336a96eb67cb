"""bench/gpu_proof.py, the one command that proves the GPU paths, as CI runs it: on a
machine without a GPU it runs what needs none (the machine's description, the CUDA
tests, which skip, and the README's gpu blocks, which skip) and says of every GPU
row that it was skipped and why. On a GPU machine the proof is run whole by
bench/gpu-proof.sh, not from here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

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
