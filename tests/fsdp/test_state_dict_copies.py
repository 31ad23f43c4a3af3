"""State dicts of a sharded model that torch can save, deep-copy and pickle, and loads that reach
the weights the next forward computes with.

A model trains 2 steps; its state dict is copied (``torch.save`` + ``torch.load``,
``copy.deepcopy``, ``pickle``) or saved with DCP; it trains 2 more steps, which must not change
the copy; a fresh model (another seed) then loads the copy (``load_state_dict``, DCP's
``set_model_state_dict``, or a ``dcp.load`` in place into ``get_model_state_dict``'s tensors)
and trains 2 steps. Checked: the copy holds the values of its moment, and the loaded model
trains as the unsharded model does (fp32, within 1e-5, FSDP2 alongside as the control) or as
FSDP2 does (bf16 compute, bitwise, both compute-copy lifetimes). 2 ranks, and 4, where the head's
5 rows split (2, 2, 1, 0).
"""

from __future__ import annotations

import copy
import io
import os
import pickle
import tempfile
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from tests.fsdp.parity import (
    adapt,
    assert_equal,
    assert_parity,
    batches,
    build,
    full,
    full_params,
    loss_of,
    run_contenders,
)

COPIES = ("torch_save", "deepcopy", "pickle", "dcp_set", "dcp_inplace")


def _steps(model: nn.Module, impl: str, precision: str, data: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    optimizer = adapt(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), impl, precision)
    for x, y in data:
        loss_of(model, impl, precision, x, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def _copy(model: nn.Module, how: str, directory: str) -> Any:
    """The copy of ``model``'s state ``how`` makes (for DCP: the checkpoint's directory)."""
    if how == "torch_save":
        buffer = io.BytesIO()
        torch.save(model.state_dict(), buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)
    if how == "deepcopy":
        return copy.deepcopy(model.state_dict())
    if how == "pickle":
        return pickle.loads(pickle.dumps(model.state_dict()))
    dcp.save(get_model_state_dict(model), checkpoint_id=directory)
    return directory


def _load(model: nn.Module, how: str, saved: Any) -> None:
    if how in ("torch_save", "deepcopy", "pickle"):
        model.load_state_dict(saved)
    elif how == "dcp_set":
        state = get_model_state_dict(model)
        dcp.load(state, checkpoint_id=saved)
        set_model_state_dict(model, state)
    else:  # dcp_inplace: into the tensors get_model_state_dict returned, nothing else
        dcp.load(get_model_state_dict(model), checkpoint_id=saved)


def _train(impl: str, how: str, precision: str, root: str) -> dict[str, Any]:
    data = batches(6)
    model = build(impl, precision)
    _steps(model, impl, precision, data[:2])
    at_copy = full_params(model)
    directory = os.path.join(root, impl)
    saved = _copy(model, how, directory)
    _steps(model, impl, precision, data[2:4])
    if how in ("torch_save", "deepcopy", "pickle"):
        copied = {k: full(v).float() for k, v in saved.items()}  # type: ignore[union-attr]
        assert_equal(copied, at_copy, f"{how}/{impl}: the copy against the weights when it was made")
    fresh = build(impl, precision, seed=3)
    _load(fresh, how, saved)
    loaded = full_params(fresh)
    assert_equal(loaded, at_copy, f"{how}/{impl}: the loaded weights against those copied")
    _steps(fresh, impl, precision, data[4:])
    return {"params": full_params(fresh)}


def copies_run(how: str, precision: str) -> None:
    # DCP needs one directory that every rank names alike: rank 0's, broadcast.
    holder: list[Any] = [tempfile.mkdtemp(prefix="fsdp-sd-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(holder, src=0)
    results = run_contenders(lambda impl: _train(impl, how, precision, holder[0]), precision)
    assert_parity(results, precision, how)


@pytest.mark.parametrize("world_size", (2, 4))
@pytest.mark.parametrize("precision", ("bf16", "fp32"))
@pytest.mark.parametrize("how", COPIES)
def test_state_dict_copies_and_loads(dist_pool: Any, how: str, precision: str, world_size: int) -> None:
    dist_pool(world_size).run(copies_run, how, precision)
