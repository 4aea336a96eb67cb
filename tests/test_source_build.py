"""A source build that cannot work stops with one message saying what to install.

The builds run in a private mount namespace where Debian's libnuma1 and
libnuma-dev are hidden (.ci/without-libnuma): numa.h and libnuma are absent, as
on a machine that never installed them, while this one keeps them for numactl
and the guests. The probes in setup.py stop the build before Cython's C code is
compiled, so each case takes a second or two.

They build as pip would, with the setuptools and Cython that pyproject.toml's
[build-system] requires: with this interpreter's own where it has them (CI's),
else in a virtual environment made once for the session, as pip's isolated
build environment is (a fresh venv's setuptools is too old for pyproject's
`license`, and it has no Cython).
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parent.parent
WITHOUT_LIBNUMA = REPO / ".ci" / "without-libnuma"
INSTALL_LINES = (
    "apt-get install libnuma-dev",
    "dnf install numactl-devel",
    "zypper install libnuma-devel",
    "apk add numactl-dev",
    "conda install -c conda-forge libnuma",
)

pytestmark = [
    pytest.mark.host_only("builds numafast from source"),
    pytest.mark.skipif(
        not (REPO / "setup.py").exists(), reason="needs the source tree (setup.py); an installed wheel has none"
    ),
]
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None or shutil.which("dpkg-query") is None,
    reason="hiding libnuma takes root, unshare and dpkg-query (Debian)",
)


def unmet(requirements: list[str]) -> list[str]:
    """Those of ``requirements`` this interpreter does not meet, each with what it has."""
    lacking = []
    for text in requirements:
        requirement = Requirement(text)
        try:
            have = importlib.metadata.version(requirement.name)
        except importlib.metadata.PackageNotFoundError:
            lacking.append(f"{requirement} (not installed)")
            continue
        if not requirement.specifier.contains(have, prereleases=True):
            lacking.append(f"{requirement} ({requirement.name} {have} installed)")
    return lacking


@pytest.fixture(scope="session")
def python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter with the build requirements of pyproject.toml: this one if it has
    them, else a virtual environment where pip installed them, as in pip's own isolated
    build. Skips, saying what is missing, where pip cannot install them (offline)."""
    with (REPO / "pyproject.toml").open("rb") as file:
        requirements = tomllib.load(file)["build-system"]["requires"]
    missing = unmet(requirements)
    if not missing:
        return sys.executable
    environment = tmp_path_factory.mktemp("build-environment")
    python = environment / "bin" / "python"
    steps = (
        ("python -m venv", [sys.executable, "-m", "venv", str(environment)]),
        ("pip install", [str(python), "-m", "pip", "install", "-q", *requirements]),
    )
    for name, step in steps:
        result = subprocess.run(step, capture_output=True, text=True, timeout=600)
        if result.returncode != 0:
            said = (result.stderr.strip() or result.stdout.strip()).splitlines()
            pytest.skip(
                f"building needs {', '.join(requirements)} (pyproject.toml [build-system]); {sys.executable} "
                f"lacks {', '.join(missing)}, and `{name}` of a build environment failed: "
                f"{said[-1] if said else f'exit status {result.returncode}'}"
            )
    return str(python)


def build(command: list[str], tmp_path: Path, env: dict[str, str] | None = None) -> str:
    """Run a build that must fail; its stdout and stderr together."""
    result = subprocess.run(
        command, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})}
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    return output


def assert_one_clear_message(output: str, what: str, install_lines: tuple[str, ...] = INSTALL_LINES) -> None:
    assert output.count("numafast cannot be built from source here") == 1, output
    assert what in output, output
    for line in install_lines:
        assert line in output, f"{line!r} missing from:\n{output}"
    # The compiler's own error shows once, inside the message, and no traceback.
    assert output.count("(the compiler said: ") == 1 and "Traceback" not in output, output


@needs_root
def test_pip_install_without_libnuma_names_the_packages(python: str, tmp_path: Path) -> None:
    # What a user runs, less the download of the build requirements (in `python`).
    command = [python, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-w", str(tmp_path), "."]
    output = build([str(WITHOUT_LIBNUMA), *command], tmp_path)
    assert_one_clear_message(output, "libnuma's header numa.h was not found")
    assert "fatal error: numa.h: No such file or directory" in output


@needs_root
def test_build_with_numa_h_but_no_library_names_the_packages(python: str, tmp_path: Path) -> None:
    command = [python, "setup.py", "build_ext", "--build-temp", str(tmp_path), "--build-lib", str(tmp_path)]
    output = build([str(WITHOUT_LIBNUMA), "--keep-headers", *command], tmp_path)
    assert_one_clear_message(output, "the library libnuma (-lnuma) was not found")
    assert "cannot find -lnuma" in output


def test_build_without_a_c_compiler_says_so(python: str, tmp_path: Path) -> None:
    command = [python, "setup.py", "build_ext", "--build-temp", str(tmp_path), "--build-lib", str(tmp_path)]
    output = build(command, tmp_path, env={"CC": str(tmp_path / "no-such-cc")})
    assert_one_clear_message(output, "no working C compiler", ("apt-get install gcc", "dnf install gcc"))
