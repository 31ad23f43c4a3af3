"""Where a NaN/Inf began: a fault planted in one named place is reported at its step, with that
place and the part of the iteration it began in, for ``fully_shard`` and torch FSDP2 models.

Each run trains the tiny transformer (uneven shards on 2 and 4 ranks) with telemetry's embedded
default writing trace files, and reads the precision report of those files as ``fsdp-patch
report --json`` gives it. The fault is planted at step ``PLANT`` in one place, by a hook or a
write a user's code could make: nothing of the product is patched.
"""

from __future__ import annotations

import functools
import gc
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from fsdp_patch.app.demo.train import _NaNInBackward  # the demo's backward-nan plant

from tests import models
from tests.integration.otel_training import environment, reset_otel

STEPS = 6
PLANT = 3
KINDS = ("fully_shard", "fsdp2")

# (stage, where) each planted fault must be reported as; ranks where the report may name it.
WANT = {
    "weight_write": ("weight_write", "blocks.1.fc2.weight"),
    "forward": ("forward", "blocks.1"),
    "loss": ("loss", "loss"),
    "backward": ("backward", "blocks.1"),
    "grad_write": ("grad_write", "blocks.0"),
    "optimizer": ("optimizer", "head.weight"),
}


def _shard(model: torch.nn.Module, kind: str, **policy: Any) -> torch.nn.Module:
    if kind == "fully_shard":
        from fsdp_patch import MixedPrecisionPolicy

        return models.shard_model(model, mp_policy=MixedPrecisionPolicy(**policy))
    from torch.distributed.fsdp import MixedPrecisionPolicy as FSDP2Policy

    return models.fsdp2_shard_model(model, mp_policy=FSDP2Policy(**policy))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


def origin_training(kind: str, fault: str, trace_dir: str, every: str) -> dict[str, Any]:
    """Train STEPS steps with ``fault`` planted at step PLANT (``healthy``: none); returns the
    final main weights' local shards and whether the process-wide wrappers are gone afterwards."""
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    reentrant = fault.endswith("_reentrant")
    frozen = fault.endswith("_frozen")
    fault = fault.removesuffix("_reentrant").removesuffix("_frozen")
    settings = {
        "FSDP_PATCH_TELEMETRY": "1",
        "FSDP_PATCH_TRACE_DIR": trace_dir,
        "FSDP_PATCH_PRECISION_EVERY": every,
        "FSDP_PATCH_SUMMARY": "none",
        "OTEL_TRACES_EXPORTER": None,
        "OTEL_METRICS_EXPORTER": None,
    }
    if trace_dir == "":
        settings["FSDP_PATCH_TELEMETRY"] = None
    originals = _process_wide()
    with environment(**settings):
        reset_otel()
        model = models.make_model(0)
        if reentrant:  # each block's computation checkpointed: recomputed in a backward of its own
            for block in model.blocks:
                block.forward = functools.partial(_checkpointed, block.forward)
        if frozen:  # a parameter without a grad, in the unit before the fault
            model.blocks[0].fc1.bias.requires_grad_(False)
        model = _shard(model, kind)
        head = [p for name, p in model.named_parameters() if name == "head.weight"]
        rest = [p for name, p in model.named_parameters() if name != "head.weight" and p.requires_grad]
        optimizer = torch.optim.AdamW([{"params": rest}, {"params": head}], lr=1e-3)
        fully_shard_optimizer(optimizer)
        other = torch.nn.Linear(4, 4) if fault == "other_model" else None
        for step, tokens in enumerate(models.make_batches(STEPS), start=1):
            planted = step == PLANT
            handles = []
            if planted and fault in ("forward", "forward_written"):
                handles.append(model.blocks[1].fc1.register_forward_hook(lambda m, a, out: out * math.inf))
            if fault == "forward_written":
                # Every step, the last block's output is written in place after its unit's hook saw it.
                handles.append(model.norm.register_forward_pre_hook(_written_in_place))
            if planted and fault == "backward":
                handles.append(model.blocks[1].fc1.register_forward_hook(lambda m, a, out: _NaNInBackward.apply(out)))
            batch = models.rank_slice(tokens, rank, world)
            loss = models.lm_loss(model, batch)
            if planted and fault == "loss":
                loss = loss * math.inf
            loss.backward()
            if other is not None:
                # Another model of the process (a GAN's discriminator, a model not adapted) runs
                # its backward and clips its grads every step; at PLANT its loss is NaN.
                (other(torch.ones(2, 4)).sum() * (math.nan if planted else 1.0)).backward()
                torch.nn.utils.clip_grad_norm_(other.parameters(), 1.0)
            for handle in handles:
                handle.remove()
            if planted and fault == "grad_write":
                grad = model.blocks[0].fc1.weight.grad
                with torch.no_grad():
                    _local(grad).view(-1)[0] = math.nan
            if planted and fault == "grad_write_dtensor":  # through the DTensor: its shard's counter stays
                with torch.no_grad():
                    model.blocks[0].fc1.weight.grad.mul_(math.nan)
            if planted and fault == "grad_replaced":  # a new grad tensor, not a write into the reduced one
                weight = model.blocks[0].fc1.weight
                weight.grad = weight.grad * math.nan
            if planted and fault == "optimizer":
                optimizer.param_groups[1]["lr"] = math.nan
            optimizer.step()
            optimizer.zero_grad()
            if planted and fault == "optimizer":
                optimizer.param_groups[1]["lr"] = 1e-3
            if step == PLANT - 1 and fault == "weight_write" and rank == 0:
                with torch.no_grad():
                    _local(model.blocks[1].fc2.weight).view(-1)[0] = math.nan
        weights = [_local(p).detach().clone() for p in model.parameters()]
        from fsdp_patch import telemetry

        telemetry.shutdown()
        del optimizer, model, head, rest
        gc.collect()
        restored = _process_wide() == originals
        reset_otel()
    return {"weights": weights, "restored": restored}


def _checkpointed(forward: Any, x: torch.Tensor) -> torch.Tensor:
    return torch.utils.checkpoint.checkpoint(forward, x, use_reentrant=True)


def _written_in_place(module: torch.nn.Module, args: tuple[Any, ...]) -> None:
    args[0].mul_(1.0)


def _process_wide() -> tuple[Any, ...]:
    return (
        torch.autograd.backward,
        torch.amp.GradScaler.step,
        torch.nn.utils.clip_grad_norm_,
        torch.nn.utils.clip_grad.clip_grad_norm_,
    )


def _unit_origins(trace_dir: Path) -> dict[int, int]:
    """Unit-level origin events per rank in the trace files (escalation's refinements aside)."""
    from fsdp_patch.telemetry import semconv
    from fsdp_patch.telemetry.offline.trace_reading import iter_events, rank_segments

    counts: dict[int, int] = {}
    for segment in rank_segments(str(trace_dir)):
        for event in iter_events(segment.path):
            args = event.get("args") or {}
            if event.get("name") == semconv.EVENT_ORIGIN and not args.get(semconv.ATTR_ORIGIN_REFINED):
                counts[segment.rank] = counts.get(segment.rank, 0) + 1
    return counts


def _report(trace_dir: Path) -> dict[str, Any]:
    from fsdp_patch.telemetry.offline.precision_report import report_json

    return report_json(str(trace_dir))


def _run(dist_pool: Any, world: int, kind: str, fault: str, tmp_path: Path, every: str) -> dict[str, Any]:
    trace_dir = tmp_path / f"{kind}-{fault}-{every}"
    os.makedirs(trace_dir, exist_ok=True)
    results = dist_pool(world).run(origin_training, kind, fault, str(trace_dir), every)
    assert all(r["restored"] for r in results), (
        "torch.autograd.backward, GradScaler.step or clip_grad_norm_ still wrapped after the optimizer is gone"
    )
    return _report(trace_dir)


@pytest.mark.parametrize("every", ["1", "100"])
@pytest.mark.parametrize("fault", sorted(WANT))
@pytest.mark.parametrize("kind", KINDS)
def test_a_planted_fault_is_reported_where_and_when_it_began(dist_pool, tmp_path, kind, fault, every) -> None:
    report = _run(dist_pool, 2, kind, fault, tmp_path, every)
    origin = report["origin"]
    want_stage, want_where = WANT[fault]
    got = None if origin is None else (origin["step"], origin["stage"], origin["where"])
    assert got == (PLANT, want_stage, want_where), (
        f"{kind}, {fault} at step {PLANT}, diagnostics every {every}: want the origin {(PLANT, want_stage, want_where)}, "
        f"got {got}; the report leads with {report['findings'][:1]}"
    )
    lead = report["findings"][0]
    assert lead["check"] == "origin", f"{kind}, {fault}: want the report to lead with the origin, it leads with {lead}"
    # The NaN stays in the weights from then on: one origin per rank, not one per later step.
    counts = _unit_origins(tmp_path / f"{kind}-{fault}-{every}")
    assert all(n == 1 for n in counts.values()), f"{kind}, {fault}: origin events per rank {counts}, want 1 each"
    if fault == "weight_write":
        assert origin["ranks"] == [0], f"{kind}: the write was on rank 0's shard only, got ranks {origin['ranks']}"
        # The forward ran on the weight written (gathered from the main weights), so the step's
        # grads held NaN and its update spread it over the parameter: the count says so.
        want = "which spread it"
        assert want in origin["detail"], f"{kind}: want the elements counted ({want!r}): {origin['detail']!r}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_unit_output_written_in_place_after_its_hook_is_still_named(dist_pool, tmp_path, kind) -> None:
    """A forward's unit outputs are checked together as its backward begins; an output the model
    writes in place after its unit's hook (here every step, by the module after the last block)
    no longer holds what the unit made: that unit is checked at once from the next forward on, so
    a NaN it makes later is still named at it, not at the module that wrote it."""
    report = _run(dist_pool, 2, kind, "forward_written", tmp_path, "100")
    origin = report["origin"]
    got = None if origin is None else (origin["step"], origin["stage"], origin["where"])
    assert got == (PLANT, *WANT["forward"]), f"{kind}: want the origin {(PLANT, *WANT['forward'])}, got {got}"


def test_a_grad_replaced_after_the_reduce_is_checked_at_the_step(dist_pool, tmp_path) -> None:
    """Torch FSDP2's grads checked after its reduce are not checked again at the step unless
    written since; a grad replaced by a new tensor (``p.grad = p.grad * nan``, no write into the
    one checked) is a grad the reduce never made, and is checked there."""
    report = _run(dist_pool, 2, "fsdp2", "grad_replaced", tmp_path, "100")
    origin = report["origin"]
    got = None if origin is None else (origin["step"], origin["stage"], origin["where"])
    assert got == (PLANT, *WANT["grad_write"]), f"want the origin {(PLANT, *WANT['grad_write'])}, got {got}"


# Telemetry on with no exporter and no summary: what a test of the checks' memory needs.
EXPORTING_NOTHING: dict[str, str | None] = {
    "FSDP_PATCH_TELEMETRY": "1",
    "FSDP_PATCH_TRACE_DIR": None,
    "FSDP_PATCH_SUMMARY": "none",
    "OTEL_TRACES_EXPORTER": "none",
    "OTEL_METRICS_EXPORTER": "none",
}


def main_grads_freed_by_zero_grad() -> dict[str, Any]:
    """``fully_shard`` frees a group's main-grad buffer once no grad holds it: after a backward
    and ``zero_grad()`` with no step between, with the checks on, every group's ``main_grad`` is
    ``None`` (the checks know a grad they saw by a weak reference)."""
    from fsdp_patch.optimizer import fully_shard_optimizer
    from fsdp_patch.sharding import parameter_group_of

    rank, world = dist.get_rank(), dist.get_world_size()
    with environment(**EXPORTING_NOTHING):
        reset_otel()
        model = _shard(models.make_model(0), "fully_shard", main_grads_dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        groups = {id(g): g for p in model.parameters() if (g := parameter_group_of(p)) is not None}
        tokens = next(iter(models.make_batches(1)))
        models.lm_loss(model, models.rank_slice(tokens, rank, world)).backward()
        held_after_backward = sum(g.main_grad is not None for g in groups.values())
        optimizer.zero_grad()
        gc.collect()
        held_after_zero_grad = sum(g.main_grad is not None for g in groups.values())
        from fsdp_patch import telemetry

        telemetry.shutdown()
        reset_otel()
    return {"groups": len(groups), "after backward": held_after_backward, "after zero_grad": held_after_zero_grad}


def test_the_checks_keep_no_main_grad_buffer_alive(dist_pool) -> None:
    got = dist_pool(2).run(main_grads_freed_by_zero_grad)[0]
    want = {"groups": got["groups"], "after backward": got["groups"], "after zero_grad": 0}
    assert got == want, f"groups holding a main-grad buffer: want {want}, got {got}"


def fsdp2_grads_freed_by_zero_grad() -> dict[str, Any]:
    """Torch FSDP2's grads (reduced in bf16, so checked before and after the reduce, and at the
    step where written since) are freed by ``zero_grad()`` with the checks on: none is referenced
    by the iteration's checks, which keep values, not tensors."""
    import weakref

    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world = dist.get_rank(), dist.get_world_size()
    with environment(**EXPORTING_NOTHING):
        reset_otel()
        model = _shard(models.make_model(0), "fsdp2", param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        fully_shard_optimizer(optimizer)
        tokens = next(iter(models.make_batches(1)))
        models.lm_loss(model, models.rank_slice(tokens, rank, world)).backward()
        grads = [_local(p.grad) for p in model.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # written since the reduce: checked at the step
        refs = [weakref.ref(g) for g in grads]
        del grads
        optimizer.step()
        optimizer.zero_grad()
        gc.collect()
        alive = sum(ref() is not None for ref in refs)
        from fsdp_patch import telemetry

        telemetry.shutdown()
        reset_otel()
    return {"grads": len(refs), "alive after zero_grad": alive}


def test_the_checks_keep_no_fsdp2_grad_alive(dist_pool) -> None:
    got = dist_pool(2).run(fsdp2_grads_freed_by_zero_grad)[0]
    want = {"grads": got["grads"], "alive after zero_grad": 0}
    assert got["grads"] > 0 and got == want, f"FSDP2 grads the checks keep alive: want {want}, got {got}"


@pytest.mark.parametrize("kind", KINDS)
def test_on_four_ranks_the_origin_is_the_same(dist_pool, tmp_path, kind) -> None:
    for fault in ("weight_write", "backward"):
        report = _run(dist_pool, 4, kind, fault, tmp_path, "100")
        origin = report["origin"]
        got = None if origin is None else (origin["step"], origin["stage"], origin["where"])
        want = (PLANT, *WANT[fault])
        assert got == want, f"{kind}, {fault}, 4 ranks: want {want}, got {got}"


@pytest.mark.parametrize("kind", KINDS)
def test_a_healthy_run_reports_no_origin_and_trains_as_with_telemetry_off(dist_pool, tmp_path, kind) -> None:
    report = _run(dist_pool, 2, kind, "healthy", tmp_path, "100")
    assert report["origin"] is None and report["verdict"] == "healthy", (
        f"{kind}: a healthy run reported {report['origin']}, verdict {report['verdict']}: {report['findings']}"
    )
    on = dist_pool(2).run(origin_training, kind, "forward", str(tmp_path / "on"), "1")
    off = dist_pool(2).run(origin_training, kind, "forward", "", "1")
    for rank, (a, b) in enumerate(zip(on, off, strict=True)):
        same = [
            torch.equal(x.view(torch.int32), y.view(torch.int32))
            for x, y in zip(a["weights"], b["weights"], strict=True)
        ]
        assert all(same), (
            f"{kind}, rank {rank}: weights after an escalated run differ with telemetry on and off: {same}"
        )


# -- two episodes in one run ------------------------------------------------------------------------


def two_episodes_training(trace_dir: str) -> dict[str, Any]:
    """The bug-pattern model under ``fully_shard``, fp16 compute and fp16 grads, a GradScaler from
    scale 1 (it skips both overflowing iterations, so the weights stay finite in between): at step
    3 head.weight[0, 0]'s local grad +4e4 on both ranks (their fp16 sum overflows in the
    reduce-scatter), at steps 7-8 rank 0's batch x1e5 (the forward overflows; step 8 is escalated,
    so its module-level checks refine that origin)."""
    from benchmarks.bug_patterns import plants
    from benchmarks.bug_patterns.run import quiet_warnings
    from benchmarks.bug_patterns.tiny_lm import Settings
    from benchmarks.bug_patterns.training import FULLY_SHARD, Context, Plant, train_on_rank

    class Both(Plant):
        def __init__(self, *each: Plant) -> None:
            self.each = each

        def before_forward(self, ctx: Context, tokens: torch.Tensor, targets: torch.Tensor) -> None:
            for plant in self.each:
                plant.before_forward(ctx, tokens, targets)

    quiet_warnings()
    reset_otel()
    try:
        settings = Settings(compute="fp16", grads="fp16", scaler=True, init_scale=1.0, steps=10)
        plant = Both(plants.GradSpike(plants.When(3, 3), 4e4), plants.BatchGain(plants.When(7, 9, (0,)), 1e5))
        return train_on_rank(FULLY_SHARD, settings, plant, trace_dir, 1)
    finally:
        gc.collect()
        reset_otel()


def _origin_events(trace_dir: Path) -> list[tuple[int, str, str, bool, int]]:
    """Every origin event of the trace files: (step, stage, where, refined, rank), in order."""
    from fsdp_patch.telemetry import semconv
    from fsdp_patch.telemetry.offline.trace_reading import iter_events, rank_segments

    found = []
    for segment in rank_segments(str(trace_dir)):
        for event in iter_events(segment.path):
            args = event.get("args") or {}
            if event.get("name") == semconv.EVENT_ORIGIN:
                found.append(
                    (
                        args[semconv.ATTR_STEP],
                        args[semconv.ATTR_ORIGIN_STAGE],
                        args[semconv.ATTR_ORIGIN_WHERE],
                        bool(args[semconv.ATTR_ORIGIN_REFINED]),
                        segment.rank,
                    )
                )
    return sorted(found)


def _steps_in(value: Any) -> list[int]:
    """Every ``step`` of the dicts nested in ``value``."""
    if isinstance(value, dict):
        return [*([value["step"]] if isinstance(value.get("step"), int) else []), *_steps_in(list(value.values()))]
    if isinstance(value, list):
        return [step for item in value for step in _steps_in(item)]
    return []


def test_of_two_episodes_the_report_leads_with_the_earlier(dist_pool, tmp_path) -> None:
    """A reduce-scatter overflow at step 3 and, after clean iterations, a forward overflow at step
    6 (iteration 7: the GradScaler skipped iteration 3, which made no step): the forward is an
    earlier stage of an iteration, the reduce an earlier step. The report and ``--json`` lead with
    the reduce-scatter at step 3, and name nothing of the second episode under it (its
    module-level refinement, at step 6, is the second episode's)."""
    from tests.integration.report_json import report_json

    traces = tmp_path / "traces"
    dist_pool(2).run(two_episodes_training, str(traces))
    events = _origin_events(traces)
    units = {(step, stage, where) for step, stage, where, refined, _ in events if not refined}
    want_units = {(3, "reduce", ""), (6, "forward", "blocks.0")}
    assert {step for step, _, _ in units} == {3, 6} and want_units <= units, (
        f"want the run to hold two episodes, the reduce at step 3 and the forward at step 6; its origins: {events}"
    )
    assert any(refined and step == 6 for step, _, _, refined, _ in events), (
        f"want the second episode refined (the first is not: one overflowing iteration), got {events}"
    )
    report = report_json(traces)
    origin = report["origin"]
    got = (origin["step"], origin["stage"], origin["where"], origin["ranks"], origin["refined"])
    assert got == (3, "reduce", "", [0], []), (
        f"--json: want the origin (3, 'reduce', '', [0], no refinement), got {got}"
    )
    steps = _steps_in(origin)
    assert max(steps) < 6, f"--json: the origin at step 3 holds steps {steps} of the second episode: {origin}"
    lead = (report["findings"][0]["check"], report["findings"][0]["first_step"])
    assert lead == ("origin", 3), f"--json leads with {report['findings'][0]}"
    text = subprocess.run(
        [sys.executable, "-m", "fsdp_patch", "report", str(traces)],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    want = "overall: problem: NaN/Inf began in the reduce-scatter of the grads, from step 3"
    assert want in text.splitlines(), f"want the line {want!r} in the report:\n{text}"
    block = text.split("  - NaN/Inf began in", 1)[1].split("\n  - ", 1)[0]
    assert "step 6" not in block, f"the second episode (step 6) is named under the first's origin:\n{block}"
