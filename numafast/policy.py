"""Memory policies as typed values: :class:`Mode`, :class:`ModeFlag`, :class:`Policy`.

A memory policy belongs to one thread and says where the pages that thread
touches first will go (see set_mempolicy(2)). :func:`get_policy` reads the
calling thread's policy from the kernel; :func:`set_policy` replaces it and turns
the kernel's refusals into exceptions that say why.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import NoReturn

from numafast import _libnuma
from numafast._validate import check_nodes, format_ids, id_list, integer, member, online_nodes
from numafast.errors import InvalidNodeError, LibnumaError, PolicyNotPermitted, PolicyUnsupported


class Mode(str, Enum):
    """The modes of set_mempolicy(2)."""

    DEFAULT = "default"
    """No policy of its own: the thread falls back to the system default, local allocation."""
    PREFERRED = "preferred"
    """Allocate on the one node given; on other nodes when it is full (never an OOM of its own)."""
    BIND = "bind"
    """Allocate only on the nodes given; when they are full, reclaim, then the OOM killer."""
    INTERLEAVE = "interleave"
    """Spread pages round-robin over the nodes given, one page each in turn."""
    LOCAL = "local"
    """Allocate on the node of the CPU that touches the page (explicitly, overriding a default)."""
    PREFERRED_MANY = "preferred_many"
    """Allocate on any of the nodes given, elsewhere when all are full (Linux 5.15+)."""
    WEIGHTED_INTERLEAVE = "weighted_interleave"
    """Interleave in proportion to the system's per-node weights (Linux 6.9+)."""


class ModeFlag(str, Enum):
    """Mode flags, OR'd into the mode by set_mempolicy(2) and returned the same way."""

    STATIC_NODES = "static_nodes"
    """The nodes are physical ids that stay put when the cpuset's mems change."""
    RELATIVE_NODES = "relative_nodes"
    """The nodes are indices into the cpuset's allowed nodes, remapped when those change."""
    NUMA_BALANCING = "numa_balancing"
    """With BIND: let automatic NUMA balancing move pages among the bound nodes (Linux 5.12+)."""


MODE_NUMBERS: dict[Mode, int] = {
    Mode.DEFAULT: _libnuma.MPOL_DEFAULT,
    Mode.PREFERRED: _libnuma.MPOL_PREFERRED,
    Mode.BIND: _libnuma.MPOL_BIND,
    Mode.INTERLEAVE: _libnuma.MPOL_INTERLEAVE,
    Mode.LOCAL: _libnuma.MPOL_LOCAL,
    Mode.PREFERRED_MANY: _libnuma.MPOL_PREFERRED_MANY,
    Mode.WEIGHTED_INTERLEAVE: _libnuma.MPOL_WEIGHTED_INTERLEAVE,
}
FLAG_BITS: dict[ModeFlag, int] = {
    ModeFlag.STATIC_NODES: _libnuma.MPOL_F_STATIC_NODES,
    ModeFlag.RELATIVE_NODES: _libnuma.MPOL_F_RELATIVE_NODES,
    ModeFlag.NUMA_BALANCING: _libnuma.MPOL_F_NUMA_BALANCING,
}
_MODES_BY_NUMBER = {number: mode for mode, number in MODE_NUMBERS.items()}
_ALL_FLAG_BITS = sum(FLAG_BITS.values())
# The kernel release that introduced each mode newer than the original four.
_MODE_SINCE = {Mode.LOCAL: "3.8", Mode.PREFERRED_MANY: "5.15", Mode.WEIGHTED_INTERLEAVE: "6.9"}
# Modes that set_mempolicy(2) refuses (EINVAL) without nodes, and those it refuses with some.
_NEED_NODES = (Mode.BIND, Mode.INTERLEAVE, Mode.PREFERRED_MANY, Mode.WEIGHTED_INTERLEAVE)
_TAKE_NO_NODES = (Mode.DEFAULT, Mode.LOCAL)


def mode_flags(flags: Iterable[ModeFlag | str] | ModeFlag | str) -> frozenset[ModeFlag]:
    """Mode flags given as members or names (one, or an iterable); ValueError naming a bad
    one and the allowed names, TypeError for neither a name nor an iterable of them."""
    if isinstance(flags, str):
        return frozenset((member(ModeFlag, flags, "flag"),))
    if isinstance(flags, Iterable) and not isinstance(flags, (bytes, bytearray)):
        return frozenset(member(ModeFlag, flag, "flag") for flag in flags)
    names = ", ".join(repr(flag.value) for flag in ModeFlag)
    raise TypeError(f"flags={flags!r}: give a flag name or a list of them (() for none); flags: {names}")


@dataclass(frozen=True)
class Policy:
    """A thread's memory policy: the mode, its nodes (ascending) and its mode flags."""

    mode: Mode
    nodes: tuple[int, ...] = ()
    flags: frozenset[ModeFlag] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        # Names are accepted for the mode and flags, integers of any kind for nodes;
        # anything else is refused here, naming what is allowed.
        object.__setattr__(self, "mode", member(Mode, self.mode, "mode"))
        object.__setattr__(self, "flags", mode_flags(self.flags))
        try:
            nodes = id_list(self.nodes)
        except TypeError as error:
            raise InvalidNodeError(f"Policy nodes {error}; nodes here: {format_ids(online_nodes())}") from None
        checked: list[int] = []
        for node in nodes:
            node_id = integer(node)
            if node_id is None or node_id < 0:
                raise InvalidNodeError(
                    f"Policy nodes {self.nodes!r}: {node!r} is not an integer node id; nodes here: {format_ids(online_nodes())}"
                )
            checked.append(node_id)
        object.__setattr__(self, "nodes", tuple(sorted(checked)))

    @classmethod
    def from_kernel(cls, mode_word: int, nodes: Iterable[int]) -> Policy:
        """The policy get_mempolicy(2) reported as a mode word (flags OR'd in) and nodes."""
        word = integer(mode_word)
        mode = None if word is None else _MODES_BY_NUMBER.get(word & ~_ALL_FLAG_BITS)
        if word is None or mode is None:
            modes = ", ".join(f"{number} ({known.value})" for known, number in MODE_NUMBERS.items())
            bits = ", ".join(f"{bit:#x} ({flag.value})" for flag, bit in FLAG_BITS.items())
            raise ValueError(f"mode word {mode_word!r} holds no known mode; modes: {modes}; flag bits OR'd in: {bits}")
        flags = frozenset(flag for flag, bit in FLAG_BITS.items() if word & bit)
        return cls(mode, tuple(sorted(nodes)), flags)

    def to_kernel(self) -> tuple[int, list[int]]:
        """(mode word with the flags OR'd in, nodes): the arguments of set_mempolicy(2)."""
        mode_word = MODE_NUMBERS[Mode(self.mode)]
        for flag in self.flags:
            mode_word |= FLAG_BITS[ModeFlag(flag)]
        return mode_word, list(self.nodes)


def get_policy() -> Policy:
    """The calling thread's memory policy, as the kernel reports it (get_mempolicy(2))."""
    return Policy.from_kernel(*_libnuma.get_mempolicy())


def set_policy(policy: Policy) -> None:
    """Make ``policy`` the calling thread's memory policy; nodes are validated first."""
    if not isinstance(policy, Policy):
        raise TypeError(f"set_policy takes a numafast.Policy, like Policy('bind', (0,)), not {policy!r}")
    if policy.mode in _NEED_NODES and not policy.nodes:
        raise InvalidNodeError(
            f"mode {policy.mode.value!r} needs at least one node, none given; nodes here: {format_ids(online_nodes())}"
        )
    if policy.mode in _TAKE_NO_NODES and policy.nodes:
        raise InvalidNodeError(f"mode {policy.mode.value!r} takes no nodes, given {format_ids(policy.nodes)}")
    if policy.nodes:
        check_nodes(policy.nodes, need_allowed=ModeFlag.RELATIVE_NODES not in policy.flags)
    set_mempolicy(*policy.to_kernel())


def set_mempolicy(mode_word: int, nodes: list[int]) -> None:
    """set_mempolicy(2) with the kernel's refusals explained (raw mode word and nodes)."""
    try:
        _libnuma.set_mempolicy(mode_word, nodes)
    except LibnumaError as error:
        raise_refusal(error, mode_word, nodes)


def raise_refusal(error: LibnumaError, mode_word: int, nodes: list[int]) -> NoReturn:
    """Raise the exception that says why the kernel refused set_mempolicy(mode_word, nodes)."""
    explained = explain_refusal(error, mode_word, nodes)
    if explained is error:
        raise error
    raise explained from error


def explain_refusal(error: LibnumaError, mode_word: int, nodes: list[int]) -> Exception:
    """The exception that says why the kernel refused set_mempolicy(mode_word, nodes)
    (``error`` itself when there is nothing to add)."""
    policy = Policy.from_kernel(mode_word, nodes)
    what = f"{error.call}({policy.mode.value}, nodes {format_ids(nodes)})"
    if error.call == "get_mempolicy":  # read first, to be restored on leaving the block
        setting = f"{policy.mode.value} on nodes {format_ids(nodes)}"
        what = f"get_mempolicy (reading the policy to restore, before setting {setting})"
    if error.errno in (errno.EPERM, errno.ENOSYS):
        return explain_call(error, what)
    if error.errno == errno.EINVAL:
        if nodes:
            # Raises InvalidNodeError or NodeNotAllowedError when a node is the cause.
            check_nodes(nodes, need_allowed=ModeFlag.RELATIVE_NODES not in policy.flags)
        since = _MODE_SINCE.get(policy.mode)
        if since:
            return PolicyUnsupported(
                f"{what} refused with EINVAL: the {policy.mode.value} mode needs Linux {since}+, "
                f"this kernel is {os.uname().release}"
            )
    return error


def explain_call(error: LibnumaError, what: str) -> Exception:
    """The exception that says why the kernel refused a NUMA system call (``what``: the call
    and its arguments, in words): EPERM names the cause and the fix, ENOSYS a kernel
    without NUMA; ``error`` itself otherwise."""
    if error.errno == errno.EPERM:
        call = error.call.removeprefix("numa_")
        return PolicyNotPermitted(f"{what} refused with EPERM; {seccomp_hint(call)}")
    if error.errno == errno.ENOSYS:
        return PolicyUnsupported(f"{what} failed with ENOSYS: this kernel has no NUMA support (CONFIG_NUMA)")
    return error


def raise_explained(error: LibnumaError, what: str) -> NoReturn:
    """Raise :func:`explain_call`'s exception for ``error``, from it."""
    explained = explain_call(error, what)
    if explained is error:
        raise error
    raise explained from error


@contextmanager
def refusals_explained(doing: str) -> Iterator[None]:
    """Within: a NUMA system call refused with EPERM or ENOSYS raises :func:`explain_call`'s
    exception, naming the call and ``doing`` (the public call, in words)."""
    try:
        yield
    except LibnumaError as error:
        if error.errno not in (errno.EPERM, errno.ENOSYS):
            raise
        raise_explained(error, f"{error.call.removeprefix('numa_')} ({doing})")


# What Docker's default seccomp profile (moby/profiles, seccomp/default.json; containerd's
# and so Kubernetes' RuntimeDefault alike) does with the NUMA system calls: these four it
# allows only with CAP_SYS_NICE; move_pages and migrate_pages not at all. Both answer EPERM.
NEED_SYS_NICE = ("get_mempolicy", "set_mempolicy", "mbind", "set_mempolicy_home_node")
NEVER_IN_DOCKER = ("move_pages", "migrate_pages")
_CAP_SYS_NICE = 23


def seccomp_state(pid: int | str = "self") -> tuple[str, bool | None]:
    """(a process's seccomp state: off, strict, filter active or unknown; whether it has
    CAP_SYS_NICE, None: unknown), from /proc/PID/status."""
    state, nice = "unknown", None
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                name, _, value = line.partition(":")
                if name == "Seccomp":
                    state = {"0": "off", "1": "strict", "2": "filter active"}.get(value.strip(), "?")
                elif name == "CapEff":
                    nice = bool(int(value, 16) >> _CAP_SYS_NICE & 1)
    except (OSError, ValueError):
        pass
    return state, nice


def seccomp_hint(*calls: str) -> str:
    """Why the NUMA system calls ``calls`` get EPERM here, and what lifts it for this user."""
    state, nice = seccomp_state()
    has = {None: "", True: ", has CAP_SYS_NICE", False: ", no CAP_SYS_NICE"}[nice]
    cause = f"a container's seccomp profile or missing capability blocks it (seccomp: {state}{has})"
    fixes = []
    if (not calls or set(calls) & set(NEED_SYS_NICE)) and nice:
        fixes.append(
            "this process has CAP_SYS_NICE, with which Docker's default profile allows get_mempolicy, set_mempolicy "
            "and mbind (docker run --cap-add SYS_NICE), so another profile refuses them: run with a seccomp profile "
            "that allows them"
        )
    elif not calls or set(calls) & set(NEED_SYS_NICE):
        fixes.append(
            "Docker's default profile allows get_mempolicy, set_mempolicy and mbind only to containers with "
            "CAP_SYS_NICE: run with --cap-add SYS_NICE (Kubernetes: add SYS_NICE to the container's "
            "securityContext.capabilities.add), or a seccomp profile that allows them"
        )
    if set(calls) & set(NEVER_IN_DOCKER):
        fixes.append(
            "Docker's default profile refuses move_pages and migrate_pages even with CAP_SYS_NICE: run with a "
            "seccomp profile that allows them (docker run --security-opt seccomp=PROFILE.json; Kubernetes: a "
            "Localhost seccompProfile in securityContext)"
        )
    if not fixes:
        fixes.append("run with a seccomp profile that allows it")
    return f"{cause}; " + "; ".join(fixes)
