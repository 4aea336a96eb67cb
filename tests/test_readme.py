"""README.md is a contract: every ```python and ```bash block runs as written.

A fence may carry tags after the language (```python gpu):

* ``gpu``: needs a CUDA GPU; skipped, saying so, where PyTorch sees none.
* ``slurm``: needs a SLURM cluster (``srun``); skipped without one.
* ``host``: slow under the guests' TCG emulation (a framework's run, the bench, a
  block of CLI commands at ~12 s each); run on the host only.

Bash blocks run on the host and in the 4-node guest, not in the memory-only guest:
they are numafast commands, each a fresh interpreter (~12 s under TCG), which the
CLI tests already run there against the CPU-less node; the Python blocks (placement
onto that node) run in every guest.
* ``ci``: installs, builds the wheel, boots a guest or is the test suite itself: not
  run here (it would change the machine or recurse) but by CI, as a phase of
  ``.ci/run``; checked here by finding each command in the CI scripts, but for the
  shell's own set-up (``.``/``source`` of a venv's activate, ``cd``, ``export``),
  which runs nothing.

``NUMAFAST_README_ONLY=gpu`` runs only the blocks with that tag (the GPU proof,
bench/gpu_proof.py, runs the ``gpu`` blocks so on a GPU machine);
``NUMAFAST_README_SKIP=host`` skips the blocks with that tag (.ci/pythons: the
other interpreters' runs would repeat the bench and framework runs of the host's).

Python blocks run in one process (torch is imported once: ~30 s in a guest), each in
a namespace of its own, so a block must import and define what it uses. A Python
block may raise a warning only on a line that says it ``warns``. Bash blocks
run one by one with ``bash -euo pipefail``; ``numafast`` there is this checkout's.
Both run in an empty directory where ``tests`` links to the checkout's.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

from sysfs_truth import cpuless_nodes_with_memory

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
README = REPO / "README.md"
IN_GUEST = os.environ.get("NUMAFAST_GUEST") == "1"
TAGS = {"gpu", "slurm", "host", "ci"}
ONLY = os.environ.get("NUMAFAST_README_ONLY")
SKIP = os.environ.get("NUMAFAST_README_SKIP")
# Where CI runs the commands of the blocks tagged ci.
CI_SCRIPTS = [*sorted((REPO / ".ci").glob("*")), TESTS / "run_suite.py"]
# A block that imports torch or numafast.torch (which imports torch).
NEEDS_TORCH = re.compile(r"^\s*(?:import|from)\s[^\n]*\btorch\b", re.MULTILINE)
# The training frameworks of the `frameworks` extra, each by its top-level module.
FRAMEWORKS = ("lightning", "accelerate", "transformers", "ray")
IMPORTED = re.compile(r"^\s*(?:import|from)\s+(\w+)", re.MULTILINE)
# Shell builtins that only set the shell up (a virtual environment's activate script, a
# directory, a variable): nothing CI must run.
SHELL_SETUP = {".", "source", "cd", "export"}
FENCE = re.compile(r"^```(\w+)((?: [\w-]+)*)\n(.*?)^```$", re.DOTALL | re.MULTILINE)

pytestmark = pytest.mark.skipif(not README.exists(), reason="needs the source tree's README.md")


@dataclass(frozen=True)
class Block:
    language: str
    tags: frozenset[str]
    line: int
    source: str

    @property
    def name(self) -> str:
        return f"README.md:{self.line}"


def blocks() -> list[Block]:
    if not README.exists():
        return []
    text = README.read_text()
    found = []
    for match in FENCE.finditer(text):
        language, tags = match[1], frozenset(match[2].split())
        if language in ("python", "bash"):
            line = text.count("\n", 0, match.start()) + 1
            found.append(Block(language, tags, line, match[3]))
    return found


BLOCKS = blocks()


@cache
def gpu_problem() -> str | None:
    """Why this machine cannot run a GPU block; None when it can."""
    from numafast.cli.bench import gpu
    from numafast.cli.bench.measure import live_topology

    return gpu.unavailable(live_topology())


def skip_reason(block: Block) -> str | None:
    if ONLY is not None and ONLY not in block.tags:
        return f"{block.name} is not tagged {ONLY} (NUMAFAST_README_ONLY={ONLY})"
    if SKIP is not None and SKIP in block.tags:
        return f"{block.name} is tagged {SKIP} (NUMAFAST_README_SKIP={SKIP})"
    if "ci" in block.tags:
        return None  # checked against the CI scripts, never run here
    if "gpu" in block.tags and (problem := gpu_problem()) is not None:
        return f"{block.name} needs a GPU: {problem}"
    if "slurm" in block.tags and shutil.which("srun") is None:
        return f"{block.name} needs a SLURM cluster (no srun here)"
    if "host" in block.tags and IN_GUEST:
        return f"{block.name} is slow under TCG emulation: run on the host only"
    if block.language == "bash" and IN_GUEST and cpuless_nodes_with_memory():
        return (f"{block.name}: shell blocks run on the host and in the 4-node guest; here they would cost minutes of "
                "TCG, and the CLI tests run the commands against the CPU-less node")
    missing = [name for name in FRAMEWORKS if name in IMPORTED.findall(block.source) and not importlib.util.find_spec(name)]
    if block.language == "python" and missing:
        return f"{block.name} needs {', '.join(missing)} (pip install numafast[frameworks]); this Python has none"
    if block.language == "python" and NEEDS_TORCH.search(block.source):
        try:
            import torch  # noqa: F401
        except ImportError:
            return f"{block.name} needs PyTorch (pip install numafast[torch]); this Python has none"
    return None


def workdir(tmp_path: Path) -> Path:
    """An empty directory with ``tests`` linked to the checkout's, and a ``numafast``
    command that runs this checkout (not whichever numafast is installed)."""
    (tmp_path / "tests").symlink_to(TESTS)
    bin_dir = tmp_path / ".bin"
    bin_dir.mkdir()
    shim = bin_dir / "numafast"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m numafast "$@"\n')
    shim.chmod(0o755)
    return bin_dir


def environment(bin_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}",
    }


RUNNER = r"""
import json, sys, traceback, warnings
results, warned = {}, {}
for name, source in json.load(open(sys.argv[1])):
    with warnings.catch_warnings(record=True) as caught:
        # What a reader running the block as a script sees, every time: Python's default
        # filters (deprecations shown only where the script itself calls), but "always".
        warnings.simplefilter("always")
        for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
            warnings.filterwarnings("ignore", category=category)
        warnings.filterwarnings("always", category=DeprecationWarning, module="__readme__")
        try:
            exec(compile(source, name, "exec"), {"__name__": "__readme__"})
        except BaseException:
            results[name] = traceback.format_exc()
        else:
            results[name] = None
    warned[name] = [[w.filename, w.lineno, f"{w.category.__name__}: {w.message}"] for w in caught]
    print(f"{name}: {'failed' if results[name] else 'ok'}", file=sys.stderr, flush=True)
json.dump(results, open(sys.argv[2], "w"))
json.dump(warned, open(sys.argv[3], "w"))
"""


@pytest.fixture(scope="module")
def python_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, str | None], dict[str, list[list[object]]]]:
    """Every runnable Python block, run in one process: ({name: traceback or None},
    {name: the warnings it raised, as [file, line, "Category: message"]})."""
    tmp_path = tmp_path_factory.mktemp("readme")
    bin_dir = workdir(tmp_path)
    runnable = [(b.name, b.source) for b in BLOCKS if b.language == "python" and skip_reason(b) is None and "ci" not in b.tags]
    (tmp_path / "blocks.json").write_text(json.dumps(runnable))
    (tmp_path / "runner.py").write_text(RUNNER)
    result = subprocess.run(
        [sys.executable, "runner.py", "blocks.json", "results.json", "warnings.json"],
        cwd=tmp_path, env=environment(bin_dir), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0 and (tmp_path / "results.json").exists(), result.stderr
    results: dict[str, str | None] = json.loads((tmp_path / "results.json").read_text())
    warned: dict[str, list[list[object]]] = json.loads((tmp_path / "warnings.json").read_text())
    return results, warned


@pytest.fixture(scope="module")
def python_results(python_run: tuple[dict[str, str | None], dict[str, list[list[object]]]]) -> dict[str, str | None]:
    return python_run[0]


def test_readme_has_blocks_and_known_tags() -> None:
    assert {b.language for b in BLOCKS} == {"python", "bash"}
    for block in BLOCKS:
        assert block.tags <= TAGS, f"{block.name}: unknown tags {sorted(block.tags - TAGS)} (known: {sorted(TAGS)})"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "python" and "ci" not in b.tags], ids=lambda b: b.name)
def test_python_block_runs_as_written(block: Block, python_results: dict[str, str | None]) -> None:
    if (reason := skip_reason(block)) is not None:
        pytest.skip(reason)
    assert python_results[block.name] is None, f"{block.name} failed:\n{python_results[block.name]}"


# torch's advice when a loader has more workers than CPUs to run them. A NumaLoader forks
# its workers bound to its node, and torch counts that node's CPUs: one in each node of
# the guests (tests/numa_vm.py), so there every example with two workers draws it.
TORCH_WORKER_ADVICE = "suggested max number of worker"


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "python" and "ci" not in b.tags], ids=lambda b: b.name)
def test_python_block_warns_only_where_it_says(
    block: Block, python_run: tuple[dict[str, str | None], dict[str, list[list[object]]]]
) -> None:
    """A reader who runs an example sees no warning it does not announce: each warning
    must point at a line of the block that says "warns" (numafast's own warnings point
    at the caller), never into numafast or torch (torch's "suggested max number of
    worker" warning points into its dataloader.py: fewer workers, then). The training
    frameworks' notices about their own APIs (Lightning, Ray) are theirs, not the
    example's, and are left out."""
    if (reason := skip_reason(block)) is not None:
        pytest.skip(reason)
    lines = block.source.splitlines()
    unannounced = [
        f"{where}:{line}: {message}" for where, line, message in python_run[1][block.name]
        if not (where == block.name and isinstance(line, int) and 0 < line <= len(lines) and "warns" in lines[line - 1])
        and not any(f"/{name}/" in str(where) for name in FRAMEWORKS)
        and not (IN_GUEST and TORCH_WORKER_ADVICE in message)
    ]  # fmt: skip
    assert not unannounced, f"{block.name} warns where it does not say so:\n" + "\n".join(unannounced)


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.language == "bash" and "ci" not in b.tags], ids=lambda b: b.name)
def test_bash_block_runs_as_written(block: Block, tmp_path: Path) -> None:
    if (reason := skip_reason(block)) is not None:
        pytest.skip(reason)
    bin_dir = workdir(tmp_path)
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block.source],
        cwd=tmp_path, env=environment(bin_dir), capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, f"{block.name} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}"


@pytest.mark.host_only("reads files")
@pytest.mark.parametrize("block", [b for b in BLOCKS if "ci" in b.tags], ids=lambda b: b.name)
def test_ci_block_commands_are_run_by_ci(block: Block) -> None:
    if ONLY is not None and ONLY not in block.tags:
        pytest.skip(f"{block.name} is not tagged {ONLY} (NUMAFAST_README_ONLY={ONLY})")
    scripts = "\n".join(path.read_text() for path in CI_SCRIPTS if path.is_file())
    for line in block.source.splitlines():
        command = line.split("#", 1)[0].strip()
        for part in filter(None, (p.strip() for p in command.split("&&"))):
            words = part.split()
            if words[0] in SHELL_SETUP:
                continue
            # A script by its name (tests/numa_vm.py: run_suite.py boots guests with it),
            # else the program and its first argument ("pip install", "python3 -m").
            script = next((Path(w).stem for w in words[:2] if w.endswith((".py", ".sh")) or w.startswith(".ci/")), None)
            program = script or " ".join(words[:2])
            assert program in scripts, f"{block.name}: {part!r} is not run by CI ({', '.join(p.name for p in CI_SCRIPTS)})"
