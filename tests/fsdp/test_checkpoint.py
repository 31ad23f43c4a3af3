"""State dicts and torch.distributed.checkpoint with no pre-processing, across world sizes.

A model trained at world size 2 is saved with ``get_model_state_dict`` + ``dcp.save`` and loaded
with ``dcp.load`` + ``set_model_state_dict`` into differently initialized models at world sizes
1 and 4 (and into a bf16-compute model at 4): full tensors are bitwise equal and forward sees the
loaded weights. ``model.state_dict()``/``load_state_dict`` and DCP's full state dicts work too.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.fsdp import rank_fns


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(tmp_path_factory.mktemp("dcp") / "ws2")


@pytest.fixture(scope="module")
def saved(run_once, checkpoint_dir: str) -> list[dict]:
    return run_once(2, rank_fns.checkpoint_save, checkpoint_dir)


def test_state_dicts_have_unwrapped_fqns_and_dtensor_values(saved) -> None:
    for facts in saved:
        assert facts["state_dict_keys"] == facts["unwrapped_keys"]
        assert facts["dcp_keys"] == facts["unwrapped_keys"]
        assert facts["state_dict_values_dtensor"] and facts["dcp_values_dtensor"]
        assert facts["full_sd_plain_equal"]


@pytest.mark.parametrize(("world_size", "bf16"), [(1, False), (4, False), (4, True)], ids=["ws1", "ws4", "ws4-bf16"])
def test_dcp_checkpoint_loads_at_another_world_size(
    run_once, saved, checkpoint_dir: str, world_size: int, bf16: bool
) -> None:
    assert Path(checkpoint_dir, ".metadata").exists()
    loaded = run_once(world_size, rank_fns.checkpoint_load, checkpoint_dir, bf16)
    expected = saved[0]["params"]
    got = loaded[0]["params"]
    assert list(got) == list(expected)
    for name in expected:
        assert got[name].dtype == expected[name].dtype == torch.float32, name
        assert torch.equal(got[name], expected[name]), f"{name} differs after loading at ws{world_size}"
    for facts in loaded:
        assert facts["changed"], "the fresh model already had the checkpoint's weights"
        assert facts["main_dtypes"] == ["torch.float32"]
        # Forward uses the loaded weights (the compute copy followed the load).
        assert facts["compute_equals_cast"]
        if bf16:
            assert abs(facts["loss"].item() - saved[0]["loss"].item()) < 0.05
        else:
            assert torch.equal(facts["loss"], saved[0]["loss"])
            assert facts["load_state_dict_equal"]
            assert torch.equal(facts["load_state_dict_loss"], saved[0]["loss"])
            assert facts["full_sd_equal"]
