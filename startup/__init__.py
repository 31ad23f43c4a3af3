"""fsdp_patch's start-up hook: ``FSDP_PATCH_TELEMETRY=1`` instruments a training script with no code change.

Installing fsdp-patch puts ``fsdp_patch_startup.pth`` beside the packages (``setup.py``); the
interpreter's ``site`` runs its one line at every start. With ``FSDP_PATCH_TELEMETRY`` unset or
empty that line reads the variable and nothing more: nothing of fsdp_patch, torch, wrapt or
OpenTelemetry is imported. Set, it imports this module (the standard library only) and calls
:func:`start`, which asks to be called back once ``torch`` has been imported; then, and only in a
process that imports torch, fsdp_patch's instrumentor is instrumented exactly as
``opentelemetry-instrument`` would: optimizers over parameters of ``fully_shard`` or torch FSDP2
get telemetry, the trace files and the exit summary appear (the embedded default, or the SDK the
application configured). A launcher such as ``torchrun`` imports torch but builds no optimizer:
nothing is recorded there and it prints nothing.

Nothing here can stop an interpreter from starting or fail a script's ``import torch``: every
failure is one line on stderr, ``fsdp_patch: ...; training continues without telemetry``.

Removal: unset the variable (the hook then does nothing), or delete ``fsdp_patch_startup.pth``
from the environment's site-packages (``python -c "import site; print(site.getsitepackages())"``),
or uninstall fsdp-patch.

Alternatives considered:
    - ``sitecustomize``: one per interpreter, owned by the environment (and by
      ``opentelemetry-instrument``, which puts its own first on ``PYTHONPATH``); a package must
      not take it.
    - Instrumenting at start-up: imports torch and OpenTelemetry into every Python process that
      inherits the variable (pip, a launcher's helpers), seconds each, for processes that train
      nothing.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType

__all__ = ["VARIABLE", "start"]

VARIABLE = "FSDP_PATCH_TELEMETRY"
_OFF = ("", "0", "false")


def _say(message: str) -> None:
    try:
        print(f"fsdp_patch: {message}; training continues without telemetry", file=sys.stderr, flush=True)
    except Exception:
        pass


def start() -> None:
    """Instrument once torch is imported, when ``FSDP_PATCH_TELEMETRY`` is on (called by the ``.pth`` line)."""
    if os.environ.get(VARIABLE, "").strip().lower() in _OFF:
        return
    try:
        import wrapt

        wrapt.register_post_import_hook(_torch_imported, "torch")
    except Exception as exc:
        _say(f"{VARIABLE} is set but its start-up hook could not watch for torch ({type(exc).__name__}: {exc})")


_started = False


def _torch_imported(torch: ModuleType) -> None:
    # Runs inside the script's own `import torch`: whatever fails here must not fail that. wrapt
    # can call it more than once for one import; the first call decides.
    global _started
    if _started:
        return
    _started = True
    try:
        from fsdp_patch.telemetry.instrumentation.autostart import instrument_from_environment

        instrument_from_environment()
    except Exception as exc:
        _say(f"{VARIABLE} is set but telemetry could not start ({type(exc).__name__}: {exc})")
