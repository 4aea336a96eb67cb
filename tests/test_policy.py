"""Policy values against the kernel's own get_mempolicy answer (runs on any host)."""

from __future__ import annotations

import errno
import threading

import pytest

import numafast
from numafast import _libnuma
from numafast.errors import LibnumaError
from numafast.policy import FLAG_BITS, MODE_NUMBERS, explain_refusal
from sysfs_truth import online_nodes, thread_policy

NODE = online_nodes()[0]


def in_fresh_thread(function):  # type: ignore[no-untyped-def]
    """Run ``function`` in a new thread: a policy set there ends with it."""
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(function()))
    thread.start()
    thread.join()
    return result[0]


@pytest.mark.parametrize(
    "policy",
    [
        numafast.Policy(numafast.Mode.DEFAULT),
        numafast.Policy(numafast.Mode.LOCAL),
        numafast.Policy(numafast.Mode.PREFERRED, (NODE,)),
        numafast.Policy(numafast.Mode.BIND, (NODE,)),
        numafast.Policy(numafast.Mode.INTERLEAVE, (NODE,)),
        numafast.Policy(numafast.Mode.BIND, (NODE,), frozenset({numafast.ModeFlag.STATIC_NODES})),
        numafast.Policy(numafast.Mode.INTERLEAVE, (0,), frozenset({numafast.ModeFlag.RELATIVE_NODES})),
    ],
    ids=str,
)
def test_set_policy_is_what_the_kernel_reports(policy: numafast.Policy) -> None:
    def set_and_read() -> tuple[tuple[int, list[int]], numafast.Policy]:
        numafast.set_policy(policy)
        return thread_policy(), numafast.get_policy()

    kernel, read_back = in_fresh_thread(set_and_read)
    expected_word = MODE_NUMBERS[policy.mode] | sum(FLAG_BITS[f] for f in policy.flags)
    assert kernel == (expected_word, list(policy.nodes))
    assert read_back == policy


def test_modes_are_strings_named_like_numactl() -> None:
    assert numafast.Mode("bind") is numafast.Mode.BIND
    assert numafast.Mode.PREFERRED_MANY == "preferred_many"
    assert {m.value for m in numafast.ModeFlag} == {"static_nodes", "relative_nodes", "numa_balancing"}


def test_threads_inherit_the_policy_of_their_creator() -> None:
    def parent() -> object:
        numafast.set_policy(numafast.Policy(numafast.Mode.INTERLEAVE, (NODE,)))
        return in_fresh_thread(thread_policy)

    assert in_fresh_thread(parent) == (_libnuma.MPOL_INTERLEAVE, [NODE])
    assert thread_policy() == (_libnuma.MPOL_DEFAULT, [])


def test_set_policy_rejects_unknown_nodes_before_the_kernel_sees_them() -> None:
    with pytest.raises(numafast.InvalidNodeError, match="does not exist; nodes here"):
        numafast.set_policy(numafast.Policy(numafast.Mode.BIND, (max(online_nodes()) + 1,)))
    with pytest.raises(numafast.InvalidNodeError, match="not an integer"):
        numafast.set_policy(numafast.Policy(numafast.Mode.BIND, ("0",)))  # type: ignore[arg-type]


def test_kernel_refusal_of_an_empty_bind_is_a_clear_error() -> None:
    # MPOL_BIND without nodes: the kernel's own EINVAL, passed on with the call named.
    with pytest.raises(LibnumaError, match="set_mempolicy failed: Invalid argument"):
        numafast.policy.set_mempolicy(_libnuma.MPOL_BIND, [])


def test_eperm_becomes_policy_not_permitted_with_the_remedy() -> None:
    # The message for a real EPERM (as seccomp returns it); the kernel here does not refuse.
    error = explain_refusal(LibnumaError("set_mempolicy", errno.EPERM), _libnuma.MPOL_BIND, [NODE])
    assert isinstance(error, numafast.PolicyNotPermitted) and isinstance(error, PermissionError)
    assert "EPERM" in str(error) and "--cap-add SYS_NICE" in str(error) and "seccomp" in str(error)
