"""fp32 training parity: fully_shard vs a single-process reference and vs torch's FSDP2.

One distributed run per world size trains every configuration below for ``STEPS`` steps (each
rank on its slice of every microbatch); the reference trains the unwrapped model on the full
microbatches in this process. Covered: SGD, SGD with momentum and AdamW (with weight decay),
1 and 3 microbatches, reduce-scatter on every microbatch or only on the last
(``set_requires_gradient_sync(False)`` on the others), ``zero_grad(set_to_none=False)``, tied
embedding/head weights within one unit, a frozen block, and unused parameters.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from tests.fsdp.conftest import max_abs_diff
from tests.fsdp.sharded_views import difference, full_grads, full_params, world
from tests.fsdp.transformer_variants import MICROBATCH, build_model
from tests.models import lm_loss, make_batches, rank_slice

WORLD_SIZES = (1, 2, 4)
TOL = 1e-6
# AdamW with eps=1e-4: torch's default eps=1e-8 makes the update g / (|g| + eps) amplify fp32
# rounding differences of near-zero gradients up to 1e6-fold (to ~1e-3 after a few steps, for
# torch's FSDP2 as for us); eps=1e-4 keeps that amplification below 1e2, so 1e-6 is a meaningful
# bound. The default eps runs too, compared tightly with FSDP2 and loosely with the reference.
ADAMW = "adamw:1e-4"
LOOSE_TOL = 1e-3


STEPS = 3


def make_optimizer(name: str, params: Iterator[nn.Parameter]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9)
    if name.startswith("adamw"):
        eps = float(name.partition(":")[2] or 1e-8)
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=eps)
    raise ValueError(name)


def _config(name: str, **overrides: Any) -> dict[str, Any]:
    config = dict(name=name, impl="ours", model="plain", opt="sgd", mb=1, sync="all", set_to_none=True)
    config.update(overrides)
    return config


OURS = [
    _config("sgd_mb1"),
    _config("adamw_mb1", opt=ADAMW),
    _config("sgd_mb3_sync_last", mb=3, sync="last"),
    _config("adamw_mb3_sync_last", opt=ADAMW, mb=3, sync="last"),
    _config("adamw_mb3_sync_all", opt=ADAMW, mb=3, sync="all"),
    _config("momentum_mb3_keep_grads", opt="sgd_momentum", mb=3, set_to_none=False),
    _config("adamw_mb3_sync_last_keep_grads", opt=ADAMW, mb=3, sync="last", set_to_none=False),
    _config("tied_adamw_mb1", model="tied", opt=ADAMW),
    _config("frozen_momentum_mb1", model="frozen", opt="sgd_momentum"),
    _config("unused_sgd_mb3", model="unused", mb=3, sync="last"),
    _config("adamw_default_eps_mb3_sync_last", opt="adamw", mb=3, sync="last"),
]
FSDP2 = [
    _config("fsdp2_sgd_mb1", impl="fsdp2"),
    _config("fsdp2_adamw_mb1", impl="fsdp2", opt=ADAMW),
    _config("fsdp2_adamw_mb3_sync_last", impl="fsdp2", opt=ADAMW, mb=3, sync="last"),
    _config("fsdp2_tied_adamw_mb1", impl="fsdp2", model="tied", opt=ADAMW),
    _config("fsdp2_adamw_default_eps_mb3_sync_last", impl="fsdp2", opt="adamw", mb=3, sync="last"),
]


def tolerance(config: dict[str, Any]) -> float:
    return LOOSE_TOL if config["opt"] == "adamw" else TOL


BY_NAME = {c["name"]: c for c in OURS + FSDP2}


def _reference_key(config: dict[str, Any], slices: int) -> tuple:
    return (slices, *sorted((k, v) for k, v in config.items() if k not in ("name", "impl")))


_REFERENCES: dict[tuple, dict[str, Any]] = {}


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

        names = {id(p): n for n, p in model.named_parameters()}
        result["grads_not_views"] = [
            names.get(id(p), repr(p))
            for g in parameter_groups(model)
            if g.main_grad is not None
            for p in g.params
            if p.grad is None
            or p.grad.to_local().untyped_storage().data_ptr() != g.main_grad.untyped_storage().data_ptr()
        ]
        result["main_grads_nonzero"] = {
            ",".join(sorted(g.names)): int((g.main_grad != 0).sum())
            for g in parameter_groups(model)
            if g.main_grad is not None and not bool((g.main_grad == 0).all())
        }
    return result


def reference(config: dict[str, Any], slices: int) -> dict[str, Any]:
    """Single-process training of the unwrapped model on the same microbatches, each run as
    ``slices`` pieces (see :func:`train`); ``slices=1`` runs it in one piece."""
    key = _reference_key(config, slices)
    if key not in _REFERENCES:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as on the ranks
        try:
            _REFERENCES[key] = train(config, sharded=False, slices=slices)
        finally:
            torch.set_num_threads(threads)
    return _REFERENCES[key]


def parity_run(configs: list[dict[str, Any]]) -> dict[str, Any] | None:
    rank, world_size = world()
    out = {}
    for config in configs:
        result = train(config, rank, world_size)
        out[config["name"]] = result
    # Per-rank losses are means over the rank's slice; the test averages them over ranks.
    losses = {name: r.pop("losses") for name, r in out.items()}
    return {"results": out if rank == 0 else None, "losses": losses}


@pytest.fixture(scope="module", params=WORLD_SIZES, ids=lambda w: f"ws{w}")
def runs(request: pytest.FixtureRequest, run_once) -> tuple[int, dict[str, Any], list[list[float]]]:
    world_size = request.param
    per_rank = run_once(world_size, parity_run, OURS + FSDP2)
    results = per_rank[0]["results"]
    # Global loss of a step: the mean of the ranks' slice means (equal slices).
    losses = {
        name: [sum(r["losses"][name][s] for r in per_rank) / world_size for s in range(STEPS)] for name in results
    }
    return world_size, results, losses


def _compare(ours: dict[str, Any], ref: dict[str, Any], what: str) -> dict[str, float]:
    assert list(ours) == list(ref), f"{what}: names differ"
    diffs = {}
    for name, value in ours.items():
        expected = ref[name]
        if expected is None:  # the reference had no grad (frozen or unused parameter)
            if value is None:
                continue
            expected = torch.zeros_like(value)
        assert value is not None, f"{what}: {name} is None, reference is not"
        diffs[name] = max_abs_diff(value, expected)
    return diffs


@pytest.mark.parametrize("name", [c["name"] for c in OURS])
def test_fp32_training_matches_single_process_reference(runs, name: str) -> None:
    world_size, results, losses = runs
    config, result = BY_NAME[name], results[name]
    ref = reference(config, slices=world_size)
    tol = tolerance(config)
    param_diffs = _compare(result["params"], ref["params"], "params")
    grad_diffs = _compare(result["grads"], ref["grads"], "last grads")
    worst = max(param_diffs, key=param_diffs.get)
    assert param_diffs[worst] <= tol, f"ws{world_size} {name}: {worst} differs by {param_diffs[worst]:.3g}"
    worst = max(grad_diffs, key=grad_diffs.get)
    assert grad_diffs[worst] <= tol, f"ws{world_size} {name}: grad of {worst} differs by {grad_diffs[worst]:.3g}"
    for step, (got, want) in enumerate(zip(losses[name], ref["losses"], strict=True)):
        assert abs(got - want) <= tol * max(1.0, abs(want)), f"ws{world_size} {name}: step {step} loss {got} vs {want}"
    # The parameters really moved (a no-op training would match a no-op reference).
    initial = dict(build_model(config["model"]).named_parameters())
    moved = [n for n, p in result["params"].items() if not torch.equal(p, initial[n].detach())]
    assert moved, "no parameter changed"
    if config["set_to_none"]:
        # After each zero_grad(set_to_none=True) every trainable group's main-grad memory was
        # free (the next backward allocates it anew, so nothing stale can leak into it).
        freed, want = result["freed"], result["trainable_groups"]
        assert freed == want > 0, f"main-grad buffers freed after zero_grad(set_to_none=True): {freed} of {want}"


@pytest.mark.parametrize("name", [c["name"] for c in OURS])
def test_fp32_training_matches_full_batch_reference(runs, name: str) -> None:
    """Against the reference that runs every microbatch in one piece: within 1e-6 for the SGD
    family; AdamW normalizes each update by the gradient's magnitude, so where a gradient is
    near zero the fp32 rounding of a differently summed gradient shows (torch's FSDP2 differs
    from this reference by as much), hence a looser bound for it."""
    world_size, results, losses = runs
    config, result = BY_NAME[name], results[name]
    ref = reference(config, slices=1)
    tol = tolerance(config)
    diffs = _compare(result["params"], ref["params"], "params")
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= tol, f"ws{world_size} {name}: {worst} differs by {diffs[worst]:.3g}"
    for step, (got, want) in enumerate(zip(losses[name], ref["losses"], strict=True)):
        # relative: the tied model's loss is ~21
        assert abs(got - want) <= tol * max(1.0, abs(want)), f"{name} step {step}: loss {got}, want {want} (tol {tol})"


@pytest.mark.parametrize("name", [c["name"] for c in FSDP2])
def test_fp32_training_matches_torch_fsdp2(runs, name: str) -> None:
    world_size, results, losses = runs
    ours_name = name.removeprefix("fsdp2_")
    torch_result, ours = results[name], results[ours_name]
    diffs = _compare(ours["params"], torch_result["params"], "params vs FSDP2")
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= TOL, f"ws{world_size} {ours_name}: {worst} differs from FSDP2 by {diffs[worst]:.3g}"
    diffs = _compare(ours["grads"], torch_result["grads"], "grads vs FSDP2")
    worst = max(diffs, key=diffs.get)
    assert diffs[worst] <= TOL, f"ws{world_size} {ours_name}: grad {worst} differs from FSDP2 by {diffs[worst]:.3g}"
    for step, (got, want) in enumerate(zip(losses[ours_name], losses[name], strict=True)):
        assert abs(got - want) <= TOL * max(1.0, abs(want)), f"{ours_name} step {step}: loss {got}, FSDP2's {want}"
    # And torch's FSDP2 itself agrees with the reference, so the three agree.
    diffs = _compare(torch_result["params"], reference(BY_NAME[name], world_size)["params"], "FSDP2 vs reference")
    worst = max(diffs, key=diffs.get)
    tol = tolerance(BY_NAME[name])
    assert diffs[worst] <= tol, f"FSDP2 {name}: {worst} differs from the reference by {diffs[worst]:.3g} (tol {tol})"


def test_zero_grad_set_to_none_false_zeroes_in_place(runs) -> None:
    _, results, _ = runs
    for name in ("momentum_mb3_keep_grads", "adamw_mb3_sync_last_keep_grads"):
        result = results[name]
        got = result["grads_not_views"]
        assert got == [], f"{name}: .grad of {got} no longer views of the main-grad buffer"
        got = result["main_grads_nonzero"]
        assert got == {}, f"{name}: main-grad buffers not zeroed (nonzero elements per group): {got}"


def test_tied_embedding_and_head_stay_one_parameter(runs) -> None:
    _, results, _ = runs
    params = results["tied_adamw_mb1"]["params"]
    # named_parameters() deduplicates the tied weight exactly as on the unwrapped model.
    assert "head.weight" not in params and "embed.weight" in params, f"parameter names: {list(params)}"
    want = list(reference(BY_NAME["tied_adamw_mb1"], 1)["params"])
    assert list(params) == want, f"parameter names: got {list(params)}, want the unwrapped model's {want}"


def test_frozen_parameters_get_no_grad_and_do_not_move(runs) -> None:
    _, results, _ = runs
    result = results["frozen_momentum_mb1"]
    initial = dict(build_model("frozen").named_parameters())
    frozen = [n for n, p in initial.items() if not p.requires_grad]
    assert frozen, "the frozen variant has no frozen parameter"
    for name in frozen:
        assert result["grads"][name] is None, f"{name}: got grad {result['grads'][name]}, want None"
        diff = difference(result["params"][name], initial[name].detach())
        assert diff is None, f"{name} (frozen) moved: {diff}"


def test_unused_parameters_keep_none_grads_and_do_not_move(runs) -> None:
    """A parameter no rank used keeps a ``None`` grad, as in the reference (its main-grad region
    is zeros, but no view is installed), and the optimizer leaves it unchanged."""
    _, results, _ = runs
    result = results["unused_sgd_mb3"]
    initial = dict(build_model("unused").named_parameters())
    for name in ("unused", "blocks.1.unused"):
        assert result["grads"][name] is None, f"{name}: got grad {result['grads'][name]}, want None"
        diff = difference(result["params"][name], initial[name].detach())
        assert diff is None, f"{name} (unused) moved: {diff}"
