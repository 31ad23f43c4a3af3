"""The application layer sits above the core and telemetry: neither imports it.

Three layers, each a folder: the core (``fsdp_patch/``: sharding, the adapter, the public API),
telemetry (``telemetry/``, installed as ``fsdp_patch.telemetry``, which imports the core) and the
application (``app/``, installed as ``fsdp_patch.app``: the ``fsdp-patch`` command and its demo,
which import both). The core's one door upwards is ``fsdp_patch/__main__.py``, the program entry
``python -m fsdp_patch`` runs and nothing imports. That the core names telemetry only by name, in
its observer seam, is ``test_core_without_telemetry.py``'s; telemetry's own layers are
``test_telemetry_layers.py``'s.
"""

from __future__ import annotations

from pathlib import Path

from tests.import_statements import import_statements

REPO = Path(__file__).resolve().parents[1]
# Folder -> the package it installs as.
LAYERS = {"fsdp_patch": "fsdp_patch", "telemetry": "fsdp_patch.telemetry", "app": "fsdp_patch.app"}
ENTRY_POINT = REPO / "fsdp_patch" / "__main__.py"


def imported_modules(path: Path, package: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, a module of ``package``; ``from P import x``
    counts as ``P.x``, which names a module or a name of ``P``."""
    return [
        (line, f"{module}.{name}" if names else module)
        for line, module, names in import_statements(path, package)
        for name in (names or [""])
    ]


def upward_imports(folder: Path, package: str, forbidden: str) -> list[str]:
    """Each import of ``forbidden`` (or a module in it) by a module under ``folder``."""
    found = []
    for path in sorted(folder.rglob("*.py")):
        if path == ENTRY_POINT:
            continue
        # The package a module's relative imports start from: its folder's (an __init__'s too).
        module_package = ".".join([package, *path.relative_to(folder).parts[:-1]])
        for line, module in imported_modules(path, module_package):
            if module == forbidden or module.startswith(forbidden + "."):
                found.append(f"{path.relative_to(folder.parent)}:{line} imports {module}")
    return found


def test_neither_the_core_nor_telemetry_imports_the_application() -> None:
    got = {
        folder: upward_imports(REPO / folder, LAYERS[folder], LAYERS["app"]) for folder in ("fsdp_patch", "telemetry")
    }
    assert got == {"fsdp_patch": [], "telemetry": []}, f"imports of the application layer from below it: {got}"


def test_the_application_is_a_folder_of_its_own_with_the_command_and_the_demo() -> None:
    got = sorted(p.name for p in (REPO / "app").iterdir() if (p / "__init__.py").is_file())
    assert got == ["cli", "demo"], f"app/'s packages: {got}"
    left = sorted(p.name for p in (REPO / "fsdp_patch").iterdir() if p.name in ("cli", "demo"))
    assert left == [], f"application packages left in the core: {left}"


def test_a_planted_upward_import_is_found(tmp_path: Path) -> None:
    """The check above is no formality: absolute and relative imports of the application from a
    core module, and one from telemetry, are each reported with their line."""
    core = tmp_path / "fsdp_patch"
    (core / "adapter").mkdir(parents=True)
    (core / "__init__.py").write_text("")
    (core / "adapter" / "__init__.py").write_text("")
    (core / "adapter" / "planted.py").write_text(
        "import torch\nfrom fsdp_patch.app.demo import train\nfrom ..app import cli\nfrom .. import optimizer\n"
    )
    telemetry = tmp_path / "telemetry"
    telemetry.mkdir()
    (telemetry / "planted.py").write_text("from fsdp_patch.app.cli import main\n")
    got = upward_imports(core, "fsdp_patch", "fsdp_patch.app") + upward_imports(
        telemetry, "fsdp_patch.telemetry", "fsdp_patch.app"
    )
    want = [
        "fsdp_patch/adapter/planted.py:2 imports fsdp_patch.app.demo.train",
        "fsdp_patch/adapter/planted.py:3 imports fsdp_patch.app.cli",
        "telemetry/planted.py:1 imports fsdp_patch.app.cli.main",
    ]
    assert got == want, f"want {want}, got {got}"
