"""What a training script cannot do with a sharded model, and its end: conversions that would change
the sharded parameters, deep copies and pickling are refused naming the parameter and the
alternative (FSDP2 refuses deepcopy too), a replacement of the wrong shape is refused at the next
forward; a trained model, its groups and its adapted optimizer are freed once the script drops them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from tests.fsdp.pattern_models import build, data, mse, rows, sgd
from tests.fsdp.pattern_training import BF16, WORLD_SIZE, raises
from tests.fsdp.sharded_views import full_params, param_differences, rank0, world


def refusals_run() -> dict[str, Any]:
    """What ``fully_shard`` refuses, with FSDP2's answer to the same call as the control."""
    import pickle

    from torch.optim.swa_utils import AveragedModel

    out: dict[str, Any] = {}
    for impl in ("ours", "fsdp2"):
        model = build(impl)
        objects = {n: p for n, p in model.named_parameters()}
        values = full_params(model)
        facts = {
            "to_bf16": raises(lambda: model.to(torch.bfloat16)),
            "half": raises(lambda: model.half()),
            "deepcopy": raises(lambda: copy.deepcopy(model)),
            "averaged_model": raises(lambda: AveragedModel(model)),
            "pickle": raises(lambda: pickle.dumps(model)),
        }
        if impl == "ours":
            facts["replaced"] = sorted(n for n, p in model.named_parameters() if objects.get(n) is not p) + sorted(
                set(objects) - dict(model.named_parameters()).keys()
            )
            facts["changed"] = param_differences(full_params(model), values)
            facts["dtypes_after"] = sorted({str(p.dtype) for p in model.parameters()})
            # A replacement of the wrong shape: refused at the next forward, the module keeps
            # its sharded parameter, and the forward after that works.
            head_weight = model.head.weight
            model.head.weight = nn.Parameter(torch.zeros(2, 2))
            x = data()[0][0][:2]
            facts["bad_replacement"] = raises(lambda: model(x))
            facts["head_weight_after_refusal"] = (
                None if model.head.weight is head_weight else f"a {tuple(model.head.weight.shape)} tensor"
            )
            facts["forward_after"] = raises(lambda: model(x))
        out[impl] = facts
    return rank0(out)


def test_refusals_name_the_parameter_and_the_alternative(run_once: Any) -> None:
    """Conversions that would change the sharded parameters, deep copies (``AveragedModel``
    makes one) and pickling are refused before anything changes; FSDP2 refuses deepcopy too."""
    results = run_once(WORLD_SIZE, refusals_run)[0]
    ours, control = results["ours"], results["fsdp2"]
    for call in ("to_bf16", "half"):
        message = ours[call] or ""
        for needle in ("ValueError", "inp.weight", "torch.float32", "MixedPrecisionPolicy", "before fully_shard"):
            assert needle in message, f"{call}: {needle!r} missing from {message!r}"
    assert ours["replaced"] == [], f"a refused conversion replaced the parameters {ours['replaced']}"
    assert ours["changed"] == {}, f"a refused conversion changed the parameters: {ours['changed']}"
    assert ours["dtypes_after"] == ["torch.float32"], ours["dtypes_after"]
    for call in ("deepcopy", "averaged_model", "pickle"):
        message = ours[call] or ""
        for needle in ("TypeError", "fully_shard", "get_model_state_dict", "AveragedModel"):
            assert needle in message, f"{call}: {needle!r} missing from {message!r}"
    assert "deepcopy" in (control["deepcopy"] or ""), f"FSDP2's deepcopy: {control['deepcopy']!r}"
    bad = ours["bad_replacement"] or ""
    for needle in ("ValueError", "head.weight", "(2, 2)", "(5, 12)"):
        assert needle in bad, f"bad replacement: {needle!r} missing from {bad!r}"
    left = ours["head_weight_after_refusal"]
    assert left is None, f"the refused replacement stayed in the module: head.weight is {left}"
    assert ours["forward_after"] is None, f"the forward after a refused replacement failed: {ours['forward_after']}"


def freed_run() -> dict[str, Any]:
    """Whether a trained sharded model, its groups and its adapted optimizer are freed once the
    script drops them (the group registry once kept every sharded model alive)."""
    import gc
    import weakref

    from fsdp_patch import parameter_groups
    from fsdp_patch.optimizer import fully_shard_optimizer

    rank, world_size = world()
    model = build("ours", dtype=BF16)
    optimizer = sgd(model.parameters())
    fully_shard_optimizer(optimizer)
    x, y = data()[0]
    mse(model(rows(x, rank, world_size).to(BF16)), rows(y, rank, world_size)).backward()
    optimizer.step()
    refs = {"model": weakref.ref(model), "optimizer": weakref.ref(optimizer)}
    refs.update({f"group{i}": weakref.ref(g) for i, g in enumerate(parameter_groups(model))})
    del model, optimizer
    gc.collect()
    return {name: ref() is None for name, ref in refs.items()}


def test_sharded_model_and_adapted_optimizer_are_freed(run_once: Any) -> None:
    for facts in run_once(WORLD_SIZE, freed_run):
        alive = [name for name, freed in facts.items() if not freed]
        assert not alive, f"still alive after the last reference went: {alive}"
