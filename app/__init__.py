"""The application layer: the ``fsdp-patch`` command (``cli/``) and its main job, the demo
(``demo/``). Installed as ``fsdp_patch.app`` (the package-dir mapping in pyproject.toml), above
both the core (``fsdp_patch``) and ``fsdp_patch.telemetry``: it imports them, neither imports it.
"""
