"""Functions the fsdp tests run on every rank of a gloo pool (``dist_pool(W).run(fn, ...)``).

Each function does a whole scenario and returns plain data (detached CPU tensors, numbers,
strings) for the test process to assert on, so that one distributed run feeds many assertions.
Full tensors are gathered on every rank (``full_tensor`` is a collective) and returned by rank 0
only, to keep pickling small.
"""

from __future__ import annotations

import gc
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tests.models import lm_loss, make_batches, make_model, rank_slice

STEPS = 3
MICROBATCH = 8  # sequences per microbatch, divisible by 1, 2 and 4 ranks

# ---------------------------------------------------------------------------- models


def build_model(kind: str = "plain") -> nn.Module:
    """The small transformer, optionally with tied weights, unused parameters or a frozen block.

    Deterministic: every rank and the single-process reference build the same weights.
    """
    model = make_model(seed=0)
    if kind == "tied":
        model.head.weight = model.embed.weight
    elif kind == "unused":
        model.unused = nn.Parameter(torch.randn(5, 3))  # in the root unit
        model.blocks[1].unused = nn.Parameter(torch.randn(3))  # in a block unit; 3 rows on 4 ranks
    elif kind == "frozen":
        model.blocks[0].requires_grad_(False)
        model.norm.requires_grad_(False)  # a frozen group next to a trainable one in the root
    elif kind != "plain":
        raise ValueError(kind)
    return model


class Uneven(nn.Module):
    """Parameters whose dim 0 does not divide by 2 or 4, including dims smaller than 4."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(5, 3)  # weight (3, 5), bias (3,)
        self.b = nn.Linear(3, 1)  # weight (1, 3), bias (1,)
        self.c = nn.Parameter(torch.randn(2, 2, 2))
        self.d = nn.Linear(3, 9)  # weight (9, 3), bias (9,)
        self.e = nn.Linear(9, 5)  # weight (5, 9), bias (5,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * self.c.sum()
        return self.e(torch.tanh(self.d(h))).sum(-1) + self.b(h).squeeze(-1)


def make_optimizer(name: str, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name.startswith("adamw"):
        eps = float(name.partition(":")[2] or 1e-8)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=eps)
    raise ValueError(name)


def world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def full(t: torch.Tensor | None) -> torch.Tensor | None:
    if t is None:
        return None
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def rank0(value: Any) -> Any:
    """``value`` on rank 0, ``None`` elsewhere (compute collectives on every rank first)."""
    return value if dist.get_rank() == 0 else None


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def full_grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: full(p.grad) for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------- training


def train(
    config: dict[str, Any], rank: int = 0, world_size: int = 1, sharded: bool = True, slices: int = 1
) -> dict[str, Any]:
    """Trains ``config``'s model ``STEPS`` steps; the single-process reference when ``sharded``
    is False.

    config keys: ``impl`` ("ours" | "fsdp2"), ``model`` (see :func:`build_model`), ``opt``,
    ``mb`` (microbatches per step), ``sync`` ("all": reduce every microbatch, "last":
    ``set_requires_gradient_sync(False)`` on all but the last), ``set_to_none``.

    The reference runs each microbatch in one piece (``slices=1``), or as ``slices`` pieces cut
    as the ranks cut it, each piece's loss divided by ``slices`` (the same objective, the same
    per-piece fp32 sums as on the ranks: AdamW turns the rounding differences of a differently
    summed gradient into visible update differences wherever a gradient is near zero).
    """
    model = build_model(config["model"])
    if sharded:
        if config["impl"] == "ours":
            from tests.models import shard_model

            shard_model(model)
        else:
            from torch.distributed.fsdp import fully_shard as torch_fully_shard

            mesh = init_device_mesh("cpu", (world_size,))
            for block in model.blocks:
                torch_fully_shard(block, mesh=mesh)
            torch_fully_shard(model, mesh=mesh)
    opt = make_optimizer(config["opt"], model.parameters())
    mb = config["mb"]
    batches = make_batches(STEPS * mb, batch=MICROBATCH)
    losses: list[float] = []
    last_grads: dict[str, Any] = {}
    freed = trainable_groups = 0
    for step in range(STEPS):
        step_loss = 0.0
        for k in range(mb):
            tokens = batches[step * mb + k]
            if sharded:
                tokens = rank_slice(tokens, rank, world_size)
                if config["sync"] == "last":
                    model.set_requires_gradient_sync(k == mb - 1)
                loss = lm_loss(model, tokens) / mb
                loss.backward()
                step_loss += loss.item()
            else:
                for piece in range(slices):
                    loss = lm_loss(model, rank_slice(tokens, piece, slices)) / mb / slices
                    loss.backward()
                    step_loss += loss.item()
        losses.append(step_loss)
        if step == STEPS - 1:
            last_grads = full_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=config["set_to_none"])
        if sharded and config["impl"] == "ours" and config["set_to_none"] and step < STEPS - 1:
            # zero_grad(set_to_none=True) dropped the grads, the main-grad buffers' only owners:
            # their memory is free until the next backward (which then starts from nothing).
            # Not checked after the last step: full_grads() gathered the grads there, and gloo's
            # worker thread lets go of a finished collective's tensors a moment after wait returns.
            from fsdp_patch import parameter_groups

            trainable = [g for g in parameter_groups(model) if g.requires_grad]
            gc.collect()
            freed += sum(g.main_grad_storage_bytes() == 0 for g in trainable)
            trainable_groups += len(trainable)
    result = {"losses": losses, "freed": freed, "trainable_groups": trainable_groups}
    result["params"] = full_params(model)
    result["grads"] = last_grads
    if sharded and config["impl"] == "ours" and not config["set_to_none"]:
        # zero_grad(set_to_none=False) zeroed the installed views in place.
        from fsdp_patch import parameter_groups

        result["grads_after_zero_are_views"] = all(
            p.grad is not None
            and p.grad.to_local().untyped_storage().data_ptr() == g.main_grad.untyped_storage().data_ptr()
            for g in parameter_groups(model)
            if g.main_grad is not None
            for p in g.params
        )
        result["main_grads_zeroed"] = all(
            bool((g.main_grad == 0).all()) for g in parameter_groups(model) if g.main_grad is not None
        )
    return result


def parity_run(configs: list[dict[str, Any]]) -> dict[str, Any] | None:
    rank, world_size = world()
    out = {}
    for config in configs:
        result = train(config, rank, world_size)
        out[config["name"]] = result
    # Per-rank losses are means over the rank's slice; the test averages them over ranks.
    losses = {name: r.pop("losses") for name, r in out.items()}
    return {"results": out if rank == 0 else None, "losses": losses}


# ---------------------------------------------------------------------------- hooks & counters


@contextmanager
def count_collectives() -> Iterator[dict[str, int]]:
    """Counts the all-gathers and reduce-scatters ``fsdp_patch`` issues (it calls them through
    ``torch.distributed``'s module attributes)."""
    counts = {"all_gather": 0, "reduce_scatter": 0}
    # fsdp_patch.torch_compat looks up whichever flat collective this torch has at each call.
    names = [
        (name, kind)
        for name, kind in (
            ("all_gather_single", "all_gather"),
            ("all_gather_into_tensor", "all_gather"),
            ("reduce_scatter_single", "reduce_scatter"),
            ("reduce_scatter_tensor", "reduce_scatter"),
        )
        if hasattr(dist, name)
    ]
    originals = {name: getattr(dist, name) for name, _ in names}

    def counting(name: str, kind: str) -> Any:
        def collective(*args: Any, **kwargs: Any) -> Any:
            counts[kind] += 1
            return originals[name](*args, **kwargs)

        return collective

    for name, kind in names:
        setattr(dist, name, counting(name, kind))
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def unsharded_bytes(model: nn.Module) -> dict[str, int]:
    from fsdp_patch import FSDPModule

    return {
        f"{name or '<root>'}[{i}]": group.unsharded_storage_bytes()
        for name, module in model.named_modules()
        if isinstance(module, FSDPModule)
        for i, group in enumerate(module.fsdp_parameter_groups)
    }


def shard_storage_facts(model: nn.Module) -> dict[str, Any]:
    """Whether every parameter's local data lives in its group's main-weight buffer and nothing
    else holds parameter storage."""
    from fsdp_patch import parameter_group_of, parameter_groups

    groups = parameter_groups(model)
    buffers = {g.main_weight.untyped_storage().data_ptr(): g.main_weight.untyped_storage().nbytes() for g in groups}
    param_storages = {}
    in_buffer = True
    for p in model.parameters():
        local = p.to_local()
        ptr = local.untyped_storage().data_ptr()
        param_storages[ptr] = local.untyped_storage().nbytes()
        g = parameter_group_of(p)
        in_buffer &= g is not None and ptr == g.main_weight.untyped_storage().data_ptr()
    return {
        "params_in_main_buffers": in_buffer,
        "param_storage_bytes": sum(param_storages.values()),
        "main_buffer_bytes": sum(buffers.values()),
        "shard_bytes_expected": sum(g.layout.shard_numel * g.main_weight.element_size() for g in groups),
        "unsharded_param_storage_bytes": sum(p.untyped_storage().nbytes() for g in groups for p in g.unsharded_params),
    }


# ---------------------------------------------------------------------------- geometry


def geometry_run() -> dict[str, Any]:
    """Sharding geometry, FQNs, grouping, group links and a reference step on uneven shapes."""
    from fsdp_patch import MixedPrecisionPolicy, fully_shard, parameter_group_of, parameter_groups

    rank, world_size = world()
    facts: dict[str, Any] = {}

    # Uneven shapes: DTensor Shard(0), chunked like torch.chunk, one unit, one SGD step.
    model = Uneven()
    reference = Uneven()
    originals = {n: p.detach().clone() for n, p in model.named_parameters()}
    names_before = [n for n, _ in model.named_parameters()]
    fully_shard(model)
    facts["fqns_before"] = names_before
    facts["fqns_after"] = [n for n, _ in model.named_parameters()]
    facts["state_dict_keys"] = list(model.state_dict().keys())
    shards = {}
    for name, p in model.named_parameters():
        chunks = torch.chunk(originals[name], world_size, dim=0)
        expected = chunks[rank] if rank < len(chunks) else originals[name][:0]
        shards[name] = {
            "is_dtensor": isinstance(p, DTensor),
            "is_parameter": isinstance(p, nn.Parameter),
            "placements": tuple(p.placements),
            "mesh_ndim": p.device_mesh.ndim,
            "global_shape": tuple(p.shape),
            "local_shape": tuple(p.to_local().shape),
            "expected_local_shape": tuple(expected.shape),
            "local_equal": torch.equal(p.to_local(), expected),
            "full_equal": torch.equal(p.full_tensor(), originals[name]),
            "grad_dtype": p.grad_dtype,
            "requires_grad": p.requires_grad,
        }
    facts["shards"] = shards
    facts["storage"] = shard_storage_facts(model)
    group = parameter_groups(model)[0]
    facts["group_links"] = all(parameter_group_of(p) is group for p in model.parameters())
    facts["group_params_are_module_params"] = [id(p) for p in group.params] == [id(p) for p in model.parameters()]
    facts["plain_tensor_has_no_group"] = parameter_group_of(torch.zeros(3)) is None

    x = torch.randn(6, 5, generator=torch.Generator().manual_seed(7))
    model(x).square().mean().backward()
    reference(x).square().mean().backward()
    grads = {}
    for (name, p), (_, ref) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        grads[name] = {
            "is_dtensor": isinstance(p.grad, DTensor),
            "placements": tuple(p.grad.placements),
            "local_shape": tuple(p.grad.to_local().shape),
            "dtype": p.grad.dtype,
            "in_main_grad": p.grad.to_local().untyped_storage().data_ptr()
            == group.main_grad.untyped_storage().data_ptr(),
            # Every rank saw the same input: the average equals the single-process grad exactly.
            "equal_reference": torch.equal(p.grad.full_tensor(), ref.grad),
        }
    facts["grads"] = grads
    with torch.no_grad():
        for p in list(model.parameters()) + list(reference.parameters()):
            p.sub_(0.1 * p.grad)
    facts["step_equal_reference"] = all(
        torch.equal(p.full_tensor(), r) for p, r in zip(model.parameters(), reference.parameters(), strict=True)
    )
    facts["forward_after_step_equal"] = torch.equal(model(x), reference(x))

    # Grouping by (dtype, requires_grad); frozen groups have no main grad; buffers per policy.
    mixed = nn.Module()
    mixed.f32 = nn.Linear(4, 3)
    mixed.bf16 = nn.Linear(4, 3).bfloat16()
    mixed.frozen = nn.Linear(4, 3)
    mixed.frozen.requires_grad_(False)
    fully_shard(mixed, mp_policy=MixedPrecisionPolicy(main_grads_dtype=torch.float32))
    facts["groups"] = sorted(
        (
            str(g.compute_dtype),
            g.requires_grad,
            str(g.main_weight.dtype),
            str(g.compute_weight.dtype),
            None if g.main_grad is None else str(g.main_grad.dtype),
            None if g.grads_dtype is None else str(g.grads_dtype),
            sorted(g.names),
            g.compute_weight is g.main_weight,
        )
        for g in mixed.fsdp_parameter_groups
    )
    facts["mixed_param_dtypes"] = {n: str(p.dtype) for n, p in mixed.named_parameters()}
    facts["mixed_grad_dtypes"] = {
        n: (str(p.grad_dtype) if p.requires_grad else None) for n, p in mixed.named_parameters()
    }
    return facts


# ---------------------------------------------------------------------------- memory


def memory_run() -> dict[str, Any]:
    """Unsharded storage across forward/backward/step, collectives per phase, eval resharding."""
    from fsdp_patch import FSDPModule, parameter_groups

    rank, world_size = world()
    facts: dict[str, Any] = {}
    tokens = rank_slice(make_batches(1, batch=MICROBATCH)[0], rank, world_size)

    for reshard in (True, False):
        model = build_model("plain")
        for block in model.blocks:
            from fsdp_patch import fully_shard

            fully_shard(block, reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        seen_in_forward: dict[str, int] = {}
        seen_in_backward: dict[str, int] = {}

        def stored(module: nn.Module) -> int:
            return sum(g.unsharded_storage_bytes() for g in module.fsdp_parameter_groups)

        for name, module in model.named_modules():
            if isinstance(module, FSDPModule):
                # Prepended, this forward hook runs before fully_shard's post-forward.
                module.register_forward_hook(
                    lambda m, a, o, name=name: seen_in_forward.__setitem__(name, stored(m)), prepend=True
                )
                # A hook on an unsharded parameter runs when backward computes its grad.
                module.fsdp_parameter_groups[0].unsharded_params[0].register_hook(
                    lambda g, name=name, m=module: seen_in_backward.__setitem__(name, stored(m))
                )
        phase: dict[str, Any] = {"init": unsharded_bytes(model)}
        with count_collectives() as fwd:
            loss = lm_loss(model, tokens)
        phase["after_forward"] = unsharded_bytes(model)
        with count_collectives() as bwd:
            loss.backward()
        phase["after_backward"] = unsharded_bytes(model)
        opt.step()
        phase["after_step"] = unsharded_bytes(model)
        phase["storage_after_step"] = shard_storage_facts(model)
        phase["expected_unsharded"] = {
            f"{name or '<root>'}[{i}]": g.layout.unsharded_numel * g.compute_weight.element_size()
            for name, module in model.named_modules()
            if isinstance(module, FSDPModule)
            for i, g in enumerate(module.fsdp_parameter_groups)
        }
        phase["seen_in_forward"] = dict(seen_in_forward)
        phase["seen_in_backward"] = dict(seen_in_backward)
        phase["forward_collectives"] = dict(fwd)
        phase["backward_collectives"] = dict(bwd)
        phase["groups"] = len(parameter_groups(model))
        # Inference: no_grad (and eval) forward reshards even without reshard_after_forward.
        model.eval()
        with torch.no_grad():
            eval_logits = model(tokens[:, :-1])
        phase["after_no_grad_forward"] = unsharded_bytes(model)
        model.train()
        with torch.no_grad():
            phase["no_grad_matches_grad_mode"] = torch.equal(eval_logits, model(tokens[:, :-1]))
        # The next training step still works and is reduce-scattered normally.
        opt.zero_grad()
        lm_loss(model, tokens).backward()
        phase["after_second_backward"] = unsharded_bytes(model)
        phase["grads_present"] = all(p.grad is not None for p in model.parameters())
        facts[f"reshard_{reshard}"] = phase

    # Frozen block: backward re-gathers it for its input grads and must free it again.
    model = build_model("frozen")
    from tests.models import shard_model

    shard_model(model)
    lm_loss(model, tokens).backward()
    facts["frozen_after_backward"] = unsharded_bytes(model)
    facts["frozen_groups"] = [
        (g.requires_grad, g.main_grad is None, g.grads_dtype, all(p.grad is None for p in g.params))
        for g in parameter_groups(model)
    ]

    # Gradient sync off: no reduce-scatter, no grads installed, until the synced microbatch.
    model = shard_model(build_model("plain"))
    model.set_requires_gradient_sync(False)
    with count_collectives() as nosync:
        lm_loss(model, tokens).backward()
    facts["nosync_collectives"] = dict(nosync)
    facts["nosync_grads_none"] = all(p.grad is None for p in model.parameters())
    facts["nosync_after_backward"] = unsharded_bytes(model)
    model.set_requires_gradient_sync(True)
    with count_collectives() as sync:
        lm_loss(model, tokens).backward()
    facts["sync_collectives"] = dict(sync)
    facts["sync_groups"] = sum(g.requires_grad for g in parameter_groups(model))
    facts["sync_grads_present"] = all(p.grad is not None for p in model.parameters())
    try:
        model.set_requires_gradient_sync("no")  # type: ignore[arg-type]
        facts["sync_bad_arg"] = None
    except TypeError as exc:
        facts["sync_bad_arg"] = str(exc)
    return facts


# ---------------------------------------------------------------------------- unused params


def unused_run() -> dict[str, Any]:
    """Parameters no rank uses, and a parameter only some ranks use (rank-dependent control flow)."""
    from fsdp_patch import fully_shard

    rank, world_size = world()

    class Branchy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(11)
            self.shared = nn.Linear(4, 4)
            self.odd_only = nn.Linear(4, 4)  # used by odd ranks only
            self.never = nn.Linear(4, 3)  # used by nobody

        def forward(self, x: torch.Tensor, use_odd: bool) -> torch.Tensor:
            h = self.shared(x)
            if use_odd:
                h = h + self.odd_only(h)
            return h

    model = Branchy()
    refs = []
    xs = [torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + r)) for r in range(world_size)]
    for r in range(world_size):
        ref = Branchy()
        ref(xs[r], r % 2 == 1).square().sum().backward()
        refs.append(ref)
    fully_shard(model)
    model(xs[rank], rank % 2 == 1).square().sum().backward()
    facts = {}
    for name, p in model.named_parameters():
        expected = torch.zeros_like(p.full_tensor())
        for ref in refs:
            g = ref.get_parameter(name).grad
            if g is not None:
                expected += g
        expected /= world_size
        if p.grad is None:
            facts[name] = {
                "grad_is_none": True,
                "reference_grads": [ref.get_parameter(name).grad is not None for ref in refs],
            }
            continue
        facts[name] = {
            "grad_is_none": False,
            "grad_is_dtensor": isinstance(p.grad, DTensor),
            "max_abs_err": (p.grad.full_tensor() - expected).abs().max().item(),
            "all_zero": bool((p.grad.full_tensor() == 0).all()),
        }
    return facts


# ---------------------------------------------------------------------------- mixed precision


def _hand_sgd(model: nn.Module, lr: float) -> list[dict[str, Any]]:
    """SGD on main weights from main grads cast to fp32, then one refresh per group."""
    from fsdp_patch import parameter_groups

    facts = []
    for group in parameter_groups(model):
        grad32 = group.main_grad.to(torch.float32)
        group.main_weight.add_(grad32, alpha=-lr)
        written = group.refresh_compute_weight()
        facts.append(
            {
                "written": written,
                "expected_written": group.compute_weight.numel() * group.compute_weight.element_size(),
                "compute_equals_cast": torch.equal(group.compute_weight, group.main_weight.to(group.compute_dtype)),
                "main_dtype": str(group.main_weight.dtype),
            }
        )
    return facts


def mixed_precision_run(steps: int) -> dict[str, Any]:
    from torch.utils._python_dispatch import TorchDispatchMode

    from fsdp_patch import MixedPrecisionPolicy, parameter_groups
    from tests.models import shard_model

    rank, world_size = world()
    batches = make_batches(steps, batch=MICROBATCH)
    out: dict[str, Any] = {}

    # --- bf16 compute, fp32 main, bf16 main grads (default), stepped by hand.
    model = shard_model(make_model(seed=0).bfloat16())
    initial = full_params(model)
    losses, step_facts, grad_facts = [], [], []
    for step in range(steps):
        loss = lm_loss(model, rank_slice(batches[step], rank, world_size))
        loss.backward()
        losses.append(loss.item())
        grad_facts.append(
            {
                n: (
                    isinstance(p.grad, DTensor),
                    tuple(p.grad.placements),
                    str(p.grad.dtype),
                    str(p.dtype),
                    str(p.grad_dtype),
                )
                for n, p in model.named_parameters()
            }
        )
        step_facts.append(_hand_sgd(model, lr=0.1))
        model.zero_grad(set_to_none=True)
    out["bf16_losses"] = losses
    out["bf16_grad_facts"] = grad_facts
    out["bf16_step_facts"] = step_facts
    out["bf16_params"] = rank0(full_params(model))
    out["bf16_initial_params"] = rank0(initial)
    out["bf16_groups"] = [
        (str(g.main_weight.dtype), str(g.compute_weight.dtype), str(g.grads_dtype)) for g in parameter_groups(model)
    ]

    # Refresh is one cast per group: count aten ops it runs.
    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    refresh_ops = []
    for group in parameter_groups(model):
        with Ops() as mode:
            group.refresh_compute_weight()
        refresh_ops.append(mode.ops)
    out["refresh_ops"] = refresh_ops

    # Forward gathers the compute copy as is (no cast from main): make the compute copy differ
    # from the main weights and look at what forward sees.
    gathered: dict[str, Any] = {}
    block = model.blocks[0]
    group = block.fsdp_parameter_groups[0]
    with torch.no_grad():
        group.compute_weight.mul_(2)  # exact in bf16
    expected_weight = full(block.fc1.weight).to(torch.bfloat16) * 2

    def look(module: nn.Module, args: Any, output: Any) -> None:
        gathered["dtype"] = str(module.fc1.weight.dtype)
        gathered["is_dtensor"] = isinstance(module.fc1.weight, DTensor)
        gathered["equals_compute_copy"] = torch.equal(module.fc1.weight.detach(), expected_weight)

    handle = block.register_forward_hook(look, prepend=True)
    with torch.no_grad():
        model(batches[0][:1, :-1])
    handle.remove()
    out["forward_sees"] = gathered
    # A change of the main weights outside any adapter (here: a manual edit) is picked up.
    with torch.no_grad():
        group.main_weight.mul_(1.0)
    handle = block.register_forward_hook(look, prepend=True)
    expected_weight = full(block.fc1.weight).to(torch.bfloat16)
    with torch.no_grad():
        model(batches[0][:1, :-1])
    handle.remove()
    out["forward_after_main_edit"] = dict(gathered)
    # ... and so is an in-place update through a DTensor parameter (as a torch optimizer does).
    with torch.no_grad():
        block.fc1.weight.add_(0.5)
    handle = block.register_forward_hook(look, prepend=True)
    expected_weight = full(block.fc1.weight).to(torch.bfloat16)
    with torch.no_grad():
        model(batches[0][:1, :-1])
    handle.remove()
    out["forward_after_param_update"] = dict(gathered)

    # --- bf16 compute with fp32 main grads: torch's SGD steps the main weights directly.
    model = shard_model(make_model(seed=0).bfloat16(), mp_policy=MixedPrecisionPolicy(main_grads_dtype=torch.float32))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses32 = []
    for step in range(steps):
        loss = lm_loss(model, rank_slice(batches[step], rank, world_size))
        loss.backward()
        losses32.append(loss.item())
        out["fp32_grads_dtypes"] = sorted({str(p.grad.dtype) for p in model.parameters()})
        opt.step()
        for g in parameter_groups(model):
            g.refresh_compute_weight()
        opt.zero_grad()
    out["fp32grads_losses"] = losses32
    out["fp32grads_compute_equals_cast"] = all(
        torch.equal(g.compute_weight, g.main_weight.to(torch.bfloat16)) for g in parameter_groups(model)
    )

    # --- the optimizer adapter, when it is there: same SGD as the hand-written step.
    try:
        from fsdp_patch.optimizer import fully_shard_optimizer
    except ImportError as exc:
        out["adapter"] = f"missing: {exc}"
    else:
        model = shard_model(make_model(seed=0).bfloat16())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        fully_shard_optimizer(opt)
        adapter_losses = []
        for step in range(steps):
            loss = lm_loss(model, rank_slice(batches[step], rank, world_size))
            loss.backward()
            adapter_losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        out["adapter"] = {
            "losses": adapter_losses,
            "params": rank0(full_params(model)),
            "compute_equals_cast": all(
                torch.equal(g.compute_weight, g.main_weight.to(torch.bfloat16)) for g in parameter_groups(model)
            ),
            "grads_after_zero": [p.grad is None for p in model.parameters()],
            "main_dtypes": sorted({str(g.main_weight.dtype) for g in parameter_groups(model)}),
        }
    return out


# ---------------------------------------------------------------------------- checkpoints


def eval_loss(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return lm_loss(model, make_batches(1, batch=4, seed=9)[0]).detach()


def checkpoint_save(path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from tests.models import shard_model

    rank, world_size = world()
    model = shard_model(build_model("plain"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for tokens in make_batches(2, batch=MICROBATCH):
        lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
        opt.step()
        opt.zero_grad()
    state = get_model_state_dict(model)
    dcp.save(state, checkpoint_id=path)
    plain = model.state_dict()
    full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {
        "params": rank0(full_params(model)),
        "loss": eval_loss(model),
        "dcp_keys": sorted(state),
        "dcp_values_dtensor": all(isinstance(v, DTensor) for v in state.values()),
        "state_dict_keys": sorted(plain),
        "state_dict_values_dtensor": all(isinstance(v, DTensor) for v in plain.values()),
        "unwrapped_keys": sorted(build_model("plain").state_dict()),
        "full_sd_plain_equal": all(
            not isinstance(full_sd[k], DTensor) and torch.equal(full_sd[k], plain[k].full_tensor()) for k in plain
        ),
    }


def checkpoint_load(path: str, bf16: bool = False) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    from fsdp_patch import parameter_groups
    from tests.models import shard_model

    rank, world_size = world()
    model = make_model(seed=5)  # different weights than the checkpoint
    if bf16:
        model = model.bfloat16()
    shard_model(model)
    before = full_params(model)
    state = get_model_state_dict(model)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state)
    facts = {
        "params": rank0(full_params(model)),
        "changed": any(not torch.equal(before[n], p) for n, p in full_params(model).items()),
        "loss": eval_loss(model),
        "main_dtypes": sorted({str(g.main_weight.dtype) for g in parameter_groups(model)}),
        "compute_equals_cast": all(
            torch.equal(g.compute_weight, g.main_weight.to(g.compute_dtype)) for g in parameter_groups(model)
        ),
    }
    if not bf16:
        # model.state_dict()/load_state_dict round trip, and a full (unsharded) state dict set
        # through DCP's helpers, both without pre-processing.
        fresh = shard_model(make_model(seed=6))
        fresh.load_state_dict(model.state_dict())
        facts["load_state_dict_equal"] = all(
            torch.equal(a, b) for a, b in zip(full_params(fresh).values(), full_params(model).values(), strict=True)
        )
        facts["load_state_dict_loss"] = eval_loss(fresh)
        fresh = shard_model(make_model(seed=7))
        full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        set_model_state_dict(fresh, full_sd, options=StateDictOptions(full_state_dict=True))
        facts["full_sd_equal"] = all(
            torch.equal(a, b) for a, b in zip(full_params(fresh).values(), full_params(model).values(), strict=True)
        )
    return facts


# ---------------------------------------------------------------------------- CPU only


@contextmanager
def forbid_cuda() -> Iterator[list[str]]:
    """Makes every ``torch.cuda`` entry point raise; ``is_available`` (which torch's own DTensor
    and DeviceMesh code query on CPU) raises only when ``fsdp_patch`` calls it directly."""
    import torch.cuda as tc

    names = [
        "current_device", "device_count", "set_device", "synchronize", "current_stream",
        "default_stream", "stream", "Stream", "Event", "_lazy_init", "init", "get_device_name",
        "get_device_properties", "get_device_capability", "mem_get_info", "memory_allocated",
        "max_memory_allocated", "memory_reserved", "empty_cache", "manual_seed", "manual_seed_all",
        "get_rng_state", "set_rng_state", "is_bf16_supported", "device", "nvtx",
    ]  # fmt: skip
    saved = {n: getattr(tc, n) for n in names if hasattr(tc, n)}
    saved["is_available"] = tc.is_available
    touched: list[str] = []
    import fsdp_patch

    package = os.path.dirname(os.path.abspath(fsdp_patch.__file__))

    def forbidden(name: str) -> Callable[..., Any]:
        def raise_(*args: Any, **kwargs: Any) -> Any:
            touched.append(name)
            raise RuntimeError(f"torch.cuda.{name} called on the CPU path")

        return raise_

    def is_available() -> bool:
        caller = os.path.abspath(sys._getframe(1).f_code.co_filename)
        if caller.startswith(package):
            touched.append(f"is_available from {caller}")
            raise RuntimeError("torch.cuda.is_available called by fsdp_patch on the CPU path")
        return saved["is_available"]()

    for name in saved:
        setattr(tc, name, forbidden(name))
    tc.is_available = is_available
    try:
        yield touched
    finally:
        for name, fn in saved.items():
            setattr(tc, name, fn)


def cpu_only_run(path: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from fsdp_patch import parameter_groups
    from tests.models import shard_model

    rank, world_size = world()
    # Seeding calls torch.cuda.manual_seed_all inside torch: build inputs first.
    model = make_model(seed=0).bfloat16()
    batches = make_batches(2, batch=MICROBATCH)
    with forbid_cuda() as touched:
        try:  # the guard itself works: a direct call raises and is recorded
            torch.cuda.current_device()
            guard_works = False
        except RuntimeError:
            guard_works = touched == ["current_device"]
        touched.clear()
        shard_model(model)  # mesh=None: builds the mesh from the default (gloo) group
        device_types = sorted({p.device_mesh.device_type for p in model.parameters()})
        devices: set[str] = set()
        for tokens in batches:
            lm_loss(model, rank_slice(tokens, rank, world_size)).backward()
            # main_grad exists from the first backward until zero_grad(set_to_none=True).
            devices |= {
                str(t.device) for g in parameter_groups(model) for t in (g.main_weight, g.compute_weight, g.main_grad)
            }
            _hand_sgd(model, lr=0.1)
            model.zero_grad()
        state = get_model_state_dict(model)
        dcp.save(state, checkpoint_id=path)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
        loss = eval_loss(model)
    return {
        "touched": touched,
        "guard_works": guard_works,
        "device_types": device_types,
        "devices": sorted(devices),
        "finite": bool(torch.isfinite(loss)),
        "cuda_initialized": torch.cuda.is_initialized(),
    }


# ---------------------------------------------------------------------------- bad inputs


def module_snapshot(module: nn.Module) -> list[tuple[Any, ...]]:
    """Everything a failed ``fully_shard`` must leave as it was, for every submodule."""
    return [
        (
            name,
            type(m),
            [(k, id(p)) for k, p in m._parameters.items()],
            [(k, id(b)) for k, b in m._buffers.items()],
            len(m._forward_pre_hooks),
            len(m._forward_hooks),
            len(m._backward_hooks),
            "_fsdp_state" in m.__dict__,
        )
        for name, m in module.named_modules(remove_duplicate=False)
    ]


class _ZeroDim(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.Linear(2, 2)
        self.scale = nn.Parameter(torch.tensor(1.0))


class _IntParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ok = nn.Linear(2, 2)
        self.index = nn.Parameter(torch.arange(3), requires_grad=False)


def _tied_pair() -> nn.Module:
    model = nn.Module()
    model.a = nn.Linear(3, 3)
    model.b = nn.Linear(3, 3)
    model.b.weight = model.a.weight
    return model


def errors_run(world_size_for_2d: int) -> dict[str, Any]:
    """Every bad input: the exception (type, message) and whether the module was left alone.

    For each case, ``setup`` builds the module (and applies any valid earlier fully_shard
    calls), ``call`` is the failing call, ``fix`` (optional) repairs the input so a retry must
    succeed, proving the failure left no registry state behind.
    """
    from fsdp_patch import fully_shard

    rank, world_size = world()
    cases: dict[str, dict[str, Any]] = {}

    def case(
        name: str,
        setup: Callable[[], nn.Module],
        call: Callable[[nn.Module], Any],
        target: Callable[[nn.Module], nn.Module] = lambda m: m,
        fix: Callable[[nn.Module], None] | None = None,
        retry: Callable[[nn.Module], Any] | None = None,
    ) -> None:
        module = setup()
        before = module_snapshot(module)
        try:
            call(module)
        except Exception as exc:
            outcome: dict[str, Any] = {"type": type(exc).__name__, "message": str(exc)}
        else:
            outcome = {"type": None, "message": ""}
        outcome["unchanged"] = module_snapshot(module) == before
        outcome["target_is_fsdp"] = type(target(module)).__name__.startswith("FSDP")
        if fix is not None:
            fix(module)
            try:
                (retry or (lambda m: fully_shard(target(m))))(module)
                outcome["retry"] = "ok"
                out = target(module)
                # The repaired module trains: forward and backward through it.
                outcome["retry_is_fsdp"] = type(out).__name__.startswith("FSDP")
            except Exception as exc:
                outcome["retry"] = f"{type(exc).__name__}: {exc}"
        cases[name] = outcome

    def twice(m: nn.Module) -> None:
        fully_shard(m)

    case("applied_twice", lambda: fully_shard(nn.Linear(4, 4)), twice)

    mesh_2d = init_device_mesh("cpu", (1, world_size), mesh_dim_names=("replicate", "shard"))
    case(
        "mesh_2d",
        lambda: nn.Linear(4, 4),
        lambda m: fully_shard(m, mesh=mesh_2d),
        fix=lambda m: None,
        retry=lambda m: fully_shard(m, mesh=mesh_2d["shard"]),
    )

    # Tied across units: the shared weight's other use sits in an already sharded unit.
    def tied_child_first() -> nn.Module:
        model = _tied_pair()
        fully_shard(model.a)
        return model

    def untie(m: nn.Module) -> None:
        m.b.weight = nn.Parameter(torch.randn(3, 3))

    case("tied_across_units_parent", tied_child_first, lambda m: fully_shard(m), fix=untie)

    def tied_siblings() -> nn.Module:
        model = _tied_pair()
        fully_shard(model.a)
        return model

    case("tied_across_units_sibling", tied_siblings, lambda m: fully_shard(m.b), target=lambda m: m.b, fix=untie)

    # Top-down order: the child's parameters already belong to the parent's unit.
    def parent_first() -> nn.Module:
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        fully_shard(model)
        return model

    case("child_after_parent", parent_first, lambda m: fully_shard(m[0]), target=lambda m: m[0])

    def zero_dim_fix(m: nn.Module) -> None:
        m.scale = nn.Parameter(torch.ones(1))

    case("zero_dim", _ZeroDim, lambda m: fully_shard(m), fix=zero_dim_fix)

    def int_fix(m: nn.Module) -> None:
        del m.index
        m.register_buffer("index", torch.arange(3))

    case("int_param", _IntParam, lambda m: fully_shard(m), fix=int_fix)

    case(
        "not_a_module",
        lambda: nn.Linear(2, 2),
        lambda m: fully_shard(m.weight),  # type: ignore[arg-type]
        target=lambda m: m,
    )
    case("bad_mesh", lambda: nn.Linear(2, 2), lambda m: fully_shard(m, mesh="cpu"))  # type: ignore[arg-type]
    case(
        "bad_policy", lambda: nn.Linear(2, 2), lambda m: fully_shard(m, mp_policy={"main_params_dtype": torch.float32})
    )  # type: ignore[arg-type]
    case("bad_reshard", lambda: nn.Linear(2, 2), lambda m: fully_shard(m, reshard_after_forward=1))  # type: ignore[arg-type]

    # Tied within one unit is supported: one sharded parameter in both places, not duplicated.
    model = _tied_pair()
    fully_shard(model)
    cases["tied_within_unit"] = {
        "same_object": model.a.weight is model.b.weight,
        "named_parameters": [n for n, _ in model.named_parameters()],
        "state_dict_keys": sorted(model.state_dict()),
        "group_params": sum(len(g.params) for g in model.fsdp_parameter_groups),
    }
    return cases


# ---------------------------------------------------------------------------- recovery


def recovery_run() -> dict[str, Any]:
    """An exception aborts a backward (after some units reduced) or a forward; the next
    iteration must give the grads of a clean one and leave nothing unsharded."""
    from fsdp_patch import FSDPModule, parameter_groups
    from tests.models import shard_model

    rank, world_size = world()
    batches = make_batches(2, batch=MICROBATCH)
    reference = build_model("plain")
    for piece in range(world_size):
        (lm_loss(reference, rank_slice(batches[1], piece, world_size)) / world_size).backward()
    expected = {n: p.grad for n, p in reference.named_parameters()}

    def clean_step_error(model: nn.Module) -> float:
        lm_loss(model, rank_slice(batches[1], rank, world_size)).backward()
        grads = full_grads(model)
        if any(g is None for g in grads.values()):
            return float("inf")
        return max((grads[n] - expected[n]).abs().max().item() for n in expected)

    class Boom(RuntimeError):
        pass

    out: dict[str, Any] = {}
    for where, explicit in (("backward", False), ("backward", True), ("forward", False), ("forward", True)):
        model = shard_model(build_model("plain"))
        # A completed iteration first, so that stale grads from it could leak too.
        lm_loss(model, rank_slice(batches[0], rank, world_size)).backward()
        armed = [True]

        def fail(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
            if not armed[0]:
                return output
            armed[0] = False
            if where == "forward":
                raise Boom("forward")

            def raise_in_backward(grad: torch.Tensor) -> None:
                raise Boom("backward")

            output.register_hook(raise_in_backward)
            return output

        model.blocks[0].register_forward_hook(fail)
        facts: dict[str, Any] = {}
        try:
            lm_loss(model, rank_slice(batches[1], rank, world_size)).backward()
            facts["raised"] = False
        except Boom:
            facts["raised"] = True
        if explicit:
            model.reset_iter_state()
            facts["after_reset"] = unsharded_bytes(model)
            # blocks.1 had reduced before blocks.0's backward raised: its main grads hold part
            # of the aborted iteration, so its .grad must be None (the next backward overwrites);
            # the others still hold the completed iteration's grads.
            facts["grads_none_after_reset"] = sorted(n for n, p in model.named_parameters() if p.grad is None)
            facts["params_sharded_after_reset"] = all(isinstance(p, DTensor) for p in model.parameters()) and all(
                isinstance(m.weight, DTensor) for m in model.modules() if isinstance(m, nn.Linear)
            )
        model.zero_grad(set_to_none=True)
        facts["max_abs_err"] = clean_step_error(model)
        facts["after_backward"] = unsharded_bytes(model)
        facts["units"] = sum(isinstance(m, FSDPModule) for m in model.modules())
        facts["param_names"] = [n for n, _ in model.named_parameters()]
        facts["groups"] = len(parameter_groups(model))
        out[f"{where}_{'explicit' if explicit else 'auto'}"] = facts
    return out
