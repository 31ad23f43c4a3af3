"""Host copies: what telemetry reads on the host is known as such, and forgotten with the tensor."""

from __future__ import annotations

import gc

import pytest
import torch
from fsdp_patch.telemetry.diagnostics import host_copies
from fsdp_patch.telemetry.diagnostics.host_copies import HostCopy, is_host_copy


def test_host_tensors_are_ready_at_once_and_known_as_host_copies() -> None:
    values, other = torch.tensor([1.0, float("nan")]), torch.ones(2)
    copies = HostCopy([values, None])

    assert copies.ready(), "a copy of host tensors waits for nothing"
    got = copies.values()
    assert got[0] is values and got[1] is None, f"host tensors are read where they are; got {got}"
    assert is_host_copy(values) and not is_host_copy(other), "only what HostCopy holds is a host copy"


def test_a_host_copy_is_forgotten_with_its_tensor() -> None:
    values = torch.zeros(3)
    HostCopy([values])
    key = id(values)
    assert key in host_copies._COPIES, "HostCopy records the tensor it holds"
    del values
    gc.collect()
    assert key not in host_copies._COPIES, "the record outlived its tensor (a new tensor at that id would pass)"


def test_values_not_ready_are_refused_without_wait() -> None:
    class Pending:
        def query(self) -> bool:
            return False

        def synchronize(self) -> None:
            self.waited = True

    copies = HostCopy([torch.zeros(1)])
    copies._event = Pending()
    with pytest.raises(RuntimeError, match="not ready"):
        copies.values()
    copies.values(wait=True)
    assert copies._event.waited, "values(wait=True) waits for the copy's event"
