#!/usr/bin/env python3
"""numafast on aarch64, from this x86-64 machine: a root of Debian arm64 packages,
numafast's extension cross-compiled against it, and 4-node aarch64 QEMU guests
booting that root's kernels (tests/numa_vm.py does the booting): Debian's arm64
kernel (4 KiB pages) and its arm64-16k one (16 KiB pages; Grace servers often run
64 KiB-page kernels), so that no page size is assumed.

* ``prepare()``: downloads Debian bookworm's arm64 packages with a private apt
  (its own state and cache under the cache folder, ``APT::Architecture=arm64``,
  nothing installed on this machine), unpacks them with ``dpkg -x`` into
  ``ROOT`` (python3, python3-numpy, libnuma1, numactl, bash, busybox-static, and,
  for the cross build and the native one, libnuma-dev, python3-dev and gcc), adds
  the kernels (``linux-image-*-arm64`` and ``linux-image-*-arm64-16k``: each one's
  Image and the modules the guest needs, with ``depmod -b``), pytest and pip from
  PyPI (pure Python; ``pip install --target``), the wheels of numafast's build
  requirements for the native build (``WHEELS``: the guest has no network), and
  byte-compiles the root's Python (a .pyc is the same on every architecture;
  without them every import compiles under TCG). Cached: a second run asks apt
  for the package list (~3 s) and rebuilds the root only when a version moved.
* ``kernel(page_kib)``: the root's kernel with that page size (4 or 16).
* ``sdist()`` and ``NATIVE_BUILD``: numafast's sdist, and the guest's script that
  builds it natively with pip (gcc under TCG) and runs a command on that build.
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
    python3 tests/aarch64_vm.py [--grace] [--16k] [--rw DIR] [--timeout S] -- CMD ARGS...   # in the guest, cwd: the tree
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
# What the guest runs (python3, numpy at numafast's floor 1.24, libnuma, numactl, a
# shell for the tests' subprocesses, getconf), what the cross build needs (the
# headers) and the native one (gcc, python3-dev).
PACKAGES = ("python3", "python3-numpy", "libnuma1", "numactl", "bash", "dash", "coreutils", "grep", "sed", "busybox-static",
            "libc-bin", "libnuma-dev", "libpython3.11-dev", "python3-dev", "gcc")  # fmt: skip
# The kernels' meta-packages, by page size in KiB: bookworm's own kernel, and the 6.12
# arm64-16k one that bookworm-security carries beside it (one root serves both: Debian
# links arm64 programs for pages up to 64 KiB).
KERNELS = {4: "linux-image-arm64", 16: "linux-image-6.12-arm64-16k"}
FLAVOURS = {4: "arm64", 16: "arm64-16k"}  # the end of each one's version: vmlinuz-6.1.0-NN-arm64


def _pinned(name: str, fallback: str) -> str:
    """NAME==this machine's version of it, else NAME with the fallback requirement."""
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return f"{name}{fallback}"


# pytest from PyPI (bookworm's is 7.2, below numafast's [test] floor): this machine's
# version, so that the guest finds the test modules that pytest rewrote here already
# compiled (__pycache__/*-pytest-VERSION.pyc; a .pyc is the same on every architecture,
# and rewriting them all again under TCG costs about a minute). pip for the native
# build (bookworm's python3-pip brings a dozen packages more).
PIP_PACKAGES = (_pinned("pytest", ">=8.0"), _pinned("pip", ">=23.0"))
# The native build's requirements (pyproject.toml's build-system), as wheels in the
# root at WHEELS for pip's isolated build environment: this machine's versions.
BUILD_WHEELS = (_pinned("setuptools", ">=77.0.3"), _pinned("Cython", ">=3.0"))
WHEELS = "/usr/local/share/numafast-wheels"
# The kernel's parts the guest uses: its Image, module lists, and the modules
# tests/numa_vm.py loads (virtio-pci, the console ports, 9p, overlay) with their
# dependencies.
KERNEL_PARTS = ("./boot/", "./lib/modules/*/modules.*", "./lib/modules/*/kernel/drivers/virtio/",
                "./lib/modules/*/kernel/drivers/char/", "./lib/modules/*/kernel/net/9p/",
                "./lib/modules/*/kernel/fs/9p/", "./lib/modules/*/kernel/fs/netfs/",
                "./lib/modules/*/kernel/fs/fscache/", "./lib/modules/*/kernel/fs/overlayfs/")  # fmt: skip
PYTHON_SOABI = "cpython-311-aarch64-linux-gnu"
PYTHON_VERSION = "3.11"
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
    kernels = [_kernel_package(apt, meta) for meta in KERNELS.values()]
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
    # The kernels alone (their dependencies, initramfs-tools and the like, are not wanted).
    for kernel in kernels:
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


def _kernel_package(apt: list[str], meta: str) -> str:
    """linux-image-6.1.0-NN-arm64 (for linux-image-arm64): what the meta-package depends on now."""
    shown = subprocess.run([*_apt_cache(apt), "depends", meta], check=True, capture_output=True, text=True).stdout
    for line in shown.splitlines():
        name = line.split(":", 1)[-1].strip()
        if line.strip().startswith("Depends:") and name.startswith("linux-image-"):
            return name
    raise RuntimeError(f"no kernel among {meta}'s dependencies: {shown}")


def _pip_packages(root: Path) -> None:
    """PIP_PACKAGES installed into the root's Python, BUILD_WHEELS downloaded into WHEELS."""
    platform = ["--python-version", PYTHON_VERSION, "--implementation", "cp",
                "--platform", "manylinux2014_aarch64", "--only-binary=:all:"]  # fmt: skip
    pip = [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]
    target = root / f"usr/local/lib/python{PYTHON_VERSION}/dist-packages"
    subprocess.run([*pip, "install", "--root-user-action=ignore", "--target", str(target), *platform, *PIP_PACKAGES], check=True)
    subprocess.run([*pip, "download", "--no-deps", "--dest", str(root / WHEELS.lstrip("/")), *platform, *BUILD_WHEELS], check=True)


def _extract_kernel(deb: Path, root: Path) -> None:
    """KERNEL_PARTS of a kernel package into root; a part one kernel lacks (6.12 has
    no fs/fscache: netfs took it in) is skipped, as tar reports it."""
    tar = subprocess.Popen(["dpkg-deb", "--fsys-tarfile", str(deb)], stdout=subprocess.PIPE)
    extracted = subprocess.run(["tar", "-x", "-C", str(root), "--wildcards", *KERNEL_PARTS], stdin=tar.stdout,
                               capture_output=True, text=True)  # fmt: skip
    assert tar.stdout is not None
    tar.stdout.close()
    if tar.wait() != 0:
        raise RuntimeError(f"dpkg-deb --fsys-tarfile {deb} failed")
    problems = [line for line in extracted.stderr.splitlines()
                if "Not found in archive" not in line and "Exiting with failure status" not in line]  # fmt: skip
    if extracted.returncode not in (0, 2) or problems:
        raise RuntimeError(f"tar -x of {deb.name} failed: {extracted.stderr.strip()[-2000:]}")


def prepare(force: bool = False) -> Path:
    """The guest root (and cross sysroot), made or brought up to date; its path."""
    cache = cache_dir()
    root = root_dir()
    start = time.monotonic()
    stamp_file = root / ".numafast-root"
    if not force and stamp_file.exists() and time.time() - stamp_file.stat().st_mtime < RECHECK_S:
        return root  # asked apt a moment ago (.ci/aarch64 makes the root, then run_suite.py wants it)
    debs = _download(cache)
    stamp_text = "\n".join([*sorted(d.name for d in debs), *PIP_PACKAGES, *BUILD_WHEELS]) + "\n"
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
        _extract_kernel(deb, fresh)
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
         *(str(fresh / p) for p in (f"usr/lib/python{PYTHON_VERSION}", "usr/lib/python3/dist-packages",
                                    f"usr/local/lib/python{PYTHON_VERSION}/dist-packages"))],
        check=False, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    stamp_file = fresh / ".numafast-root"
    stamp_file.write_text(stamp)
    fresh.rename(root)
    _say(f"root {root} made from {len(debs)} packages in {time.monotonic() - start:.1f} s")
    return root


def kernel(page_kib: int = 4, root: Path | None = None) -> str:
    """The root's kernel with pages of page_kib KiB (its vmlinuz; numa_vm boots it)."""
    pattern = f"boot/vmlinuz-*-{FLAVOURS[page_kib]}"
    found = sorted((root or root_dir()).glob(pattern))
    if not found:
        raise RuntimeError(f"no {page_kib} KiB-page kernel ({pattern}) in {root or root_dir()}: run --prepare")
    return str(found[-1])


# The native build, in the guest (bash -c NATIVE_BUILD guest SDIST PAGE_BYTES CMD...):
# the page size checked first (a run on the wrong kernel fails, not passes quietly),
# then pip builds the sdist as a user with no wheel for their Python would (isolated
# build environment from WHEELS, gcc -O2; --no-deps: the root's numpy is the one;
# CFLAGS=-g0 only drops the debug information, a quarter of gcc's time under TCG)
# into /tmp/site, whose numafast/ is then bind-mounted over the tree's: pytest, and
# every test's subprocess whatever its PYTHONPATH, imports that build. CMD runs on it.
# SDIST may be a cp311 aarch64 wheel instead: pip installs it, and CMD tests that.
NATIVE_BUILD = r"""
set -e
sdist=$1 page=$2
shift 2
if [ "$(getconf PAGESIZE)" != "$page" ]; then
    echo "aarch64 native build: the guest's page size is $(getconf PAGESIZE) bytes, not $page" >&2
    exit 1
fi
start=$(date +%s)
CFLAGS=-g0 python3 -m pip install -q --disable-pip-version-check --root-user-action=ignore --no-index --no-deps \
    --find-links WHEELS --target /tmp/site "$sdist"
echo "aarch64 native build: $(basename "$sdist") installed by pip (built, if an sdist) in $(($(date +%s) - start)) s" \
    "on $(getconf PAGESIZE)-byte pages"
busybox mount -o bind /tmp/site/numafast numafast
python3 -c 'import os, sys, numafast._libnuma as m
built = os.stat("/tmp/site/numafast/" + os.path.basename(m.__file__))
sys.exit(None if os.path.samestat(os.stat(m.__file__), built) else f"{m.__file__} is not the native build")'
exec "$@"
""".replace("WHEELS", WHEELS)


def sdist(outdir: Path) -> Path:
    """numafast's sdist of the tree, built into outdir (emptied first) for the native build."""
    shutil.rmtree(outdir, ignore_errors=True)
    outdir.mkdir(parents=True)
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(outdir), str(REPO)],
                   check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    made = next(outdir.glob("numafast-*.tar.gz"))
    _say(f"sdist {made.name} in {time.monotonic() - start:.1f} s")
    return made


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
    parser.add_argument("--16k", dest="page_kib", action="store_const", const=16, default=4,
                        help="boot the 16 KiB-page kernel")
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
    return run_in_guest(cmd, topology, cwd=REPO, rw=args.rw, root=root, kernel=kernel(args.page_kib, root),
                        timeout=args.timeout, verbose=args.verbose)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
