"""``fully_shard`` with the optimizer adapter in mixed precision trains bitwise like torch's FSDP2
with the same dtypes: bf16 compute on the training patterns (checkpointing, two backwards, two
optimizers over one group, sync-off accumulation in fp32 main grads, whose buffer the synced
microbatch frees), telemetry off and on; fp16 compute with a GradScaler over fp32 main grads, and
torch's refusal with the advice over fp16 ones.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from tests.fsdp.pattern_models import STEPS, NetOptions, build, data, mse, rows, sgd
from tests.fsdp.pattern_training import (
    BF16,
    WORLD_SIZE,
    backward_once,
    backward_twice,
    fsdp2_limitation,
    raises,
    sgd_all,
    sgd_and_head_bias_apart,
)
from tests.fsdp.sharded_views import full_params, rank0, world

MICROBATCHES = 4


@dataclass(frozen=True)
class MixedPattern:
    """A bf16 pattern of :func:`train_mixed`.

    Attributes:
        net: The model's options.
        optimizers: Builds the optimizers over the model.
        backward: Runs the backward of a microbatch's loss; returns the loss it reports.
        fp32_main_grads: fp32 main grads (FSDP2: ``reduce_dtype=fp32``) and MICROBATCHES
            microbatches with gradient sync off but for the last; else bf16 main grads, one batch.
    """

    net: NetOptions | None = None
    optimizers: Callable[[nn.Module], list[torch.optim.Optimizer]] = sgd_all
    backward: Callable[[Any, torch.Tensor], torch.Tensor] = backward_once
    fp32_main_grads: bool = False


MIXED = {
    "ckpt": MixedPattern(net={"inner": "nonreentrant", "outer": "reentrant"}),
    "multi_backward": MixedPattern(net={"output": "dataclass"}, backward=backward_twice, fp32_main_grads=True),
    "two_optimizers": MixedPattern(optimizers=sgd_and_head_bias_apart),
    "fp32_accum": MixedPattern(fp32_main_grads=True),
}


def train_mixed(impl: str, name: str) -> dict[str, Any]:
    """bf16 compute, fp32 main weights: ``fully_shard`` + ``fully_shard_optimizer`` ("ours",
    telemetry off; "ours_telemetry", telemetry on with diagnostics every step) against FSDP2 with
    ``param_dtype=bf16``, whose arithmetic is the same; the patterns are :data:`MIXED`'s.
    """
    pattern = MIXED[name]
    rank, world_size = world()
    fp32_grads = pattern.fp32_main_grads
    if impl == "fsdp2":
        model = build("fsdp2", pattern.net, dtype=BF16, reduce_dtype=torch.float32 if fp32_grads else BF16)
    else:
        model = build(
            "ours",
            pattern.net,
            dtype=BF16,
            main_grads_dtype=torch.float32 if fp32_grads else None,
            compute_copy="per_gather" if impl == "ours_per_gather" else "persistent",
        )
    optimizers = pattern.optimizers(model)
    if impl != "fsdp2":
        from fsdp_patch.optimizer import fully_shard_optimizer

        for optimizer in optimizers:
            fully_shard_optimizer(optimizer)
    facts: dict[str, Any] = {"losses": [], "accumulator": [], "optimizers": len(optimizers)}
    microbatches = MICROBATCHES if fp32_grads else 1
    for x, y in data():
        x, y = rows(x, rank, world_size), rows(y, rank, world_size)
        if impl != "fsdp2":
            x = x.to(BF16)  # FSDP2 casts forward inputs to param_dtype itself
        for k, (xk, yk) in enumerate(zip(x.chunk(microbatches), y.chunk(microbatches), strict=True)):
            if fp32_grads:
                model.set_requires_gradient_sync(k == microbatches - 1)
            output = model(xk)
            loss = mse(output, yk) / microbatches
            pattern.backward(output, loss)
            facts["losses"].append(loss.item())
            if fp32_grads and impl != "fsdp2":
                facts["accumulator"].append(_accumulators(model))
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    facts["params"] = full_params(model)
    return facts


def _accumulators(model: nn.Module) -> list[tuple[str, int] | None]:
    """Per group: the fp32 accumulation buffer of sync-off microbatches (dtype, elements) or None."""
    from fsdp_patch import parameter_groups

    return [
        None if (a := g.grad_reduce.accumulated) is None else (str(a.dtype), a.numel()) for g in parameter_groups(model)
    ]


def mixed_run(pattern: str) -> dict[str, Any]:
    from tests.integration.otel_training import environment, in_memory_otel

    out = {impl: train_mixed(impl, pattern) for impl in ("ours", "ours_per_gather")}
    try:
        out["fsdp2"] = train_mixed("fsdp2", pattern)
    except Exception as exc:
        out["fsdp2"] = {"error": f"{type(exc).__name__}: {exc}"}
    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY="1"), in_memory_otel() as (spans, _):
        out["ours_telemetry"] = train_mixed("ours_telemetry", pattern)
        out["ours_telemetry"]["step_spans"] = sum(s.name == "fsdp.optimizer.step" for s in spans.get_finished_spans())
    return rank0(out)


@pytest.mark.parametrize("pattern", ("ckpt", "multi_backward", "two_optimizers", "fp32_accum"))
def test_mixed_precision_with_adapter_equals_fsdp2_bitwise(run_once: Any, pattern: str) -> None:
    """bf16 compute with the optimizer adapter, telemetry off (compute copy persistent and
    ``per_gather``) and on: losses and final weights bitwise those of FSDP2 with ``param_dtype=bf16`` (same
    casts, same reduce dtype), for checkpointing, two optimizers over one group (bf16 main grads),
    two backwards and sync-off accumulation (fp32 main grads; FSDP2 ``reduce_dtype=fp32``)."""
    results = run_once(WORLD_SIZE, mixed_run, pattern)[0]
    limitation = fsdp2_limitation(pattern, results)
    if limitation is not None:
        # Without the control the claim (bitwise FSDP2's training) cannot be checked on this torch:
        # telemetry on and off and the compute-copy lifetimes must still train bitwise alike.
        want = results["ours"]
        for impl in ("ours_per_gather", "ours_telemetry"):
            got = results[impl]
            assert got["losses"] == want["losses"], (
                f"{pattern}/{impl}: losses {got['losses']}, telemetry off/persistent {want['losses']}"
            )
            differ = [n for n in want["params"] if not torch.equal(got["params"][n], want["params"][n])]
            assert not differ, f"{pattern}/{impl}: final weights differ from telemetry off/persistent in {differ}"
        pytest.skip(
            f"FSDP2 control unavailable: {limitation}; the fp32 pattern tests check fully_shard "
            "against the unsharded model"
        )
    assert "error" not in results["fsdp2"], f"{pattern} under FSDP2 raised: {results['fsdp2']['error']}"
    want = results["fsdp2"]
    for impl in ("ours", "ours_per_gather", "ours_telemetry"):
        got = results[impl]
        assert got["losses"] == want["losses"], f"{pattern}/{impl}: losses {got['losses']}, FSDP2 {want['losses']}"
        differ = [n for n in want["params"] if not torch.equal(got["params"][n], want["params"][n])]
        assert not differ, f"{pattern}/{impl}: final weights differ from FSDP2's in {differ}"
    spans = results["ours_telemetry"]["step_spans"]
    want_spans = STEPS * results["ours_telemetry"]["optimizers"]
    assert spans == want_spans, f"telemetry on: {spans} step spans, want {want_spans}"


def test_sync_off_accumulates_in_fp32_and_frees_the_buffer(run_once: Any) -> None:
    """With bf16 compute and fp32 main grads, sync-off microbatches accumulate in an fp32
    buffer (the reduce-scatter input), which the synced microbatch consumes and frees."""
    ours = run_once(WORLD_SIZE, mixed_run, "fp32_accum")[0]["ours"]
    per_step = [ours["accumulator"][i : i + MICROBATCHES] for i in range(0, len(ours["accumulator"]), MICROBATCHES)]
    for step, seen in enumerate(per_step):
        accumulating, synced = seen[:-1], seen[-1]
        for k, groups in enumerate(accumulating):
            dtypes = {g[0] if g else None for g in groups}
            assert dtypes == {"torch.float32"}, f"step {step} microbatch {k}: accumulation buffers {groups}"
        assert synced == [None] * len(synced), f"step {step}: buffers left after the synced microbatch: {synced}"


def grad_scaler_run() -> dict[str, Any]:
    """fp16 compute with GradScaler: fp32 main grads (supported) against FSDP2 (fp16 params,
    fp32 reduce); fp16 main grads get torch's error with the advice."""
    import gc

    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = world()
    f16 = torch.float16
    original = torch.amp.GradScaler.__dict__["_unscale_grads_"]
    out: dict[str, Any] = {}
    for impl in ("ours", "fsdp2", "ours_fp16_grads"):
        if impl == "fsdp2":
            model = build(impl, dtype=f16, reduce_dtype=torch.float32)
        else:
            model = build("ours", dtype=f16, main_grads_dtype=f16 if impl == "ours_fp16_grads" else torch.float32)
        optimizer = sgd(model.parameters())
        if impl != "fsdp2":
            fully_shard_optimizer(optimizer)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        facts: dict[str, Any] = {"losses": [], "scales": [], "error": None}
        for step, (x, y) in enumerate(data()):
            x, y = rows(x, rank, world_size), rows(y, rank, world_size)
            if impl != "fsdp2":
                x = x.to(f16)
            loss = mse(model(x), y)
            # Step 1 overflows fp16 grads: GradScaler skips it and halves the scale.
            scaler.scale(loss * (1e6 if step == 1 else 1.0)).backward()
            try:
                scaler.unscale_(optimizer)  # as before gradient clipping
            except ValueError:
                facts["error"] = raises(lambda: scaler.unscale_(optimizer))
                break
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
            facts["losses"].append(loss.item())
            facts["scales"].append(scaler.get_scale())
        facts["params"] = full_params(model)
        out[impl] = facts
        if impl == "ours_fp16_grads":
            facts["hint_installed"] = torch.amp.GradScaler.__dict__["_unscale_grads_"] is not original
            del model, optimizer, loss, scaler
            gc.collect()
            facts["hint_removed_exactly"] = torch.amp.GradScaler.__dict__["_unscale_grads_"] is original
    return rank0(out)


def test_grad_scaler_with_fp32_main_grads_equals_fsdp2_and_fp16_main_grads_get_advice(run_once: Any) -> None:
    """The supported fp16 combination: ``main_grads_dtype=torch.float32``, which GradScaler
    unscales (bitwise FSDP2's training, overflowed step skipped by both); with fp16 main grads
    torch's refusal carries what to set, and the hint is removed with the last fp16 group."""
    results = run_once(WORLD_SIZE, grad_scaler_run)[0]
    ours, want = results["ours"], results["fsdp2"]
    assert want["error"] is None and ours["error"] is None, (want["error"], ours["error"])
    assert ours["losses"] == want["losses"], f"losses {ours['losses']}, FSDP2 {want['losses']}"
    assert ours["scales"] == want["scales"] == [1024.0, 512.0, 512.0], (
        f"scales {ours['scales']}, FSDP2 {want['scales']}"
    )
    differ = [n for n in want["params"] if not torch.equal(ours["params"][n], want["params"][n])]
    assert not differ, f"final weights differ from FSDP2's in {differ}"
    fp16 = results["ours_fp16_grads"]
    message = fp16["error"] or ""
    for needle in ("Attempting to unscale FP16 gradients", "main_grads_dtype=torch.float32"):
        assert needle in message, f"{needle!r} missing from {message!r}"
    assert fp16["hint_installed"] and fp16["hint_removed_exactly"], fp16
