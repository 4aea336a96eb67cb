"""The CPUs and nodes a process may use: its affinity and its cpuset's mems.

Live, the kernel says it directly (sched_getaffinity, Mems_allowed_list). A
snapshot says it in ``proc/self/status`` when that was saved (the lists, or on
old kernels only the masks ``Cpus_allowed`` and ``Mems_allowed``); otherwise the
cpuset the snapshot's process sat in says it, found through ``proc/self/cgroup``
(or ``proc/self/cpuset``) and ``proc/mounts``, in one of three forms:

* cgroup v1 (``cgroup`` mounted with the ``cpuset`` option): ``cpuset.cpus`` and
  ``cpuset.mems`` (``cpus`` and ``mems`` when also mounted ``noprefix``);
* the legacy cpuset filesystem (type ``cpuset``, e.g. at ``/dev/cpuset``), which is
  that same hierarchy mounted ``noprefix``: ``cpus`` and ``mems``;
* cgroup v2: ``cpuset.cpus.effective`` and ``cpuset.mems.effective``.
"""

from __future__ import annotations

import os
from pathlib import Path, PurePosixPath

from numafast.topo.files import id_set, read_fields, read_id_list, read_lines
from numafast.topo.model import Node

PROC_SELF = Path("proc/self")
CGROUP_V1_FILES = ("cpuset.cpus", "cpuset.mems")
# A v1 cpuset hierarchy mounted "noprefix", as the legacy cpuset filesystem always is.
NOPREFIX_FILES = ("cpus", "mems")
CGROUP_V2_FILES = ("cpuset.cpus.effective", "cpuset.mems.effective")

IdSets = tuple[list[int] | None, list[int] | None]


def from_status(root: Path) -> IdSets:
    """The allowed CPUs and mems of ``proc/self/status``: the ``*_allowed_list`` fields, or
    the ``Cpus_allowed`` / ``Mems_allowed`` masks where the lists are missing."""
    path = root / PROC_SELF / "status"
    fields = read_fields(path)
    if fields is None:
        return None, None
    cpus, mems = (
        id_set(fields.get(f"{name}_list"), fields.get(name), f"{path}: {name}_list", name)
        for name in ("Cpus_allowed", "Mems_allowed")
    )
    return cpus, mems


V1Mount = tuple[Path, tuple[str, str]]


def cgroup_mounts(root: Path) -> tuple[V1Mount | None, Path | None]:
    """From ``proc/mounts``: the v1 cpuset hierarchy's mount point with the names of its
    cpus and mems files, and the v2 unified hierarchy's mount point."""
    v1: V1Mount | None = None
    v2: Path | None = None
    for line in read_lines(root / "proc/mounts") or []:
        words = line.split()
        if len(words) < 4:
            continue
        mount_point, fs_type, options = words[1], words[2], words[3].split(",")
        if fs_type == "cgroup2":
            v2 = Path(mount_point)
        elif v1 is None and (fs_type == "cpuset" or (fs_type == "cgroup" and "cpuset" in options)):
            noprefix = fs_type == "cpuset" or "noprefix" in options
            v1 = Path(mount_point), NOPREFIX_FILES if noprefix else CGROUP_V1_FILES
    return v1, v2


def cgroup_paths(root: Path) -> tuple[str | None, str | None]:
    """The process's cgroup path in the v1 cpuset hierarchy and in the v2 hierarchy.

    ``proc/self/cgroup`` lines are 'ID:controllers:path'; v2's is '0::path'.
    ``proc/self/cpuset`` holds the cpuset path alone: all an old kernel with the
    legacy cpuset filesystem (and no cgroups) has.
    """
    v1: str | None = None
    v2: str | None = None
    for line in read_lines(root / PROC_SELF / "cgroup") or []:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "cpuset" in controllers.split(","):
            v1 = path
    if v1 is None or v2 is None:
        lines = read_lines(root / PROC_SELF / "cpuset")
        if lines:
            v1 = v1 or lines[0]
            v2 = v2 or lines[0]
    return v1, v2


def cpuset_files(root: Path, mount: Path, cgroup: str, names: tuple[str, str]) -> IdSets:
    """The cpuset lists of a cgroup, looking up towards the mount's root.

    A v2 cgroup without the cpuset controller has no cpuset files: its parent's
    effective sets apply. Inside a container without a cgroup namespace the
    process's path names a host directory that is not mounted there: then the
    mount's root is the container's own cgroup.
    """
    base = root / mount.relative_to(mount.anchor)
    directory = base / PurePosixPath(cgroup).relative_to("/") if cgroup.startswith("/") else base
    if not directory.is_dir():
        directory = base
    while True:
        if (directory / names[0]).exists():
            return read_id_list(directory / names[0]), read_id_list(directory / names[1])
        if directory == base or base not in directory.parents:
            return None, None
        directory = directory.parent


def from_cgroup(root: Path) -> IdSets:
    """The cpuset's CPUs and mems, v1 (or the legacy cpuset filesystem) first: on a hybrid
    host it is the one that holds the cpuset."""
    v1_mount, v2_mount = cgroup_mounts(root)
    v1_path, v2_path = cgroup_paths(root)
    if v1_mount is not None and v1_path is not None:
        cpus, mems = cpuset_files(root, v1_mount[0], v1_path, v1_mount[1])
        if cpus is not None:
            return cpus, mems
    if v2_mount is not None and v2_path is not None:
        return cpuset_files(root, v2_mount, v2_path, CGROUP_V2_FILES)
    return None, None


def snapshot_allowed(root: Path, nodes: list[Node], online_cpus: list[int]) -> tuple[list[int], list[int]]:
    """(allowed CPUs, allowed nodes) as the snapshot's files say, limited to what exists.

    With neither a status file nor a cpuset, nothing restricts: every online CPU
    and every node with memory (the kernel's Mems_allowed of an unconfined task).
    """
    cpus, mems = from_status(root)
    if cpus is None and mems is None:
        cpus, mems = from_cgroup(root)
    node_ids = {node.id for node in nodes}
    if cpus is None:
        cpus = online_cpus
    if mems is None:
        mems = [node.id for node in nodes if node.mem_total != 0]
    return sorted(set(cpus).intersection(online_cpus)), sorted(node_ids.intersection(mems))


def live_allowed(nodes: list[Node]) -> tuple[list[int], list[int]]:
    """(allowed CPUs, allowed nodes) of the calling thread, asked of the kernel now."""
    cpus = sorted(os.sched_getaffinity(0))
    _, mems = from_status(Path("/"))
    if mems is None:
        mems = [node.id for node in nodes if node.mem_total != 0]
    node_ids = {node.id for node in nodes}
    return cpus, sorted(node_ids.intersection(mems))
