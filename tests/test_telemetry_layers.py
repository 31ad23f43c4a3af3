"""telemetry/ is layers with one-way imports: no module imports a layer above its own.

From the bottom up: the names and settings (``semconv``, ``env``, ``precision_thresholds``,
``trace_limits``, at the package's top); ``offline/`` (trace files read back and converted, reports:
neither OpenTelemetry nor torch); ``diagnostics/`` (the precision statistics: torch, no OpenTelemetry);
``export/`` (the embedded SDK defaults: providers, exporters, trace files written, summary);
``instrumentation/`` (instrumentor, observer, instruments, timing, the adapter's observer source).
The package's own ``__init__`` is its facade: it may name any layer, and no module imports it.
Within a layer too, no module imports itself back through a chain of others.
"""

from __future__ import annotations

from pathlib import Path

from tests.import_statements import import_statements

TELEMETRY = Path(__file__).resolve().parents[1] / "telemetry"
LAYERS = ("", "offline", "diagnostics", "export", "instrumentation")  # "" is the bottom: the top-level modules
# What a layer may not import besides layers above it.
FORBIDDEN = {"": ("opentelemetry", "torch"), "offline": ("opentelemetry", "torch"), "diagnostics": ("opentelemetry",)}


def _layer_of(path: Path) -> str:
    parts = path.relative_to(TELEMETRY).parts
    return parts[0] if len(parts) > 1 else ""


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path``, relative ones resolved within telemetry/."""
    package = ".".join(["fsdp_patch", "telemetry", *path.relative_to(TELEMETRY).parts[:-1]])
    found = []
    for line, module, names in import_statements(path, package):
        if names and _layer_of_module(module) is not None and _is_package(module):
            # "from <package> import x": x is a module of it, else a name of the package itself.
            found += [(line, _name_in(module, name)) for name in names]
        else:
            found.append((line, module))
    return found


def _is_package(module: str) -> bool:
    return (TELEMETRY.joinpath(*module.split(".")[2:]) / "__init__.py").is_file()


def _name_in(package: str, name: str) -> str:
    folder = TELEMETRY.joinpath(*package.split(".")[2:])
    return f"{package}.{name}" if (folder / f"{name}.py").is_file() or (folder / name).is_dir() else package


def _layer_of_module(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["fsdp_patch", "telemetry"]:
        return None
    if len(parts) == 2:
        return "facade"
    return parts[2] if parts[2] in LAYERS[1:] else ""


def test_every_module_imports_only_its_layer_and_those_below() -> None:
    modules = [p for p in sorted(TELEMETRY.rglob("*.py")) if p != TELEMETRY / "__init__.py"]
    layers_found = {_layer_of(p) for p in modules}
    assert layers_found == set(LAYERS), f"want the layers {sorted(LAYERS)}, got {sorted(layers_found)}"
    violations = []
    for path in modules:
        own = LAYERS.index(_layer_of(path))
        for line, module in _imports(path):
            layer = _layer_of_module(module)
            where = f"{path.relative_to(TELEMETRY)}:{line} imports {module}"
            if layer == "facade":
                violations.append(f"{where} (the facade, which re-exports the layers)")
            elif layer is not None and LAYERS.index(layer) > own:
                violations.append(f"{where} (layer {layer!r} above {LAYERS[own]!r})")
            elif layer is None and module.split(".")[0] in FORBIDDEN.get(LAYERS[own], ()):
                violations.append(f"{where} (layer {LAYERS[own]!r} imports no {module.split('.')[0]})")
    assert violations == [], "imports against the layers' direction:\n" + "\n".join(violations)


def _module_of(path: Path) -> str:
    parts = path.relative_to(TELEMETRY).with_suffix("").parts
    return ".".join(["fsdp_patch", "telemetry", *(parts[:-1] if parts[-1] == "__init__" else parts)])


def test_no_module_imports_itself_back() -> None:
    """No module of the package imports, through any chain of the package's modules, one that
    imports it back (the facade aside: it imports the layers, none imports it)."""
    modules = [p for p in sorted(TELEMETRY.rglob("*.py")) if p != TELEMETRY / "__init__.py"]
    graph = {_module_of(p): {m for _, m in _imports(p)} for p in modules}
    for module in graph:
        graph[module] &= set(graph) - {module}
    cycles = []
    for start in sorted(graph):
        seen, todo = set(), list(graph[start])
        while todo:
            module = todo.pop()
            if module == start:
                cycles.append(start)
                break
            if module not in seen:
                seen.add(module)
                todo.extend(graph[module])
    assert cycles == [], f"modules that import themselves back: {cycles}"
