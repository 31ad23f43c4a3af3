"""The float32 shadow, module by module: which modules it ranks costliest and why (their own
operations, or their weights' rounding, gathered from the fp32 main weights on 2 ranks under
fully_shard and FSDP2), and that the model it shadows is left exactly as it was."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from fsdp_patch.telemetry.diagnostics.module_shadow import ModuleCost, ModuleShadow
from fsdp_patch.telemetry.diagnostics.op_audit import OpAudit
from torch import nn

from fsdp_patch.module.model_units import ShardedModel, sharded_models


class NaiveVariance(nn.Module):
    """``E[x²] - E[x]²`` of inputs far from 0: a cancellation that bfloat16 leaves few digits of."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + 100.0
        return (x * x).mean(-1, keepdim=True) - x.mean(-1, keepdim=True) ** 2 + x


class OffsetGain(nn.Module):
    """A gain stored as 1 + a small offset and used as that offset: bfloat16 holds the weight as 1."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.gain = nn.Parameter(1.0 + 1e-3 * (1.0 + torch.rand(width, generator=torch.Generator().manual_seed(3))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * (self.gain - 1.0) * 1000.0


class Model(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.variance = NaiveVariance()
        self.drop = nn.Dropout(0.25)
        self.norm = nn.BatchNorm1d(width)
        self.act = nn.ReLU(inplace=True)
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act(self.norm(self.drop(self.variance(self.proj(x))))))


def _whole(model: nn.Module) -> list[ShardedModel]:
    return [ShardedModel(model, (("", model),))]


def _costs(model: nn.Module, x: torch.Tensor, shadow: bool, autocast: bool = False) -> tuple[Any, ...]:
    torch.manual_seed(7)
    runner = ModuleShadow(_whole(model)) if shadow else None
    if runner is not None:
        runner.start()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out = model(x)
    out.float().square().sum().backward()
    costs = runner.finish() if runner is not None else []
    state = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return out.detach(), state, grads, torch.get_rng_state(), costs, runner.failed if runner else {}


def _model(dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    torch.manual_seed(0)
    return Model().to(dtype).train()


def test_the_shadow_ranks_the_module_that_loses_precision_and_leaves_the_model_as_it_was() -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    out, state, grads, rng, costs, failed = _costs(_model(), x, shadow=True)
    want_out, want_state, want_grads, want_rng, _, _ = _costs(_model(), x, shadow=False)
    assert failed == {}, f"every leaf's recompute ran: {failed}"
    assert torch.equal(out, want_out), "the output is bitwise the one without the shadow"
    differ = [k for k in want_state if not torch.equal(state[k], want_state[k])]
    assert differ == [], f"parameters and buffers (the norm's running statistics) unchanged: {differ} differ"
    differ = [k for k in want_grads if not torch.equal(grads[k], want_grads[k])]
    assert differ == [], f"grads unchanged: {differ} differ"
    assert torch.equal(rng, want_rng), "the generator drew what it draws without the shadow (dropout's masks alike)"
    by_name = {c.module: c for c in costs}
    assert "drop" not in by_name, f"dropout draws random numbers and is not recomputed: {by_name.get('drop')}"
    assert set(by_name) == {"proj", "variance", "norm", "act", "out"}, f"every other leaf measured: {sorted(by_name)}"
    first = costs[0]
    assert first.module == "variance", f"want the cancellation ranked costliest, got {[c.module for c in costs]}"
    assert first.cost > 8 and first.error > 0.05, f"its local error is far beyond bf16's rounding: {first}"
    assert first.weight_error == 0.0, f"it has no weights: {first}"
    assert by_name["proj"].cost < 8, f"a bf16 Linear costs about its rounding: {by_name['proj']}"
    assert all(c.dtype == torch.bfloat16 and c.calls == 1 for c in costs), costs


def test_under_autocast_the_recompute_runs_in_float32() -> None:
    """A float32 model under autocast: the Linears' outputs are bfloat16, their recompute is not (an
    autocast left on would recompute them in bfloat16 too, and find no error at all)."""
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    *_, costs, failed = _costs(_model(torch.float32), x, shadow=True, autocast=True)
    by_name = {c.module: c for c in costs}
    assert failed == {}, failed
    assert set(by_name) >= {"proj", "out"}, f"autocast's bfloat16 Linears measured: {sorted(by_name)}"
    got = [by_name[n].error for n in ("proj", "out")]
    assert all(0 < e < 0.05 for e in got), (
        f"want the Linears' bf16 rounding against float32 (0 < error < 5%), got {got}"
    )


def test_the_operation_audit_sees_the_iteration_and_not_the_shadows_recompute() -> None:
    def findings(shadowed: bool) -> list[tuple[str, str, str]]:
        model = _model()
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        names = {id(m): n for n, m in model.named_modules()}
        audit = OpAudit(names)
        shadow = ModuleShadow(_whole(model))
        audit.start()
        if shadowed:
            shadow.start()
        model(x).float().sum().backward()
        if shadowed:
            shadow.finish()
        return sorted((f.kind, f.op, f.site.where) for f in audit.finish(top_k=10))

    got, want = findings(True), findings(False)
    assert got == want, f"the audit's findings with the shadow running {got}, without {want}"
    assert want, "the audit finds the cancellation"


def _shadow_on_ranks(kind: str, gather_fails: bool = False) -> list[ModuleCost]:
    import torch.distributed as dist

    from benchmarks.bug_patterns.run import quiet_warnings

    quiet_warnings()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), OffsetGain(16), nn.Linear(16, 5))
    if kind == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    else:
        from fsdp_patch import MixedPrecisionPolicy, fully_shard  # type: ignore[assignment]
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    fully_shard(model[1], mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    shadow = ModuleShadow(sharded_models(list(model.parameters())))
    shadow.start()
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    if gather_fails:
        from unittest import mock

        gather = "fsdp_patch.telemetry.diagnostics.module_shadow.full_weight"
        with mock.patch(gather, side_effect=RuntimeError("offloaded")):
            model(x).float().sum().backward()
        costs = shadow.finish()
        assert list(shadow.failed) == ["(the main weights' gather)"], shadow.failed
        return costs
    model(x).float().sum().backward()
    costs = shadow.finish()
    assert shadow.failed == {}, shadow.failed
    return costs


@pytest.mark.parametrize("kind", ["fully_shard", "fsdp2"])
def test_a_weight_the_compute_copy_rounds_away_is_named_from_the_gathered_main_weights(dist_pool, kind: str) -> None:
    """The gain's 16 elements are sharded over 2 ranks; bfloat16 holds each as 1, so the forward
    multiplies by 0: only the fp32 main weights, gathered, show what the module should compute."""
    for rank, costs in enumerate(dist_pool(2).run(_shadow_on_ranks, kind)):
        by_name = {c.module: c for c in costs}
        assert set(by_name) == {"0", "1", "2"}, f"{kind}, rank {rank}: every leaf measured: {sorted(by_name)}"
        gain = by_name["1"]
        got = (costs[0].module, round(gain.error, 3), round(gain.weight_error, 3), gain.module_type)
        assert got == ("1", 1.0, 1.0, "OffsetGain"), (
            f"{kind}, rank {rank}: want the gain first, wholly wrong, all of it its weights', named by its own class; got {got}"
        )
        assert by_name["0"].cost < 8, f"{kind}, rank {rank}: a bf16 Linear costs about its rounding: {by_name['0']}"


def test_a_gather_that_fails_is_never_raised_and_the_leaves_go_on_from_their_compute_weights(dist_pool) -> None:
    for rank, costs in enumerate(dist_pool(2).run(_shadow_on_ranks, "fully_shard", True)):
        by_name = {c.module: c for c in costs}
        got = (sorted(by_name), by_name["1"].error)
        assert got == (["0", "1", "2"], 0.0), (
            f"rank {rank}: every leaf measured, the gain from its compute weights alone (no error seen): got {got}"
        )


def full_weights_run() -> list[tuple[str, bool]]:
    """Uneven shards of fully_shard's and FSDP2's parameters (and HSDP's on 4 ranks): the shadow's
    gather against ``full_tensor()``, bitwise."""
    import torch.distributed as dist
    from fsdp_patch.telemetry.diagnostics.full_weights import full_weight
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fsdp_patch import fully_shard

    world = dist.get_world_size()
    meshes = {"1-D": None}
    if world == 4:
        meshes["HSDP"] = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    out = []
    for label, mesh in meshes.items():
        for kind, shard in (("fully_shard", fully_shard), ("fsdp2", torch_fully_shard)):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(16, 7), torch.nn.Linear(7, 3))
            shard(model, **({"mesh": mesh} if mesh is not None else {}))
            for name, param in model.named_parameters():
                out.append((f"{label} {kind} {name}", torch.equal(full_weight(param), param.full_tensor())))
    return out


@pytest.mark.parametrize("world_size", [2, 4])
def test_the_shadow_gathers_uneven_shards_as_full_tensor_does(dist_pool, world_size: int) -> None:
    got = dist_pool(world_size).run(full_weights_run)[0]
    differ = [name for name, same in got if not same]
    assert got and not differ, f"gathered weights that differ from full_tensor(): {differ} (of {len(got)})"
