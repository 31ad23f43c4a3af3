"""What every rank of the demo runs: build, (resume,) train, checkpoint, report."""

from __future__ import annotations

import json
import os
import time
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fsdp_patch import FSDPModule, MixedPrecisionPolicy
from fsdp_patch.optimizer import fully_shard_optimizer

from . import checkpoint
from .config import RunOptions, TrainingConfig
from .data import tokens_at
from .model import GPT, lm_loss, shard, to_float8
from .progress import Progress
from .scenarios import FLOAT8_OUTLIER, GROWTH_PER_STEP, LAYER_LR_FACTOR, ORIGIN_PLANTS, SCENARIOS, UNDERFLOW_SCALE
from .schedule import WarmupCosine

# The demo's HTML report, beside the trace files it plots.
HTML_REPORT = "report.html"


def _device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def build(
    training: TrainingConfig, device: torch.device, compute_copy: str = "persistent"
) -> tuple[GPT, torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """The sharded model, its adapted AdamW and the warm-up + cosine schedule, as at step 0."""
    torch.manual_seed(training.seed)
    model = GPT(training.gpt_config()).to(device=device, dtype=training.dtype("compute_dtype"))
    if SCENARIOS[training.scenario].float8:
        to_float8(model, device)
    policy = MixedPrecisionPolicy(
        main_params_dtype=training.dtype("main_dtype"),
        main_grads_dtype=training.dtype("grad_dtype"),
        compute_copy=compute_copy,  # type: ignore[arg-type]
    )
    shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(_param_groups(model, training), lr=training.lr, weight_decay=training.weight_decay)
    fully_shard_optimizer(optimizer)
    schedule = WarmupCosine(training.warmup_steps, training.decay_steps, training.min_lr / training.lr)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def _param_groups(model: GPT, training: TrainingConfig) -> list[dict[str, object]]:
    """The optimizer's param groups: every parameter in one, except where the scenario plants a
    parameter left out of the optimizer, or one in a group of its own with a far smaller lr."""
    scenario = SCENARIOS[training.scenario]
    named = dict(model.named_parameters())
    layer = scenario.layer
    if scenario.plant == "left_out":
        return [{"params": [p for name, p in named.items() if name != layer]}]
    if scenario.plant == "layer_lr" and layer is not None:
        rest = [p for name, p in named.items() if name != layer]
        return [{"params": rest}, {"params": [named[layer]], "lr": training.lr * LAYER_LR_FACTOR}]
    if scenario.plant == "optimizer_nan" and layer is not None:
        rest = [p for name, p in named.items() if name != layer]
        return [{"params": rest}, {"params": [named[layer]]}]
    return [{"params": list(named.values())}]


class _NaNInBackward(torch.autograd.Function):
    """Identity forward; its backward returns NaN grads."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return grad * float("nan")


class _LargeGrad(torch.autograd.Function):
    """Identity forward; its backward sends a grad summing to 5e4 over the rows of each column: the
    bias behind it gets 5e4 on every rank, finite in fp16, past 65504 once summed over ranks."""

    @staticmethod
    def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
        return torch.full_like(grad, 5e4 / (grad.numel() // grad.shape[-1]))


def _plant_in_forward(model: GPT, training: TrainingConfig, now: dict[str, int]) -> None:
    """A forward hook on the scenario's module that plants its NaN/Inf at the plant step (part of the
    model from the start, as the module's own computation would be)."""
    scenario = SCENARIOS[training.scenario]
    effects = {
        "forward_overflow": lambda out: out * 1e5,
        "backward_nan": _NaNInBackward.apply,
        "reduce_overflow": _LargeGrad.apply,
    }
    planted_here = scenario.plant in ("growth", "float8_outlier") or scenario.plant in effects
    module = model.get_submodule(scenario.layer) if planted_here and scenario.layer is not None else None
    if scenario.plant == "growth" and module is not None:
        # The module's output grows by GROWTH_PER_STEP every step from the plant step on.
        module.register_forward_hook(
            lambda m, a, out: (
                out * GROWTH_PER_STEP ** (now["step"] - training.plant_step + 1)
                if now["step"] >= training.plant_step
                else out
            )
        )
        return
    if scenario.plant == "float8_outlier" and module is not None:
        # From the plant step on, one feature of the layer's output far above the rest.
        module.register_forward_hook(
            lambda m, a, out: _with_outlier_feature(out) if now["step"] >= training.plant_step else out
        )
        return
    effect = effects.get(scenario.plant or "")
    if effect is None or module is None:
        return
    module.register_forward_hook(lambda m, a, out: effect(out) if now["step"] == training.plant_step else out)


def _with_outlier_feature(out: torch.Tensor, feature: int = 7) -> torch.Tensor:
    outlier = torch.zeros(out.shape[-1], dtype=out.dtype, device=out.device)
    outlier[feature] = FLOAT8_OUTLIER
    return out + outlier


def _update_ema(ema: list[torch.Tensor], model: GPT, decay: float = 0.999) -> None:
    """The ``ema-bf16`` scenario's bug: a moving average of this rank's weight shards kept in
    bfloat16, whose updates (a thousandth of the difference) are below its resolution."""
    shards = [cast(DTensor, p).to_local().detach() for p in model.parameters()]
    with torch.no_grad():
        if not ema:
            ema.extend(shard.to(torch.bfloat16) for shard in shards)
        for average, shard in zip(ema, shards, strict=True):
            average.mul_(decay).add_(shard.to(torch.bfloat16), alpha=1 - decay)


def _plant(model: GPT, optimizer: torch.optim.Optimizer, training: TrainingConfig, step: int) -> None:
    """The scenario's bug, after the backward of ``step`` (its param groups were made by :func:`build`)."""
    scenario = SCENARIOS[training.scenario]
    plant = scenario.plant
    if plant is None or step < training.plant_step or (step != training.plant_step and plant != "underflow"):
        return
    if plant == "clip_inf":
        grad = cast(DTensor, dict(model.named_parameters())[cast(str, scenario.layer)].grad)
        with torch.no_grad():
            grad.to_local().mul_(1e38)  # the squares of the total norm overflow: Inf
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        return
    if plant == "optimizer_nan":
        optimizer.param_groups[1]["lr"] = float("nan")
        return
    if plant in ORIGIN_PLANTS or plant in ("ema_bf16", "growth", "float8_outlier"):  # planted elsewhere
        return
    if scenario.layer is None:
        raise ValueError(f"scenario {training.scenario!r} plants {plant!r} but names no layer")
    # fully_shard's parameters are DTensors; the layers planted into take part in every backward.
    param = cast(DTensor, dict(model.named_parameters())[scenario.layer])
    grad = cast(DTensor, param.grad)
    with torch.no_grad():
        if plant == "nan" and dist.get_rank() == 0:
            grad.to_local().view(-1)[0] = float("nan")
        elif plant == "overflow":
            # Main weights (fp32) past fp16's largest value: the refresh to fp16 gives Inf.
            param.to_local().fill_(7.0e4)
        elif plant == "underflow":
            grad.to_local().mul_(UNDERFLOW_SCALE)
        elif plant == "bf16_state" and "exp_avg_sq" in optimizer.state.get(param, {}):
            # AdamW keeps stepping with it, silently; the next dtype audit names it.
            state = optimizer.state[param]
            state["exp_avg_sq"] = state["exp_avg_sq"].to(torch.bfloat16)


def train_rank(options: RunOptions, resume_from: checkpoint.SavedState | None) -> None:
    """Train on this rank; rank 0 shows progress and, at the end, the precision report."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    training = options.training
    model, optimizer, scheduler = build(training, _device(), options.compute_copy)
    step, position, load_seconds = 0, 0, 0.0
    if resume_from is not None:
        started = time.perf_counter()
        checkpoint.load(resume_from, model, optimizer, scheduler)
        step, position, load_seconds = resume_from.step, resume_from.data_position, time.perf_counter() - started
    config = training.gpt_config()
    rows = training.batch // training.microbatches  # sequences per microbatch, all ranks
    per_rank = rows // world_size
    progress = Progress(step, options.steps, training.batch * config.seq, options.progress if rank == 0 else "none")
    if rank == 0:
        _print_start(options, model, resume_from, load_seconds)
    # Created (or emptied) by the launcher; a resumed run appends its steps.
    log = open(options.loss_log, "a", encoding="utf-8") if rank == 0 and options.loss_log else None
    device = next(model.parameters()).device
    plant, planted_layer = SCENARIOS[training.scenario].plant, SCENARIOS[training.scenario].layer
    now = {"step": step}
    _plant_in_forward(model, training, now)
    ema: list[torch.Tensor] = []
    try:
        while step < options.steps:
            step += 1
            now["step"] = step
            started = time.perf_counter()
            loss_sum = torch.zeros((), device=device)
            for micro in range(training.microbatches):
                tokens = tokens_at(config, rows, position, training.seed)[rank * per_rank : (rank + 1) * per_rank]
                position += 1
                cast(FSDPModule, model).set_requires_gradient_sync(micro == training.microbatches - 1)
                loss = lm_loss(model, tokens.to(device)) / training.microbatches
                if plant == "loss_nan" and step == training.plant_step:
                    loss = loss + torch.log(torch.zeros((), device=device)) * 0.0  # a log of 0: NaN
                loss.backward()
                loss_sum += loss.detach()
            _plant(model, optimizer, training, step)
            lr = optimizer.param_groups[0]["lr"]
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            if plant == "ema_bf16" and step >= training.plant_step:
                _update_ema(ema, model)
            if plant == "weight_write" and step == training.plant_step - 1 and rank == 0:
                with torch.no_grad():  # between this step and the plant step, outside the optimizer
                    cast(DTensor, dict(model.named_parameters())[cast(str, planted_layer)]).to_local().view(-1)[0] = (
                        float("nan")
                    )
            dist.all_reduce(loss_sum)
            loss_value = loss_sum.item() / world_size
            progress.step(step, loss_value, float(lr), time.perf_counter() - started)
            if log is not None:
                log.write(json.dumps({"step": step, "loss": loss_value, "lr": float(lr)}) + "\n")
                log.flush()
            last = step == options.steps
            if options.checkpoint_dir and (last or (options.checkpoint_every and step % options.checkpoint_every == 0)):
                saved_at = time.perf_counter()
                path = checkpoint.save(
                    options.checkpoint_dir,
                    step,
                    position,
                    model,
                    optimizer,
                    scheduler,
                    training,
                    options.keep_checkpoints,
                )
                progress.note(f"checkpoint: {path} ({time.perf_counter() - saved_at:.1f} s)")
    finally:
        if log is not None:
            log.close()
    elapsed = progress.close()
    _finish(options, rank, resume_from.step if resume_from else 0, elapsed)


def _print_start(
    options: RunOptions, model: GPT, resume_from: checkpoint.SavedState | None, load_seconds: float
) -> None:
    training = options.training
    params = sum(p.numel() for p in model.parameters())
    where = "from scratch"
    if resume_from:
        where = f"resuming from {resume_from.path} at step {resume_from.step} (loaded in {load_seconds:.1f} s)"
    scenario = SCENARIOS[training.scenario]
    planted = ""
    if scenario.plant is not None:
        at = "from the start" if scenario.plant_from_start else f"at step {training.plant_step}"
        planted = f"; planted in {scenario.layer}, {at}: {scenario.description}"
    print(
        f"fsdp-patch demo: scenario {training.scenario}{planted}, {dist.get_world_size()} rank(s) on {dist.get_backend()}, "
        f"{params:,} parameters, compute {training.compute_dtype} / main {training.main_dtype} / grads "
        f"{training.grad_dtype}, AdamW lr {training.lr:g} (warm-up {training.warmup_steps}, cosine to "
        f"{training.min_lr:g} at step {training.decay_steps}), {options.steps} steps, {where}",
        flush=True,
    )


def _finish(options: RunOptions, rank: int, start_step: int, elapsed: float) -> None:
    import fsdp_patch.telemetry as telemetry

    # Every rank's trace file is complete before rank 0 reads them.
    telemetry.shutdown()
    dist.barrier()
    if rank != 0:
        return
    steps = options.steps - start_step
    print(f"done: {steps} step{'s' if steps != 1 else ''} in {elapsed:.1f} s", flush=True)
    if not telemetry.telemetry_active():
        print("no precision report: telemetry is off", flush=True)
        return
    from fsdp_patch.telemetry.export.selection import trace_files_off_reason
    from fsdp_patch.telemetry.offline.html_report import write_report_html
    from fsdp_patch.telemetry.offline.precision_report import report
    from fsdp_patch.telemetry.offline.trace_reading import TraceFileError

    # Checked first: trace files of an earlier run in the directory must not be reported as this run's.
    reason = trace_files_off_reason(dist.get_world_size())
    if reason is not None:
        print(f"no precision report: {reason} (the report reads {options.trace_dir}).", flush=True)
        return
    page = os.path.join(options.trace_dir, HTML_REPORT)
    try:
        text = report(options.trace_dir, options.report_lines, step_offset=start_step)
        write_report_html(options.trace_dir, page, options.report_lines, step_offset=start_step)
    except TraceFileError as exc:
        print(f"no precision report: {exc}", flush=True)
        return
    print(
        f"\n{text}plots: {page} (open it in a browser; it needs no network)\n"
        f"traces: {options.trace_dir}{os.sep} (Perfetto: rank*.trace.json; Jaeger upload: rank*.jaeger.json; "
        f"again: fsdp-patch report {options.trace_dir} --html {page})",
        flush=True,
    )
