"""The float8 compute copy of torchao's tensorwise ``Float8Linear`` weights
(``enable_fsdp_float8_all_gather=True``): kept in float8 with one scale per weight, refreshed
after the optimizer step with one amax all-reduce per group, cast again at the iteration's first
all-gather (as every compute copy is) with those scales, no second all-reduce; all-gathered as
bytes (gloo has no float8 type), half the bytes of a bf16 gather; the unsharded weights are
torchao's ``Float8TrainingTensor``. Where no adapter refreshed (an optimizer not adapted), or the
weights were loaded, the gather reduces the amax anew.

Training on 2 and 4 gloo ranks (even and uneven shards) is held to the same model gathered in
bf16 (torchao's cast in forward instead), within float8 noise, and to FSDP2 with torchao's float8
all-gather where FSDP2 runs (even shards: on uneven ones its gloo all-gather aborts): bitwise on
2 ranks; on 4 within the order of bf16 sums (ours reduce-scatters the float8 weights and the
biases as two groups, FSDP2 as one, so a ring sums them in other orders). A DCP checkpoint
saved on 2 ranks loads on 4 into a model that computes the same. With
``reshard_after_forward=2`` backward re-gathers the float8 rows kept after forward.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.fsdp import float8_models
from tests.fsdp.float8_models import BF16, EVEN, UNEVEN
from tests.fsdp.sharded_views import rank0, record_all_gathers
from tests.fsdp.training_runs import global_losses

# Float8 e4m3 keeps 3 mantissa bits: one step is 2^-3 of a value. The float8-gathered and the
# bf16-gathered model cast the same fp32 weights to float8 by two roads (directly, or through
# bf16, each with a scale from that tensor's amax), so a few elements land one step apart; the
# updates then differ by a fraction of a step.
FLOAT8_NOISE = 2.0**-3
# The losses move by far less: few elements are a step apart. Bound: one step of the bf16
# outputs the loss is computed from.
LOSS_NOISE = 2.0**-7
# bf16 keeps 8 bits: a grad summed over 4 ranks in another order differs in its last bits.
REDUCE_ORDER = 2.0**-7


def _relative_differences(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], start: dict[str, torch.Tensor]):
    """Per parameter, ``|got - want| / |want - start|`` (norms): how far apart two runs ended, in
    units of how far the reference moved."""
    return {name: ((got[name] - want[name]).norm() / (want[name] - start[name]).norm()).item() for name in want}


def training_run(rows: tuple[int, int, int], hsdp: bool = False) -> dict[str, Any]:
    """The float8-gathered model, the bf16-gathered one and, on even shards of a 1-D mesh, FSDP2's
    float8 all-gather; ``hsdp``: ``fully_shard``'s on a 2 x 2 mesh (replicated over the first)."""
    from torch.distributed.device_mesh import init_device_mesh

    start = {n: p.detach().float() for n, p in float8_models.float8_mlp(True, rows).named_parameters()}
    runs = {"float8": ("ours", True), "bf16": ("ours", False)}
    if rows == EVEN and not hsdp:
        runs["fsdp2"] = ("fsdp2", True)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    got = {}
    for label, (impl, fp8) in runs.items():
        model = float8_models.shard(float8_models.float8_mlp(fp8, rows), impl, mesh=mesh)
        got[label] = float8_models.train(model, impl)
    losses = {label: global_losses(run["losses"]) for label, run in got.items()}
    out = {
        "losses": losses,
        "against_bf16": _relative_differences(got["float8"]["params"], got["bf16"]["params"], start),
    }
    if "fsdp2" in got:
        fsdp2 = got["fsdp2"]["params"]
        out["against_fsdp2"] = _relative_differences(got["float8"]["params"], fsdp2, start)
        out["max_abs_against_fsdp2"] = max((got["float8"]["params"][n] - fsdp2[n]).abs().max().item() for n in fsdp2)
    return rank0(out)


@pytest.mark.parametrize(
    ("world_size", "hsdp"), [(2, False), (4, False), pytest.param(4, True, id="4-hsdp")], ids=["2", "4", "4-hsdp"]
)
@pytest.mark.parametrize("rows", [EVEN, UNEVEN], ids=["even", "uneven"])
def test_float8_gathered_training_is_within_float8_noise_of_bf16_and_matches_fsdp2(
    run_once, world_size: int, hsdp: bool, rows: tuple[int, int, int]
) -> None:
    """On 2 and 4 ranks, and on HSDP's 2 x 2 mesh (each weight's amax reduced over its shard group,
    the grads over the replicas too)."""
    float8_models.require_torchao()
    got = run_once(world_size, training_run, rows, hsdp)[0]
    losses = got["losses"]
    for step, (fp8, bf16) in enumerate(zip(losses["float8"], losses["bf16"], strict=True)):
        assert abs(fp8 - bf16) <= LOSS_NOISE * abs(bf16), (
            f"step {step}: float8-gathered loss {fp8}, bf16-gathered {bf16}: expected within {LOSS_NOISE:.3g} relative"
        )
    worst = max(got["against_bf16"].items(), key=lambda item: item[1])
    assert worst[1] <= FLOAT8_NOISE, (
        f"expected every parameter within {FLOAT8_NOISE} of the bf16-gathered run's update, got {worst[1]:.3g} "
        f"in {worst[0]} ({got['against_bf16']})"
    )
    if rows != EVEN or hsdp:
        return
    if world_size == 2:
        assert losses["float8"] == losses["fsdp2"], f"expected FSDP2's losses {losses['fsdp2']}, got {losses['float8']}"
        assert got["max_abs_against_fsdp2"] == 0.0, (
            f"expected FSDP2's parameters bitwise, got off by {got['max_abs_against_fsdp2']:.3g}"
        )
        return
    worst = max(got["against_fsdp2"].items(), key=lambda item: item[1])
    assert worst[1] <= REDUCE_ORDER, (
        f"expected every parameter within {REDUCE_ORDER} of FSDP2's update, got {worst[1]:.3g} in {worst[0]}"
    )


@contextmanager
def counting_all_reduces() -> Iterator[list[int]]:
    """Counts ``torch.distributed.all_reduce`` calls (the amax reduce calls it through the module)."""
    calls = [0]
    original = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return original(*args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = original


def _gathered(gathers: list[dict[str, Any]]) -> list[tuple[str, int]]:
    return [(str(g["input"].dtype), g["input_numel"] * g["input"].element_size()) for g in gathers]


def refresh_run() -> dict[str, Any]:
    """One step of the float8-gathered model on uneven shards: what the step refreshed, what the
    next forward gathered and computed with; and what a bf16-gathered model gathers."""
    from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8 as torchao_cast

    from fsdp_patch import parameter_groups
    from fsdp_patch.optimizer import fully_shard_optimizer

    model = float8_models.shard(float8_models.float8_mlp(True, UNEVEN), "ours")
    groups = [g for g in parameter_groups(model) if g.float8 is not None]
    optimizer = torch.optim.SGD(model.parameters(), lr=float8_models.LR)
    fully_shard_optimizer(optimizer)
    x, y = float8_models.batches(UNEVEN[-1])[0]
    mine = float8_models.my_rows
    torch.nn.functional.mse_loss(model(mine(x).to(torch.bfloat16)).float(), mine(y)).backward()
    before = [g._copy.refreshes for g in groups]
    with counting_all_reduces() as step_calls:
        optimizer.step()
    facts: dict[str, Any] = {
        "group_names": [g.names for g in groups],
        "refreshed_by_step": [g._copy.refreshes - n for g, n in zip(groups, before, strict=True)],
        "stale_after_step": [g.compute_stale for g in groups],
        "step_all_reduces": step_calls[0],
        "copy_dtypes": [str(g.compute_weight.dtype) for g in groups],
        "scales": [],
        "bytes_as_torchao": [],
    }
    float8_max = torch.finfo(torch.float8_e4m3fn).max
    for group in groups:
        for index, param in enumerate(group.params):
            # Computed here from the whole weight, as torchao's precompute_float8_dynamic_scale_for_fsdp does.
            amax = param.full_tensor().float().abs().max().double().clamp(min=1e-12)
            facts["scales"].append((group._copy.scales[index].item(), (float8_max / amax).float().item()))
            scale = group._copy.scales[index]
            want = torchao_cast(param.to_local(), scale, torch.float8_e4m3fn, None, GemmInputRole.WEIGHT)._data
            got = group._copy.buffer.local(index)
            facts["bytes_as_torchao"].append(torch.equal(got.view(torch.uint8), want.view(torch.uint8)))
    scales = [s for g in groups for s in g._copy.scales.tolist()]

    unsharded: list[tuple[str, str, float]] = []

    def note(module: nn.Module, args: Any) -> None:
        weight = module.weight
        if isinstance(weight, Float8TrainingTensor):
            unsharded.append((str(weight._data.dtype), str(weight.dtype), weight._scale.item()))

    handles = [layer.register_forward_pre_hook(note) for layer in float8_models.linears(model)]
    with torch.no_grad(), record_all_gathers() as gathers, counting_all_reduces() as forward_calls:
        model(x.to(torch.bfloat16))
    for handle in handles:
        handle.remove()
    facts.update(
        unsharded=unsharded,
        step_scales=scales,
        forward_all_reduces=forward_calls[0],
        gathered=_gathered(gathers),
        float8_shard_numels=[g.layout.shard_numel for g in groups],
    )
    bf16 = float8_models.shard(float8_models.float8_mlp(False, UNEVEN), "ours")
    with torch.no_grad(), record_all_gathers() as bf16_gathers:
        bf16(x.to(torch.bfloat16))
    facts["bf16_gathered"] = _gathered(bf16_gathers)
    return rank0(facts)


@pytest.fixture(scope="module")
def refresh(run_once) -> dict[str, Any]:
    float8_models.require_torchao()
    return run_once(2, refresh_run)[0]


def test_each_float8_linear_weight_gets_a_float8_copy(refresh) -> None:
    assert refresh["group_names"] == [["0.weight"], ["2.weight"], ["4.weight"]], (
        f"expected one float8 group per layer, got {refresh['group_names']}"
    )
    assert refresh["copy_dtypes"] == ["torch.float8_e4m3fn"] * 3, (
        f"expected float8 copies, got {refresh['copy_dtypes']}"
    )


def test_the_step_refreshes_the_copy_with_one_amax_all_reduce_per_group(refresh) -> None:
    assert refresh["refreshed_by_step"] == [1, 1, 1], (
        f"expected one refresh per group, got {refresh['refreshed_by_step']}"
    )
    assert refresh["stale_after_step"] == [False] * 3, f"expected fresh copies, got {refresh['stale_after_step']}"
    assert refresh["step_all_reduces"] == 3, (
        f"expected 3 all-reduces (one per group), got {refresh['step_all_reduces']}"
    )
    for got, want in refresh["scales"]:
        assert got == want, f"expected the scale float8 max / amax of the whole weight {want}, got {got}"
    assert all(refresh["bytes_as_torchao"]), f"expected torchao's cast's bytes: {refresh['bytes_as_torchao']}"


def test_forward_gathers_float8_bytes_into_float8_training_tensors(refresh) -> None:
    want = [("torch.float8_e4m3fn", "torch.bfloat16", scale) for scale in refresh["step_scales"]]
    assert refresh["unsharded"] == want, f"expected the unsharded weights {want}, got {refresh['unsharded']}"
    # The iteration's first gather casts every compute copy again ([Note: compute-copy freshness]),
    # with the scales the step's refresh reduced.
    assert refresh["forward_all_reduces"] == 0, f"expected no all-reduce, got {refresh['forward_all_reduces']}"
    float8 = [numel for dtype, numel in refresh["gathered"] if dtype == "torch.uint8"]
    assert float8 == refresh["float8_shard_numels"], (
        f"expected each float8 shard gathered as its bytes {refresh['float8_shard_numels']}, got {refresh['gathered']}"
    )


def test_the_float8_copy_gathers_half_the_bytes_of_bf16_for_the_weights(refresh) -> None:
    weights = sum(refresh["float8_shard_numels"])  # elements, one byte each in float8, two in bf16
    float8_total = sum(nbytes for _, nbytes in refresh["gathered"])
    bf16_total = sum(nbytes for _, nbytes in refresh["bf16_gathered"])
    assert bf16_total - float8_total == weights, (
        f"expected the float8 model to gather {weights} bytes (one per weight element) fewer than the bf16 "
        f"model's {bf16_total}, got {float8_total}"
    )


def reductions_run() -> dict[str, Any]:
    """Amax all-reduces counted around each part of training the float8-gathered model on uneven
    shards: steps of two microbatches, a load_state_dict between a step and the next forward, a
    write outside the optimizer that grows a weight, and an optimizer left unadapted."""
    from fsdp_patch.telemetry.diagnostics.float8_casts import measure_gathered

    from fsdp_patch.optimizer import fully_shard_optimizer

    mine = float8_models.my_rows
    model = float8_models.shard(float8_models.float8_mlp(True, UNEVEN), "ours")
    optimizer = torch.optim.SGD(model.parameters(), lr=float8_models.LR)
    fully_shard_optimizer(optimizer)
    counts: dict[str, list[int]] = {"step": [], "microbatches": []}
    for x, y in float8_models.batches(UNEVEN[-1]):
        with counting_all_reduces() as forwards:
            for half in (0, 1):
                model.set_requires_gradient_sync(half == 1)  # type: ignore[operator]
                rows = mine(x).chunk(2)[half], mine(y).chunk(2)[half]
                torch.nn.functional.mse_loss(model(rows[0].to(BF16)).float(), rows[1]).backward()
        with counting_all_reduces() as step:
            optimizer.step()
        optimizer.zero_grad()
        counts["microbatches"].append(forwards[0])
        counts["step"].append(step[0])
    x = float8_models.batches(UNEVEN[-1])[0][0].to(BF16)
    model.load_state_dict(model.state_dict())
    with torch.no_grad(), counting_all_reduces() as after_load:
        model(x)
    saturated: list[float] = []
    optimizer.step()  # no grads: the adapter's refresh alone
    with torch.no_grad():
        first = float8_models.linears(model)[0]
        first.weight.to_local().mul_(4)  # outside the optimizer, between the step and the forward
        handle = first.register_forward_pre_hook(lambda m, a: saturated.append(measure_gathered(m.weight)[6].item()))
        with counting_all_reduces() as after_write:
            model(x)
        handle.remove()
    plain = float8_models.shard(float8_models.float8_mlp(True, UNEVEN, seed=1), "ours")
    with torch.no_grad(), counting_all_reduces() as unadapted:
        plain(x)
        plain(x)
    return rank0(
        {
            **counts,
            "after_load": after_load[0],
            "after_write": after_write[0],
            "saturated_after_write": saturated,
            "unadapted_two_forwards": unadapted[0],
        }
    )


def test_the_amax_is_reduced_once_per_step(run_once) -> None:
    """Steps of two microbatches: each step's refresh reduces each group's amax once (3 groups),
    the forwards and backwards of both microbatches after it none; a load reduces anew at the next gather,
    and so does every forward of a model no adapter refreshes. A weight grown x4 outside the
    optimizer between the step and the forward keeps the step's scale: clamped at float8's largest
    value (what torchao's precomputed scale does under FSDP2), which the float8 cast watch
    measures as saturated."""
    float8_models.require_torchao()
    got = run_once(2, reductions_run)[0]
    steps = len(got["step"])
    # Before the first step no adapter has refreshed: each microbatch's forward reduces (2 x 3).
    want = {"step": [3] * steps, "microbatches": [6] + [0] * (steps - 1), "after_load": 3, "after_write": 0}
    assert {k: got[k] for k in want} == want, f"all-reduces: got {got}, want {want}"
    assert got["unadapted_two_forwards"] == 6, f"an unadapted model's two forwards: {got['unadapted_two_forwards']}"
    assert len(got["saturated_after_write"]) == 1 and got["saturated_after_write"][0] > 0.5, (
        f"expected most of the grown weight clamped, got a saturated share {got['saturated_after_write']}"
    )


def checkpoint_run(path: str, save: bool) -> dict[str, Any]:
    """``save``: train the float8-gathered model a step and save it with DCP; else load it into a
    model built from another seed. Either way, its full parameters and a forward's output."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    model = float8_models.shard(float8_models.float8_mlp(True, UNEVEN, seed=0 if save else 5), "ours")
    if save:
        float8_models.train(model, "ours")
        dcp.save(get_model_state_dict(model), checkpoint_id=path)
    else:
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=path)
        set_model_state_dict(model, state)
    x, _ = float8_models.batches(UNEVEN[-1], seed=7)[0]
    with torch.no_grad():
        out = model(x.to(torch.bfloat16))
    params = {n: p.full_tensor() for n, p in model.named_parameters()}
    return rank0({"params": params, "out": out})


def test_a_checkpoint_saved_on_2_ranks_loads_on_4_and_computes_the_same(dist_pool, tmp_path: Path) -> None:
    float8_models.require_torchao()
    path = str(tmp_path / "float8")
    saved = dist_pool(2).run(checkpoint_run, path, True)[0]
    loaded = dist_pool(4).run(checkpoint_run, path, False)[0]
    for name, want in saved["params"].items():
        assert torch.equal(loaded["params"][name], want), f"{name}: loaded on 4 ranks differs from the saved"
    assert torch.equal(loaded["out"], saved["out"]), (
        f"expected the loaded model's output bitwise, off by {(loaded['out'] - saved['out']).abs().max().item():.3g}"
    )


def regather_run() -> dict[str, Any]:
    """The float8-gathered model with each layer keeping half its rows after forward (backward
    re-gathers them over pairs of ranks, as bytes) against freeing them all."""
    runs = {}
    for reshard in (True, 2):
        model = float8_models.shard(float8_models.float8_mlp(True, UNEVEN), "ours", reshard_after_forward=reshard)
        runs[reshard] = float8_models.train(model, "ours")
    differences = {n: (runs[2]["params"][n] - runs[True]["params"][n]).abs().max().item() for n in runs[True]["params"]}
    return rank0({"losses": (runs[2]["losses"], runs[True]["losses"]), "differences": differences})


def test_backward_regathers_float8_rows_kept_after_forward(run_once) -> None:
    float8_models.require_torchao()
    got = run_once(4, regather_run)[0]
    kept, freed = got["losses"]
    assert kept == freed, f"expected the losses of resharding all {freed}, got {kept}"
    assert all(d == 0.0 for d in got["differences"].values()), (
        f"expected the same parameters, off by {got['differences']}"
    )
