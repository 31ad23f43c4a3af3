"""The one list of telemetry's process-wide changes (``fsdp_patch.telemetry.process_wide``) against
what the tests watch change (``telemetry_testing.global_state``, whose every change an instrumented
run must undo: tests/telemetry/test_instrumentor.py, tests/integration/test_instrumentation.py) and
against the code that makes each change."""

from __future__ import annotations

import importlib
import inspect

from fsdp_patch.telemetry.process_wide import CHANGES
from telemetry_testing import global_state

# global_state()'s keys -> the listed change each observes (atexit, which cannot be listed, is
# watched by test_instrumentor's own patch of atexit.register).
OBSERVED = {
    "Optimizer.__init__": "torch.optim.Optimizer.__init__",
    "global optimizer step pre-hooks": "torch.optim.optimizer global step pre-hooks",
    "dist.destroy_process_group": "torch.distributed.destroy_process_group (and distributed_c10d's)",
    "c10d.destroy_process_group": "torch.distributed.destroy_process_group (and distributed_c10d's)",
    "opentelemetry logger filters": "the opentelemetry loggers' filters",
    "torch.autograd.backward": "torch.autograd.backward",
    "GradScaler.step": "torch.amp.GradScaler.step",
    "nn.utils.clip_grad_norm_": "torch.nn.utils.clip_grad_norm_ (and torch.nn.utils.clip_grad's)",
    "nn.utils.clip_grad.clip_grad_norm_": "torch.nn.utils.clip_grad_norm_ (and torch.nn.utils.clip_grad's)",
    "dispatch modes": "the training thread's dispatch mode stack",
    "global module forward hooks": "torch.nn.modules.module global forward pre-hooks and hooks",
}
# Watched to stay as they are: OpenTelemetry's global providers are the application's.
UNCHANGED = {"global tracer provider", "global meter provider"}
# What each listed change's module must hold: the code that makes the change.
MADE_BY = {
    "torch.optim.Optimizer.__init__": "torch.optim.Optimizer.__init__ = ",
    "torch.optim.optimizer global step pre-hooks": "register_optimizer_step_pre_hook(",
    "torch.distributed.destroy_process_group (and distributed_c10d's)": '"destroy_process_group", wrapper',
    "atexit": "atexit.register(",
    "the opentelemetry loggers' filters": ".addFilter(",
    "torch.autograd.backward": '_install("backward", torch.autograd, "backward"',
    "torch.amp.GradScaler.step": '_install("scaler", torch.amp.GradScaler, "step"',
    "torch.nn.utils.clip_grad_norm_ (and torch.nn.utils.clip_grad's)": '"clip_grad_norm_", _on_clip',
    "the training thread's dispatch mode stack": "_push_mode(self)",
    "torch.nn.modules.module global forward pre-hooks and hooks": "register_module_forward_pre_hook(",
}


def test_every_global_the_tests_watch_is_a_listed_change() -> None:
    targets = {change.target for change in CHANGES}
    got = (sorted(set(global_state()) - set(OBSERVED) - UNCHANGED), sorted(set(OBSERVED.values()) - targets))
    assert got == ([], []), f"(watched and not mapped to a change, mapped to a change not listed): {got}"
    unwatched = sorted(targets - set(OBSERVED.values()) - {"atexit"})
    assert unwatched == [], f"listed changes no test watches: {unwatched}"


def test_each_listed_change_is_made_by_its_module() -> None:
    missing = []
    for change in CHANGES:
        source = inspect.getsource(importlib.import_module(f"fsdp_patch.telemetry.{change.module}"))
        if MADE_BY[change.target] not in source:
            missing.append(f"{change.target}: {change.module} holds no {MADE_BY[change.target]!r}")
    assert missing == [], "\n".join(missing)
    kinds = sorted({change.kind for change in CHANGES})
    assert kinds == ["filter", "hook", "mode", "wrapper"], kinds
