"""Training-script patterns run three ways on every rank: ``fully_shard``, torch's FSDP2 (the
control), and the unsharded model in one process (the reference).

Each pattern trains a 2-block MLP a few SGD steps the way real scripts do (activation
checkpointing, several backwards, any output structure, state loading, late freezing, several
optimizers, ...). The sharded runs see their rank's rows of each batch; the reference sees all
rows, so with equal slices its mean loss and grads are what the ranks' averaged grads give.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.checkpoint import checkpoint

from tests.fsdp.rank_fns import full, full_params, rank0, world

IN, DIM, HIDDEN, OUT = 6, 12, 20, 5
BATCH = 8  # rows per step, divisible by 1, 2 and 4 ranks
STEPS = 3
LR = 0.05
IMPLS = ("ours", "fsdp2", "reference")


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


class Block(nn.Module):
    """A residual block; ``inner`` checkpoints its feed-forward (a submodule the unit owns)."""

    def __init__(self, inner: str) -> None:
        super().__init__()
        self.ff = FeedForward()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner == "none":
            return x + self.ff(x)
        return x + checkpoint(self.ff, x, use_reentrant=self.inner == "reentrant")


@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor


class Holder:
    """An object the pytree does not know, holding the logits as an attribute."""

    def __init__(self, logits: torch.Tensor) -> None:
        self.logits = logits


class Net(nn.Module):
    """Input layer, two blocks, head; ``outer`` checkpoints each block (a sharded unit)."""

    def __init__(
        self, inner: str = "none", outer: str = "none", output: str = "tensor", zero_size: bool = False
    ) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, DIM)
        self.blocks = nn.ModuleList(Block(inner) for _ in range(2))
        self.head = nn.Linear(DIM, OUT)
        self.empty = nn.Parameter(torch.randn(0, 3)) if zero_size else None
        self.outer = outer
        self.output = output

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.inp(x))
        first = h
        for index, block in enumerate(self.blocks):
            h = block(h) if self.outer == "none" else checkpoint(block, h, use_reentrant=self.outer == "reentrant")
            if index == 0:
                first = h
        logits = self.head(h)
        if self.empty is not None:
            logits = logits + self.empty.sum()
        if self.output == "dataclass":
            return Output(logits, first)
        if self.output == "object":
            return Holder(logits)
        if self.output == "nested":
            return {"out": [(logits,)], "aux": None}
        return logits


def logits_of(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        return output["out"][0][0]
    return output.logits


def data(steps: int = STEPS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)) for _ in range(steps)]


def rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    per = t.shape[0] // world_size
    return t[rank * per : (rank + 1) * per]


# ---------------------------------------------------------------------------- building


def shard(
    model: Net,
    impl: str,
    reshard_after_forward: bool = True,
    dtype: torch.dtype | None = None,
    main_grads_dtype: torch.dtype | None = None,
    reduce_dtype: torch.dtype | None = None,
    compute_copy: str = "persistent",
) -> Net:
    """Shards each block, then the root, with ``impl``; ``dtype`` is the compute dtype."""
    if impl == "reference":
        return model
    if impl == "ours":
        from fsdp_patch import MixedPrecisionPolicy, fully_shard

        if dtype is not None:
            model.to(dtype)
        policy = MixedPrecisionPolicy(main_grads_dtype=main_grads_dtype, compute_copy=compute_copy)  # type: ignore[arg-type]
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        fully_shard(model, reshard_after_forward=reshard_after_forward, mp_policy=policy)
        return model
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if dtype is not None:
        # fully_shard's main weights start as the compute-dtype model's values, upcast.
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(dtype))

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    # Grads reduced in the compute dtype unless told otherwise, as fully_shard's main grads are: said
    # explicitly, since from torch 2.15 FSDP2's reduce_dtype=None follows the fp32 parameters instead.
    policy = TorchPolicy(param_dtype=dtype, reduce_dtype=reduce_dtype if reduce_dtype is not None else dtype)
    for block in model.blocks:
        torch_fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    torch_fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=policy)
    return model


def build(impl: str, net: dict[str, Any] | None = None, frozen_head: bool = False, **shard_kwargs: Any) -> Net:
    torch.manual_seed(0)
    model = Net(**(net or {}))
    if frozen_head:
        model.head.requires_grad_(False)
    return shard(model, impl, **shard_kwargs)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def mse(output: Any, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(logits_of(output).float(), y)


# ---------------------------------------------------------------------------- one training run


def train(impl: str, pattern: str, reshard_after_forward: bool = True) -> dict[str, Any]:
    """Trains ``pattern`` STEPS steps with ``impl``; returns losses, final params and facts."""
    rank, world_size = world()
    if impl == "reference":
        rank, world_size = 0, 1
    nets = {
        "ckpt_inside_nonreentrant": {"inner": "nonreentrant"},
        "ckpt_inside_reentrant": {"inner": "reentrant"},
        "ckpt_around_nonreentrant": {"outer": "nonreentrant"},
        "ckpt_around_reentrant": {"outer": "reentrant"},
        "multi_backward": {"output": "dataclass"},
        "output_dataclass": {"output": "dataclass"},
        "output_object": {"output": "object"},
        "output_nested": {"output": "nested"},
        "zero_size": {"zero_size": True},
    }
    model = build(
        impl, nets.get(pattern), frozen_head=pattern == "late_unfreeze", reshard_after_forward=reshard_after_forward
    )
    if pattern == "convert_noop":
        model.float()
        model.to(torch.float32)
        model.cpu()
        model.to("cpu")
        # Meta-device style initialization: empty storage, then the values loaded.
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        model.to_empty(device="cpu")
        model.load_state_dict(saved)
    if pattern == "two_optimizers":
        bias = model.head.bias
        optimizers = [sgd([p for p in model.parameters() if p is not bias]), torch.optim.SGD([bias], lr=0.1)]
    else:
        optimizers = [sgd(model.parameters())]
    facts: dict[str, Any] = {"losses": []}
    for step, (x, y) in enumerate(data()):
        x, y = rows(x, rank, world_size), rows(y, rank, world_size)
        if step == 1:
            if pattern == "late_freeze":
                model.head.requires_grad_(False)
            elif pattern == "late_unfreeze":
                model.head.requires_grad_(True)
            elif pattern in ("load_assign", "load_copy"):
                loaded = {k: v.detach() * 0.5 + 0.01 for k, v in model.state_dict().items()}
                model.load_state_dict(loaded, assign=pattern == "load_assign")
                facts["loaded_values_in_use"] = all(
                    torch.equal(full(model.get_parameter(k)), full(v)) for k, v in loaded.items()
                )
                if pattern == "load_assign":
                    # assign=True registers new tensors: an optimizer must be built over them.
                    optimizers = [sgd(model.parameters())]
        if pattern == "autograd_grad":
            xi = x.clone().requires_grad_()
            (input_grad,) = torch.autograd.grad(mse(model(xi), y), xi)
            facts.setdefault("grads_none_after_autograd_grad", []).append(
                all(p.grad is None for p in model.parameters())
            )
            facts.setdefault("input_grad_norm", []).append(input_grad.norm().item() * world_size)
        output = model(x)
        loss = mse(output, y)
        if pattern == "multi_backward":
            aux = 0.1 * output.hidden.pow(2).mean()
            loss.backward(retain_graph=True)
            aux.backward()
            loss = loss + aux.detach()
        else:
            loss.backward()
        facts["losses"].append(loss.item())
        if step == STEPS - 1:
            facts["grads"] = {n: full(p.grad) for n, p in model.named_parameters()}
        for optimizer in optimizers:
            optimizer.step()
            if pattern != "user_grad":
                optimizer.zero_grad()
        if pattern == "user_grad":
            # A grad assigned by the user (a new tensor, not fully_shard's view) is what the next
            # backward accumulates onto, as in an unsharded model.
            for p in model.parameters():
                p.grad = p.grad * 0.5
    facts["params"] = full_params(model)
    return facts


def pattern_run(pattern: str, reshard_after_forward: bool = True, impls: tuple[str, ...] = IMPLS) -> dict[str, Any]:
    """``train`` for each implementation; an implementation that raises is reported, not fatal."""
    out: dict[str, Any] = {}
    for impl in impls:
        try:
            out[impl] = train(impl, pattern, reshard_after_forward)
        except Exception as exc:
            out[impl] = {"error": f"{type(exc).__name__}: {exc}"}
    losses = {impl: r.get("losses") for impl, r in out.items()}
    return {"results": rank0(out), "losses": losses}


# ---------------------------------------------------------------------------- mixed precision

BF16 = torch.bfloat16
MICROBATCHES = 4


def train_mixed(impl: str, pattern: str) -> dict[str, Any]:
    """bf16 compute, fp32 main weights: ``fully_shard`` + ``fully_shard_optimizer`` ("ours",
    hook attachment; "ours_telemetry", wrapt attachment with telemetry and diagnostics every
    step) against FSDP2 with ``param_dtype=bf16``, whose arithmetic is the same.

    Patterns: ``ckpt`` (checkpoint inside and around units) and ``two_optimizers`` with bf16
    main grads (the default policy; FSDP2 reduces in bf16); ``multi_backward`` (two backwards
    add their grads: in fp32 main grads, as FSDP2 adds into its fp32 sharded grads) and
    ``fp32_accum`` (fp32 main grads, MICROBATCHES microbatches with gradient sync off but for
    the last one) with fp32 main grads (FSDP2: ``reduce_dtype=fp32``).
    """
    rank, world_size = world()
    net = {"ckpt": {"inner": "nonreentrant", "outer": "reentrant"}, "multi_backward": {"output": "dataclass"}}.get(
        pattern
    )
    fp32_grads = pattern in ("multi_backward", "fp32_accum")
    if impl == "fsdp2":
        model = build("fsdp2", net, dtype=BF16, reduce_dtype=torch.float32 if fp32_grads else BF16)
    else:
        model = build(
            "ours",
            net,
            dtype=BF16,
            main_grads_dtype=torch.float32 if fp32_grads else None,
            compute_copy="per_gather" if impl == "ours_per_gather" else "persistent",
        )
    if pattern == "two_optimizers":
        bias = model.head.bias
        optimizers = [sgd([p for p in model.parameters() if p is not bias]), torch.optim.SGD([bias], lr=0.1)]
    else:
        optimizers = [sgd(model.parameters())]
    if impl != "fsdp2":
        from fsdp_patch.optimizer import fully_shard_optimizer

        for optimizer in optimizers:
            fully_shard_optimizer(optimizer)
    facts: dict[str, Any] = {"losses": [], "accumulator": []}
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
            if pattern == "multi_backward":
                aux = 0.1 * output.hidden.float().pow(2).mean()
                loss.backward(retain_graph=True)
                aux.backward()
            else:
                loss.backward()
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
        None if g._accumulated is None else (str(g._accumulated.dtype), g._accumulated.numel())
        for g in parameter_groups(model)
    ]


def mixed_run(pattern: str) -> dict[str, Any]:
    from tests.integration.rank_fns import environment, in_memory_otel

    out = {impl: train_mixed(impl, pattern) for impl in ("ours", "ours_per_gather")}
    try:
        out["fsdp2"] = train_mixed("fsdp2", pattern)
    except Exception as exc:
        out["fsdp2"] = {"error": f"{type(exc).__name__}: {exc}"}
    with environment(FSDP_PATCH_TELEMETRY="1", FSDP_PATCH_PRECISION_EVERY="1"), in_memory_otel() as (spans, _):
        out["ours_telemetry"] = train_mixed("ours_telemetry", pattern)
        out["ours_telemetry"]["step_spans"] = sum(s.name == "fsdp.optimizer.step" for s in spans.get_finished_spans())
    return rank0(out)


# ---------------------------------------------------------------------------- refusals


def _raises(fn: Callable[[], Any]) -> str | None:
    """``"Type: message"`` (with notes) of what ``fn`` raised, or None."""
    try:
        fn()
    except Exception as exc:
        notes = " ".join(getattr(exc, "__notes__", []))
        return f"{type(exc).__name__}: {exc} {notes}".strip()
    return None


def refusals_run() -> dict[str, Any]:
    """What ``fully_shard`` refuses, with FSDP2's answer to the same call as the control."""
    import pickle

    from torch.optim.swa_utils import AveragedModel

    out: dict[str, Any] = {}
    for impl in ("ours", "fsdp2"):
        model = build(impl)
        objects = {n: p for n, p in model.named_parameters()}
        values = full_params(model)
        facts = {
            "to_bf16": _raises(lambda: model.to(torch.bfloat16)),
            "half": _raises(lambda: model.half()),
            "deepcopy": _raises(lambda: copy.deepcopy(model)),
            "averaged_model": _raises(lambda: AveragedModel(model)),
            "pickle": _raises(lambda: pickle.dumps(model)),
        }
        if impl == "ours":
            facts["untouched"] = objects == dict(model.named_parameters()) and all(
                torch.equal(values[n], v) for n, v in full_params(model).items()
            )
            facts["dtypes_after"] = sorted({str(p.dtype) for p in model.parameters()})
            # A replacement of the wrong shape: refused at the next forward, the module keeps
            # its sharded parameter, and the forward after that works.
            head_weight = model.head.weight
            model.head.weight = nn.Parameter(torch.zeros(2, 2))
            x = data()[0][0][:2]
            facts["bad_replacement"] = _raises(lambda: model(x))
            facts["bad_replacement_reverted"] = model.head.weight is head_weight
            facts["forward_after"] = _raises(lambda: model(x)) is None
        out[impl] = facts
    return rank0(out)


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
                facts["error"] = _raises(lambda: scaler.unscale_(optimizer))
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


def freed_run() -> dict[str, Any]:
    """Whether a trained sharded model, its groups and its adapted optimizer are freed once the
    script drops them (the group registry once kept every sharded model alive)."""
    import gc
    import weakref

    from fsdp_patch import parameter_groups
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = world()
    model = build("ours", dtype=BF16)
    optimizer = sgd(model.parameters())
    fully_shard_optimizer(optimizer)
    x, y = data()[0]
    mse(model(rows(x, rank, world_size).to(BF16)), rows(y, rank, world_size)).backward()
    optimizer.step()
    refs = {"model": weakref.ref(model), "optimizer": weakref.ref(optimizer)}
    refs.update({f"group{i}": weakref.ref(g) for i, g in enumerate(parameter_groups(model))})
    del model, optimizer
    gc.collect()
    return {name: ref() is None for name, ref in refs.items()}
