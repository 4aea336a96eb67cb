#!/usr/bin/env python3
"""numafast on aarch64, from this x86-64 machine: a root of Debian arm64 packages,
numafast's extension cross-compiled against it, and 4-node aarch64 QEMU guests
booting that root's kernel (tests/numa_vm.py does the booting).

* ``prepare()``: downloads Debian bookworm's arm64 packages with a private apt
  (its own state and cache under the cache folder, ``APT::Architecture=arm64``,
  nothing installed on this machine), unpacks them with ``dpkg -x`` into
  ``ROOT`` (python3, python3-numpy, libnuma1, numactl, bash, busybox-static, and,
  for the cross build, libnuma-dev and libpython3.11-dev), adds the kernel
  (``linux-image-*-arm64``: its Image and the modules the guest needs, with
  ``depmod -b``), pytest from PyPI (pure Python; ``pip install --target``), and
  byte-compiles the root's Python (a .pyc is the same on every architecture;
  without them every import compiles under TCG). Cached: a second run asks apt
  for the package list (~3 s) and rebuilds the root only when a version moved.
* ``build_extension()``: ``setup.py build_ext --inplace`` with
  ``aarch64-linux-gnu-gcc --sysroot=ROOT``: the source build, cross, making
  ``numafast/_libnuma.cpython-311-aarch64-linux-gnu.so`` beside the x86-64 one
  (each interpreter loads its own), so the guest tests the tree as the x86 guests do.
* ``cross_env()``: the environment that makes setuptools build for aarch64;
  .ci/wheel-aarch64 builds the manylinux wheel with it.
* ``AARCH64_FOUR_NODES``, ``AARCH64_GRACE``: the guests' topologies.

Host packages (Debian 12): qemu-system-arm gcc-aarch64-linux-gnu kmod.
The cache folder is $NUMAFAST_AARCH64_CACHE, else ~/.cache/numafast-aarch64.

CLI::

    python3 tests/aarch64_vm.py --prepare [--build]
    python3 tests/aarch64_vm.py [--grace] [--rw DIR] [--timeout S] -- CMD ARGS...   # in the guest, cwd: the tree
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from numa_vm import GuestTopology, run_in_guest

REPO = Path(__file__).resolve().parent.parent
SUITE = "bookworm"
MIRROR = "http://deb.debian.org/debian"
SECURITY = "http://deb.debian.org/debian-security"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"
# What the guest runs (python3, numpy at numafast's floor 1.24, libnuma, numactl and a
# shell for the tests' subprocesses) and what the cross build needs (the headers).
PACKAGES = ("python3", "python3-numpy", "libnuma1", "numactl", "bash", "dash", "coreutils", "grep", "sed", "busybox-static",
            "libnuma-dev", "libpython3.11-dev")  # fmt: skip
# pytest from PyPI (bookworm's is 7.2, below numafast's [test] floor): this machine's
# version, so that the guest finds the test modules that pytest rewrote here already
# compiled (__pycache__/*-pytest-VERSION.pyc; a .pyc is the same on every architecture,
# and rewriting them all again under TCG costs about a minute).
try:
    PIP_PACKAGES: tuple[str, ...] = (f"pytest=={importlib.metadata.version('pytest')}",)
except importlib.metadata.PackageNotFoundError:
    PIP_PACKAGES = ("pytest>=8.0",)
# The kernel's parts the guest uses: its Image, module lists, and the modules
# tests/numa_vm.py loads (virtio-pci, the console ports, 9p, overlay) with their
# dependencies.
KERNEL_PARTS = ("./boot/", "./lib/modules/*/modules.*", "./lib/modules/*/kernel/drivers/virtio/",
                "./lib/modules/*/kernel/drivers/char/", "./lib/modules/*/kernel/net/9p/",
                "./lib/modules/*/kernel/fs/9p/", "./lib/modules/*/kernel/fs/netfs/",
                "./lib/modules/*/kernel/fs/fscache/", "./lib/modules/*/kernel/fs/overlayfs/")  # fmt: skip
PYTHON_SOABI = "cpython-311-aarch64-linux-gnu"
# A root whose packages apt confirmed this recently is taken as it is.
RECHECK_S = 600

# 4 nodes of one CPU each, the distances of the x86 4-node guest.
AARCH64_FOUR_NODES = GuestTopology(
    nodes=4, cpus=4,
    distances=((10, 16, 32, 32), (16, 10, 32, 32), (32, 32, 10, 16), (32, 32, 16, 10)),
)  # fmt: skip
# Grace-like: two Grace nodes with CPUs, then two CPU-less nodes with memory,
# standing for each GPU's HBM (as on a GH200 pair; tests/fixtures/gh200), far from
# the other Grace. Node 0 has 512 MiB, as in the x86 memory-only guest: a test fills it.
AARCH64_GRACE = GuestTopology(
    nodes=4, cpus=4, node_cpus=("0-1", "2-3", "", ""), mem_per_node_mib=(512, 512, 768, 768),
    distances=((10, 40, 80, 120), (40, 10, 120, 80), (80, 120, 10, 120), (120, 80, 120, 10)),
)  # fmt: skip


def cache_dir() -> Path:
    xdg = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return Path(os.environ.get("NUMAFAST_AARCH64_CACHE") or xdg / "numafast-aarch64")


def root_dir() -> Path:
    return cache_dir() / "root"


def _say(message: str) -> None:
    print(f"aarch64_vm: {message}", file=sys.stderr, flush=True)


def _apt(cache: Path) -> list[str]:
    """apt-get with its own arm64-only state, lists and archive under cache/apt."""
    apt = cache / "apt"
    for sub in ("state/lists/partial", "cache/archives/partial", "etc/preferences.d", "etc/sources.list.d"):
        (apt / sub).mkdir(parents=True, exist_ok=True)
    status = apt / "state/status"
    if not status.exists():
        status.write_text("")  # nothing installed: apt resolves every dependency
    sources = apt / "etc/sources.list"
    line = f"[arch=arm64 signed-by={KEYRING}]"
    sources.write_text(
        f"deb {line} {MIRROR} {SUITE} main\ndeb {line} {MIRROR} {SUITE}-updates main\n"
        f"deb {line} {SECURITY} {SUITE}-security main\n"
    )
    options = {
        "APT::Architecture": "arm64", "APT::Architectures": "arm64", "APT::Install-Recommends": "false",
        "Dir::State": apt / "state", "Dir::State::status": status, "Dir::Cache": apt / "cache",
        "Dir::Etc::SourceList": sources, "Dir::Etc::SourceParts": apt / "etc/sources.list.d",
        "Dir::Etc::Preferences": apt / "etc/preferences", "Dir::Etc::PreferencesParts": apt / "etc/preferences.d",
        "Debug::NoLocking": "1", "quiet": "2", "APT::Sandbox::User": "root",
    }  # fmt: skip
    return ["apt-get", *(f"-o{key}={value}" for key, value in options.items())]


def _apt_cache(apt: list[str]) -> list[str]:
    return ["apt-cache", *apt[1:]]


def _download(cache: Path) -> list[Path]:
    """The .debs of PACKAGES and their dependencies, and the kernel's, downloaded
    (apt keeps what it has fetched: a second run downloads nothing)."""
    apt = _apt(cache)
    archives = cache / "apt/cache/archives"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    updated = subprocess.run([*apt, "update"], env=env, capture_output=True, text=True)
    if updated.returncode != 0:
        raise RuntimeError(f"apt-get update (arm64) failed: {updated.stderr.strip()[-2000:]}")
    kernel = _kernel_package(apt)
    subprocess.run([*apt, "install", "-y", "--download-only", *PACKAGES], env=env, check=True)
    # With an empty dpkg status, the simulation lists every package: 'Inst NAME (VERSION ... [ARCH])'.
    simulated = subprocess.run([*apt, "install", "-s", "-y", *PACKAGES], env=env, check=True,
                               capture_output=True, text=True).stdout  # fmt: skip
    debs: list[Path] = []
    for line in simulated.splitlines():
        words = line.replace("(", "").replace("[", "").replace("]", "").replace(")", "").split()
        if words[:1] == ["Inst"]:
            name, version, arch = words[1], words[2], words[-1]
            debs.append(archives / f"{name}_{version.replace(':', '%3a')}_{arch}.deb")
    # The kernel alone (its package's dependencies, initramfs-tools and the like, are not wanted).
    uris = subprocess.run([*apt, "download", "--print-uris", kernel], env=env, check=True,
                          capture_output=True, text=True).stdout  # fmt: skip
    kernel_deb = archives / uris.split()[1]
    if not kernel_deb.exists():
        _say(f"downloading {kernel}")
        subprocess.run([*apt, "download", kernel], env=env, check=True, cwd=archives)
    debs.append(kernel_deb)
    absent = [d.name for d in debs if not d.exists()]
    if absent:
        raise RuntimeError(f"apt did not download {absent}")
    return debs


def _kernel_package(apt: list[str]) -> str:
    """linux-image-6.1.0-NN-arm64: what the linux-image-arm64 meta-package depends on now."""
    shown = subprocess.run([*_apt_cache(apt), "depends", "linux-image-arm64"], check=True, capture_output=True, text=True).stdout
    for line in shown.splitlines():
        name = line.split(":", 1)[-1].strip()
        if line.strip().startswith("Depends:") and name.startswith("linux-image-"):
            return name
    raise RuntimeError(f"no kernel among linux-image-arm64's dependencies: {shown}")


def _pip_packages(root: Path) -> None:
    target = root / "usr/local/lib/python3.11/dist-packages"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--root-user-action=ignore",
         "--target", str(target), "--python-version", "3.11", "--implementation", "cp",
         "--platform", "manylinux2014_aarch64", "--only-binary=:all:", *PIP_PACKAGES],
        check=True,
    )  # fmt: skip


def prepare(force: bool = False) -> Path:
    """The guest root (and cross sysroot), made or brought up to date; its path."""
    cache = cache_dir()
    root = root_dir()
    start = time.monotonic()
    stamp_file = root / ".numafast-root"
    if not force and stamp_file.exists() and time.time() - stamp_file.stat().st_mtime < RECHECK_S:
        return root  # asked apt a moment ago (.ci/aarch64 makes the root, then run_suite.py wants it)
    debs = _download(cache)
    stamp_text = "\n".join(sorted(d.name for d in debs)) + "\n" + "\n".join(PIP_PACKAGES) + "\n"
    stamp = hashlib.sha256(stamp_text.encode()).hexdigest()
    if not force and stamp_file.exists() and stamp_file.read_text() == stamp:
        stamp_file.touch()
        _say(f"root {root} is up to date ({len(debs)} packages; {time.monotonic() - start:.1f} s)")
        return root
    shutil.rmtree(root, ignore_errors=True)
    fresh = root.with_name("root.new")
    shutil.rmtree(fresh, ignore_errors=True)
    fresh.mkdir(parents=True)
    kernel_debs = [d for d in debs if d.name.startswith("linux-image-")]
    for deb in debs:
        if deb in kernel_debs:
            continue
        subprocess.run(["dpkg-deb", "-x", str(deb), str(fresh)], check=True)
    for deb in kernel_debs:
        tar = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(fresh), "--wildcards", *KERNEL_PARTS], stdin=tar.stdout, check=True)
        assert tar.stdout is not None
        tar.stdout.close()
        if tar.wait() != 0:
            raise RuntimeError(f"dpkg-deb --fsys-tarfile {deb} failed")
    for modules in (fresh / "lib/modules").iterdir():
        subprocess.run(["depmod", "-b", str(fresh), modules.name], check=True)
    # What maintainer scripts would have made (dpkg -x runs none): numpy's BLAS and
    # LAPACK through update-alternatives, /bin/sh.
    multiarch = fresh / "usr/lib/aarch64-linux-gnu"
    for library in [*multiarch.glob("blas/lib*.so.3"), *multiarch.glob("lapack/lib*.so.3")]:
        if not (multiarch / library.name).exists():
            os.symlink(library.relative_to(multiarch), multiarch / library.name)
    if not (fresh / "bin/sh").exists():
        os.symlink("dash", fresh / "bin/sh")
    _pip_packages(fresh)
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "-j0", "-x", r"/(test|tests|idlelib|lib2to3|tkinter)/",
         *(str(fresh / p) for p in ("usr/lib/python3.11", "usr/lib/python3/dist-packages",
                                    "usr/local/lib/python3.11/dist-packages"))],
        check=False, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    stamp_file = fresh / ".numafast-root"
    stamp_file.write_text(stamp)
    fresh.rename(root)
    _say(f"root {root} made from {len(debs)} packages in {time.monotonic() - start:.1f} s")
    return root


def cross_env(root: Path) -> dict[str, str]:
    """setuptools builds numafast._libnuma for aarch64 (Python 3.11) in this environment:
    the cross compiler on ROOT as sysroot (its libc, numa.h, libnuma.so), the arm64
    Python headers, the aarch64 file name and platform tag."""
    cc = f"aarch64-linux-gnu-gcc --sysroot={root}"
    include = root / "usr/include"
    return {
        **os.environ,
        "CC": cc,
        "LDSHARED": f"{cc} -shared",
        "CFLAGS": f"-I{include}/aarch64-linux-gnu/python3.11 -I{include}/python3.11",
        "LDFLAGS": "",
        "_PYTHON_HOST_PLATFORM": "linux-aarch64",
        "SETUPTOOLS_EXT_SUFFIX": f".{PYTHON_SOABI}.so",
    }


def build_extension(root: Path) -> Path:
    """The source build, cross: numafast/_libnuma.cpython-311-aarch64-linux-gnu.so in the tree."""
    if not shutil.which("aarch64-linux-gnu-gcc"):
        raise RuntimeError("no aarch64-linux-gnu-gcc: apt-get install gcc-aarch64-linux-gnu")
    build = cache_dir() / "build"
    start = time.monotonic()
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace", "-b", str(build / "lib"), "-t", str(build / "temp")],
        cwd=REPO, env=cross_env(root), check=True,
    )  # fmt: skip
    built = REPO / "numafast" / f"_libnuma.{PYTHON_SOABI}.so"
    _say(f"cross-built {built.relative_to(REPO)} in {time.monotonic() - start:.1f} s")
    return built


def main() -> int:
    argv = sys.argv[1:]
    cmd: list[str] = []
    if "--" in argv:
        cmd = argv[argv.index("--") + 1 :]
        argv = argv[: argv.index("--")]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="make or update the arm64 root, then exit")
    parser.add_argument("--build", action="store_true", help="and cross-build the extension in the tree")
    parser.add_argument("--force", action="store_true", help="remake the root even if up to date")
    parser.add_argument("--grace", action="store_true", help="the Grace-like topology (2 CPU + 2 CPU-less nodes)")
    parser.add_argument("--rw", action="append", default=[], help="another host folder shared read-write")
    parser.add_argument("--timeout", type=float, default=None)
    parser.add_argument("--verbose", "-v", action="store_true")
    args = parser.parse_args(argv)
    root = prepare(args.force) if args.prepare or args.build or not (root_dir() / ".numafast-root").exists() else root_dir()
    if args.build:
        build_extension(root)
    if not cmd:
        return 0
    topology = AARCH64_GRACE if args.grace else AARCH64_FOUR_NODES
    return run_in_guest(cmd, topology, cwd=REPO, rw=args.rw, root=root, timeout=args.timeout, verbose=args.verbose)


if __name__ == "__main__":
    sys.exit(main())
