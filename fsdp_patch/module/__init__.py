"""The module layer: what ``fully_shard`` makes of a module, and what a sharded module does.

- :mod:`.shard_module`: ``fully_shard`` itself (checks, parameter groups, the class swap) and the
  registry of units; :mod:`.fsdp_module`: ``FSDPModule``, the class a sharded module becomes;
- :mod:`.unit`, :mod:`.root_context`, :mod:`.training_state`: one unit through an iteration (its
  hooks and states) and what a root shares with the units under it;
- what a sharded module keeps working: :mod:`.conversion` (``Module._apply``),
  :mod:`.state_dict_hooks`, :mod:`.forward_methods` (methods other than ``forward``),
  :mod:`.output_tensors` (any output structure), :mod:`.compile_boundary` (``torch.compile``);
- what ``fully_shard`` installs into torch for its groups: :mod:`.dcp_optimizer_state` (DCP's
  optimizer state dict) and :mod:`.grad_scaler_hint` (``GradScaler`` with fp16 main grads);
- :mod:`.model_units`: the sharded models (``fully_shard``'s or FSDP2's) above an optimizer's parameters.

Above :mod:`fsdp_patch.sharding` and :mod:`fsdp_patch.torch_interop`; the optimizer adapter
(:mod:`fsdp_patch.adapter`) is imported only lazily, by DCP's state-dict hook
(``tests/test_core_layers.py``).
"""
