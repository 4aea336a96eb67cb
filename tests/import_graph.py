"""The import graph of a package's modules, for tests that keep it free of cycles."""

from __future__ import annotations

import ast
from pathlib import Path


def import_cycles(package: Path, name: str) -> list[tuple[str, ...]]:
    """Every cycle among the modules of ``package`` (imported as ``name``): imports at
    module level, inside functions and under TYPE_CHECKING all count."""
    imports: dict[str, set[str]] = {}
    for source in package.glob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == name:
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(f"{name}."):
                names.add(node.module.removeprefix(f"{name}.").split(".")[0])  # type: ignore[union-attr]
        imports[source.stem] = {module for module in names if (package / f"{module}.py").exists()} - {source.stem}
    imports.pop("__init__", None)

    def cycle_from(module: str, path: tuple[str, ...]) -> tuple[str, ...] | None:
        if module in path:
            return (*path, module)
        return next((c for m in sorted(imports.get(module, ())) if (c := cycle_from(m, (*path, module)))), None)

    return [cycle for module in sorted(imports) if (cycle := cycle_from(module, ()))]
