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


def started(*arguments: str) -> None:
    subprocess.run([sys.executable, *arguments], check=True, stdout=subprocess.DEVNULL)


def test_everything_eagerly(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    record(benchmark, table, GROUP, "import numafast and all it loaded before (baseline)",
           lambda: started("-c", EVERYTHING), unit="us/op", scale=lambda seconds: seconds * 1e6)  # fmt: skip


def test_import_numafast(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    record(benchmark, table, GROUP, "import numafast", lambda: started("-c", "import numafast"), unit="us/op",
           scale=lambda seconds: seconds * 1e6)  # fmt: skip


def test_numafast_run(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    record(benchmark, table, GROUP, "numafast run -- true", lambda: started("-m", "numafast", "run", "--", "true"),
           unit="us/op", scale=lambda seconds: seconds * 1e6)  # fmt: skip


def test_bare_interpreter(benchmark, table) -> None:  # type: ignore[no-untyped-def]
    record(benchmark, table, GROUP, "python -c pass (the floor)", lambda: started("-c", "pass"), unit="us/op",
           scale=lambda seconds: seconds * 1e6)  # fmt: skip
