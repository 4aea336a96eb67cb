"""Reading one process from /proc: its parent, threads, and mappings with their pages per node.

Every reader raises :class:`ProcessGone` when the process ended (or its pid was
reused) while it was read, and :class:`ProcessUnreadable` when the kernel refuses
the files (another user's process without CAP_SYS_PTRACE), so that a caller
reports both instead of failing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

from numafast._validate import parse_ids

PROC = Path("/proc")


class ProcessGone(Exception):
    """The process ended, or became a zombie, while it was read."""


class ProcessUnreadable(Exception):
    """The kernel refuses to show the process's files to this checker."""


@dataclass(frozen=True)
class Thread:
    """One thread's allowed CPUs and memory nodes (/proc/PID/task/TID/status)."""

    tid: int
    cpus: tuple[int, ...]
    mems: tuple[int, ...]


@dataclass(frozen=True)
class Mapping:
    """One mapping of /proc/PID/numa_maps joined with its /proc/PID/smaps entry."""

    start: int
    policy: str
    """The policy as numa_maps prints it: ``default``, ``interleave:0-3``, ``prefer (many):0-1``..."""
    path: str | None
    """The mapped file, escapes undone (``/memfd:NAME (deleted)``); None for anonymous memory."""
    shared: bool
    """Mapped MAP_SHARED (the ``s`` of smaps' permissions)."""
    locked: bool
    """Page-locked: mlock'ed or mapped MAP_LOCKED (VmFlags ``lo``)."""
    size: int
    """Bytes of address space."""
    node_bytes: dict[int, int] = field(default_factory=dict)
    """Bytes resident per node, as far as this process maps them."""
    identity: tuple[str, int, int] = ("", 0, 0)
    """(device, inode, offset) of a file mapping: the same pages mapped by several processes."""


@dataclass(frozen=True)
class Process:
    """What /proc shows of one process."""

    pid: int
    ppid: int
    name: str
    threads: tuple[Thread, ...]
    mappings: tuple[Mapping, ...]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
        raise ProcessGone(str(path)) from None
    except PermissionError as error:
        # The memory files need ptrace read access: the same user, or CAP_SYS_PTRACE.
        raise ProcessUnreadable(f"{path}: {error.strerror} (another user's process, or one this checker "
                                "may not trace; reading it needs that user or CAP_SYS_PTRACE)") from None


def stat_fields(pid: int) -> tuple[str, str, int, int]:
    """(command name, state letter, parent pid, start time) from /proc/PID/stat."""
    text = _read(PROC / str(pid) / "stat")
    # The name sits in parentheses and may itself hold spaces and parentheses.
    name = text[text.index("(") + 1 : text.rindex(")")]
    rest = text[text.rindex(")") + 2 :].split()
    return name, rest[0], int(rest[1]), int(rest[19])


def parent_pids() -> dict[int, int]:
    """{pid: parent pid} of every process this checker can see."""
    parents: dict[int, int] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = stat_fields(int(entry.name))[2]
            except (ProcessGone, ProcessUnreadable, ValueError, IndexError):
                continue
    return parents


def descendants(pid: int) -> list[tuple[int, int]]:
    """(pid, parent pid) of every process below ``pid`` (its children, theirs, ...), parents first."""
    children: dict[int, list[int]] = {}
    for child, parent in parent_pids().items():
        children.setdefault(parent, []).append(child)
    found: list[tuple[int, int]] = []
    waiting = [(child, pid) for child in sorted(children.get(pid, []))]
    while waiting:
        child, parent = waiting.pop(0)
        found.append((child, parent))
        waiting.extend((grandchild, child) for grandchild in sorted(children.get(child, [])))
    return found


def _status_fields(text: str) -> dict[str, str]:
    return {key: value.strip() for key, _, value in (line.partition(":") for line in text.splitlines())}


def threads(pid: int) -> tuple[Thread, ...]:
    """Each thread's allowed CPUs and nodes; a thread that ends while it is read is left out."""
    found: list[Thread] = []
    try:
        tids = sorted(int(task.name) for task in (PROC / str(pid) / "task").iterdir())
    except (FileNotFoundError, ProcessLookupError):
        raise ProcessGone(f"/proc/{pid}/task") from None
    except PermissionError as error:
        raise ProcessUnreadable(f"/proc/{pid}/task: {error.strerror}") from None
    for tid in tids:
        try:
            fields = _status_fields(_read(PROC / str(pid) / "task" / str(tid) / "status"))
        except ProcessGone:
            continue
        if "Cpus_allowed_list" in fields:
            found.append(Thread(tid, tuple(parse_ids(fields["Cpus_allowed_list"])),
                                tuple(parse_ids(fields.get("Mems_allowed_list", "")))))  # fmt: skip
    return tuple(found)


# numa_maps: "START POLICY [file=PATH | heap | stack | huge] KEY=VALUE...". Two policy
# names hold a space; the path escapes space, tab, newline and "=" as \ooo octal.
NUMA_MAPS_LINE = re.compile(
    r"(?P<start>[0-9a-f]+) (?P<policy>(?:weighted interleave|prefer \(many\)|[a-z]+)(?:=[a-z|]+)?(?::[0-9,-]+)?)"
    r"(?: file=(?P<path>\S+))?(?P<rest>.*)"
)
OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def unescape(path: str) -> str:
    """Undo the kernel's \\ooo escapes in a numa_maps path."""
    return OCTAL_ESCAPE.sub(lambda match: chr(int(match.group(1), 8)), path)


@dataclass
class NumaMapsLine:
    """One line of /proc/PID/numa_maps."""

    start: int
    policy: str
    path: str | None
    node_bytes: dict[int, int]


def parse_numa_maps(text: str) -> list[NumaMapsLine]:
    """The mappings of a /proc/PID/numa_maps text, with bytes per node."""
    lines: list[NumaMapsLine] = []
    for line in text.splitlines():
        match = NUMA_MAPS_LINE.fullmatch(line.strip())
        if match is None:
            continue
        words = dict(word.partition("=")[::2] for word in match["rest"].split() if "=" in word)
        # N<node>= counts pages of the mapping's own size, kernelpagesize_kB: the base
        # page (4, 16 or 64 KiB; THP counted in base pages) or a hugetlb page. The
        # kernel writes it on every line with a count.
        counts = {int(key[1:]): int(value) for key, value in words.items() if key[:1] == "N" and key[1:].isdigit()}
        page_bytes = int(words["kernelpagesize_kB"]) * 1024 if counts else 0
        node_bytes = {node: count * page_bytes for node, count in counts.items()}
        path = unescape(match["path"]) if match["path"] else None
        lines.append(NumaMapsLine(int(match["start"], 16), match["policy"], path, node_bytes))
    return lines


@dataclass
class SmapsEntry:
    """What /proc/PID/smaps adds for one mapping."""

    size: int
    shared: bool
    locked: bool
    identity: tuple[str, int, int]


SMAPS_HEADER = re.compile(r"([0-9a-f]+)-([0-9a-f]+) (\S{4}) ([0-9a-f]+) (\S+) (\d+)")


def parse_smaps(text: str) -> dict[int, SmapsEntry]:
    """{mapping start: its size, sharing, page-locking and file identity} from a smaps text."""
    entries: dict[int, SmapsEntry] = {}
    current: SmapsEntry | None = None
    for line in text.splitlines():
        header = SMAPS_HEADER.match(line)
        if header is not None:
            start, end, permissions, offset, device, inode = header.groups()
            current = SmapsEntry(int(end, 16) - int(start, 16), permissions[3] == "s", False,
                                 (device, int(inode), int(offset, 16)))  # fmt: skip
            entries[int(start, 16)] = current
        elif current is not None and line.startswith("VmFlags:"):
            current.locked = current.locked or "lo" in line.split()[1:]
        elif current is not None and line.startswith("Locked:"):
            # Locked: counts the locked pages' proportional share; VmFlags "lo" also marks
            # a locked mapping with nothing resident yet.
            current.locked = current.locked or int(line.split()[1]) > 0
    return entries


def join(numa_maps: list[NumaMapsLine], smaps: dict[int, SmapsEntry]) -> tuple[Mapping, ...]:
    """The mappings, numa_maps' pages and policy with smaps' sharing and locking.

    The two files are read one after the other: a mapping made or unmapped in between
    is in one of them only, and is kept as numa_maps shows it, unlocked and of unknown size.
    """
    mappings: list[Mapping] = []
    for line in numa_maps:
        entry = smaps.get(line.start)
        shared = entry.shared if entry else False
        mappings.append(Mapping(line.start, line.policy, line.path, shared, entry.locked if entry else False,
                                entry.size if entry else 0, line.node_bytes,
                                entry.identity if entry else ("", 0, 0)))  # fmt: skip
    return tuple(mappings)


def read_process(pid: int) -> Process:
    """The process as /proc shows it now; ProcessGone if it ended (or is a zombie) meanwhile."""
    name, state, ppid, started = stat_fields(pid)
    if state in "ZX":
        raise ProcessGone(f"{pid} has exited")
    thread_list = threads(pid)
    mappings = join(parse_numa_maps(_read(PROC / str(pid) / "numa_maps")),
                    parse_smaps(_read(PROC / str(pid) / "smaps")))  # fmt: skip
    # A process that exits while its files are read leaves them empty, and its pid
    # may already be another process's: the same start time proves it is the same one.
    _, state, _, started_now = stat_fields(pid)
    if started_now != started or state in "ZX":
        raise ProcessGone(f"{pid} exited while it was read")
    return Process(pid, ppid, name, thread_list, mappings)


def hidden_pid_note() -> str | None:
    """Why a pid may be missing although it runs: /proc mounted with hidepid."""
    try:
        mounts = (PROC / "self" / "mounts").read_text()
    except OSError:
        return None
    for line in mounts.splitlines():
        words = line.split()
        if len(words) > 3 and words[1] == str(PROC):
            option = next((o for o in words[3].split(",") if o.startswith("hidepid=")), None)
            if option is not None and option not in ("hidepid=0", "hidepid=off"):
                return f"/proc is mounted with {option}: other users' processes are invisible here"
    return None

