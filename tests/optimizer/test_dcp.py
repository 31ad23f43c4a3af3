"""DCP round trip of model and adapted-optimizer state across world sizes.

On 2 ranks: train 3 steps, ``dcp.save`` the model (``get_model_state_dict``) and optimizer
(``get_optimizer_state_dict``), then keep training 3 more steps (the uninterrupted run).
At world sizes 1, 2 and 4: build a differently initialized model, adapt its optimizer,
``init_optimizer_state``, take the state-dict templates, ``dcp.load``,
``set_model_state_dict``/``set_optimizer_state_dict``. The full (gathered) model and
optimizer tensors then equal the saved ones bitwise, the compute copy follows the loaded
weights, and on 2 ranks 3 more steps equal the uninterrupted run bitwise (which also shows
that the state ``init_optimizer_state`` made is kept once a load filled it).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from fsdp_patch.optimizer import fully_shard_optimizer, init_optimizer_state
from tests.optimizer.support import OPTIMIZERS, backward, batches, build_model, compute_is_fresh, env, full, same

SAVE_AT = 3
TOTAL = 6


def _make(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = build_model(seed=seed)
    opt = OPTIMIZERS["adamw"](model.parameters())
    with env(FSDP_PATCH_TELEMETRY=None):
        fully_shard_optimizer(opt)
    return model, opt


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, data: list[torch.Tensor]) -> None:
    for tokens in data:
        backward(model, tokens)
        opt.step()
        opt.zero_grad()


def _full_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Model and optimizer state dicts with every tensor gathered whole (collective)."""
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, opt)
    out: dict[str, Any] = {f"model.{k}": full(v) for k, v in sorted(msd.items())}
    for fqn in sorted(osd["state"]):
        for key, value in sorted(osd["state"][fqn].items()):
            out[f"optim.{fqn}.{key}"] = full(value) if isinstance(value, torch.Tensor) else value
    out["optim.param_groups"] = [
        {k: (sorted(v) if k == "params" else v) for k, v in group.items()} for group in osd["param_groups"]
    ]
    return out


def _save(path: str) -> dict[str, Any]:
    data = batches(TOTAL)
    model, opt = _make(seed=0)
    _train(model, opt, data[:SAVE_AT])
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    saved = _full_state(model, opt)
    _train(model, opt, data[SAVE_AT:])
    return {"saved": saved, "uninterrupted": _full_state(model, opt)}


def _load(path: str, continue_training: bool) -> dict[str, Any]:
    data = batches(TOTAL)
    model, opt = _make(seed=123)  # other weights: the load has to overwrite them
    init_optimizer_state(opt)
    with torch.no_grad():
        model(data[0][:1, :-1])  # a forward before the load: the compute copy is current
    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, opt)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
    set_model_state_dict(model, msd)
    set_optimizer_state_dict(model, opt, osd)
    loaded = _full_state(model, opt)
    with torch.no_grad():
        model(data[0][:1, :-1])  # a forward gathers the compute copy
    out: dict[str, Any] = {"loaded": loaded, "compute_fresh_after_forward": compute_is_fresh(model)}
    if continue_training:
        _train(model, opt, data[SAVE_AT:])
        out["continued"] = _full_state(model, opt)
    return out


def _mismatches(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    if a.keys() != b.keys():
        return [f"keys differ: {sorted(a.keys() ^ b.keys())[:5]}"]
    return [k for k in a if not same(a[k], b[k])]


@pytest.fixture(scope="module")
def checkpoint(dist_pool: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[str, Any]]:
    path = str(tmp_path_factory.mktemp("dcp") / "step3")
    results = dist_pool(2).run(_save, path)
    return path, results[0]


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_dcp_round_trip(dist_pool: Any, checkpoint: tuple[str, dict[str, Any]], world_size: int) -> None:
    path, saved = checkpoint
    results = dist_pool(world_size).run(_load, path, world_size == 2)
    for rank, result in enumerate(results):
        assert not _mismatches(result["loaded"], saved["saved"]), (
            f"world size {world_size}, rank {rank}: loaded != saved for {_mismatches(result['loaded'], saved['saved'])}"
        )
        assert result["compute_fresh_after_forward"], f"rank {rank}: the compute copy did not follow the load"
        if world_size == 2:
            diff = _mismatches(result["continued"], saved["uninterrupted"])
            assert not diff, f"rank {rank}: resumed run != uninterrupted run for {diff}"
    # The training did move things, so the comparisons above are not vacuous.
    assert _mismatches(saved["saved"], saved["uninterrupted"])
