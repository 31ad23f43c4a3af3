"""The start-up hook (``startup/``, installed as ``fsdp_patch_startup.pth``) in fresh interpreters.

With ``FSDP_PATCH_TELEMETRY`` unset (or off) an interpreter's start imports nothing of fsdp_patch,
torch, wrapt or OpenTelemetry; set, nothing but the hook until the script imports torch, and then
the instrumentor is instrumented. A broken installation or a bad value never stops the interpreter
nor fails ``import torch``: one line on stderr says why telemetry is off.

Which installation: the environment running the tests (``make test``'s editable install); the
installed-package test (``tests/cli/test_installed_command.py``) checks a regular install's hook.
"""

from __future__ import annotations

import json
import os
import site
import subprocess
import sys
from pathlib import Path

import pytest

HOOK = "fsdp_patch_startup.pth"
HEAVY = ("fsdp_patch", "torch", "wrapt", "opentelemetry")

# What a fresh interpreter has imported: the heavy packages' top-level modules, and the hook's.
PROBE = f"""
import json, sys
print(json.dumps(sorted({{m.split(".")[0] for m in sys.modules if m.split(".")[0] in {HEAVY + ("fsdp_patch_startup",)!r}}})))
"""
# Whether importing torch instrumented fsdp_patch's instrumentor (and wrapped Optimizer.__init__).
AFTER_TORCH = """
import json, sys
import torch
from fsdp_patch.telemetry.instrumentation import activation
from fsdp_patch.telemetry import FSDPOptimizerInstrumentor
init = torch.optim.Optimizer.__dict__["__init__"]
print(json.dumps({"instrumented": activation.instrumented is not None,
                  "by_opentelemetry": FSDPOptimizerInstrumentor().is_instrumented_by_opentelemetry,
                  "init_wrapped": hasattr(init, "__wrapped__")}))
"""


def _env(**set_: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FSDP_PATCH_", "OTEL_", "PYTHONPATH"))}
    env.update(set_)
    return env


def _python(code: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def _last_json(result: subprocess.CompletedProcess[str]) -> object:
    assert result.returncode == 0, f"want exit 0, got {result.returncode}; stderr:\n{result.stderr[-3000:]}"
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_the_hook_is_installed_beside_the_packages() -> None:
    found = [Path(d) / HOOK for d in site.getsitepackages() if (Path(d) / HOOK).is_file()]
    assert found, f"want {HOOK} in one of {site.getsitepackages()}, found none"
    line = found[0].read_text().strip()
    assert line.startswith("import os;") and "FSDP_PATCH_TELEMETRY" in line, f"unexpected hook line: {line!r}"


@pytest.mark.parametrize("value", [None, "", "0", "false"])
def test_off_imports_nothing_at_start(value: str | None, tmp_path: Path) -> None:
    env = _env() if value is None else _env(FSDP_PATCH_TELEMETRY=value)
    got = _last_json(_python(PROBE, env, tmp_path))
    want = [] if not value else ["fsdp_patch_startup"]  # "0": the hook's own module reads the value
    assert got == want, f"FSDP_PATCH_TELEMETRY={value!r}: want {want} imported at start, got {got}"


def test_on_imports_only_the_hook_until_torch_is_imported(tmp_path: Path) -> None:
    got = _last_json(_python(PROBE, _env(FSDP_PATCH_TELEMETRY="1"), tmp_path))
    assert got == ["fsdp_patch_startup", "wrapt"], f"want the hook and wrapt only at start, got {got}"


def test_on_instruments_when_torch_is_imported(tmp_path: Path) -> None:
    got = _last_json(_python(AFTER_TORCH, _env(FSDP_PATCH_TELEMETRY="1"), tmp_path))
    want = {"instrumented": True, "by_opentelemetry": True, "init_wrapped": True}
    assert got == want, f"want {want} after import torch, got {got}"
    off = _last_json(_python(AFTER_TORCH, _env(), tmp_path))
    want_off = {"instrumented": False, "by_opentelemetry": False, "init_wrapped": False}
    assert off == want_off, f"with the variable unset want {want_off}, got {off}"


def test_a_bad_value_is_one_line_and_torch_still_imports(tmp_path: Path) -> None:
    result = _python(AFTER_TORCH, _env(FSDP_PATCH_TELEMETRY="yes"), tmp_path)
    got = _last_json(result)
    assert got["instrumented"] is False, f"a bad value must leave telemetry off, got {got}"
    lines = [line for line in result.stderr.splitlines() if line.startswith("fsdp_patch:")]
    assert len(lines) == 1 and "FSDP_PATCH_TELEMETRY='yes' is not valid" in lines[0], (
        f"want one line naming the bad value, got {lines}; stderr:\n{result.stderr[-2000:]}"
    )
    assert "training continues without telemetry" in lines[0], lines[0]


def test_a_broken_fsdp_patch_cannot_fail_import_torch(tmp_path: Path) -> None:
    # A package of that name that fails to import stands first on the path.
    broken = tmp_path / "broken"
    (broken / "fsdp_patch").mkdir(parents=True)
    (broken / "fsdp_patch" / "__init__.py").write_text("raise RuntimeError('this installation is broken')\n")
    code = "import torch; print('trained', torch.ones(2).sum().item())"
    result = _python(code, _env(FSDP_PATCH_TELEMETRY="1", PYTHONPATH=str(broken)), tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "trained 2.0", (
        f"want the script to run, got exit {result.returncode}, stdout {result.stdout!r}; stderr:\n{result.stderr[-2000:]}"
    )
    lines = [line for line in result.stderr.splitlines() if line.startswith("fsdp_patch:")]
    assert len(lines) == 1 and "this installation is broken" in lines[0], f"want one line with the cause, got {lines}"


def test_a_broken_hook_module_cannot_stop_the_interpreter(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "fsdp_patch_startup.py").write_text("raise RuntimeError('the hook module is broken')\n")
    result = _python("print('started')", _env(FSDP_PATCH_TELEMETRY="1", PYTHONPATH=str(broken)), tmp_path)
    assert result.returncode == 0 and result.stdout.strip() == "started", (
        f"want the interpreter to start, got exit {result.returncode}; stderr:\n{result.stderr[-2000:]}"
    )
