"""Print what pyproject.toml requires to build and test, one requirement a line.

Usage: python3 .ci/floors.py [--newest] [EXTRA...]

The build requirements, the dependencies and the named extras, each pinned to
its floor (``numpy==1.24``), or as written with ``--newest`` (pip then takes the
newest). .ci/install-matrix gives CI's Python 3.11 environment the floors (torch's
among them: ``floors.py plot test torch``), so that every lowest version
pyproject.toml states is one CI builds and tests with (.ci/pythons).
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

FLOOR = re.compile(r"^\s*([A-Za-z0-9._-]+)\s*>=\s*([0-9][0-9.]*)\s*$")


def requirements(extras: list[str], newest: bool) -> list[str]:
    project_file = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())
    project = project_file["project"]
    wanted = [*project_file["build-system"]["requires"], *project["dependencies"]]
    for extra in extras:
        wanted += project["optional-dependencies"][extra]
    if newest:
        return wanted
    pins = []
    for requirement in wanted:
        match = FLOOR.match(requirement)
        if match is None:
            raise SystemExit(f"floors: {requirement!r} is not of the form NAME>=VERSION")
        pins.append(f"{match[1]}=={match[2]}")
    return pins


if __name__ == "__main__":
    arguments = sys.argv[1:]
    newest = "--newest" in arguments
    print("\n".join(requirements([a for a in arguments if a != "--newest"], newest)))
