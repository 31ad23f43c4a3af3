"""State dicts and torch.distributed.checkpoint with no pre-processing, across world sizes.

A model trained at world size 2 is saved with ``get_model_state_dict`` + ``dcp.save`` and loaded
with ``dcp.load`` + ``set_model_state_dict`` into differently initialized models at world sizes
1 and 4 (and into a bf16-compute model at 4): full tensors are bitwise equal and forward sees the
loaded weights. ``model.state_dict()``/``load_state_dict`` and DCP's full state dicts work too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tests.fsdp.sharded_views import difference, full_params, param_differences, rank0, stale_compute_copies, world
from tests.fsdp.transformer_variants import MICROBATCH, build_model
from tests.models import lm_loss, make_batches, make_model, rank_slice


def eval_loss(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return lm_loss(model, make_batches(1, batch=4, seed=9)[0]).detach()


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("dcp") / "ws2")


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
        "dcp_values_not_dtensor": sorted(k for k, v in state.items() if not isinstance(v, DTensor)),
        "state_dict_keys": sorted(plain),
        "state_dict_values_not_dtensor": sorted(k for k, v in plain.items() if not isinstance(v, DTensor)),
        "unwrapped_keys": sorted(build_model("plain").state_dict()),
        "full_sd_dtensors": sorted(k for k in plain if isinstance(full_sd[k], DTensor)),
        "full_sd_vs_plain": {
            k: diff for k in plain if (diff := difference(full_sd[k], plain[k].full_tensor())) is not None
        },
    }


@pytest.fixture(scope="module")
def saved(run_once, checkpoint_dir: str) -> list[dict]:
    return run_once(2, checkpoint_save, checkpoint_dir)


def test_state_dicts_have_unwrapped_fqns_and_dtensor_values(saved) -> None:
    for facts in saved:
        assert facts["state_dict_keys"] == facts["unwrapped_keys"]
        assert facts["dcp_keys"] == facts["unwrapped_keys"]
        not_dtensor = facts["state_dict_values_not_dtensor"]
        assert not_dtensor == [], f"state_dict() values that are not DTensors: {not_dtensor}"
        not_dtensor = facts["dcp_values_not_dtensor"]
        assert not_dtensor == [], f"get_model_state_dict() values that are not DTensors: {not_dtensor}"
        dtensors = facts["full_sd_dtensors"]
        assert dtensors == [], f"full state dict values that are still DTensors: {dtensors}"
        diffs = facts["full_sd_vs_plain"]
        assert diffs == {}, f"full state dict values differ from the gathered state_dict(): {diffs}"


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
        "unchanged": sorted(n for n, p in full_params(model).items() if torch.equal(before[n], p)),
        "param_count": len(before),
        "loss": eval_loss(model),
        "main_dtypes": sorted({str(g.main_weight.dtype) for g in parameter_groups(model)}),
        "stale_compute_copies": stale_compute_copies(parameter_groups(model)),
    }
    if not bf16:
        # model.state_dict()/load_state_dict round trip, and a full (unsharded) state dict set
        # through DCP's helpers, both without pre-processing.
        fresh = shard_model(make_model(seed=6))
        fresh.load_state_dict(model.state_dict())
        facts["load_state_dict_diffs"] = param_differences(full_params(fresh), full_params(model))
        facts["load_state_dict_loss"] = eval_loss(fresh)
        fresh = shard_model(make_model(seed=7))
        full_sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        set_model_state_dict(fresh, full_sd, options=StateDictOptions(full_state_dict=True))
        facts["full_sd_diffs"] = param_differences(full_params(fresh), full_params(model))
    return facts


@pytest.mark.parametrize(("world_size", "bf16"), [(1, False), (4, False), (4, True)], ids=["ws1", "ws4", "ws4-bf16"])
def test_dcp_checkpoint_loads_at_another_world_size(
    run_once, saved, checkpoint_dir: str, world_size: int, bf16: bool
) -> None:
    assert Path(checkpoint_dir, ".metadata").exists()
    loaded = run_once(world_size, checkpoint_load, checkpoint_dir, bf16)
    expected = saved[0]["params"]
    got = loaded[0]["params"]
    assert list(got) == list(expected), f"parameter names: got {list(got)}, want {list(expected)}"
    for name in expected:
        dtypes = (got[name].dtype, expected[name].dtype)
        assert dtypes == (torch.float32, torch.float32), f"{name}: loaded and saved dtypes {dtypes}, want fp32"
    diffs = param_differences(got, expected)
    assert diffs == {}, f"parameters differ after loading at ws{world_size}: {diffs}"
    for facts in loaded:
        unchanged = facts["unchanged"]
        assert len(unchanged) < facts["param_count"], (
            f"the fresh model already had the checkpoint's weights: {unchanged}"
        )
        assert facts["main_dtypes"] == ["torch.float32"], f"main weights in {facts['main_dtypes']}"
        # Forward uses the loaded weights (the compute copy followed the load).
        stale = facts["stale_compute_copies"]
        assert stale == {}, f"compute copies not the loaded main weights cast: {stale}"
        want_loss = saved[0]["loss"].item()
        if bf16:
            got_loss = facts["loss"].item()
            assert abs(got_loss - want_loss) < 0.05, f"loss {got_loss} after a bf16 load, want {want_loss} +- 0.05"
        else:
            diff = difference(facts["loss"], saved[0]["loss"])
            assert diff is None, f"loss after loading: {diff}"
            diffs = facts["load_state_dict_diffs"]
            assert diffs == {}, f"load_state_dict(state_dict()) round trip differs: {diffs}"
            diff = difference(facts["load_state_dict_loss"], saved[0]["loss"])
            assert diff is None, f"loss after load_state_dict: {diff}"
            diffs = facts["full_sd_diffs"]
            assert diffs == {}, f"a full state dict set through DCP's helpers differs: {diffs}"
