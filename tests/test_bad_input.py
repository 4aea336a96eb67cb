"""Every bad input to a public call gets a clear answer: numafast's own exception (a
subclass of the matching builtin), naming the value and what is allowed, never a
crash or a generic error from deep inside NumPy or the standard library.

The calls run in a child process (one for all of them: the extension is among the
callees, and a crash must fail the test, not end the run). NumPy integers are
integers everywhere; the cases marked ``None`` must succeed.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sysfs_truth import online_nodes

TESTS = Path(__file__).resolve().parent
DGX = TESTS / "fixtures" / "dgx-h100"
NODE = online_nodes()[0]
CPU = min(os.sched_getaffinity(0))

# (call, exception class or None for success, fragments its message must hold)
CASES: list[tuple[str, str | None, tuple[str, ...]]] = [
    # node arguments: one id or a list; NumPy integers are ids
    (f"numafast.membind({NODE})", None, ()),
    (f"numafast.interleave(np.int64({NODE}))", None, ()),
    (f"numafast.cpubind(nodes={NODE})", None, ()),
    (f"numafast.numa_local(np.int32({NODE}))", None, ()),
    (f"numafast.empty(4096, 'uint8', nodes=[np.int64({NODE})])", None, ()),
    (f"numafast.mbind(numafast.empty(8192, 'uint8'), np.int64({NODE}))", None, ()),
    ("numafast.membind('0')", "InvalidNodeError", ("nodes '0' is a string", "nodes here: ")),
    ("numafast.membind(None)", "InvalidNodeError", ("nodes None is neither an integer nor a list", "nodes here: ")),
    ("numafast.interleave(1.5)", "InvalidNodeError", ("1.5", "nodes here: ")),
    ("numafast.numa_local(True)", "InvalidNodeError", ("node True is not an integer node id", "nodes here: ")),
    ("numafast.numa_local(np.float64(0))", "InvalidNodeError", ("0.0", "is not an integer node id", "nodes here: ")),
    ("numafast.preferred(4095)", "InvalidNodeError", ("node 4095 does not exist", "nodes here: ")),
    ("numafast.numa_local([0, 1])", "InvalidNodeError",
     ("node [0, 1] is not an integer node id", "to run on CPUs [0, 1], use cpubind(cpus=[0, 1])", "nodes here: ")),
    ("numafast.topolgy", "AttributeError", ("module 'numafast' has no attribute 'topolgy'",)),
    # flags are bools: 1, "yes" or None are no answer to a yes-or-no question; NumPy's bools are bools
    (f"numafast.numa_local({NODE}, strict=np.True_)", None, ()),
    (f"numafast.numa_local({NODE}, strict=1)", "TypeError", ("strict must be True or False, not 1",)),
    (f"numafast.numa_local({NODE}, strict='yes')", "TypeError", ("strict must be True or False, not 'yes'",)),
    (f"numafast.bind({NODE}, strict=None)", "TypeError", ("strict must be True or False, not None",)),
    (f"numafast.bind_process({NODE}, migrate='no')", "TypeError", ("migrate must be True or False, not 'no'",)),
    ("numafast.empty(4096, 'uint8', hugepages='no')", "TypeError", ("hugepages must be True or False, not 'no'",)),
    (f"numafast.mbind(numafast.empty(8192, 'uint8'), {NODE}, move=0)", "TypeError", ("move must be True or False, not 0",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1, prefault=None)", "TypeError", ("prefault must be True or False, not None",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1).reap(wait='yes')", "TypeError", ("wait must be True or False, not 'yes'",)),
    # CPU arguments
    (f"numafast.cpubind(cpus={CPU})", None, ()),
    (f"numafast.cpubind(cpus=[np.int64({CPU})])", None, ()),
    ("numafast.cpubind(cpus=-1)", "InvalidCpuSetError", ("cpu -1 is not a CPU id", "allowed CPUs: ")),
    ("numafast.cpubind(cpus=True)", "InvalidCpuSetError", ("cpus True is neither an integer nor a list", "allowed CPUs: ")),
    ("numafast.cpubind(cpus=[])", "InvalidCpuSetError", ("empty CPU set", "allowed CPUs: ")),
    # modes and flags by name
    (f"numafast.membind({NODE}, flags='static_nodes')", None, ()),
    (f"numafast.membind({NODE}, flags=['bogus'])", "ValueError", ("flag='bogus'", "'static_nodes', 'relative_nodes'")),
    (f"numafast.membind({NODE}, flags=5)", "TypeError", ("flags=5: give a flag name or a list of them",
                                                           "'static_nodes', 'relative_nodes', 'numa_balancing'")),
    (f"numafast.membind({NODE}, flags=None)", "TypeError", ("flags=None: give a flag name or a list", "'static_nodes'")),
    (f"numafast.membind({NODE}, flags=b'static_nodes')", "TypeError", ("flags=b'static_nodes': give a flag name",)),
    ("numafast.Policy('bind', (0,), None)", "TypeError", ("flags=None: give a flag name or a list", "'static_nodes'")),
    (f"numafast.interleave({NODE}, weights=5)", "InvalidWeightsError", ("weights 5 is not a list", "one weight (1..255) per node")),
    (f"numafast.interleave([{NODE}, {NODE}], weights=[1, 2])", "InvalidWeightsError",
     (f"node {NODE} given more than once", "give each node once")),
    ("numafast.Policy.from_kernel(99, [])", "ValueError", ("mode word 99 holds no known mode", "2 (bind)", "0x8000 (static_nodes)")),
    ("numafast.set_policy(None)", "TypeError", ("set_policy takes a numafast.Policy", "not None")),
    ("numafast.set_policy('bind')", "TypeError", ("set_policy takes a numafast.Policy", "not 'bind'")),
    ("numafast.Policy('bogus', (0,))", "ValueError", ("mode='bogus'", "'default', 'preferred', 'bind'")),
    ("numafast.Policy('bind', (0,), frozenset({'sticky'}))", "ValueError", ("flag='sticky'", "'static_nodes'")),
    ("numafast.Policy('bind', ('0',))", "InvalidNodeError", ("'0' is not an integer node id", "nodes here: ")),
    ("numafast.set_policy(numafast.Policy('bind'))", "InvalidNodeError", ("mode 'bind' needs at least one node", "nodes here: ")),
    ("numafast.set_policy(numafast.Policy('local', (0,)))", "InvalidNodeError", ("mode 'local' takes no nodes, given 0",)),
    ("numafast.mbind(bytearray(8192), 0, mode='bogus')", "ValueError", ("mode 'bogus'", "bind, interleave, preferred")),
    # shapes, sizes and dtypes
    ("numafast.empty(np.int64(4096), 'uint8')", None, ()),
    ("numafast.zeros((np.int32(2), 4096), 'float32')", None, ()),
    ("numafast.empty(4096.0)", "TypeError", ("shape 4096.0 is neither an integer nor a sequence of integers",)),
    ("numafast.empty((2, 3.0))", "TypeError", ("3.0 is not an integer", "dimensions are integers >= 1")),
    ("numafast.empty((2, True))", "TypeError", ("True is not an integer",)),
    ("numafast.empty(-1)", "InvalidSizeError", ("negative dimension -1", "dimensions are integers >= 1")),
    ("numafast.empty(0)", "InvalidSizeError", ("shape 0 holds no element",)),
    ("numafast.empty(16, 'flaot32')", "TypeError", ("dtype 'flaot32' is not a NumPy data type", "'float32', 'uint8'")),
    ("numafast.empty(16, object)", "TypeError", ("holds Python objects", "give a numeric dtype")),
    ("numafast.empty(4096, 'f4,(2,)f4')", None, ()),
    ("numafast.empty(4096, np.dtype(('f4', (2,))))", "TypeError",
     ("is a subarray dtype", "give the element dtype 'float32' and add (2,) to the shape")),
    ("numafast.zeros((2, 3), '(2,)f4')", "TypeError", ("dtype '(2,)f4' is a subarray dtype",)),
    ("numafast.empty(4096, 'S')", "TypeError", ("dtype 'S' has no size (0 bytes an element)", "'S16'")),
    ("numafast.empty(4096, 'U')", "TypeError", ("dtype 'U' has no size",)),
    ("numafast.empty(4096, 'V0')", "TypeError", ("dtype 'V0' has no size",)),
    # pinned pools: NumPy integers are sizes
    (f"numafast.PinnedPool({NODE}, np.int64(4096), np.int32(2), timeout=np.int64(1)).acquire(np.int64(100)).nbytes",
     None, ()),
    (f"numafast.PinnedPool({NODE}, 4096.0, 2)", "InvalidSizeError", ("slot_bytes must be a positive integer, not 4096.0",)),
    (f"numafast.PinnedPool({NODE}, 4096, 2**63)", "InvalidSizeError",
     ("9223372036854775808 slots of 4096 bytes", "more than an address space holds")),
    (f"numafast.PinnedPool({NODE}, 2**63, 2)", "InvalidSizeError", ("2 slots of 9223372036854775808 bytes",)),
    ("_libnuma.slot_table_bytes(2**60)", "InvalidSizeError", ("a slot table of 1152921504606846976 slots", "the count must be 0 to")),
    (f"numafast.PinnedPool({NODE}, 4096, 1).acquire(-1)", "InvalidSizeError", ("nbytes must be a non-negative integer, not -1",)),
    # the pool's calls for the processes that share it: the C slot table's refusals, named
    (f"numafast.PinnedPool({NODE}, 4096, 1).adopt('0', 0, 4096)", "InvalidSizeError", ("index must be a non-negative integer, not '0'",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1).adopt(0, -1, 4096)", "InvalidSizeError", ("generation must be a non-negative integer, not -1",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1).adopt(0, 0, 1.5)", "InvalidSizeError", ("nbytes must be a non-negative integer, not 1.5",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1).adopt(0, 0, 4097)", "SlotTooSmallError",
     ("4097 bytes do not fit in a slot of 4096 bytes",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1).adopt(5, 0, 1)", "InvalidSizeError", ("slot 5: this pool has slots 0 to 0",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1).end_lease(5, 0, 1)", "InvalidSizeError", ("slot 5: this pool has slots 0 to 0",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1).end_lease(0, 2**64, 1)", "InvalidSizeError",
     ("generation must be a non-negative integer below 2**64, not 18446744073709551616",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1).contains(-1)", "InvalidSizeError", ("address must be a non-negative integer, not -1",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1).contains(np.uint64(4096))", None, ()),
    (f"numafast.PinnedPool({NODE}, 4096, 1).contains(4096.0)", "InvalidSizeError", ("address must be a non-negative integer, not 4096.0",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1).record_stream(1.5, None)", "InvalidSizeError", ("address must be a non-negative integer, not 1.5",)),
    (f"numafast.PinnedPool({NODE}, 4096, 1).release_with(None)", "TypeError", ("reservation must have a release() method",)),
    ("numafast.pool_worker.PoolView(None)", "TypeError", ("handle must be a PoolHandle, what PinnedPool.share() returns",)),
    ("numafast.pool_worker.BoardReader(5)", "TypeError", ("handle must be a BoardHandle, what PoolBoard.handle() returns",)),
    # a slot held, kept for a "guard" that is none: it would never come back
    (f"(lambda pool, slot: pool.guard_held(None))(*(lambda p: (p, p.acquire()))(numafast.PinnedPool({NODE}, 4096, 1)))",
     "TypeError", ("guard must be a numafast._process.ForkGuard", "not None")),
    # buffers
    ("numafast.page_nodes(1)", "InvalidBufferError", ("a int does not expose its memory",)),
    (f"numafast.mbind(np.ones(1 << 16)[::2], {NODE})", "InvalidBufferError", ("not C-contiguous", "numpy.ascontiguousarray")),
    # the extension's own calls
    ("_libnuma.node_to_cpus(4095)", "InvalidNodeError", ("node 4095 does not exist", "nodes here: ")),
    ("_libnuma.distance(0, 4095)", "InvalidNodeError", ("node 4095 does not exist", "nodes here: ")),
    ("_libnuma.node_size64(-1)", "InvalidNodeError", ("node -1 does not exist", "nodes here: ")),
    ("_libnuma.set_preferred(4095)", "InvalidNodeError", ("node 4095 does not exist", "nodes here: ")),
    ("_libnuma.node_of_cpu(1 << 20)", "InvalidCpuSetError", (f"cpu {1 << 20} does not exist", "CPUs here: 0-")),
    # GPU affinity planning: an option that would empty the placement is named
    (f"numafast.cpus_for_gpu(np.int64(0), topology=Topology.from_sysfs('{DGX}'))", None, ()),
    (f"numafast.cpus_for_gpu(0, mode='single', max_cores=0, topology=Topology.from_sysfs('{DGX}'))",
     "ValueError", ("max_cores=0", "give an integer >= 1")),
    (f"numafast.cpus_for_gpu(0, min_cores=-1, topology=Topology.from_sysfs('{DGX}'))", "ValueError", ("min_cores=-1",)),
    (f"numafast.plan(np.int64(2), topology=Topology.from_sysfs('{DGX}'))", None, ()),
    (f"numafast.plan(1, mode='bogus', topology=Topology.from_sysfs('{DGX}'))", "ValueError", ("mode='bogus'", "'node', 'socket'")),
    (f"numafast.plan(2, dataloader_workers=np.int64(2), topology=Topology.from_sysfs('{DGX}'))", None, ()),
    (f"numafast.plan(2, dataloader_workers=-1, topology=Topology.from_sysfs('{DGX}'))",
     "ValueError", ("dataloader_workers must be a non-negative integer, not -1",)),
    (f"numafast.plan_rank(np.int64(1), topology=Topology.from_sysfs('{DGX}'))", None, ()),
    (f"numafast.plan_rank(1.0, topology=Topology.from_sysfs('{DGX}'))", "LocalRankError", ("local_rank must be an integer >= 0, not 1.0",)),
    # the bench's Python API and its result
    ("numafast.bench(threads=np.float64(1))", "ValueError", ("threads must be a whole number of at least 1, not",)),
    ("numafast.bench(size=64.5)", "InvalidSizeError", ("size 64.5: buffers must be whole numbers of bytes, at least",)),
    ("numafast.bench(nodes='0')", "InvalidNodeError", ("nodes '0' is a string", "nodes here: ")),
    ("numafast.BenchResult.from_json('nope')", "ValueError", ("not a JSON text of schema numafast.bench/1",)),
    ("numafast.BenchResult.from_json('[]')", "ValueError", ("a numafast.bench/1 document is a JSON object, not list",)),
    (f"numafast.bench(nodes=[{NODE}], quick=True, matrices=['read_gbps']).matrices['read_gbps'].value(4095, {NODE})",
     "KeyError", ("read_gbps has no row 4095; its rows: ",)),
]

CHILD = r"""
import json, sys
import numpy as np
import numafast
from numafast import Topology, _libnuma
results = []
for call in json.loads(sys.argv[1]):
    try:
        eval(call)
    except Exception as error:
        results.append([type(error).__name__, [c.__name__ for c in type(error).__mro__], str(error)])
    else:
        results.append(None)
print(json.dumps(results))
"""


pytestmark = pytest.mark.host_only(
    "validation: the answers do not depend on the kernel's nodes, and the child takes minutes under TCG"
)


@pytest.fixture(scope="module")
def outcomes() -> dict[str, list[object] | None]:
    """Each call's outcome in one child process: None, or [class, its MRO names, message]."""
    calls = [call for call, _, _ in CASES]
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(calls)], capture_output=True, text=True, timeout=600,
        cwd=TESTS.parent, env={**os.environ, "PYTHONPATH": str(TESTS.parent)},
    )  # fmt: skip
    assert result.returncode == 0, f"the child died (status {result.returncode}):\n{result.stderr}"
    return dict(zip(calls, json.loads(result.stdout.splitlines()[-1]), strict=True))


@pytest.mark.parametrize(("call", "error", "fragments"), CASES, ids=[call for call, _, _ in CASES])
def test_bad_input_gets_a_clear_answer(
    call: str, error: str | None, fragments: tuple[str, ...], outcomes: dict[str, list[object] | None]
) -> None:
    outcome = outcomes[call]
    if error is None:
        assert outcome is None, f"{call} raised {outcome}"
        return
    assert outcome is not None, f"{call} raised nothing"
    name, mro, message = outcome
    assert error in mro, f"{call} raised {name}: {message}"  # type: ignore[operator]
    if error.endswith("Error") and error not in ("ValueError", "TypeError", "KeyError", "AttributeError"):
        assert "NumaError" in mro and ({"ValueError", "PermissionError", "OSError"} & set(mro))  # type: ignore[arg-type]
    for fragment in fragments:
        assert fragment in message, f"{call}: {fragment!r} not in {message!r}"  # type: ignore[operator]


TORCH_ON_FIRST_USE = r"""
import sys
import numafast
assert "torch" not in sys.modules, "import numafast imported torch"
sys.modules["torch"] = None  # as if PyTorch were not installed
try:
    numafast.torch
except ModuleNotFoundError as error:
    print(error)
del sys.modules["torch"]
import importlib.util
if importlib.util.find_spec("torch") is not None:  # where PyTorch is installed after all
    print(numafast.torch.NumaLoader.__name__)
"""


def test_numafast_torch_is_imported_on_first_use_or_says_what_to_install() -> None:
    result = subprocess.run(
        [sys.executable, "-c", TORCH_ON_FIRST_USE], capture_output=True, text=True, timeout=600,
        cwd=TESTS.parent, env={**os.environ, "PYTHONPATH": str(TESTS.parent)},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    installed = importlib.util.find_spec("torch") is not None
    assert result.stdout.splitlines() == [
        "numafast.torch needs PyTorch, which this Python does not have: pip install 'numafast[torch]'",
        *(["NumaLoader"] if installed else []),
    ]
