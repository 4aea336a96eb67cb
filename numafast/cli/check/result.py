"""What ``numafast check`` found: :class:`CheckReport` and its JSON form, schema
``numafast.check/1``.

The JSON document (``numafast check --json``, ``CheckReport.to_json()``); node ids
are JSON object keys, so strings; sizes are bytes::

    {
      "schema": "numafast.check/1",
      "version": "0.1.0",                  # numafast's
      "created": "2026-01-31T12:00:00Z",   # UTC, when the audit started
      "settings": {"node": null, "gpu": 3, "max_remote": 0.1, "descendants": true},
      "ok": false,                         # every rank ok: the exit status is 0
      "ranks": [{                          # one per PID given
        "pid": 4242,
        "status": "wrong",                 # see STATUSES
        "node": 0,                         # the node it should be on; null: none (unbound)
        "local_nodes": [0],                # nodes whose pages count as local (a GPU's own memory node too)
        "expected": "GPU 3 is on node 0",  # why that node
        "numbering": "GPUs numbered by ...",  # with --gpu: whose CUDA_VISIBLE_DEVICES; else null
        "memory": {CLASS: USAGE},          # the whole rank; shared pages mapped by several processes once
        "problems": ["1.2 GiB of page-locked memory (100%) on node 1: ...; GPU 3 is on node 0", ...],
        "processes": [{                    # the rank's process first, then its descendants
          "pid": 4242, "ppid": 1, "name": "python3",  # ppid and name null when never read
          "status": "wrong",
          "reason": null,                  # why "exited", "unreadable" or "missing"
          "threads": [{"tids": [4242, 4250], "cpus": [0, 1], "cpu_nodes": [0], "mems": [0, 1]}],
                                           # threads grouped by allowed CPUs and memory nodes (cpuset)
          "memory": {CLASS: USAGE},
          "remote_share": 0.4,             # of all its own memory, on nodes other than local_nodes
          "policies": [{                   # mappings under a policy that places pages elsewhere
            "class": "page_locked", "policy": "interleave:0-3", "mappings": 1, "size": 16777216,
            "bytes": {"0": 4194304, "1": 4194304}, "labels": ["numafast pool"],
            "inherited": true,             # the process's own policy, not one set on the memory (mbind)
            "cause": "...", "fix": "..."}],
          "problems": ["..."]
        }]
      }]
    }

CLASS is ``page_locked`` (smaps VmFlags ``lo``: mlock'ed), ``shared`` (shmem: /dev/shm,
memfd, System V, shared anonymous) or ``anonymous`` (private: heap, stacks, arrays);
mapped files are not counted. USAGE is ``{"bytes": {NODE: bytes}, "mappings": count,
"labels": {LABEL: {NODE: bytes}}}``, LABEL what the memory probably is (``numafast
pool``, ``torch shared tensor``, ``shared anonymous``, ``memfd``, ``/dev/shm file``,
``System V shared memory``, ``anonymous``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from numafast.cli.check.classes import MemoryClass

SCHEMA = "numafast.check/1"
STATUSES = {
    "ok": "placed as expected",
    "wrong": "placed wrongly; the problems say how",
    "exited": "ended while it was audited",
    "unreadable": "cannot be audited: the kernel refuses its files (another user's process), or --gpu names no GPU of it",
    "missing": "no such process visible here",
}


@dataclass
class ClassUsage:
    """One class of memory: bytes per node, per label."""

    labels: dict[str, dict[int, int]] = field(default_factory=dict)
    mappings: int = 0

    def add(self, label: str, node_bytes: dict[int, int]) -> None:
        held = self.labels.setdefault(label, {})
        for node, count in node_bytes.items():
            held[node] = held.get(node, 0) + count
        self.mappings += 1

    @property
    def node_bytes(self) -> dict[int, int]:
        total: dict[int, int] = {}
        for held in self.labels.values():
            for node, count in held.items():
                total[node] = total.get(node, 0) + count
        return dict(sorted(total.items()))

    def total(self) -> int:
        return sum(self.node_bytes.values())


@dataclass
class ThreadGroup:
    """Threads that may run on the same CPUs and allocate on the same nodes."""

    tids: list[int]
    cpus: list[int]
    cpu_nodes: list[int]
    mems: list[int]


@dataclass
class PolicyFinding:
    """Mappings of one class under one policy that places their pages off the expected node."""

    memory_class: MemoryClass
    policy: str
    mappings: int
    size: int
    node_bytes: dict[int, int]
    labels: list[str]
    inherited: bool
    cause: str
    fix: str


@dataclass
class ProcessAudit:
    """One process: its threads, memory, policies and verdict."""

    pid: int
    status: str
    ppid: int | None = None
    name: str | None = None
    reason: str | None = None
    threads: list[ThreadGroup] = field(default_factory=list)
    memory: dict[MemoryClass, ClassUsage] = field(default_factory=dict)
    remote_share: float = 0.0
    policies: list[PolicyFinding] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


@dataclass
class RankAudit:
    """A process given on the command line and its descendants."""

    pid: int
    status: str
    node: int | None
    local_nodes: list[int]
    expected: str
    numbering: str | None = None
    memory: dict[MemoryClass, ClassUsage] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    processes: list[ProcessAudit] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    """What may explain a verdict without being one: memory placement a container refuses."""


@dataclass
class CheckReport:
    """Every rank audited by one ``numafast check``."""

    version: str
    created: str
    settings: dict[str, Any]
    ranks: list[RankAudit]

    @property
    def ok(self) -> bool:
        return all(rank.status == "ok" for rank in self.ranks)

    def to_json(self) -> str:
        return json.dumps({"schema": SCHEMA, "version": self.version, "created": self.created,
                           "settings": self.settings, "ok": self.ok,
                           "ranks": [_rank_document(rank) for rank in self.ranks]}, indent=1)  # fmt: skip

    @classmethod
    def from_json(cls, text: str) -> CheckReport:
        """The report a ``to_json`` text holds; ValueError unless it follows numafast.check/1."""
        try:
            document = json.loads(text)
            if not isinstance(document, dict) or document.get("schema") != SCHEMA:
                raise ValueError(f"not a {SCHEMA} document")
            report = cls(document["version"], document["created"], document["settings"],
                         [_rank(rank) for rank in document["ranks"]])  # fmt: skip
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"a malformed {SCHEMA} document: {error!r}") from None
        if report.ok != document["ok"]:
            raise ValueError(f"a {SCHEMA} document whose 'ok' contradicts its ranks' statuses")
        return report


def _nodes(node_bytes: dict[int, int]) -> dict[str, int]:
    return {str(node): count for node, count in sorted(node_bytes.items())}


def _node_ids(document: dict[str, int]) -> dict[int, int]:
    return {int(node): int(count) for node, count in document.items()}


def _memory_document(memory: dict[MemoryClass, ClassUsage]) -> dict[str, Any]:
    return {memory_class.value: {"bytes": _nodes(usage.node_bytes), "mappings": usage.mappings,
                                 "labels": {label: _nodes(held) for label, held in usage.labels.items()}}
            for memory_class, usage in memory.items()}  # fmt: skip


def _memory(document: dict[str, Any]) -> dict[MemoryClass, ClassUsage]:
    memory: dict[MemoryClass, ClassUsage] = {}
    for name, usage in document.items():
        memory[MemoryClass(name)] = ClassUsage({label: _node_ids(held) for label, held in usage["labels"].items()},
                                               usage["mappings"])  # fmt: skip
        if memory[MemoryClass(name)].node_bytes != _node_ids(usage["bytes"]):
            raise ValueError(f"{SCHEMA}: {name} bytes differ from the sum of its labels")
    return memory


def _process_document(process: ProcessAudit) -> dict[str, Any]:
    return {
        "pid": process.pid, "ppid": process.ppid, "name": process.name, "status": process.status,
        "reason": process.reason,
        "threads": [vars(group) for group in process.threads],
        "memory": _memory_document(process.memory),
        "remote_share": process.remote_share,
        "policies": [{"class": finding.memory_class.value, "policy": finding.policy, "mappings": finding.mappings,
                      "size": finding.size, "bytes": _nodes(finding.node_bytes), "labels": finding.labels,
                      "inherited": finding.inherited, "cause": finding.cause, "fix": finding.fix}
                     for finding in process.policies],
        "problems": process.problems,
    }  # fmt: skip


def _process(document: dict[str, Any]) -> ProcessAudit:
    _status(document["status"])
    return ProcessAudit(
        document["pid"], document["status"], document["ppid"], document["name"], document["reason"],
        [ThreadGroup(**group) for group in document["threads"]], _memory(document["memory"]),
        document["remote_share"],
        [PolicyFinding(MemoryClass(f["class"]), f["policy"], f["mappings"], f["size"], _node_ids(f["bytes"]),
                       f["labels"], f["inherited"], f["cause"], f["fix"]) for f in document["policies"]],
        document["problems"],
    )  # fmt: skip


def _rank_document(rank: RankAudit) -> dict[str, Any]:
    return {"pid": rank.pid, "status": rank.status, "node": rank.node, "local_nodes": rank.local_nodes,
            "expected": rank.expected, "numbering": rank.numbering, "memory": _memory_document(rank.memory),
            "problems": rank.problems, "processes": [_process_document(p) for p in rank.processes],
            "notes": rank.notes}  # fmt: skip


def _rank(document: dict[str, Any]) -> RankAudit:
    _status(document["status"])
    return RankAudit(document["pid"], document["status"], document["node"], document["local_nodes"],
                     document["expected"], document["numbering"], _memory(document["memory"]),
                     document["problems"], [_process(p) for p in document["processes"]],
                     list(document.get("notes", [])))  # fmt: skip


def _status(status: object) -> None:
    if status not in STATUSES:
        raise ValueError(f"{SCHEMA}: status {status!r} is not one of {', '.join(STATUSES)}")
