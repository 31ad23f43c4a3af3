"""Which model a ``clip_grad_norm_``'s parameters belong to (model_parameters.ModelParameters)."""

from __future__ import annotations

import torch
from fsdp_patch.telemetry.instrumentation.model_parameters import ModelParameters
from torch import nn


def test_a_models_parameters_are_told_from_anothers() -> None:
    model, other = nn.Linear(4, 4), nn.Linear(4, 4)
    known = ModelParameters(lambda: model)
    got = [known.hold_any(list(m.parameters())) for m in (model, other, model, other)]
    assert got == [True, False, True, False], f"the model's, another's, the model's, another's: got {got}"
    assert not known.hold_any([]), "nothing clipped is no model's"


def test_a_parameter_replaced_by_a_load_is_still_the_models() -> None:
    model = nn.Linear(4, 4)
    known = ModelParameters(lambda: model)
    assert known.hold_any([model.weight])
    model.weight = nn.Parameter(torch.zeros(4, 4))  # load_state_dict(assign=True) makes new ones
    got = known.hold_any([model.weight])
    assert got, "a new parameter of the model: want it found (the parameters read again), got not found"


def test_a_model_gone_holds_nothing() -> None:
    other = nn.Linear(4, 4)
    known = ModelParameters(lambda: None)
    got = known.hold_any(list(other.parameters()))
    assert not got, f"a model collected: want no parameter its own, got {got}"
