"""Logical CPUs from ``sys/devices/system/cpu``: which are online, their package,
SMT siblings and last-level-cache group."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from numafast._validate import format_ids
from numafast.topo.files import read_id_list, read_id_set, read_int, read_text, subdirs, warn
from numafast.topo.model import Cpu

CPU_DIR = Path("sys/devices/system/cpu")
# Cache types whose sharing says which CPUs compete for data (not Instruction caches).
DATA_CACHE_TYPES = ("Unified", "Data")


def online_cpus(root: Path) -> list[int]:
    """CPUs the kernel has online: ``cpu/online``, else (older kernels) each ``cpuN``
    directory whose own ``cpuN/online`` switch is not 0 (cpu0 often has no switch).

    An offline CPU keeps its directory (to be onlined again) but runs nothing, so
    it is no CPU of the topology.
    """
    online = read_id_list(root / CPU_DIR / "online")
    if online:
        return online
    present = [number for number, _ in subdirs(root / CPU_DIR, "cpu")]
    if not present:
        warn(f"{root / CPU_DIR / 'online'}: missing or empty, and no cpuN directory: no CPUs")
        return []
    offline = [cpu for cpu in present if read_int(root / CPU_DIR / f"cpu{cpu}" / "online") == 0]
    warn(
        f"{root / CPU_DIR / 'online'}: missing or empty; taking the CPUs whose own cpuN/online "
        f"switch is not 0 (offline: {format_ids(offline)})"
    )
    return [cpu for cpu in present if cpu not in offline]


def package_of(root: Path, cpu: int) -> int | None:
    """``cpuN/topology/physical_package_id``: the socket."""
    return read_int(root / CPU_DIR / f"cpu{cpu}" / "topology" / "physical_package_id")


def smt_siblings(root: Path, cpu: int) -> list[int] | None:
    """``cpuN/topology/thread_siblings_list`` (core_cpus_list on newer kernels), or their
    masks ``thread_siblings`` / ``core_cpus``: one physical core."""
    topology = root / CPU_DIR / f"cpu{cpu}" / "topology"
    siblings = read_id_set(topology / "thread_siblings_list", topology / "thread_siblings")
    if siblings is None:
        siblings = read_id_set(topology / "core_cpus_list", topology / "core_cpus")
    return siblings


def last_level_cache_dir(root: Path, cpu: int) -> tuple[Path, list[int]] | None:
    """``cpu``'s highest-level Unified or Data cache (``cpuN/cache/indexM``) whose sharing
    CPUs are known: its directory (for its ``size``...) and the CPUs that share it
    (its ``shared_cpu_list``, or the ``shared_cpu_map`` mask). None when the cache
    directory is missing.
    """
    best: tuple[int, Path, list[int]] | None = None
    for _, index in subdirs(root / CPU_DIR / f"cpu{cpu}" / "cache", "index"):
        if read_text(index / "type") not in DATA_CACHE_TYPES:
            continue
        level = read_int(index / "level")
        if level is None or (best is not None and level <= best[0]):
            continue
        cpus = read_id_set(index / "shared_cpu_list", index / "shared_cpu_map")
        if cpus:
            best = level, index, cpus
    return None if best is None else best[1:]


def last_level_cache(root: Path, cpu: int) -> list[int] | None:
    """CPUs sharing ``cpu``'s last-level cache (:func:`last_level_cache_dir`).

    On an EPYC this is one CCX's L3 (several per node); on a Xeon the socket's L3.
    """
    found = last_level_cache_dir(root, cpu)
    return None if found is None else found[1]


def read_cpus(root: Path, online: list[int], node_of: Mapping[int, int]) -> list[Cpu]:
    """Each of the ``online`` CPUs with its node (None if no node lists it), package, core
    and LLC group.

    No cache is shared by CPUs of different packages (sockets): a last-level cache
    reported so (a hypervisor's made-up CPUID, a firmware bug) is taken to be the
    package's. Damage is reported once per kind, naming the CPUs, rather than once
    per CPU.
    """
    online_set = set(online)
    no_siblings: list[int] = []
    no_cache: list[int] = []
    package = {cpu: package_of(root, cpu) for cpu in online}
    siblings: dict[int, list[int]] = {}
    llc: dict[int, list[int]] = {}
    for cpu in online:
        listed_siblings = smt_siblings(root, cpu)
        if listed_siblings is None:
            no_siblings.append(cpu)
        siblings[cpu] = sorted(online_set.intersection(listed_siblings or ()) | {cpu})
        llc_cpus = last_level_cache(root, cpu)
        if llc_cpus is None:
            no_cache.append(cpu)
            # Every level of a core's cache is shared by its SMT siblings at least.
            llc[cpu] = siblings[cpu]
        else:
            llc[cpu] = sorted(online_set.intersection(llc_cpus) | {cpu})
    package_cpus: dict[int, list[int]] = {}
    for cpu, number in package.items():
        if number is not None:
            package_cpus.setdefault(number, []).append(cpu)
    across_packages: list[int] = []
    for cpu in online:
        number = package[cpu]
        if number is not None and any(package[other] not in (number, None) for other in llc[cpu]):
            across_packages.append(cpu)
            llc[cpu] = package_cpus[number]
    if no_package := [cpu for cpu in online if package[cpu] is None]:
        warn(f"cpu {format_ids(no_package)}: no topology/physical_package_id; package unknown")
    if no_siblings:
        warn(
            f"cpu {format_ids(no_siblings)}: no topology/thread_siblings_list nor thread_siblings; "
            "each taken as its own core"
        )
    if no_cache:
        warn(
            f"cpu {format_ids(no_cache)}: no cache/index*/ with a Unified or Data cache; "
            "last-level-cache group taken as the CPU's SMT siblings"
        )
    if across_packages:
        warn(
            f"cpu {format_ids(across_packages)}: the last-level cache is reported shared with CPUs of "
            "another package, which no cache is; taken as the package's CPUs"
        )
    return [
        Cpu(cpu, node_of.get(cpu), package[cpu], siblings[cpu][0], tuple(siblings[cpu]), tuple(llc[cpu]))
        for cpu in online
    ]
