"""The import statements of a source file, relative ones resolved: what the layers tests read."""

from __future__ import annotations

import ast
from pathlib import Path


def import_statements(path: Path, package: str) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import in ``path``, a module of ``package``: ``import a.b``
    gives ``("a.b", [])``, ``from ..x import y, z`` gives the resolved ``x`` and ``["y", "z"]``."""
    parts = package.split(".")
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = parts[: len(parts) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            found.append((node.lineno, module, [a.name for a in node.names]))
    return found
