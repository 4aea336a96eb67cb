"""First contact (issue 49): what a new user sees, run as that user would run it.

Each case is a script in a child process that is not privileged as root is: its
RLIMIT_MEMLOCK lowered to a user's usual 8 MiB (or another soft and hard limit)
and CAP_IPC_LOCK dropped (setpriv), so the kernel enforces the limit. The script
records every warning it gets, as a user running it would see them ("always"),
and prints them with where they point and what the kernel says is locked
(VmLck). Every batch is checked by content: sample i is an image filled with i
and the label i.

* Without a usable GPU, lock="auto" locks nothing and says nothing: a train and
  an eval loader run warning-free, and the kernel counts no locked byte.
* A loop that keeps its labels gets exactly one warning, at its own line, naming
  ``.clone()`` and nothing about limits.
* Where locking is asked for (lock="best-effort": what lock="auto" does where a
  GPU is usable), a limit too low warns exactly once, at the user's line, with the
  real shortfall and advice that works for this user: the advice is run, and the
  same script is then warning-free and locked.
* ``NumaLoader(dataset)`` and ``num_workers=0`` give one hint each, once.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")

from numafast import cuda  # noqa: E402

GPU = cuda.usable()

ROOT = Path(__file__).resolve().parent.parent
USER_LIMIT = 8 << 20  # KiB-exact: `ulimit -l` prints 8192
# As root, CAP_IPC_LOCK ignores RLIMIT_MEMLOCK: drop it, as a user (or a container) lacks it.
WITHOUT_IPC_LOCK = ("setpriv", "--inh-caps=-ipc_lock", "--bounding-set=-ipc_lock")

pytestmark = [
    pytest.mark.host_only("a worker-forking child per case: RLIMIT_MEMLOCK and warnings are not NUMA-specific"),
    pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux) to drop CAP_IPC_LOCK"),
    pytest.mark.skipif(
        resource.getrlimit(resource.RLIMIT_MEMLOCK)[1] < USER_LIMIT,
        reason=f"this process's hard RLIMIT_MEMLOCK is below {USER_LIMIT >> 10} KiB: a child cannot raise it",
    ),
]

# The user's script. Its lines that make a loader or ask for a batch end in a "# name"
# comment, so that a warning's line can be named; argv[1] picks the case.
SCRIPT = """\
import json, sys, warnings
import torch
from torch.utils.data import DataLoader, Dataset
import numafast.torch

class Tagged(Dataset):
    def __init__(self, count): self.count = count
    def __len__(self): return self.count
    def __getitem__(self, i): return torch.full((3, 32, 32), float(i)), i

def check(images, labels):
    assert torch.equal(images[:, 0, 0, 0], labels.float()), labels

case, lock = sys.argv[1], sys.argv[2]
train, evaluate = Tagged(640), Tagged(1280)
seen = []
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    if case == "train":
        for x, y in numafast.torch.NumaLoader(DataLoader(train, batch_size=64, num_workers=2), lock=lock):  # train
            check(x, y)
            seen += y.tolist()
    elif case in ("train-eval", "keep-labels"):
        train_loader = numafast.torch.NumaLoader(DataLoader(train, batch_size=64, shuffle=True, num_workers=2), lock=lock)
        eval_loader = numafast.torch.NumaLoader(DataLoader(evaluate, batch_size=64, num_workers=2), lock=lock)
        for epoch in range(2):
            for x, y in train_loader if case == "train-eval" else ():  # train
                check(x, y)
                seen += y.tolist()
            targets = []
            for x, y in eval_loader:  # eval
                check(x, y)
                targets.append(y if case == "keep-labels" else y.clone())
            del x, y
            seen += torch.cat(targets).tolist()
    elif case == "hints":
        for _ in range(2):
            for x, y in numafast.torch.NumaLoader(evaluate):  # dataset
                check(x, y)
                seen += y.tolist()
            for x, y in numafast.torch.NumaLoader(evaluate, batch_size=64):  # no-workers
                check(x, y)
                seen += y.tolist()
lines = open(__file__).read().splitlines()
def where(w):
    if w.filename != __file__:
        return w.filename
    return lines[w.lineno - 1].rsplit("# ", 1)[-1] if "# " in lines[w.lineno - 1] else f"line {w.lineno}"
print(json.dumps({
    "warnings": [[type(w.message).__name__, str(w.message), where(w)] for w in caught],
    "vmlck_kib": int(open("/proc/self/status").read().split("VmLck:")[1].split()[0]),
    "seen": sorted(seen),
}))
"""


def run_as_user(tmp_path: Path, case: str, *, lock: str = "auto", soft: int = USER_LIMIT, hard: int = USER_LIMIT,
                shell: str = "") -> dict[str, Any]:
    """SCRIPT's ``case`` without CAP_IPC_LOCK, with RLIMIT_MEMLOCK ``soft``/``hard`` set
    before it starts (prlimit), after the ``shell`` commands a user would type first."""
    script = tmp_path / "user_script.py"
    script.write_text(SCRIPT)
    command = f"{shell}\nexec {sys.executable} {script} {case} {lock}"
    result = subprocess.run(
        [*WITHOUT_IPC_LOCK, "prlimit", f"--memlock={soft}:{hard}", "bash", "-euc", command],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    outcome: dict[str, Any] = json.loads(result.stdout.splitlines()[-1])
    return outcome


FIRST_EXAMPLE_RUNNER = """\
import sys, warnings
source = open(sys.argv[1]).read()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    exec(compile(source, "README's first example", "exec"), {"__name__": "__main__"})
print("WARNINGS", [f"{w.category.__name__}: {w.message}" for w in caught])
print("VmLck", open("/proc/self/status").read().split("VmLck:")[1].split()[0])
"""


def every_sample_twice(count_train: int, count_eval: int) -> list[int]:
    return sorted([*range(count_train), *range(count_eval)] * 2)


def test_without_a_gpu_a_train_and_an_eval_loader_lock_nothing_and_say_nothing(tmp_path: Path) -> None:
    """The first user's script (issue 49): on old code the eval loader's pool went past
    8 MiB with the train loader's and warned, advising `ulimit -l unlimited`."""
    if GPU:
        pytest.skip("this machine has a usable GPU: lock='auto' locks here (see the GPU test below)")
    outcome = run_as_user(tmp_path, "train-eval")
    assert outcome["seen"] == every_sample_twice(640, 1280)
    assert outcome["warnings"] == []
    assert outcome["vmlck_kib"] == 0  # the kernel's count: nothing page-locked


def test_without_a_gpu_the_readmes_first_example_runs_warning_free_for_a_user(tmp_path: Path) -> None:
    """The first Python block of README.md, as a user with the usual 8 MiB limit runs it."""
    if GPU:
        pytest.skip("this machine has a usable GPU: lock='auto' locks here")
    from test_readme import BLOCKS

    first = next(block for block in BLOCKS if block.language == "python")
    (tmp_path / "example.py").write_text(first.source)
    (tmp_path / "runner.py").write_text(FIRST_EXAMPLE_RUNNER)
    result = subprocess.run(
        [*WITHOUT_IPC_LOCK, "prlimit", f"--memlock={USER_LIMIT}:{USER_LIMIT}", sys.executable, "runner.py", "example.py"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    # The first batches, in flight before the owner copied the first in and made the pool
    # (at most prefetch_factor x num_workers), are copied; every later one lands.
    pinned = re.fullmatch(r"8 of 8 batches pinned in 1 pool, (\d+) collated there by the workers", lines[0])
    assert pinned and 8 - 2 * 2 <= int(pinned[1]) < 8, result.stdout
    assert lines[1:] == ["WARNINGS []", "VmLck 0"], result.stdout


@pytest.mark.parametrize("lock", ["auto", "best-effort"])  # without a GPU: nothing locked; or locked, as with one
def test_a_loop_that_keeps_its_labels_warns_once_at_its_line_naming_clone(tmp_path: Path, lock: str) -> None:
    """An eval loop that keeps every batch's labels: pools are added for them, and with
    locking those past 8 MiB are not locked; the one warning names the cause and its
    fix (.clone()), not the limit (old code: a MemlockWarning first, "1 earlier
    batches", sizes in bytes)."""
    outcome = run_as_user(tmp_path, "keep-labels", lock=lock)
    assert outcome["seen"] == sorted([*range(1280)] * 2)
    [(category, message, where)] = outcome["warnings"]
    assert (category, where) == ("RuntimeWarning", "eval"), outcome["warnings"]
    assert ".clone()" in message and "y.to(device)" in message
    kept = re.search(r"keeps tensors of earlier batches \((\d+) (batch|batches) so far", message)
    assert kept and (kept[1] == "1") == (kept[2] == "batch"), message  # no "1 earlier batches"
    assert re.search(r"whole slot \(\d+\.\d MiB\).*max_pinned_bytes \(\d+\.\d GiB\)", message), message  # sizes read as people read them
    assert not any(word in message for word in ("ulimit", "RLIMIT", "memlock", "page-lock")), message
    assert (outcome["vmlck_kib"] > 0) == (lock != "auto" or GPU)


def test_a_limit_past_the_hard_one_warns_once_at_the_users_line_with_the_real_shortfall(tmp_path: Path) -> None:
    """Locking asked for, soft = hard = 8 MiB: the train loader's pool is locked, the eval
    loader's is not. The shortfall is the eval pool's size less the room left; the advice
    is the one that needs root, since `ulimit -l unlimited` fails for this user."""
    outcome = run_as_user(tmp_path, "train-eval", lock="best-effort")
    assert outcome["seen"] == every_sample_twice(640, 1280)
    [(category, message, where)] = outcome["warnings"]
    assert (category, where) == ("MemlockWarning", "eval"), outcome["warnings"]
    locked_kib = outcome["vmlck_kib"]  # the train loader's pool, the one locked
    pool = message.split("page-locking the ")[1].split(" pool")[0]
    assert pool.endswith(" MiB") and locked_kib > 0, message
    short = int(message.split(" KiB short")[0].rsplit(" ", 1)[1])
    pool_kib = short + USER_LIMIT // 1024 - locked_kib
    assert abs(pool_kib / 1024 - float(pool.split()[0])) < 0.06, (pool, short, locked_kib)  # the real shortfall
    assert "only root or an administrator can raise" in message and "limits.conf" in message
    assert "ulimit -S -l" not in message and "lock='off'" in message
    refused = subprocess.run([*WITHOUT_IPC_LOCK, "prlimit", f"--memlock={USER_LIMIT}:{USER_LIMIT}", "bash", "-c",
                              "ulimit -l unlimited"], capture_output=True, text=True)  # fmt: skip
    assert refused.returncode != 0, "this user could raise the limit: the advice above would be wrong"


def test_a_soft_limit_below_the_hard_one_gets_the_advice_that_needs_no_privileges_and_it_works(tmp_path: Path) -> None:
    """Soft 4 MiB, hard 8 MiB, one loader whose pool needs 6 MiB: raising the soft limit
    is the fix, and any user may; the advice, run first, makes the same script lock
    its pool and say nothing."""
    soft = 4 << 20
    outcome = run_as_user(tmp_path, "train", lock="best-effort", soft=soft)
    assert outcome["seen"] == sorted(range(640))
    [(category, message, where)] = outcome["warnings"]
    assert (category, where) == ("MemlockWarning", "train"), outcome["warnings"]
    assert "needs no privileges up to the hard limit" in message and "root" not in message, message
    advice = message.split("`")[1]
    assert advice == f"ulimit -S -l {USER_LIMIT // 1024}", message
    assert outcome["vmlck_kib"] == 0  # nothing half-locked
    after = run_as_user(tmp_path, "train", lock="best-effort", soft=soft, shell=advice)
    assert after["warnings"] == [] and after["vmlck_kib"] > 0, after  # advice taken: locked, nothing said


def test_a_dataset_without_batch_size_and_no_workers_each_hint_once_at_the_users_line(tmp_path: Path) -> None:
    outcome = run_as_user(tmp_path, "hints")
    assert outcome["seen"] == sorted([*range(1280)] * 4)
    hints = outcome["warnings"]
    assert [(category, where) for category, _, where in hints] == [("LoaderHint", "dataset"), ("LoaderHint", "no-workers")]
    batch_hint, workers_hint = (message for _, message, _ in hints)
    assert "batches of 1 sample" in batch_hint and "no worker processes" in batch_hint and "batch_size=" in batch_hint
    assert "num_workers=0" in workers_hint and "num_workers=2 or more" in workers_hint


@pytest.mark.skipif(not GPU, reason="needs a usable CUDA GPU: lock='auto' locks only there")
def test_on_a_gpu_lock_auto_locks_and_a_limit_too_low_warns_once_at_the_users_line(tmp_path: Path) -> None:
    outcome = run_as_user(tmp_path, "train-eval", soft=USER_LIMIT)
    assert outcome["seen"] == every_sample_twice(640, 1280)
    [(category, message, where)] = outcome["warnings"]
    assert (category, where) == ("MemlockWarning", "eval"), outcome["warnings"]
    assert " KiB short" in message and "only root or an administrator" in message
