"""Tests of the optimizer adapter, on gloo pools of 1, 2 and 4 CPU ranks.

- ``test_step_equivalence``: every optimizer of the list, telemetry off and a recording
  observer, bitwise equal to a hand-cast fp32 reference; compute copy refreshed; LBFGS with
  a closure on 2 ranks.
- ``test_schedulers``: every LR scheduler, created before or after the adaptation.
- ``test_composition``: step hooks, GradScaler, state_dict, the public path with telemetry on.
- ``test_composition_lifecycle``: deepcopy/pickle, idempotence, undo, lifetime.
- ``test_exception_safety``: failing updates and closures, and every way of carrying on.
- ``test_bad_input``: refused input changes nothing; no half-adapted optimizer.
- ``test_init_state``: ``init_optimizer_state`` neutrality, and torch's path using it.
- ``test_dcp``: DCP save on 2 ranks, load on 1, 2 and 4, resume bitwise.
- ``test_precision_aware``: no cast, bf16 grads reach the update, refresh still happens.
- ``test_fast_path``, ``test_fast_path_buffers``: the cached plan and cast views stay correct
  across changes between steps; the cast buffers' ownership and release.

Rank-side helpers (models, the recording observer, the hand-cast reference, bitwise
comparisons) are in ``support``; the fast-path tests' adapted/reference pair in ``fast_path_pairs``.
"""
