"""The binding context managers on this host's kernel (any node count): what the
kernel reports inside and after each block, threads, decorators and bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import numafast
from numafast import _libnuma
from sysfs_truth import node_cpus, online_nodes, thread_policy

TESTS = Path(__file__).resolve().parent
NODE = online_nodes()[0]
ALL_CPUS = os.sched_getaffinity(0)


def state() -> tuple[set[int], tuple[int, list[int]]]:
    return os.sched_getaffinity(0), thread_policy()


def test_numa_local_preferred_and_strict_then_exact_restore() -> None:
    before = state()
    with numafast.numa_local(NODE):
        assert state() == (set(node_cpus(NODE)), (_libnuma.MPOL_PREFERRED, [NODE]))
    with numafast.numa_local(NODE, strict=True):
        assert thread_policy() == (_libnuma.MPOL_BIND, [NODE])
    assert state() == before


def test_restores_a_policy_with_flags_and_a_narrowed_cpu_set_exactly() -> None:
    cpu = min(ALL_CPUS)
    with numafast.cpubind(cpus=[cpu]), numafast.interleave([NODE], flags=["static_nodes"]):
        outer = state()
        assert outer == ({cpu}, (_libnuma.MPOL_INTERLEAVE | _libnuma.MPOL_F_STATIC_NODES, [NODE]))
        with numafast.numa_local(NODE):
            assert os.sched_getaffinity(0) == set(node_cpus(NODE))
        assert state() == outer
    assert state() == (ALL_CPUS, (_libnuma.MPOL_DEFAULT, []))


def test_exception_in_the_body_restores_and_propagates() -> None:
    before = state()
    with pytest.raises(RuntimeError, match="body"):
        with numafast.membind([NODE]), numafast.cpubind(cpus=[max(ALL_CPUS)]):
            raise RuntimeError("body")
    assert state() == before


def test_decorator_applies_per_call_and_from_many_threads() -> None:
    @numafast.local_alloc()
    def inside() -> tuple[int, list[int]]:
        return thread_policy()

    results: list[object] = []
    threads = [threading.Thread(target=lambda: results.append(inside())) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == [(_libnuma.MPOL_LOCAL, [])] * 4
    assert inside() == (_libnuma.MPOL_LOCAL, []) and thread_policy() == (_libnuma.MPOL_DEFAULT, [])


def test_a_block_affects_only_the_thread_that_entered_it_and_threads_it_creates() -> None:
    inside, release = threading.Event(), threading.Event()
    seen: dict[str, object] = {}

    def bystander() -> None:
        inside.wait()
        seen["bystander"] = thread_policy()
        release.set()

    other = threading.Thread(target=bystander)
    other.start()
    with numafast.preferred(NODE):
        inside.set()
        release.wait()
        child = threading.Thread(target=lambda: seen.update(child=thread_policy()))
        child.start()
        child.join()
    other.join()
    assert seen == {"bystander": (_libnuma.MPOL_DEFAULT, []), "child": (_libnuma.MPOL_PREFERRED, [NODE])}


def test_one_placement_nests_and_serves_several_threads_at_once() -> None:
    placement = numafast.preferred(NODE)
    inner = numafast.interleave([NODE])
    barrier = threading.Barrier(2)
    seen: list[object] = []

    def worker() -> None:
        with placement:
            barrier.wait()
            seen.append(thread_policy())
            barrier.wait()
        seen.append(thread_policy())

    other = threading.Thread(target=worker)
    other.start()
    with placement:
        barrier.wait()
        with inner, placement:
            assert thread_policy() == (_libnuma.MPOL_PREFERRED, [NODE])
        assert thread_policy() == (_libnuma.MPOL_PREFERRED, [NODE])
        barrier.wait()
    other.join()
    assert seen == [(_libnuma.MPOL_PREFERRED, [NODE]), (_libnuma.MPOL_DEFAULT, [])]
    assert thread_policy() == (_libnuma.MPOL_DEFAULT, [])


def test_blocks_left_out_of_order_by_generators_restore_their_own_state() -> None:
    def placed(block):  # type: ignore[no-untyped-def]
        with block:
            yield thread_policy()
            yield thread_policy()

    first = placed(numafast.membind([NODE]))
    assert next(first) == (_libnuma.MPOL_BIND, [NODE])
    second = placed(numafast.interleave([NODE]))
    assert next(second) == (_libnuma.MPOL_INTERLEAVE, [NODE])
    first.close()  # the outer block ends first: it restores what it found (default)
    assert thread_policy() == (_libnuma.MPOL_DEFAULT, [])
    second.close()  # then the inner one restores what it found (membind)
    assert thread_policy() == (_libnuma.MPOL_BIND, [NODE])
    with numafast.local_alloc():  # nothing left on the stack from either
        pass
    numafast.set_policy(numafast.Policy(numafast.Mode.DEFAULT))


def test_bind_is_persistent_and_bind_process_moves_threads_pinned_elsewhere() -> None:
    code = f"""
import json, os, threading
import numafast
from sysfs_truth import thread_cpus_of_process, thread_policy
numafast.bind({NODE}, strict=True)
bound = (sorted(os.sched_getaffinity(0)), thread_policy())
ready, release = threading.Barrier(3), threading.Event()
def pinned():
    os.sched_setaffinity(0, {{{max(ALL_CPUS)}}})
    ready.wait(); release.wait()
threads = [threading.Thread(target=pinned) for _ in range(2)]
for t in threads: t.start()
ready.wait()
pinned_cpus = thread_cpus_of_process()
moved = numafast.bind_process({NODE})
print(json.dumps([bound, pinned_cpus, thread_cpus_of_process(), moved, thread_policy()]))
release.set()
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=TESTS.parent,
                            env={**os.environ, "PYTHONPATH": f"{TESTS.parent}:{TESTS}"})  # fmt: skip
    assert result.returncode == 0, result.stderr
    bound, pinned_cpus, after, moved, policy = json.loads(result.stdout)
    assert bound == [node_cpus(NODE), [_libnuma.MPOL_BIND, [NODE]]]
    assert sum(cpus == [max(ALL_CPUS)] for cpus in pinned_cpus.values()) == 2
    assert sorted(map(int, after)) == sorted(moved)
    assert all(cpus == node_cpus(NODE) for cpus in after.values())
    assert policy == [_libnuma.MPOL_PREFERRED, [NODE]]


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: numafast.numa_local(max(online_nodes()) + 1), numafast.InvalidNodeError, "does not exist; nodes here"),
        (lambda: numafast.numa_local("0"), numafast.InvalidNodeError, "not an integer node id"),
        (lambda: numafast.membind([]), numafast.InvalidNodeError, "no node given"),
        (lambda: numafast.interleave([-1]), numafast.InvalidNodeError, "node -1 does not exist"),
        (lambda: numafast.cpubind(cpus=[]), numafast.InvalidCpuSetError, "empty CPU set; allowed CPUs"),
        (lambda: numafast.cpubind(cpus=[4096]), numafast.InvalidCpuSetError, "cpu 4096 not allowed; allowed CPUs"),
        (lambda: numafast.cpubind(cpus=[1.5]), numafast.InvalidCpuSetError, "not a CPU id"),
        (lambda: numafast.cpubind(), TypeError, "exactly one of cpus= or nodes="),
        (lambda: numafast.cpubind(cpus=[0], nodes=[0]), TypeError, "exactly one"),
        (lambda: numafast.membind([NODE], flags=["sticky"]), ValueError, "flag='sticky' is not one of 'static_nodes', 'relative_nodes'"),
        (lambda: numafast.interleave([NODE], weights=[1, 2]), numafast.InvalidWeightsError, "2 weights for 1 nodes"),
        (lambda: numafast.interleave([NODE], weights=5), numafast.InvalidWeightsError, "weights 5 is not a list"),
        (lambda: numafast.membind([NODE], flags=None), TypeError, "flags=None: give a flag name or a list"),
    ],
)
def test_bad_input_names_the_value_and_what_is_allowed(make, error, message) -> None:  # type: ignore[no-untyped-def]
    before = state()
    with pytest.raises(error, match=message):
        make()
    assert state() == before


def test_numpy_bools_are_bools_and_other_values_of_strict_are_refused() -> None:
    numafast.binding._numa_local_placements.clear()  # np.True_ must not depend on a cached strict=True
    with numafast.numa_local(NODE, strict=np.True_):
        assert thread_policy() == (_libnuma.MPOL_BIND, [NODE])
    with numafast.numa_local(NODE, strict=np.False_):
        assert thread_policy() == (_libnuma.MPOL_PREFERRED, [NODE])
    with numafast.numa_local(NODE, strict=True):  # 1 == True: the cache must not answer for it
        pass
    before = state()
    with pytest.raises(TypeError, match="strict must be True or False, not 1"):
        numafast.numa_local(NODE, strict=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="migrate must be True or False, not 'yes'"):
        numafast.bind_process(NODE, migrate="yes")  # type: ignore[arg-type]
    assert state() == before


def test_leaving_a_block_not_entered_in_this_thread_says_so() -> None:
    placement = numafast.membind(NODE)
    with pytest.raises(RuntimeError, match="not entered in this thread"):
        placement.__exit__(None, None, None)
    errors: list[BaseException] = []

    def leave() -> None:
        try:
            placement.__exit__(None, None, None)
        except BaseException as error:
            errors.append(error)

    with placement:
        inside = thread_policy()
        thread = threading.Thread(target=leave)
        thread.start()
        thread.join()
        assert thread_policy() == inside  # nothing of this thread's was restored by the other
    assert [type(e) for e in errors] == [RuntimeError] and "not entered in this thread" in str(errors[0])
    assert thread_policy() == (_libnuma.MPOL_DEFAULT, [])


def test_weighted_interleave_uses_the_kernels_system_wide_weights() -> None:
    if not numafast.capabilities().weighted_interleave.available:
        with pytest.raises(numafast.PolicyUnsupported, match="needs Linux 6.9"):
            numafast.interleave([NODE], weights=[1])
        return
    weight = int(Path(f"/sys/kernel/mm/mempolicy/weighted_interleave/node{NODE}").read_text())
    with numafast.interleave([NODE], weights=[weight]):
        assert thread_policy() == (_libnuma.MPOL_WEIGHTED_INTERLEAVE, [NODE])
    with pytest.raises(numafast.InvalidWeightsError, match="system-wide weights"):
        numafast.interleave([NODE], weights=[weight % 255 + 1])
    with pytest.raises(numafast.InvalidWeightsError, match="not an integer in 1..255"):
        numafast.interleave([NODE], weights=[0])


def test_decorated_generator_runs_every_resumption_inside_and_the_caller_outside() -> None:
    # ContextDecorator alone would enter and leave the block before the first item:
    # the generator's body then ran under the caller's placement, silently.
    cpu = min(os.sched_getaffinity(0))
    before = state()
    seen: list[object] = []

    @numafast.cpubind(cpus=[cpu])
    @numafast.local_alloc()
    def items(count: int):  # type: ignore[no-untyped-def]
        try:
            for _ in range(count):
                sent = yield state()
                seen.append(("sent", sent, state()))
        except KeyError:
            seen.append(("thrown", state()))
            yield "after throw"
        finally:
            seen.append(("finally", state()))
        return "done"

    inside = ({cpu}, (_libnuma.MPOL_LOCAL, []))
    generator = items(3)
    assert state() == before  # creating it runs nothing
    assert next(generator) == inside
    assert state() == before
    assert generator.send("x") == inside
    assert generator.throw(KeyError("k")) == "after throw"
    assert state() == before
    with pytest.raises(StopIteration) as stopped:
        next(generator)
    assert stopped.value.value == "done"
    assert seen == [("sent", "x", inside), ("thrown", inside), ("finally", inside)]
    assert state() == before

    closed = items(5)
    next(closed)
    closed.close()  # GeneratorExit at the yield: the finally runs inside too
    assert seen[-1] == ("finally", inside) and state() == before


def test_decorating_a_coroutine_function_is_refused_naming_it() -> None:
    with pytest.raises(TypeError, match=r"cannot decorate \S*fetch, a coroutine or async generator function"):

        @numafast.local_alloc()
        async def fetch() -> None: ...
