"""The core knows nothing of telemetry: telemetry registers into the adapter's observer seam.

``fsdp_patch`` (the core; the application layer above it is ``app/``) names ``fsdp_patch.telemetry`` in one
place only, ``adapter/observer_source.py``, which imports it by name when ``FSDP_PATCH_TELEMETRY``
is set. With the variable unset, sharding a model, adapting its optimizer and training import
no ``fsdp_patch.telemetry*`` module.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.training_script import one_rank_training

REPO = Path(__file__).resolve().parents[1]
CORE = REPO / "fsdp_patch"
TRIGGER = CORE / "adapter" / "observer_source.py"


def _telemetry_references(path: Path) -> list[str]:
    """Imports of telemetry in ``path``, and string constants naming the package (an import by name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if "telemetry" in a.name.split(".")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [a.name for a in node.names]
            if "telemetry" in module.split(".") or (module in ("fsdp_patch", "") and "telemetry" in names):
                found.append(f"line {node.lineno}: from {'.' * node.level}{module} import {', '.join(names)}")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and node.value.startswith("fsdp_patch.telemetry")
        ):
            found.append(f"line {node.lineno}: {node.value!r}")
    return found


def test_core_names_telemetry_only_in_the_trigger() -> None:
    core_files = sorted(CORE.rglob("*.py"))
    assert TRIGGER in core_files, f"want the trigger {TRIGGER} among the core's files"
    got = {str(p.relative_to(REPO)): refs for p in core_files if (refs := _telemetry_references(p))}
    trigger = str(TRIGGER.relative_to(REPO))
    assert list(got) == [trigger], f"want telemetry named only in {trigger}, got {got}"
    assert len(got[trigger]) == 1, f"want one reference in {trigger}, got {got[trigger]}"


# Two adapted training steps; then which telemetry modules were loaded, and what the step is.
TRAIN_AND_LIST_MODULES = one_rank_training(
    2,
    after='print(sorted(m for m in sys.modules if m.startswith("fsdp_patch.telemetry")))\n'
    "print(type(optimizer.step).__name__)\n",
)


def test_training_with_telemetry_unset_imports_no_telemetry(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_"))}
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TRAIN_AND_LIST_MODULES))
    result = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180, check=False
    )
    assert result.returncode == 0, f"want exit 0, got {result.returncode}:\n{result.stderr[-3000:]}"
    modules, step_type = result.stdout.strip().splitlines()
    assert modules == "[]", f"want no fsdp_patch.telemetry module imported, got {modules}"
    assert step_type == "_BoundMethodWrapper", f"want the attachment's wrapt wrapper as the step, got {step_type}"
