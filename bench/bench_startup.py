"""How long a process that only places itself takes to start: ``import numafast`` and
``numafast run -- true`` (a launcher's wrapper of each rank), each a new interpreter,
against the same interpreter importing what ``import numafast`` loaded until it left
NumPy, memory, pages, pools and the bench's measuring for their first use (the
baseline, measured in the same run), and against a bare interpreter (the floor).

``python3 -m pytest bench/bench_startup.py``
"""

from __future__ import annotations

import subprocess
import sys

from bench_pool import record, table  # noqa: F401 - table is the report fixture

TITLE = "starting a process that places itself"
GROUP = "a new interpreter, start to exit"
EVERYTHING = "import numafast, numafast.memory, numafast.pages, numafast.pool, numafast.cli.bench.measure"


def record_start(benchmark, table, case: str, *arguments: str) -> None:  # type: ignore[no-untyped-def]
    """Time a new interpreter run with ``arguments``, start to exit, as ``case``."""
    def start() -> None:
        subprocess.run([sys.executable, *arguments], check=True, stdout=subprocess.DEVNULL)

    record(benchmark, table, GROUP, case, start, unit="us/op", scale=lambda seconds: seconds * 1e6)


def test_everything_eagerly(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    record_start(benchmark, table, "import numafast and all it loaded before (baseline)", "-c", EVERYTHING)


def test_import_numafast(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    record_start(benchmark, table, "import numafast", "-c", "import numafast")


def test_numafast_run(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    record_start(benchmark, table, "numafast run -- true", "-m", "numafast", "run", "--", "true")


def test_bare_interpreter(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    record_start(benchmark, table, "python -c pass (the floor)", "-c", "pass")
