"""The CPU (gloo) path never touches ``torch.cuda``.

During ``fully_shard`` (mesh built from the default group), bf16 training with hand-stepped main
weights and refreshes, ``get_model_state_dict``, ``dcp.save``/``dcp.load`` and
``set_model_state_dict``, every ``torch.cuda`` entry point raises; ``is_available``, which
torch's own DTensor and DeviceMesh code query on CPU, raises only when fsdp_patch calls it.
"""

from __future__ import annotations

from tests.fsdp import rank_fns


def test_cpu_path_never_touches_torch_cuda(run_once, tmp_path) -> None:
    per_rank = run_once(2, rank_fns.cpu_only_run, str(tmp_path / "ckpt"))
    for facts in per_rank:
        assert facts["guard_works"], "the torch.cuda guard did not catch a direct call"
        assert facts["touched"] == [], f"torch.cuda used: {facts['touched']}"
        assert facts["device_types"] == ["cpu"]
        assert facts["devices"] == ["cpu"]
        assert facts["finite"]
        assert not facts["cuda_initialized"]
