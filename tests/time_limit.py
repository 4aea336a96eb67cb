"""Every test ends: one that runs past its time limit fails, saying where it waits, and
the run goes on.

A hang used to cost a whole CI run (a torch shutdown waiting forever on a lock a killed
worker held). Now, past ``NUMAFAST_TEST_LIMIT_S`` (600 s on a host, 1200 s in a guest,
where TCG is slow), SIGALRM prints what each child process waits in and every thread's
stack, then fails the test where it waits. Python runs the handler in the main thread
between two bytecodes, and a blocking wait made through Python (a multiprocessing lock,
``time.sleep``, a queue, a join) is cut short by the signal. A wait that no signal ends (a
C loop that retries on EINTR without looking at Python's signals) is ended 60 s later by
faulthandler, which prints the stacks again, to the run's own stderr (pytest captures fd 2
during a test), and exits the run: a failure that says where. A child process a test
forks does not inherit the timer. ``NUMAFAST_TEST_LIMIT_S=0`` turns the limit off.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from collections.abc import Generator
from contextlib import nullcontext
from pathlib import Path
from types import FrameType

import pytest

IN_GUEST = os.environ.get("NUMAFAST_GUEST") == "1"  # inside a guest tests/run_suite.py booted
LIMIT_S = float(os.environ.get("NUMAFAST_TEST_LIMIT_S", "1200" if IN_GUEST else "600"))
HARD_EXIT_AFTER_S = min(60.0, LIMIT_S)  # past the limit, for a wait the signal did not end
_run_stderr: list[int] = []  # a copy of fd 2 as it was before pytest captured it


def pytest_configure(config: pytest.Config) -> None:
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else nullcontext():
        _run_stderr.append(os.dup(2))


def children() -> list[int]:
    """This process's child processes (those of each of its threads)."""
    pids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        try:
            pids.extend(int(pid) for pid in (task / "children").read_text().split())
        except OSError:
            pass
    return pids


def where_children_wait() -> str:
    """One line per child process: its name, state and kernel wait channel."""
    lines = []
    for pid in children():
        proc = Path(f"/proc/{pid}")
        try:
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
            lines.append(f"child {pid} ({(proc / 'comm').read_text().strip()}): state {state}, "
                         f"waiting in {(proc / 'wchan').read_text() or '-'}")
        except OSError:
            pass
    return "\n".join(lines) or "no child processes"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Generator[None, None, None]:
    if LIMIT_S <= 0 or not hasattr(signal, "setitimer"):
        yield
        return

    def past_limit(signum: int, frame: FrameType | None) -> None:
        sys.stderr.write(f"\n==== {item.nodeid} ran past its {LIMIT_S:g} s limit\n{where_children_wait()}\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        pytest.fail(f"ran past its {LIMIT_S:g} s limit (NUMAFAST_TEST_LIMIT_S); every thread's stack is in its "
                    "captured stderr", pytrace=False)

    previous = signal.signal(signal.SIGALRM, past_limit)
    signal.setitimer(signal.ITIMER_REAL, LIMIT_S)
    faulthandler.dump_traceback_later(LIMIT_S + HARD_EXIT_AFTER_S, exit=True, file=_run_stderr[0])
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        signal.signal(signal.SIGALRM, previous)
