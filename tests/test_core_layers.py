"""fsdp_patch/ (the core) is grouped by concern into layers with one-way imports.

From the bottom up: ``torch_interop/`` (what the core reads of torch and changes in it) and
``mixed_precision`` (the policy, a plain value); ``sharding/`` (a unit's parameters: placement,
layout, buffers, collectives, the parameter group, the registry); ``adapter/`` (the optimizer
adapter); ``module/`` (``fully_shard`` and what a sharded module does); at the top the public API
(``optimizer``, the facade ``__init__``) and ``__main__``, the program entry. No module imports a
layer above its own; none imports telemetry (``test_core_without_telemetry.py``: the core names it
only by name, in its observer seam) or the application (``test_application_layer.py``).
"""

from __future__ import annotations

from pathlib import Path

from tests.test_application_layer import imported_modules

CORE = Path(__file__).resolve().parents[1] / "fsdp_patch"
LAYERS = ("torch_interop", "mixed_precision", "sharding", "adapter", "module", "top")


def layer_of(module: str) -> str | None:
    """The layer of an absolute module name of the core (``None`` outside the core, or the package itself)."""
    parts = module.split(".")
    if parts[0] != "fsdp_patch" or len(parts) == 1 or parts[1] in ("telemetry", "app"):
        return None
    return parts[1] if parts[1] in LAYERS else "top"


def downward_violations(core: Path) -> list[str]:
    """Each import, by a module under ``core``, of a module in a layer above the importer's own."""
    found = []
    for path in sorted(core.rglob("*.py")):
        parts = path.relative_to(core).with_suffix("").parts
        module = ".".join(["fsdp_patch", *(parts[:-1] if parts[-1] == "__init__" else parts)])
        own = layer_of(module) or "top"
        package = ".".join(["fsdp_patch", *path.relative_to(core).parts[:-1]])
        for line, imported in imported_modules(path, package):
            layer = layer_of(imported)
            if layer is not None and LAYERS.index(layer) > LAYERS.index(own):
                found.append(
                    f"{path.relative_to(core.parent)}:{line} imports {imported} (layer {layer!r} above {own!r})"
                )
    return found


def test_the_core_is_grouped_by_concern() -> None:
    got = sorted(p.name for p in CORE.iterdir() if (p / "__init__.py").is_file())
    assert got == ["adapter", "module", "sharding", "torch_interop"], f"the core's packages: {got}"
    flat = sorted(p.name for p in CORE.glob("*.py"))
    want = ["__init__.py", "__main__.py", "mixed_precision.py", "optimizer.py"]
    assert flat == want, f"the core's top-level modules: want the public API and the entry point {want}, got {flat}"


def test_every_core_module_imports_only_its_layer_and_those_below() -> None:
    violations = downward_violations(CORE)
    assert violations == [], "imports against the layers' direction:\n" + "\n".join(violations)


def test_a_planted_upward_import_is_found(tmp_path: Path) -> None:
    """The check is no formality: a sharding module importing the module layer (absolute and
    relative) and torch_interop importing the adapter are each reported with their line."""
    core = tmp_path / "fsdp_patch"
    for folder in ("sharding", "torch_interop"):
        (core / folder).mkdir(parents=True)
        (core / folder / "__init__.py").write_text("")
    (core / "__init__.py").write_text("")
    (core / "sharding" / "planted.py").write_text(
        "import torch\nfrom fsdp_patch.module.unit import UnitState\nfrom ..module import shard_module\n"
        "from ..torch_interop import torch_compat\n"
    )
    (core / "torch_interop" / "planted.py").write_text("from fsdp_patch.adapter import adapt_optimizer\n")
    got = downward_violations(core)
    want = [
        "fsdp_patch/sharding/planted.py:2 imports fsdp_patch.module.unit.UnitState (layer 'module' above 'sharding')",
        "fsdp_patch/sharding/planted.py:3 imports fsdp_patch.module.shard_module (layer 'module' above 'sharding')",
        "fsdp_patch/torch_interop/planted.py:1 imports fsdp_patch.adapter.adapt_optimizer (layer 'adapter' above 'torch_interop')",
    ]
    assert got == want, f"want {want}, got {got}"
