"""Run PyTorch's own DataLoader tests (its ``test/test_dataloader.py``) against NumaLoader.

With ``--numafast``, every Python process of the run (pytest, the test file's spawned
processes, the ``python -c`` subprocesses some tests start) finds
``torch.utils.data.DataLoader`` and ``torch.utils.data.dataloader.DataLoader`` replaced,
before anything imports them, by a NumaLoader(node=0) subclass taking DataLoader's
arguments: a ``sitecustomize`` module in a temporary folder put first on PYTHONPATH.
Without it, the same pytest command runs the file stock, for the comparison.

The test file is not in this repository: take it from PyTorch's sources at the installed
version (``git show v<version>:test/test_dataloader.py``). It needs ``expecttest``
(``torch.testing._internal``); ``pytest-timeout``, where installed, bounds each test.
Install them outside the environment, e.g. ``pip install --target DIR expecttest
pytest-timeout`` (then remove the pytest that comes along from DIR) and put DIR on
PYTHONPATH::

    export PYTHONPATH=DIR TMPDIR=/tmp/suite    # a local disk: workers' shared memory files
    nice -n 10 python3 bench/torch_suite.py DIR2/test_dataloader.py --stock -- -k TestDataLoader
    nice -n 10 python3 bench/torch_suite.py DIR2/test_dataloader.py --numafast -- -k TestDataLoader

``test_proper_exit`` (worker lifecycle: loader and worker errors, a killed loader)
is a slowTest: it runs only with ``PYTORCH_TEST_WITH_SLOW=1`` in the environment.
Arguments after ``--`` go to pytest. The whole run is killed (its process group) after
``--timeout`` seconds; each test after ``--test-timeout`` where pytest-timeout is there.
The exit status is pytest's, or 124 after the timeout.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Imported by every interpreter of the run, before site-packages' own code runs.
SITECUSTOMIZE = '''\
"""numafast's torch_suite: DataLoader is NumaLoader(node=0) in this process."""
from typing import Any, TypeVar

import torch.utils.data
import torch.utils.data.dataloader

from numafast.torch import NumaLoader

T_co = TypeVar("T_co", covariant=True)


class DataLoader(NumaLoader[T_co]):
    """NumaLoader on node 0 over the arguments given to DataLoader."""

    def __init__(self, dataset: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(dataset, *args, node=0, **kwargs)


torch.utils.data.DataLoader = DataLoader
torch.utils.data.dataloader.DataLoader = DataLoader
'''


def pytest_command(test_file: Path, test_timeout: int, extra: list[str]) -> list[str]:
    """pytest over ``test_file``, quiet, without a cache in PyTorch's folder."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfEs", str(test_file)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command += ["--timeout", str(test_timeout)]
    return command + extra


def run(command: list[str], env: dict[str, str], cwd: Path, timeout: float) -> int:
    """``command``'s exit status; after ``timeout`` seconds its whole process group is
    killed (workers and spawned processes included) and 124 returned."""
    process = subprocess.Popen(command, env=env, cwd=cwd, start_new_session=True)
    try:
        return process.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        print(f"torch_suite: killed after {timeout:.0f} s", file=sys.stderr)
        return 124


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog="Arguments after -- go to pytest.")
    parser.add_argument("test_file", type=Path, help="PyTorch's test/test_dataloader.py")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--stock", action="store_true", help="torch's own DataLoader")
    mode.add_argument("--numafast", action="store_true", help="DataLoader replaced by NumaLoader(node=0)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds for the whole run")
    parser.add_argument("--test-timeout", type=int, default=300, help="seconds per test (with pytest-timeout)")
    ours, pytest_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    args = parser.parse_args(ours)
    test_file = args.test_file.resolve()
    if not test_file.is_file():
        parser.error(f"{test_file} is not a file")
    if args.timeout <= 0 or args.test_timeout <= 0:
        parser.error("--timeout and --test-timeout take a positive number of seconds")
    with tempfile.TemporaryDirectory(prefix="torch_suite_") as folder:
        paths = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        if args.numafast:
            Path(folder, "sitecustomize.py").write_text(SITECUSTOMIZE)
            paths.insert(0, folder)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
        command = pytest_command(test_file, args.test_timeout, pytest_args)
        return run(command, env, test_file.parent, args.timeout)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
