"""Verdicts: is a process, and a rank of processes, where it should be?

A process is wrong when a thread may run on CPUs of another node than the
expected one, when its cpuset keeps it from allocating there, when more than
``max_remote`` of one class of its memory (page-locked, shared, anonymous) lies
on other nodes, or when a mapping of its own memory is under a policy that puts
pages elsewhere (interleave over several nodes, bind or prefer to other nodes).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from numafast._validate import format_ids, format_size, parse_ids
from numafast.cli.check.classes import MemoryClass, classify, label
from numafast.cli.check.procfs import Mapping, Process
from numafast.cli.check.result import ClassUsage, PolicyFinding, ProcessAudit, ThreadGroup


@dataclass(frozen=True)
class Expectation:
    """Where a rank belongs, and why."""

    node: int | None
    """The node its threads should run on; None: not known (an unbound process)."""
    local_nodes: tuple[int, ...]
    """Nodes whose pages count as local: ``node`` and a GPU's own memory node."""
    reason: str
    """Says why, for the messages: ``GPU 3 is on node 0``, ``the rank runs on node 1``."""
    run_command: str
    """The ``numafast run`` that would start the rank where it belongs."""


def thread_groups(process: Process, node_of_cpu: Callable[[int], int]) -> list[ThreadGroup]:
    """The threads, grouped by their allowed CPUs and memory nodes."""
    groups: dict[tuple[tuple[int, ...], tuple[int, ...]], list[int]] = {}
    for thread in process.threads:
        groups.setdefault((thread.cpus, thread.mems), []).append(thread.tid)
    return [ThreadGroup(tids, list(cpus), sorted({node_of_cpu(cpu) for cpu in cpus}), list(mems))
            for (cpus, mems), tids in groups.items()]  # fmt: skip


def memory_usage(mappings: Iterable[Mapping]) -> dict[MemoryClass, ClassUsage]:
    """Bytes per node of each class of the process's own memory."""
    return usage_per_class((memory_class, m) for m in mappings if (memory_class := classify(m)) is not None)


def usage_per_class(classified: Iterable[tuple[MemoryClass, Mapping]]) -> dict[MemoryClass, ClassUsage]:
    """Bytes per node and label of each class, in the classes' order."""
    usage: dict[MemoryClass, ClassUsage] = {}
    for memory_class, mapping in classified:
        usage.setdefault(memory_class, ClassUsage()).add(label(mapping), mapping.node_bytes)
    return {memory_class: usage[memory_class] for memory_class in MemoryClass if memory_class in usage}


def remote_problems(memory: dict[MemoryClass, ClassUsage], expectation: Expectation, max_remote: float) -> list[str]:
    """One line per class with more than ``max_remote`` of its bytes off the local nodes."""
    problems: list[str] = []
    for memory_class, usage in memory.items():
        total = usage.total()
        remote = {node: count for node, count in usage.node_bytes.items() if node not in expectation.local_nodes}
        if total == 0 or sum(remote.values()) / total <= max_remote:
            continue
        where = ", ".join(f"node {node} {format_size(count)}" for node, count in sorted(remote.items()))
        if len(remote) == 1:
            where = f"node {next(iter(remote))}"
        remote_labels = {name: sum(count for node, count in held.items() if node in remote)
                         for name, held in sorted(usage.labels.items())}  # fmt: skip
        what = ", ".join(f"{name} {format_size(count)}" for name, count in remote_labels.items()
                         if count and name != memory_class.display)  # fmt: skip
        problems.append(f"{format_size(sum(remote.values()))} of {memory_class.display} memory "
                        f"({sum(remote.values()) / total:.0%}) on {where}{f' ({what})' if what else ''}; "
                        f"{expectation.reason}")  # fmt: skip
    return problems


def parse_policy(policy: str) -> tuple[str, list[int]]:
    """``interleave=static:0-3`` -> (``interleave``, [0, 1, 2, 3])."""
    mode_and_flags, _, nodes = policy.partition(":")
    return mode_and_flags.partition("=")[0], parse_ids(nodes)


NUMACTL_OPTIONS = {"interleave": "--interleave", "weighted interleave": "--weighted-interleave",
                   "bind": "--membind", "prefer": "--preferred", "prefer (many)": "--preferred-many"}  # fmt: skip


def misplacing(policy: str, expectation: Expectation) -> bool:
    """Whether a policy puts new pages off the expected node: interleaving over several
    nodes, or binding or preferring other nodes than the local ones."""
    mode, nodes = parse_policy(policy)
    if mode not in NUMACTL_OPTIONS:  # default, local: the page goes where its thread runs
        return False
    if expectation.node is None:
        return "interleave" in mode and len(nodes) > 1
    return not set(nodes) <= set(expectation.local_nodes)


def explain(policy: str, memory_class: MemoryClass, inherited: bool, all_nodes: list[int],
            expectation: Expectation) -> tuple[str, str]:  # fmt: skip
    """(the likely cause, the fix) of ``memory_class`` memory under ``policy``."""
    mode, nodes = parse_policy(policy)
    effect = {"interleave": "interleaved over", "weighted interleave": "interleaved over",
              "bind": "bound to", "prefer": "preferring", "prefer (many)": "preferring"}[mode]  # fmt: skip
    consequence = f"{memory_class.display} memory {effect} nodes {format_ids(nodes)}"
    if memory_class is MemoryClass.PAGE_LOCKED:
        consequence = f"page-locked staging buffers {effect} nodes {format_ids(nodes)}"
    if inherited:
        numactl_nodes = "all" if sorted(nodes) == sorted(all_nodes) else format_ids(nodes)
        cause = f"started under numactl {NUMACTL_OPTIONS[mode]}={numactl_nodes} (or set_mempolicy): {consequence}"
        return cause, f"start the rank with `{expectation.run_command}` instead"
    cause = f"the program set this policy on the memory itself (mbind): {consequence}"
    if expectation.node is None:
        return cause, "bind the process to one node, then allocate on it"
    return cause, f"allocate it on node {expectation.node} instead (numafast.empty(..., node={expectation.node}))"


def process_policy(mappings: Iterable[Mapping]) -> str | None:
    """The policy of the process itself (set_mempolicy, numactl), as numa_maps shows it.

    numa_maps prints a mapping's own policy (mbind) or else the main thread's:
    mapped files, which programs do not mbind, show the main thread's.
    """
    counts = Counter(m.policy for m in mappings if m.path is not None and classify(m) is None)
    return counts.most_common(1)[0][0] if counts else None


def policy_findings(mappings: tuple[Mapping, ...], expectation: Expectation, all_nodes: list[int]) -> list[PolicyFinding]:
    """The process's own memory under misplacing policies, grouped by class and policy."""
    own_policy = process_policy(mappings)
    groups: dict[tuple[MemoryClass, str], list[Mapping]] = {}
    for mapping in mappings:
        memory_class = classify(mapping)
        if memory_class is not None and misplacing(mapping.policy, expectation):
            groups.setdefault((memory_class, mapping.policy), []).append(mapping)
    findings: list[PolicyFinding] = []
    for (memory_class, policy), members in sorted(groups.items(), key=lambda group: list(MemoryClass).index(group[0][0])):
        node_bytes: dict[int, int] = {}
        for mapping in members:
            for node, count in mapping.node_bytes.items():
                node_bytes[node] = node_bytes.get(node, 0) + count
        inherited = policy == own_policy
        cause, fix = explain(policy, memory_class, inherited, all_nodes, expectation)
        findings.append(PolicyFinding(memory_class, policy, len(members), sum(m.size for m in members),
                                      dict(sorted(node_bytes.items())), sorted({label(m) for m in members}),
                                      inherited, cause, fix))  # fmt: skip
    return findings


def policy_problem(finding: PolicyFinding) -> str:
    """``64.0 MiB of page-locked memory (numafast pool) under interleave:0-3: CAUSE; fix: FIX``."""
    labels = [name for name in finding.labels if name != finding.memory_class.display]
    what = f" ({', '.join(labels)})" if labels else ""
    return (f"{format_size(finding.size)} of {finding.memory_class.display} memory{what} under {finding.policy}: "
            f"{finding.cause}; fix: {finding.fix}")  # fmt: skip


def thread_problems(groups: list[ThreadGroup], expectation: Expectation) -> list[str]:
    problems: list[str] = []
    for group in groups:
        threads = f"thread {group.tids[0]}" if len(group.tids) == 1 else f"threads {format_ids(group.tids)}"
        if expectation.node is None and len(group.cpu_nodes) > 1:
            problems.append(f"{threads} may run on CPUs {format_ids(group.cpus)} (nodes {format_ids(group.cpu_nodes)}): "
                            "not bound to one node")  # fmt: skip
        elif expectation.node is not None and group.cpu_nodes != [expectation.node]:
            problems.append(f"{threads} may run on CPUs {format_ids(group.cpus)} (nodes {format_ids(group.cpu_nodes)}); "
                            f"{expectation.reason}")  # fmt: skip
        if expectation.node is not None and group.mems and not set(expectation.local_nodes) & set(group.mems):
            problems.append(f"{threads} may allocate only on nodes {format_ids(group.mems)} (their cpuset); "
                            f"{expectation.reason}")  # fmt: skip
    return problems


def audit_process(process: Process, expectation: Expectation, max_remote: float, all_nodes: list[int],
                  node_of_cpu: Callable[[int], int]) -> ProcessAudit:  # fmt: skip
    """The verdict on one process read from /proc."""
    groups = thread_groups(process, node_of_cpu)
    memory = memory_usage(process.mappings)
    total = sum(usage.total() for usage in memory.values())
    local = sum(usage.node_bytes.get(node, 0) for usage in memory.values() for node in expectation.local_nodes)
    remote_share = 0.0 if expectation.node is None or total == 0 else 1 - local / total
    findings = policy_findings(process.mappings, expectation, all_nodes)
    problems = thread_problems(groups, expectation)
    if expectation.node is not None:
        problems += remote_problems(memory, expectation, max_remote)
    problems += [policy_problem(finding) for finding in findings]
    return ProcessAudit(process.pid, "wrong" if problems else "ok", process.ppid, process.name, None, groups,
                        memory, remote_share, findings, problems)  # fmt: skip


def rank_memory(processes: Iterable[Process]) -> dict[MemoryClass, ClassUsage]:
    """The rank's memory per class, each shared page counted once.

    Shared memory mapped by several processes (a pool the main process locks and its
    workers map, a tensor handed to the main process) shows in each one's numa_maps;
    the same file range is counted once, with the most pages any process maps of it,
    and in the strongest class any process gives it (page-locked in one is page-locked).
    """
    best: dict[tuple[object, ...], tuple[MemoryClass, Mapping]] = {}
    for process in processes:
        for mapping in process.mappings:
            memory_class = classify(mapping)
            if memory_class is None:
                continue
            key: tuple[object, ...] = (process.pid, mapping.start)
            if mapping.path is not None and mapping.identity[1] != 0:
                key = (mapping.identity, mapping.size)
            held = best.get(key)
            if held is not None:
                order = list(MemoryClass)
                memory_class = min(memory_class, held[0], key=order.index)
                if sum(held[1].node_bytes.values()) > sum(mapping.node_bytes.values()):
                    mapping = held[1]
            best[key] = (memory_class, mapping)
    return usage_per_class(best.values())

