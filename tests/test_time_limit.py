"""A test that hangs fails, saying where it waits, and the run goes on
(tests/time_limit.py); one that cannot be interrupted ends the run, saying where."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from time_limit import LIMIT_S

pytestmark = pytest.mark.host_only("pytest runs of their own: nothing the kernel's nodes change")

TESTS = Path(__file__).resolve().parent

HANGS = '''
import multiprocessing

def test_waits_on_a_lock_a_dead_process_held():
    lock = multiprocessing.Lock()  # as torch's shutdown waited, on a lock a killed worker held
    lock.acquire()
    lock.acquire()

def test_after_it():
    pass
'''

SWALLOWS = '''
import multiprocessing

def test_swallows_every_interruption():
    lock = multiprocessing.Lock()
    lock.acquire()
    while True:
        try:
            lock.acquire()
        except BaseException:
            pass

def test_never_reached():
    pass
'''


def run_with_limit(tmp_path: Path, source: str, limit_s: int) -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_it.py").write_text(source)
    env = {**os.environ, "NUMAFAST_TEST_LIMIT_S": str(limit_s), "PYTHONPATH": str(TESTS)}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "time_limit",
                           "test_it.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip


def test_every_test_of_this_suite_runs_under_the_limit() -> None:
    remaining, _interval = signal.getitimer(signal.ITIMER_REAL)
    assert 0 < remaining <= LIMIT_S


def test_a_test_past_its_limit_fails_with_its_stack_and_the_run_goes_on(tmp_path: Path) -> None:
    result = run_with_limit(tmp_path, HANGS, 2)
    out = result.stdout + result.stderr
    assert result.returncode == 1, out
    assert "1 failed, 1 passed" in out, out
    assert "ran past its 2 s limit (NUMAFAST_TEST_LIMIT_S)" in out, out
    assert 'test_it.py", line 7 in test_waits_on_a_lock_a_dead_process_held' in out, out  # where it waited


def test_a_test_that_swallows_the_interruption_ends_the_run_saying_where(tmp_path: Path) -> None:
    result = run_with_limit(tmp_path, SWALLOWS, 1)
    out = result.stdout + result.stderr
    assert result.returncode != 0 and "passed" not in out, out
    assert "Timeout (0:00:02)!" in out, out  # the limit and as long again (at most 60 s)
    assert 'test_it.py", line 9 in test_swallows_every_interruption' in out, out
