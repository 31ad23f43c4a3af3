"""What the core reads of torch and changes in it, at the bottom of the core.

- :mod:`.torch_compat`: what differs between the supported torch releases, read by feature;
- :mod:`.fsdp2`: torch FSDP2's parameter groups, seen from an optimizer's parameters;
- :mod:`.scoped_patch`: an attribute of torch replaced while some objects live, restored exactly.

Imports nothing of fsdp_patch but these (``tests/test_core_layers.py``).
"""
