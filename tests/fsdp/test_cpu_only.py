"""The CPU (gloo) path never touches ``torch.cuda``.

During ``fully_shard`` (mesh built from the default group), bf16 training with hand-stepped main
weights and refreshes, ``get_model_state_dict``, ``dcp.save``/``dcp.load`` and
``set_model_state_dict``, every ``torch.cuda`` entry point raises; ``is_available``, which
torch's own DTensor and DeviceMesh code query on CPU, raises only when fsdp_patch calls it.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from tests.fsdp.sharded_views import world
from tests.fsdp.test_checkpoint import eval_loss
from tests.fsdp.test_mixed_precision import _hand_sgd
from tests.fsdp.transformer_variants import MICROBATCH
from tests.models import lm_loss, make_batches, make_model, rank_slice


@contextmanager
def forbid_cuda() -> Iterator[list[str]]:
    """Makes every ``torch.cuda`` entry point raise; ``is_available`` (which torch's own DTensor
    and DeviceMesh code query on CPU) raises only when ``fsdp_patch`` calls it directly."""
    import torch.cuda as tc

    names = [
        "current_device",
        "device_count",
        "set_device",
        "synchronize",
        "current_stream",
        "default_stream",
        "stream",
        "Stream",
        "Event",
        "_lazy_init",
        "init",
        "get_device_name",
        "get_device_properties",
        "get_device_capability",
        "mem_get_info",
        "memory_allocated",
        "max_memory_allocated",
        "memory_reserved",
        "empty_cache",
        "manual_seed",
        "manual_seed_all",
        "get_rng_state",
        "set_rng_state",
        "is_bf16_supported",
        "device",
        "nvtx",
    ]
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
            guard = {"raised": False, "touched": list(touched)}
        except RuntimeError:
            guard = {"raised": True, "touched": list(touched)}
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
        "guard": guard,
        "device_types": device_types,
        "devices": sorted(devices),
        "loss": loss.item(),
        "cuda_initialized": torch.cuda.is_initialized(),
    }


def test_cpu_path_never_touches_torch_cuda(run_once, tmp_path) -> None:
    per_rank = run_once(2, cpu_only_run, str(tmp_path / "ckpt"))
    for facts in per_rank:
        want_guard = {"raised": True, "touched": ["current_device"]}
        assert facts["guard"] == want_guard, (
            f"the torch.cuda guard on a direct call: {facts['guard']}, want {want_guard}"
        )
        assert facts["touched"] == [], f"torch.cuda used: {facts['touched']}"
        assert facts["device_types"] == ["cpu"], f"mesh device types {facts['device_types']}"
        assert facts["devices"] == ["cpu"], f"buffer devices {facts['devices']}"
        assert math.isfinite(facts["loss"]), f"loss after the checkpoint round trip: {facts['loss']}"
        assert facts["cuda_initialized"] is False, f"torch.cuda.is_initialized(): {facts['cuda_initialized']}"
