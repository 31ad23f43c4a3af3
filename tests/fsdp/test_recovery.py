"""Recovery from an exception that aborts a forward or a backward.

Autograd drops queued callbacks when a backward raises; before this was handled, a failed
backward left every later backward without its final callback (no grads installed, the root
left unsharded) and partly reduced grads could leak into the next iteration; a failed forward
left the unsharded parameters registered in the modules (so ``zero_grad`` and ``state_dict``
saw the wrong tensors). Now a failed forward is undone as the exception passes each unit, the
root's next forward resets an aborted backward, and ``reset_iter_state()`` resets explicitly (as
FSDP2's method of that name). The next iteration then gives the grads of a clean one.
"""

from __future__ import annotations

import pytest

from tests.fsdp import rank_fns


@pytest.mark.parametrize("case", ["backward_auto", "backward_explicit", "forward_auto", "forward_explicit"])
def test_iteration_after_an_exception_matches_a_clean_one(run_once, case: str) -> None:
    for facts in run_once(2, rank_fns.recovery_run):
        outcome = facts[case]
        assert outcome["raised"]
        assert outcome["max_abs_err"] <= 1e-6, outcome
        assert set(outcome["after_backward"].values()) == {0}, outcome["after_backward"]
        if case.endswith("explicit"):
            assert set(outcome["after_reset"].values()) == {0}
            assert outcome["params_sharded_after_reset"]
        if case == "backward_explicit":
            got = outcome["grads_none_after_reset"]
            assert got and all(n.startswith("blocks.1.") for n in got), f"grads None after reset: {got}"
            want = sum(n.startswith("blocks.1.") for n in outcome["param_names"])
            assert len(got) == want, f"{len(got)} of blocks.1's {want} grads are None after reset: {got}"
