"""The float8 cast watch on real training: torchao's float8 MLP (tests/fsdp/float8_models.py, three
``Float8Linear`` layers, fp8 emulated) on gloo ranks, sharded by ``fully_shard`` (weights gathered in
bf16, or as the float8 compute copy: the weight arrives in float8) or by torch FSDP2 (float8 without
its fp8 all-gather, which gloo cannot run), the optimizer adapted, the default diagnostics schedule.

On the diagnosed iterations (steps 1, 2, 3 and 5 of 6) every float8 module's input, weight and grad
output is reported, a step later, under the user's module names, the first and last modules named
so; the watch's hooks are on the models only while a diagnosed iteration runs, and gone after the
run and when telemetry is turned off; training is bitwise the same with telemetry off. A healthy run
whose first and last layers stay in bf16 has no float8 finding in the report.
"""

from __future__ import annotations

import gc
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.fsdp import float8_models
from tests.fsdp.float8_models import BF16, EVEN, UNEVEN
from tests.integration.otel_training import environment, in_memory_otel, reset_otel

STEPS = 6
DIAGNOSED = (1, 2, 3, 5)  # the default schedule's steps among the first 6
WATCH_MODULE = "fsdp_patch.telemetry.instrumentation.float8_watch"
QUIET = {"FSDP_PATCH_SUMMARY": "none", "OTEL_TRACES_EXPORTER": None, "OTEL_METRICS_EXPORTER": None}


def watch_hooks(model: nn.Module) -> dict[str, int]:
    """Per module (by name), the forward hooks and pre-hooks the float8 watch installed."""
    counts: dict[str, int] = {}
    for name, module in model.named_modules():
        hooks = [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]
        mine = sum(1 for hook in hooks if getattr(hook, "__module__", None) == WATCH_MODULE)
        if mine:
            counts[name] = mine
    return counts


def all_hooks(model: nn.Module) -> int:
    """Every forward hook and pre-hook on the model's modules (FSDP's and every watch's)."""
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())


def float8_events(spans: Any) -> list[dict[str, Any]]:
    """Every ``fsdp.precision.float8`` event, with ``on``: the span it is on (name, step)."""
    from fsdp_patch.telemetry import semconv

    return [
        {"on": (span.name, span.attributes.get(semconv.ATTR_STEP)), **dict(event.attributes)}
        for span in spans.get_finished_spans()
        for event in span.events
        if event.name == semconv.EVENT_FLOAT8_CAST
    ]


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int, after_step: Any = None) -> list[float]:
    """``steps`` SGD steps on this rank's rows of float8_models' batches; ``after_step(step)`` after each."""
    out = float8_models.linears(model)[-1].out_features
    batches = float8_models.batches(out) + float8_models.batches(out, seed=2)
    losses = []
    for step, (x, y) in enumerate(batches[:steps], start=1):
        loss = F.mse_loss(model(float8_models.my_rows(x).to(BF16)).float(), float8_models.my_rows(y))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        if after_step is not None:
            after_step(step)
    return losses


def watched_training(impl: str, telemetry: bool, fp8_all_gather: bool, rows: tuple[int, int, int]) -> dict[str, Any]:
    """STEPS steps of the float8 MLP sharded by ``impl`` (``"ours"``: ``fully_shard``, ``"fsdp2"``),
    the optimizer adapted, telemetry on or off, a no_grad evaluation forward after each step. This
    rank's losses and final parameters, the
    watch's hooks after adapting, after each step and after the run, every hook counted before
    adapting and after each step, and the float8 events."""
    from torchao.float8.float8_linear import Float8Linear

    from fsdp_patch import telemetry as fsdp_telemetry
    from fsdp_patch.optimizer import fully_shard_optimizer

    settings = {"FSDP_PATCH_TELEMETRY": "1" if telemetry else None, "FSDP_PATCH_PRECISION_EVERY": None, **QUIET}
    out: dict[str, Any] = {"watch_hooks": {}, "hooks": {}}
    with environment(**settings), in_memory_otel() as (spans, _):
        gc.collect()  # an earlier body's optimizers and their watches go first
        model = float8_models.shard(float8_models.float8_mlp(fp8_all_gather, rows), impl)
        out["float8_modules"] = [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
        out["hooks_before"] = all_hooks(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=float8_models.LR)
        fully_shard_optimizer(optimizer)
        out["watch_hooks_adapted"] = watch_hooks(model)

        evaluation = float8_models.my_rows(float8_models.batches(1, seed=3)[0][0]).to(BF16)

        def count(step: int) -> None:
            out["watch_hooks"][step] = watch_hooks(model)
            out["hooks"][step] = all_hooks(model)
            with torch.no_grad():  # an evaluation between steps: no part of the iteration measured
                model(evaluation)

        out["losses"] = train_steps(model, optimizer, STEPS, count)
        fsdp_telemetry.shutdown()  # reads what the last diagnosed iteration measured
        out["watch_hooks_after_run"] = watch_hooks(model)
        out["events"] = float8_events(spans)
        out["params"] = {name: p.full_tensor().detach().float() for name, p in model.named_parameters()}
    return out


_RUNS: dict[tuple[Any, ...], list[dict[str, Any]]] = {}


def runs(dist_pool: Any, world_size: int, impl: str, fp8: bool, rows: tuple[int, int, int]) -> dict[bool, list[dict]]:
    """Per telemetry on/off, each rank's :func:`watched_training`, once per session."""
    for on in (True, False):
        key = (world_size, impl, fp8, rows, on)
        if key not in _RUNS:
            _RUNS[key] = dist_pool(world_size).run(watched_training, impl, on, fp8, rows)
    return {on: _RUNS[(world_size, impl, fp8, rows, on)] for on in (True, False)}


SHARDINGS = [
    pytest.param(2, "ours", False, EVEN, id="fully_shard"),
    pytest.param(2, "fsdp2", False, EVEN, id="fsdp2"),
    pytest.param(2, "ours", True, EVEN, id="fully_shard-float8-copy"),
    pytest.param(4, "ours", False, UNEVEN, id="ws4-fully_shard-uneven"),
    pytest.param(4, "ours", True, UNEVEN, id="ws4-fully_shard-float8-copy-uneven"),
]


@pytest.mark.parametrize(("world_size", "impl", "fp8", "rows"), SHARDINGS)
def test_every_float8_cast_is_reported_a_step_later_on_diagnosed_iterations_only(
    dist_pool: Any, world_size: int, impl: str, fp8: bool, rows: tuple[int, int, int]
) -> None:
    from fsdp_patch.telemetry import semconv

    float8_models.require_torchao()
    for rank, got in enumerate(runs(dist_pool, world_size, impl, fp8, rows)[True]):
        modules = got["float8_modules"]
        assert modules == ["0", "2", "4"], f"rank {rank}: want the MLP's three Float8Linear, got {modules}"
        per_step = Counter((e["on"], e[semconv.ATTR_STEP]) for e in got["events"])
        want = {((semconv.SPAN_STEP, step + 1), step): 3 * len(modules) for step in DIAGNOSED}
        assert dict(per_step) == want, f"rank {rank}: want (span, step measured): events {want}, got {dict(per_step)}"
        for step in DIAGNOSED:
            events = [e for e in got["events"] if e[semconv.ATTR_STEP] == step]
            casts = sorted((e[semconv.ATTR_FLOAT8_MODULE], e[semconv.ATTR_FLOAT8_ROLE]) for e in events)
            want_casts = sorted((m, role) for m in modules for role in semconv.FLOAT8_ROLES)
            assert casts == want_casts, f"rank {rank}, step {step}: want each module's casts once, got {casts}"
            positions = {e[semconv.ATTR_FLOAT8_MODULE]: e[semconv.ATTR_FLOAT8_POSITION] for e in events}
            assert positions == {"0": "first", "2": "middle", "4": "last"}, f"rank {rank}, step {step}: {positions}"
            gathered = {(e[semconv.ATTR_FLOAT8_ROLE], e[semconv.ATTR_FLOAT8_GATHERED]) for e in events}
            want_gathered = {(semconv.FLOAT8_ROLE_WEIGHT, fp8), (semconv.FLOAT8_ROLE_INPUT, False)}
            want_gathered.add((semconv.FLOAT8_ROLE_GRAD_OUTPUT, False))
            assert gathered == want_gathered, (
                f"rank {rank}, step {step}: want (role, gathered) {want_gathered}, got {gathered}"
            )
            calls = {e[semconv.ATTR_FLOAT8_CALLS] for e in events}
            assert calls == {1}, f"rank {rank}, step {step}: one forward and backward: want 1 call each, got {calls}"


@pytest.mark.parametrize(("world_size", "impl", "fp8", "rows"), SHARDINGS)
def test_a_healthy_float8_run_fires_no_cast_check(
    dist_pool: Any, world_size: int, impl: str, fp8: bool, rows: tuple[int, int, int]
) -> None:
    """Fresh scales, Gaussian batches: nothing flushed, clamped or made NaN (a gathered weight's
    top value holds its rounded elements, not clamped ones)."""
    from fsdp_patch.telemetry import float8_thresholds, semconv
    from fsdp_patch.telemetry.diagnostics.float8_casts import VALUES

    float8_models.require_torchao()
    attributes = {key: getattr(semconv, f"ATTR_FLOAT8_{key.upper()}") for key in VALUES}
    for rank, got in enumerate(runs(dist_pool, world_size, impl, fp8, rows)[True]):
        for event in got["events"]:
            values = {key: float(event[attribute]) for key, attribute in attributes.items()}
            fired = [t.check for t in float8_thresholds.fired(event[semconv.ATTR_FLOAT8_ROLE], values)]
            where = (event[semconv.ATTR_STEP], event[semconv.ATTR_FLOAT8_MODULE], event[semconv.ATTR_FLOAT8_ROLE])
            assert fired == [], f"rank {rank}, {where}: want no check fired, got {fired} for {values}"


@pytest.mark.parametrize(("world_size", "impl", "fp8", "rows"), SHARDINGS)
def test_the_watch_hooks_the_models_only_while_a_diagnosed_iteration_runs(
    dist_pool: Any, world_size: int, impl: str, fp8: bool, rows: tuple[int, int, int]
) -> None:
    float8_models.require_torchao()
    measured = dict.fromkeys(["0", "2", "4"], 3)  # a pre-hook and a hook, and the forward order's pre-hook
    for rank, got in enumerate(runs(dist_pool, world_size, impl, fp8, rows)[True]):
        assert got["watch_hooks_adapted"] == measured, (
            f"rank {rank}: step 1 is diagnosed, got {got['watch_hooks_adapted']}"
        )
        want = {step: measured if step + 1 in DIAGNOSED else {} for step in range(1, STEPS + 1)}
        assert got["watch_hooks"] == want, f"rank {rank}: after each step: want {want}, got {got['watch_hooks']}"
        undiagnosed = {step: got["hooks"][step] for step in range(1, STEPS + 1) if step + 1 not in DIAGNOSED}
        assert len(set(undiagnosed.values())) == 1, f"rank {rank}: hooks before undiagnosed iterations {undiagnosed}"
        assert got["watch_hooks_after_run"] == {}, f"rank {rank}: left after the run: {got['watch_hooks_after_run']}"


@pytest.mark.parametrize(("world_size", "impl", "fp8", "rows"), SHARDINGS)
def test_training_is_bitwise_the_same_with_the_watch_on_and_off(
    dist_pool: Any, world_size: int, impl: str, fp8: bool, rows: tuple[int, int, int]
) -> None:
    float8_models.require_torchao()
    both = runs(dist_pool, world_size, impl, fp8, rows)
    for rank, (on, off) in enumerate(zip(both[True], both[False], strict=True)):
        assert on["losses"] == off["losses"], f"rank {rank}: losses on {on['losses']}, off {off['losses']}"
        differ = [n for n in off["params"] if not torch.equal(on["params"][n], off["params"][n])]
        assert differ == [], f"rank {rank}: parameters differing between telemetry on and off: {differ}"
        assert off["events"] == [], f"rank {rank}: telemetry off reported {len(off['events'])} float8 events"
        hooks = {"adapted": off["watch_hooks_adapted"], **off["watch_hooks"]}
        assert all(h == {} for h in hooks.values()), f"rank {rank}: telemetry off, the watch hooked: {hooks}"
        added = {step: n - off["hooks_before"] for step, n in off["hooks"].items()}
        assert set(added.values()) == {0}, f"rank {rank}: telemetry off: hooks added after each step {added}"


def stopped_mid_run(impl: str, how: str) -> dict[str, Any]:
    """Telemetry turned off (``"uninstrument"``: on through the instrumentor) or flushed
    (``"shutdown"``) after 4 steps, with the 5th iteration's hooks on; or flushed after 5 steps, step
    5's casts waiting to be read, the per-iteration checks off (``"shutdown-origin-off"``). The
    watch's hooks before and after, and the float8 events (each with the span it is on)."""
    from fsdp_patch.telemetry import FSDPOptimizerInstrumentor

    from fsdp_patch import telemetry as fsdp_telemetry
    from fsdp_patch.optimizer import fully_shard_optimizer

    settings = {
        "FSDP_PATCH_TELEMETRY": None if how == "uninstrument" else "1",
        "FSDP_PATCH_PRECISION_ORIGIN": "off" if how == "shutdown-origin-off" else None,
        "FSDP_PATCH_PRECISION_EVERY": None,
    }
    out: dict[str, Any] = {}
    with environment(**settings, **QUIET), in_memory_otel() as (spans, _):
        gc.collect()
        instrumentor = FSDPOptimizerInstrumentor()
        if how == "uninstrument":
            instrumentor.instrument()
        model = float8_models.shard(float8_models.float8_mlp(False), impl)
        optimizer = torch.optim.SGD(model.parameters(), lr=float8_models.LR)  # adapted by the instrumentor
        if how != "uninstrument":
            fully_shard_optimizer(optimizer)
        train_steps(model, optimizer, 5 if how == "shutdown-origin-off" else 4)
        out["on"] = watch_hooks(model)
        if how == "uninstrument":
            instrumentor.uninstrument()
        else:
            fsdp_telemetry.shutdown()
        out["off"] = watch_hooks(model)
        out["events"] = float8_events(spans)
    return out


@pytest.mark.parametrize("impl", ["ours", "fsdp2"], ids=["fully_shard", "fsdp2"])
@pytest.mark.parametrize("how", ["uninstrument", "shutdown"])
def test_turning_telemetry_off_or_flushing_removes_the_watch_hooks(dist_pool: Any, impl: str, how: str) -> None:
    float8_models.require_torchao()
    for rank, got in enumerate(dist_pool(2).run(stopped_mid_run, impl, how)):
        want_on = dict.fromkeys(["0", "2", "4"], 3)
        assert got["on"] == want_on, f"rank {rank}: the 5th iteration is diagnosed: want {want_on}, got {got['on']}"
        assert got["off"] == {}, f"rank {rank}: after {how}: want no watch hook, got {got['off']}"


def test_the_last_diagnosed_iteration_is_reported_at_the_flush_without_the_per_iteration_checks(
    dist_pool: Any,
) -> None:
    from fsdp_patch.telemetry import semconv

    float8_models.require_torchao()
    for rank, got in enumerate(dist_pool(2).run(stopped_mid_run, "ours", "shutdown-origin-off")):
        per_step = Counter((e["on"], e[semconv.ATTR_STEP]) for e in got["events"])
        want = {((semconv.SPAN_STEP, step + 1), step): 9 for step in DIAGNOSED[:-1]}
        want[((semconv.SPAN_CHECKS, 5), 5)] = 9  # read at the flush: no step followed
        assert dict(per_step) == want, f"rank {rank}: want (span, step measured): events {want}, got {dict(per_step)}"


def traced_healthy_run(trace_dir: str) -> None:
    """The MLP with its first and last layers left in bf16 (module_filter_fn), 6 steps under
    ``fully_shard`` with telemetry on, trace files in ``trace_dir``."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from fsdp_patch import telemetry as fsdp_telemetry
    from fsdp_patch.optimizer import fully_shard_optimizer

    settings = {"FSDP_PATCH_TELEMETRY": "1", "FSDP_PATCH_TRACE_DIR": trace_dir, "FSDP_PATCH_PRECISION_EVERY": None}
    with environment(**settings, **QUIET):
        reset_otel()
        gc.collect()
        torch.manual_seed(0)
        hidden, middle, out = EVEN
        model = nn.Sequential(
            nn.Linear(float8_models.IN, hidden), nn.GELU(), nn.Linear(hidden, middle), nn.GELU(), nn.Linear(middle, out)
        ).to(BF16)
        model = convert_to_float8_training(
            model, config=Float8LinearConfig(emulate=True), module_filter_fn=lambda module, fqn: fqn not in ("0", "4")
        )
        model = float8_models.shard(model, "ours")
        optimizer = torch.optim.SGD(model.parameters(), lr=float8_models.LR)
        fully_shard_optimizer(optimizer)
        train_steps(model, optimizer, STEPS)
        fsdp_telemetry.shutdown()
        del optimizer, model
        gc.collect()
        reset_otel()


def test_a_healthy_run_with_its_first_and_last_layers_in_bf16_has_no_float8_finding(
    dist_pool: Any, tmp_path: Path
) -> None:
    from fsdp_patch.telemetry import float8_thresholds
    from fsdp_patch.telemetry.offline import precision_report

    float8_models.require_torchao()
    dist_pool(2).run(traced_healthy_run, str(tmp_path))
    data = precision_report.report_json(str(tmp_path))
    float8_checks = {t.check for t in float8_thresholds.FLOAT8_CHECKS}
    found = [f["check"] for f in data["findings"] if f["check"] in float8_checks]
    assert found == [], f"want no float8 finding, got {found}: {data['findings']}"
    got = sorted((c["module"], c["role"], c["step"], c["ranks"]) for c in data["float8"])
    want = sorted(("2", role, DIAGNOSED[-1], [0, 1]) for role in ("input", "weight", "grad_output"))
    assert got == want, f"want the float8 layer's casts at the last diagnosed step from both ranks, got {got}"
    trends = {c["role"]: [step for step, _ in c["scale_trend"]] for c in data["float8"]}
    assert trends == dict.fromkeys(("input", "weight", "grad_output"), list(DIAGNOSED)), f"scale trends: {trends}"
