#!/usr/bin/env python3
"""Run a command inside a throw-away QEMU guest with an emulated NUMA topology.

The guest boots the host's stock Debian kernel (``linux-image-amd64``) with a
real ACPI SRAT/SLIT (nodes, CPU-to-node map, distances).  Its root is the
host's ``/``, read-only over 9p under a tmpfs overlay (copy-on-write, writes
vanish); the working directory and any ``rw`` directories are shared
read-write.  The command's stdout, stderr and exit status come back over
three virtio-serial ports and are streamed to ours.

One-time install (Debian 12)::

    apt-get install -y --no-install-recommends \
        qemu-system-x86 busybox-static kmod linux-image-amd64 tiny-initramfs numactl

CLI::

    python3 tests/numa_vm.py [--nodes N] [--cpus C] [--node-cpus "0-1;2-3;"]
        [--mem-per-node 1G|512M,512M,768M] [--distances "10,16;16,10"|20]
        [--cwd DIR] [--rw DIR]... [--env K=V]... [--timeout SECS] [--kernel PATH]
        [--accel tcg|kvm] [--cpu-model M] [--append ARG]... [--verbose] [--check]
        -- CMD ARGS...

Exit status: CMD's (128+N if killed by signal N); 124 on timeout; 125 if the
VM itself failed (qemu's log and the guest console tail go to stderr).
In the guest: NUMA_VM=1, NUMA_VM_NODES, NUMA_VM_CPUS; stdin is /dev/null; root.
Python API: ``run_in_guest(cmd, GuestTopology(...))``.  Stdlib only.
"""

from __future__ import annotations

import argparse
import codecs
import dataclasses
import gzip
import lzma
import os
import re
import shlex
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import IO, Any

PROG = "numa_vm"
EXIT_TIMEOUT = 124
EXIT_VM_FAILED = 125
# Needed before the root is mounted; modprobe adds their dependencies.
GUEST_MODULES = ("virtio_pci", "virtio_console", "9pnet_virtio", "9p", "overlay")
APT_HINT = "apt-get update && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends"
# Host variables that make no sense in the guest (or are read-only in bash).
_ENV_DROP = re.compile(
    r"(PWD|OLDPWD|SHLVL|_|TERM|DISPLAY|WAYLAND_DISPLAY|XAUTHORITY|SSH_.*|DBUS_SESSION_BUS_ADDRESS"
    r"|XDG_RUNTIME_DIR|TMUX|TMUX_PANE|STY|WINDOWID|COLUMNS|LINES|PS1|PROMPT_COMMAND|BASH_ENV|ENV"
    r"|NUMA_VM.*|SHELLOPTS|BASHOPTS|BASH_.*|UID|EUID|PPID|GROUPS)"
)
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# ---------------------------------------------------------------- topology
def _parse_cpulist(spec: str) -> list[int]:
    """'0-1,4' -> [0, 1, 4]."""
    cpus: list[int] = []
    for part in filter(None, spec.replace(" ", "").split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"node_cpus: bad range {part!r}")
        cpus.extend(range(int(m[1]), int(m[2] or m[1]) + 1))
    return cpus


@dataclasses.dataclass(frozen=True)
class GuestTopology:
    """Guest NUMA layout.

    ``mem_per_node_mib``: one size for all nodes or one per node (>= 128 each).
    ``distances``: full SLIT matrix (diagonal 10, others 11..254; Linux drops
    the whole SLIT otherwise); None = 20 between all nodes.
    ``node_cpus``: per-node cpulists ("0-1", "2,3"; "" = memory-only node,
    which must come last); None = split the CPUs evenly, remainder first.
    """

    nodes: int
    cpus: int
    mem_per_node_mib: tuple[int, ...] | int = 1024
    distances: tuple[tuple[int, ...], ...] | None = None
    node_cpus: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.nodes <= 64 or not 1 <= self.cpus <= 64:
            raise ValueError("nodes and cpus must be 1..64")
        if len(self.mem_mib) != self.nodes or min(self.mem_mib) < 128:
            raise ValueError(f"mem_per_node_mib: need 1 or {self.nodes} sizes, each >= 128 MiB")
        dist = self.distance_matrix
        if len(dist) != self.nodes or any(len(row) != self.nodes for row in dist):
            raise ValueError(f"distances: need a {self.nodes}x{self.nodes} matrix")
        for i, row in enumerate(dist):
            for j, d in enumerate(row):
                if i == j and d != 10:
                    raise ValueError(f"distances: diagonal must be 10 (node {i}: {d})")
                if i != j and not 10 < d <= 254:
                    raise ValueError(f"distances[{i}][{j}]={d}: must be 11..254 (Linux ignores the SLIT otherwise)")
        seen: set[int] = set()
        for i, spec in enumerate(self.cpu_ranges):
            for c in _parse_cpulist(spec):
                if c >= self.cpus or c in seen:
                    raise ValueError(f"node_cpus: cpu {c} is >= cpus or in two nodes")
                seen.add(c)
            # Linux numbers nodes in SRAT order and QEMU emits CPU nodes first,
            # so a memory-only node before a CPU node would be renumbered.
            if spec and i and not self.cpu_ranges[i - 1]:
                raise ValueError("node_cpus: memory-only nodes must come after all nodes with CPUs")
        if len(self.cpu_ranges) != self.nodes or len(seen) != self.cpus:
            raise ValueError(f"node_cpus: need {self.nodes} entries placing all {self.cpus} cpus")

    @property
    def mem_mib(self) -> tuple[int, ...]:
        m = self.mem_per_node_mib
        return (m,) * self.nodes if isinstance(m, int) else (m * self.nodes if len(m) == 1 else tuple(m))

    @property
    def distance_matrix(self) -> tuple[tuple[int, ...], ...]:
        if self.distances is not None:
            return tuple(tuple(r) for r in self.distances)
        return tuple(tuple(10 if i == j else 20 for j in range(self.nodes)) for i in range(self.nodes))

    @property
    def cpu_ranges(self) -> tuple[str, ...]:
        if self.node_cpus is not None:
            return tuple(s.replace(" ", "") for s in self.node_cpus)
        per, rem = divmod(self.cpus, self.nodes)
        out, nxt = [], 0
        for i in range(self.nodes):
            n = per + (i < rem)
            out.append("" if n == 0 else str(nxt) if n == 1 else f"{nxt}-{nxt + n - 1}")
            nxt += n
        return tuple(out)

    @property
    def sockets(self) -> int:
        """One socket per node on an even default split, so the scheduler's
        package/LLC topology agrees with the nodes; else a single socket."""
        even = self.node_cpus is None and self.cpus % self.nodes == 0
        return self.nodes if even else 1

    def describe(self) -> str:
        pairs = enumerate(zip(self.cpu_ranges, self.mem_mib, strict=True))
        nodes = " ".join(f"node{i}[cpus={c or 'none'} mem={m}M]" for i, (c, m) in pairs)
        dist = ";".join(",".join(map(str, r)) for r in self.distance_matrix)
        return f"{self.nodes} nodes, {self.cpus} vCPUs: {nodes} distances={dist}"


FOUR_NODES = GuestTopology(
    nodes=4, cpus=4, distances=((10, 16, 32, 32), (16, 10, 32, 32), (32, 32, 10, 16), (32, 32, 16, 10))
)
# Node 2 has memory but no CPUs.
MEMORY_ONLY = GuestTopology(
    nodes=3,
    cpus=2,
    node_cpus=("0", "1", ""),
    mem_per_node_mib=(512, 512, 768),
    distances=((10, 20, 40), (20, 10, 40), (40, 40, 10)),
)


# ---------------------------------------------------------------- prerequisites
class MissingPrerequisites(RuntimeError):
    """Raised when host tools are missing; ``str()`` is the apt-get line."""


@dataclasses.dataclass(frozen=True)
class _Host:
    qemu: str
    busybox: str
    kernel: str
    kver: str
    # The guest's root: "/" (this machine's, x86-64), or a foreign root made of
    # another architecture's Debian packages (tests/aarch64_vm.py), which then
    # supplies the kernel, its modules, busybox and every program the guest runs.
    root: str = "/"
    arch: str = "x86_64"


def _vkey(s: str) -> list[Any]:
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", s)]


def _find_kernel(root: str = "/") -> str | None:
    """Newest ROOT/boot/vmlinuz-* whose modules (with 9p) are installed."""
    best = None
    for k in sorted(Path(root, "boot").glob("vmlinuz-*"), key=lambda p: _vkey(p.name)):
        mods = Path(root, "lib/modules", k.name.removeprefix("vmlinuz-"), "kernel/fs/9p")
        if os.access(k, os.R_OK) and any(mods.glob("9p.ko*")):
            best = str(k)
    return best


def _is_static_elf(path: str) -> bool:
    """True for an ELF64 without a PT_INTERP program header (no libc needed)."""
    try:
        with open(path, "rb") as f:
            hdr = f.read(64)
            if hdr[:5] != b"\x7fELF\x02":
                return False
            phoff, = struct.unpack_from("<Q", hdr, 32)
            phentsize, phnum = struct.unpack_from("<HH", hdr, 54)
            f.seek(phoff)
            ph = f.read(phentsize * phnum)
        return all(struct.unpack_from("<I", ph, i * phentsize)[0] != 3 for i in range(phnum))
    except (OSError, struct.error):
        return False


def _host(kernel: str | None = None, root: str = "/") -> _Host:
    if root != "/":
        return _foreign_host(kernel, root)
    qemu = shutil.which(os.environ.get("NUMA_VM_QEMU", "qemu-system-x86_64"))
    busybox = os.environ.get("NUMA_VM_BUSYBOX", "/bin/busybox")
    missing = [] if qemu else ["qemu-system-x86"]
    if not _is_static_elf(busybox):  # the initramfs has no libc
        missing.append("busybox-static")
    if not shutil.which("modprobe", path=os.environ.get("PATH", "") + ":/sbin:/usr/sbin"):
        missing.append("kmod")
    if not shutil.which("setpriv"):
        missing.append("util-linux")
    kernel = kernel or _find_kernel()
    if not kernel:
        # tiny-initramfs satisfies linux-image's initramfs dependency without udev
        missing += ["linux-image-amd64", "tiny-initramfs"]
    if missing:
        raise MissingPrerequisites(f"{APT_HINT} {' '.join(missing)}")
    assert qemu and kernel
    kver = os.environ.get("NUMA_VM_KVER") or re.sub(r"^vmlinu[zx]-", "", Path(kernel).name)
    return _Host(qemu, busybox, kernel, kver)


def _foreign_host(kernel: str | None, root: str) -> _Host:
    """An aarch64 guest on a root of Debian arm64 packages (tests/aarch64_vm.py makes it)."""
    qemu = shutil.which(os.environ.get("NUMA_VM_QEMU", "qemu-system-aarch64"))
    missing = [] if qemu else ["qemu-system-arm"]
    if not shutil.which("modprobe", path=os.environ.get("PATH", "") + ":/sbin:/usr/sbin"):
        missing.append("kmod")
    if not shutil.which("setpriv"):
        missing.append("util-linux")
    if missing:
        raise MissingPrerequisites(f"{APT_HINT} {' '.join(missing)}")
    busybox = os.path.join(root, "bin/busybox")
    kernel = kernel or _find_kernel(root)
    if not kernel or not _is_static_elf(busybox):
        raise MissingPrerequisites(f"{root}: no guest root (kernel, busybox); make it with python3 tests/aarch64_vm.py --prepare")
    assert qemu
    kver = re.sub(r"^vmlinu[zx]-", "", Path(kernel).name)
    return _Host(qemu, busybox, kernel, kver, root=root, arch="aarch64")


def missing_prerequisites() -> str | None:
    """The apt-get line that installs what is missing, or None if all is there."""
    try:
        _host()
    except MissingPrerequisites as e:
        return str(e)
    return None


# ---------------------------------------------------------------- initramfs
def _cpio(entries: Sequence[tuple[str, int, bytes]]) -> bytes:
    """gzip'd newc cpio of (name, mode, data); a char device's data is b'MAJ:MIN'."""
    out = bytearray()

    def add(ino: int, name: str, mode: int, data: bytes, rdev: tuple[int, int] = (0, 0)) -> None:
        nm = name.encode() + b"\0"
        nlink = 2 if mode & 0o040000 else 1
        fields = (ino, mode, 0, 0, nlink, 0, len(data), 0, 0, *rdev, len(nm), 0)
        out.extend(b"070701" + "".join(f"{v:08X}" for v in fields).encode() + nm)
        out.extend(b"\0" * (-len(out) % 4) + data + b"\0" * (-len(data) % 4))

    for ino, (name, mode, data) in enumerate(entries, 1):
        if mode & 0o170000 == 0o020000:
            maj, mnr = map(int, data.split(b":"))
            add(ino, name, mode, b"", (maj, mnr))
        else:
            add(ino, name, mode, data)
    add(0, "TRAILER!!!", 0, b"")
    return gzip.compress(bytes(out), compresslevel=1, mtime=0)


def _module_data(path: str) -> tuple[str, bytes]:
    base = os.path.basename(path)
    if base.endswith(".xz"):
        return base[:-3], lzma.decompress(Path(path).read_bytes())
    if base.endswith(".gz"):
        return base[:-3], gzip.decompress(Path(path).read_bytes())
    if base.endswith(".zst"):  # no zstd in the 3.11 stdlib
        return base[:-4], subprocess.run(["zstd", "-qdc", path], check=True, capture_output=True).stdout
    return base, Path(path).read_bytes()


def _modules(kver: str, root: str = "/") -> list[tuple[str, bytes]]:
    """Guest modules in load order, decompressed, via modprobe --show-depends
    (in ROOT's /lib/modules: a foreign root's modules.dep is made by depmod -b)."""
    out: list[tuple[str, bytes]] = []
    names: set[str] = set()
    modprobe = shutil.which("modprobe", path=os.environ.get("PATH", "") + ":/sbin:/usr/sbin") or "modprobe"
    for mod in GUEST_MODULES:
        where = [] if root == "/" else ["-d", root]
        r = subprocess.run([modprobe, *where, "-S", kver, "--show-depends", mod], capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"modprobe -S {kver} --show-depends {mod}: {r.stderr.strip()}")
        for line in r.stdout.splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "insmod":  # 'builtin x' needs nothing
                name, data = _module_data(words[1])
                if name not in names:
                    names.add(name)
                    out.append((name, data))
    return out


# /init: PID 1 in the initramfs, under the static busybox.
_INIT = r"""#!/bin/busybox sh
/bin/busybox mkdir -p /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
fail() { echo "numa_vm init: $*" >/dev/console; poweroff -f; sleep 5; }
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
while read -r m; do insmod "/mods/$m" || fail "insmod $m"; done </mods/order
mount -t 9p -o ro,trans=virtio,version=9p2000.L,msize=512000,cache=loose numavm_root /lower || fail "mount 9p root"
mount -t tmpfs -o mode=0755 numavm_rw /rw || fail "mount tmpfs"
mkdir -p /rw/upper /rw/work
mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work overlay /newroot || fail "mount overlay"
while read -r tag path; do
    [ -n "$tag" ] || continue
    mkdir -p "/newroot$path" 2>/dev/null
    mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000,cache=mmap "$tag" "/newroot$path" \
        || fail "mount 9p $tag on $path"
done </numavm/shares
mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs /newroot/run
mkdir -p /newroot/run/numavm
cp /numavm/* /bin/busybox /newroot/run/numavm/
mount --move /proc /newroot/proc
mount --move /sys /newroot/sys
mount --move /dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm
mount -t devpts -o gid=5,mode=620,ptmxmode=666 devpts /newroot/dev/pts
mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /newroot/dev/shm
mount -t cgroup2 cgroup2 /newroot/sys/fs/cgroup 2>/dev/null
ln -sf /proc/self/fd /newroot/dev/fd
ln -sf /proc/self/fd/0 /newroot/dev/stdin
ln -sf /proc/self/fd/1 /newroot/dev/stdout
ln -sf /proc/self/fd/2 /newroot/dev/stderr
hostname numa-vm
ip link set lo up 2>/dev/null
exec switch_root /newroot /bin/bash /run/numavm/guest.sh
fail "switch_root failed"
"""

# guest.sh: PID 1 in the overlay root, under the host's bash.  Builtins only
# where possible: every fork+exec costs ~0.1 s under TCG.
_GUEST_SH = r"""BB=/run/numavm/busybox
OUT= ERR= RET=
for p in /sys/class/virtio-ports/*; do
    read -r name <"$p/name" 2>/dev/null || continue
    case "$name" in
        numavm.stdout) OUT=/dev/${p##*/} ;;
        numavm.stderr) ERR=/dev/${p##*/} ;;
        numavm.ret)    RET=/dev/${p##*/} ;;
    esac
done
# busybox poweroff -f syncs all filesystems (the rw 9p shares too) first
finish() { [ -n "$RET" ] && echo "$1" >"$RET"; $BB poweroff -f; sleep 10; }
if [ -z "$OUT" ] || [ -z "$ERR" ] || [ -z "$RET" ]; then
    echo "numa_vm guest: virtio ports missing" >/dev/console; finish 125
fi
. /run/numavm/env.sh
. /run/numavm/cmd.sh
if ! cd "$NUMAVM_CWD"; then echo "numa_vm: cannot cd to $NUMAVM_CWD in the guest" >"$ERR"; finish 125; fi
export PWD="$NUMAVM_CWD"
# A write to a virtio port moves at most 32 KiB; writers that ignore short
# writes (Python's unbuffered stdio under PYTHONUNBUFFERED=1) would lose the
# rest.  So the command writes into pipes, and busybox cats feed the ports.
exec 3> >(trap '' TERM; exec $BB cat >"$OUT"); P1=$!
exec 4> >(trap '' TERM; exec $BB cat >"$ERR"); P2=$!
"${NUMAVM_CMD[@]}" </dev/null >&3 2>&4 3>&- 4>&-
rc=$?
exec 3>&- 4>&-
# Left-over background processes would hold the pipes open: TERM them all
# (the cats ignore it), then wait for the cats to drain.
kill -TERM -1 2>/dev/null
wait "$P1" "$P2"
finish "$rc"
"""


def _guest_env(cwd: str, extra: Mapping[str, str], topo: GuestTopology, foreign: bool = False) -> dict[str, str]:
    if foreign:  # another architecture's root: nothing of this machine's environment applies
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "HOME": "/root", "LANG": "C.UTF-8"}
    else:
        env = {k: v for k, v in os.environ.items() if _IDENT.fullmatch(k) and not _ENV_DROP.fullmatch(k)}
    env.update(TERM="dumb", NUMA_VM="1", NUMA_VM_NODES=str(topo.nodes), NUMA_VM_CPUS=str(topo.cpus))
    env.update(extra)
    if foreign:
        return env
    # A pyenv shim is a bash script forking a dozen times: ~4.5 s per python3
    # under TCG.  Put the interpreter dirs the shim would pick for cwd first.
    path = env.get("PATH", "")
    py = shutil.which("python3", path=path)
    pyenv = shutil.which("pyenv", path=path)
    if py and "/shims/" in py and pyenv:
        r = subprocess.run([pyenv, "prefix"], cwd=cwd, env=env, capture_output=True, text=True)
        bins = [f"{p}/bin" for p in r.stdout.strip().split(":") if r.returncode == 0 and os.path.isdir(f"{p}/bin")]
        if bins:
            env["PATH"] = ":".join([*bins, path])
    return env


def _initramfs(host: _Host, cmd: Sequence[str], cwd: str, env: Mapping[str, str], shares: Sequence[str]) -> bytes:
    d, x = 0o040755, 0o100755
    dirs = ("bin", "mods", "proc", "sys", "dev", "lower", "rw", "newroot", "numavm")
    entries: list[tuple[str, int, bytes]] = [(n, d, b"") for n in dirs]
    entries.append(("dev/console", 0o020600, b"5:1"))
    entries.append(("bin/busybox", x, Path(host.busybox).read_bytes()))
    mods = _modules(host.kver, host.root)
    entries += [(f"mods/{n}", 0o100644, data) for n, data in mods]
    entries.append(("mods/order", 0o100644, "".join(f"{n}\n" for n, _ in mods).encode()))
    entries.append(("init", x, _INIT.encode()))
    entries.append(("numavm/guest.sh", 0o100644, _GUEST_SH.encode()))
    env_sh = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())
    entries.append(("numavm/env.sh", 0o100644, env_sh.encode()))
    cmd_sh = f"NUMAVM_CWD={shlex.quote(cwd)}\nNUMAVM_CMD=({' '.join(map(shlex.quote, cmd))})\n"
    entries.append(("numavm/cmd.sh", 0o100644, cmd_sh.encode()))
    entries.append(("numavm/shares", 0o100644, "".join(f"numavm_rw{i} {p}\n" for i, p in enumerate(shares)).encode()))
    return _cpio(entries)


# ---------------------------------------------------------------- kernel image
def _extract_vmlinux(image: bytes) -> Iterator[bytes]:
    """Candidate ELF vmlinux payloads from a bzImage (xz, gzip or zstd)."""
    for magic in (b"\xfd7zXZ\x00", b"\x1f\x8b\x08", b"\x28\xb5\x2f\xfd"):
        off = image.find(magic)
        for _ in range(5):
            if off < 0:
                break
            try:
                if magic[0] == 0xFD:  # one xz stream; trailing data ends up in unused_data
                    yield lzma.LZMADecompressor(lzma.FORMAT_XZ).decompress(image[off:])
                elif magic[0] == 0x1F:
                    yield zlib.decompressobj(31).decompress(image[off:])
                elif shutil.which("zstd"):
                    yield subprocess.run(["zstd", "-qdc"], input=image[off:], capture_output=True).stdout
            except (lzma.LZMAError, zlib.error, OSError):
                pass
            off = image.find(magic, off + 1)


def _boot_kernel(host: _Host, verbose: bool) -> str:
    """Decompressing a bzImage costs ~3 s per boot under TCG: if the kernel has
    CONFIG_PVH=y, extract its ELF vmlinux once into a cache (atomic rename, so
    concurrent runs are safe) and let qemu boot that through the PVH entry."""
    kernel = host.kernel
    if host.arch != "x86_64":  # arm64's vmlinuz is an uncompressed Image already
        return kernel
    with open(kernel, "rb") as f:
        if f.read(4) == b"\x7fELF":
            return kernel
    try:
        if "CONFIG_PVH=y\n" not in Path(f"/boot/config-{host.kver}").read_text():
            return kernel
    except OSError:
        return kernel
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    cache = Path(os.environ.get("NUMA_VM_CACHE") or xdg / "numa-vm")
    st = os.stat(kernel)
    cached = cache / f"vmlinux-{host.kver}-{st.st_size}-{int(st.st_mtime)}"
    if cached.is_file() and cached.stat().st_size:
        return str(cached)
    for elf in _extract_vmlinux(Path(kernel).read_bytes()):
        if elf[:4] == b"\x7fELF":
            try:
                cache.mkdir(parents=True, exist_ok=True)
                tmp = cached.with_name(f"{cached.name}.{os.getpid()}.tmp")
                tmp.write_bytes(elf)
                os.replace(tmp, cached)
            except OSError as e:
                _warn(f"cannot cache vmlinux in {cache}: {e}; booting {kernel} compressed (slower)")
                return kernel
            if verbose:
                _warn(f"cached uncompressed kernel for PVH boot: {cached}")
            return str(cached)
    _warn(f"could not extract an ELF vmlinux from {kernel}; booting it compressed (slower)")
    return kernel


# ---------------------------------------------------------------- running
def _warn(msg: str) -> None:
    print(f"{PROG}: {msg}", file=sys.stderr, flush=True)


def _qesc(s: str) -> str:
    return s.replace(",", ",,")  # qemu option values write ',' as ',,'


def _clean_stale(tmpdir: str) -> None:
    """Remove work dirs of runs whose process is gone (e.g. SIGKILLed)."""
    for d in Path(tmpdir).glob("numa-vm.*"):
        try:
            pid = int((d / "pid").read_text())
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (OSError, ValueError):
            pass


class _Relay(threading.Thread):
    """Copies a FIFO to a text stream (its binary buffer when it has one),
    flushing each chunk.  Keeps draining if the sink breaks, so the guest
    never blocks on a full port."""

    def __init__(self, fd: int, sink: IO[str]) -> None:
        super().__init__(daemon=True)
        self.fd, self.sink = fd, sink

    def run(self) -> None:
        buf: IO[bytes] | None = getattr(self.sink, "buffer", None)
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        ok = True
        try:
            while chunk := os.read(self.fd, 65536):
                if not ok:
                    continue
                try:
                    if buf is not None:
                        self.sink.flush()
                        buf.write(chunk)
                        buf.flush()
                    else:
                        self.sink.write(dec.decode(chunk))
                        self.sink.flush()
                except (OSError, ValueError):
                    ok = False
        finally:
            os.close(self.fd)


def _qemu_argv(host: _Host, topo: GuestTopology, boot_kernel: str, tmp: str, shares: Sequence[str],
               accel: str, cpu_model: str | None, append: Sequence[str]) -> list[str]:
    q = [host.qemu, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot", "-name", "numa-vm"]
    if host.arch == "aarch64":
        # virt boots the Image directly with a device tree, whose numa-node-id and
        # distance-map give Linux the nodes (memory-only ones too, numbered as given).
        # pauth-impdef: TCG's architected pointer-auth cipher (QARMA) is slow.
        q += ["-machine", "virt,gic-version=3", "-accel", "tcg,thread=multi", "-cpu", cpu_model or "max,pauth-impdef=on"]
    elif accel == "kvm":
        q += ["-machine", "q35"]
        q += ["-accel", "kvm", "-cpu", cpu_model or "host"]
    else:
        q += ["-machine", "q35"]  # q35: i440fx's ACPI PCI-link IRQ setup costs ~0.5 s under TCG
        q += ["-accel", "tcg,thread=multi", "-cpu", cpu_model or "max"]
    s = topo.sockets
    q += ["-smp", f"{topo.cpus},sockets={s},cores={topo.cpus // s},threads=1", "-m", f"{sum(topo.mem_mib)}M"]
    for i, (cpus, mem) in enumerate(zip(topo.cpu_ranges, topo.mem_mib, strict=True)):
        q += ["-object", f"memory-backend-ram,id=numavm-m{i},size={mem}M"]
        q += ["-numa", f"node,nodeid={i},memdev=numavm-m{i}" + "".join(f",cpus={p}" for p in cpus.split(",") if p)]
    for i, row in enumerate(topo.distance_matrix):
        q += [a for j, d in enumerate(row) if i != j for a in ("-numa", f"dist,src={i},dst={j},val={d}")]
    q += ["-fsdev", f"local,id=numavm_root,path={_qesc(host.root)},security_model=none,readonly=on,multidevs=remap",
          "-device", "virtio-9p-pci,fsdev=numavm_root,mount_tag=numavm_root"]
    for i, p in enumerate(shares):
        q += ["-fsdev", f"local,id=numavm_rw{i},path={_qesc(p)},security_model=none,multidevs=remap",
              "-device", f"virtio-9p-pci,fsdev=numavm_rw{i},mount_tag=numavm_rw{i}"]
    q += ["-device", "virtio-serial-pci,id=numavm-vser"]
    for port, f in (("stdout", "out"), ("stderr", "err"), ("ret", "ret")):
        q += ["-chardev", f"file,id=numavm-{f},path={_qesc(tmp)}/{f}",
              "-device", f"virtserialport,bus=numavm-vser.0,chardev=numavm-{f},name=numavm.{port}"]
    q += ["-chardev", f"file,id=numavm-con,path={_qesc(tmp)}/console.log", "-serial", "chardev:numavm-con"]
    console = ["console=ttyAMA0"] if host.arch == "aarch64" else ["console=ttyS0", "edd=off"]
    kargs = [*console, "quiet", "loglevel=4", "panic=-1", "rdinit=/init", "mitigations=off",
             "numa_balancing=disable", *append]  # balancing would migrate pages behind the tests' back
    return q + ["-kernel", boot_kernel, "-initrd", f"{tmp}/initramfs.cpio.gz", "-append", " ".join(kargs)]


def run_in_guest(
    cmd: Sequence[str],
    topology: GuestTopology,
    *,
    cwd: str | Path = ".",
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
    rw: Sequence[str | Path] = (),
    kernel: str | None = None,
    accel: str = "tcg",
    cpu_model: str | None = None,
    append: Sequence[str] = (),
    verbose: bool = False,
    root: str | Path = "/",
) -> int:
    """Run ``cmd`` in a fresh NUMA guest; return its exit status.

    The host environment is passed through (minus TERM, DISPLAY, SSH_* and
    the like) with ``env`` on top.  With ``root`` another architecture's root
    (tests/aarch64_vm.py: Debian arm64 packages), the guest is an aarch64
    ``virt`` machine booting that root's kernel, with only ``env`` and a plain
    PATH, HOME and LANG.  ``cwd`` and ``rw`` are shared read-write;
    the rest of / is copy-on-write.  Guest stdout/stderr are streamed to
    sys.stdout/sys.stderr as they arrive.  Returns 124 after ``timeout``
    seconds (0/None: no limit), 125 if the VM failed or prerequisites are
    missing.  qemu runs under PR_SET_PDEATHSIG, so it dies with us even on
    SIGKILL (the signal is tied to the calling thread, which blocks here).
    """
    if not cmd:
        raise ValueError("empty command")
    if accel not in ("tcg", "kvm"):
        raise ValueError("accel must be tcg or kvm")
    if accel == "kvm" and os.path.isdir("/sys/module/kvm_pvm"):
        # kvm_pvm runs only PVM-enabled guest kernels; a stock one never boots
        raise ValueError("accel=kvm: /dev/kvm here is kvm_pvm, which cannot run a stock kernel; use tcg")
    try:
        host = _host(kernel, os.path.realpath(root))
    except MissingPrerequisites as e:
        _warn(f"missing prerequisites. Install them once with:\n  {e}")
        return EXIT_VM_FAILED
    cwd_abs = os.path.realpath(cwd)
    if not os.path.isdir(cwd_abs):
        raise ValueError(f"cwd {cwd}: no such directory")
    shares: list[str] = [] if cwd_abs == "/" else [cwd_abs]
    for d in map(os.path.realpath, rw):
        if not os.path.isdir(d) or d == "/":
            raise ValueError(f"rw {d}: not a directory, or /")
        if d not in shares:
            shares.append(d)
    shares.sort(key=lambda p: p.count("/"))  # parents are mounted before children
    guest_env = _guest_env(cwd_abs, env or {}, topology, foreign=host.root != "/")
    boot_kernel = _boot_kernel(host, verbose)

    tmpdir = tempfile.gettempdir()
    _clean_stale(tmpdir)
    tmp = tempfile.mkdtemp(prefix="numa-vm.", dir=tmpdir)
    proc: subprocess.Popen[bytes] | None = None
    relays: list[_Relay] = []
    holders: list[int] = []
    try:
        Path(tmp, "pid").write_text(f"{os.getpid()}\n")
        Path(tmp, "initramfs.cpio.gz").write_bytes(_initramfs(host, cmd, cwd_abs, guest_env, shares))
        Path(tmp, "ret").touch()
        # qemu writes guest stdout/stderr into FIFOs.  We open each for reading
        # (non-blocking, so the open cannot hang) and also hold a dummy write
        # end: qemu's open then never blocks, the reader never sees a premature
        # EOF, and closing our write end after qemu exits gives the reader EOF.
        for name, sink in (("out", sys.stdout), ("err", sys.stderr)):
            fifo = os.path.join(tmp, name)
            os.mkfifo(fifo)
            rfd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
            os.set_blocking(rfd, True)
            holders.append(os.open(fifo, os.O_WRONLY))
            relays.append(_Relay(rfd, sink))
        argv = _qemu_argv(host, topology, boot_kernel, tmp, shares, accel, cpu_model, append)
        if verbose:
            _warn(f"topology: {topology.describe()}")
            _warn(f"qemu: {shlex.join(argv)}")
        # Kill qemu if we die, even by SIGKILL: setpriv (util-linux) sets the
        # parent-death signal, then execs qemu.
        argv = ["setpriv", "--pdeathsig", "TERM", "--", *argv]
        with open(os.path.join(tmp, "qemu.log"), "wb") as log:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        for r in relays:
            r.start()
        timed_out = False
        try:
            qrc = proc.wait(timeout or None)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.terminate()
            try:
                qrc = proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                qrc = proc.wait()
        proc = None
        for fd in holders:
            os.close(fd)
        holders.clear()
        for r in relays:
            r.join()
        sys.stdout.flush()

        def read(name: str) -> str:
            p = Path(tmp, name)
            return p.read_text(errors="replace") if p.exists() else ""

        def show_console() -> None:
            log_text, console = read("qemu.log"), read("console.log").splitlines()[-60:]
            sys.stderr.write(f"{PROG}: ---- qemu (exit {qrc}) ----\n{log_text}"
                             f"{PROG}: ---- guest console (last 60 lines) ----\n" + "".join(f"{c}\n" for c in console))
            sys.stderr.flush()

        rc = re.sub(r"\D", "", read("ret"))
        if timed_out:
            _warn(f"timed out after {timeout:g}s; guest killed")
            if verbose:
                show_console()
            return EXIT_TIMEOUT
        if not rc:
            _warn("the VM failed before the command finished (no exit status came back)")
            show_console()
            return EXIT_VM_FAILED
        if verbose:
            show_console()
        return int(rc)
    finally:
        if proc is not None:  # interrupted: take the VM down first
            proc.kill()
            proc.wait()
        for fd in holders:
            os.close(fd)
        for r in relays:
            if r.ident is None:  # never started: its fd is still ours
                os.close(r.fd)
            elif r.is_alive():
                r.join(5)
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- CLI
def _parse_mem(spec: str, nodes: int) -> tuple[int, ...]:
    def mib(s: str) -> int:
        m = re.fullmatch(r"(\d+)([GM]?)", s.strip().upper())
        if not m:
            raise ValueError(f"bad --mem-per-node size {s!r}")
        return int(m[1]) * (1024 if m[2] == "G" else 1)

    sizes = tuple(mib(s) for s in spec.split(","))
    return sizes * nodes if len(sizes) == 1 else sizes


def _parse_distances(spec: str, nodes: int) -> tuple[tuple[int, ...], ...]:
    if re.fullmatch(r"\s*\d+\s*", spec):
        return tuple(tuple(10 if i == j else int(spec) for j in range(nodes)) for i in range(nodes))
    try:
        return tuple(tuple(int(x) for x in row.split(",")) for row in spec.replace(" ", "").split(";") if row)
    except ValueError:
        raise ValueError(f"bad --distances {spec!r}") from None


def _parse_node_cpus(spec: str, nodes: int) -> tuple[str, ...]:
    parts = spec.split(";")
    while len(parts) > nodes and parts[-1].strip() == "":  # "0-1;2-3;" is 2 entries
        parts.pop()
    return tuple(parts + [""] * (nodes - len(parts)))


def _raise_exit(code: int) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(code)  # unwinds through run_in_guest's cleanup
    return handler


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, cmd = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(prog="numa_vm.py", description=__doc__.split("\n\n")[0],
                                epilog="Exit: CMD's status; 124 on --timeout; 125 if the VM failed.")
    p.add_argument("--nodes", type=int, default=2, help="NUMA nodes (default 2)")
    p.add_argument("--cpus", type=int, help="vCPUs (default max(4, nodes); each is a host thread under TCG)")
    p.add_argument("--node-cpus", help='per-node cpulists, e.g. "0-1;2-3;" (empty = memory-only, must be last)')
    p.add_argument("--mem-per-node", default="1G", help="1G | 512M,512M,768M (default 1G)")
    p.add_argument("--distances", help='"10,21;21,10" or one remote distance (default 20)')
    p.add_argument("--cwd", default=".", help="guest working directory, shared read-write")
    p.add_argument("--rw", action="append", default=[], help="extra host dir shared read-write")
    p.add_argument("--env", action="append", default=[], help="VAR=VALUE set in the guest")
    p.add_argument("--timeout", type=float, help="kill the guest after SECS, exit 124")
    p.add_argument("--kernel", help="guest kernel (default: newest /boot/vmlinuz-* with 9p modules)")
    p.add_argument("--accel", default="tcg", choices=("tcg", "kvm"))
    p.add_argument("--cpu-model", help="qemu -cpu (default max; Nehalem-v2 is faster but has no AVX)")
    p.add_argument("--append", action="append", default=[], help="extra kernel argument")
    p.add_argument("--verbose", "-v", action="store_true", help="print the qemu command and guest console")
    p.add_argument("--check", action="store_true", help="only check prerequisites")
    p.add_argument("command", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    cmd = a.command + cmd
    if a.check:
        try:
            h = _host(a.kernel)
        except MissingPrerequisites as e:
            _warn(f"missing prerequisites. Install them once with:\n  {e}")
            return EXIT_VM_FAILED
        ver = subprocess.run([h.qemu, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
        print(f"{PROG}: ok: qemu={h.qemu} ({''.join(ver)}) busybox={h.busybox} kernel={h.kernel}")
        if not shutil.which("numactl"):
            print(f"{PROG}: note: numactl is not installed (apt package numactl); the guest lacks it too")
        return 0
    if not cmd:
        p.print_usage(sys.stderr)
        return EXIT_VM_FAILED
    try:
        topo = GuestTopology(
            nodes=a.nodes,
            cpus=a.cpus if a.cpus is not None else max(4, a.nodes),
            mem_per_node_mib=_parse_mem(a.mem_per_node, a.nodes),
            distances=_parse_distances(a.distances, a.nodes) if a.distances else None,
            node_cpus=_parse_node_cpus(a.node_cpus, a.nodes) if a.node_cpus is not None else None,
        )
        env = dict(kv.split("=", 1) for kv in a.env if "=" in kv)
        if len(env) != len(a.env):
            raise ValueError("--env needs VAR=VALUE")
        for sig, code in ((signal.SIGTERM, 143), (signal.SIGHUP, 129)):
            signal.signal(sig, _raise_exit(code))
        return run_in_guest(cmd, topo, cwd=a.cwd, env=env, timeout=a.timeout, rw=a.rw, kernel=a.kernel,
                            accel=a.accel, cpu_model=a.cpu_model, append=a.append, verbose=a.verbose)
    except ValueError as e:
        _warn(str(e))
        return EXIT_VM_FAILED
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
