"""Puts fsdp_patch's start-up hook, ``fsdp_patch_startup.pth``, beside the installed packages.

Everything else is declared in ``pyproject.toml``. A ``.pth`` file must lie at the top of
site-packages, outside any package, where neither ``package-data`` nor ``data-files`` reach: the
build copies it into the wheel's top level, for a regular wheel (``build_py``) and for an editable
one (``editable_wheel``, whose wheel holds only the link to the sources otherwise). What the hook
does: ``startup/__init__.py``.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

HOOK = Path(__file__).resolve().parent / "startup" / "fsdp_patch_startup.pth"


class BuildWithStartupHook(build_py):
    def run(self) -> None:
        super().run()
        if not self.editable_mode:
            self.copy_file(str(HOOK), str(Path(self.build_lib, HOOK.name)))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs.append(str(Path(self.build_lib, HOOK.name)))
        return outputs


class EditableWithStartupHook(editable_wheel):
    # `_run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)` fills the folder whose
    # files the editable wheel holds besides its link to the sources (setuptools >= 64).
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):  # type: ignore[no-untyped-def]
        result = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copy2(HOOK, Path(unpacked_wheel, HOOK.name))
        return result


setup(cmdclass={"build_py": BuildWithStartupHook, "editable_wheel": EditableWithStartupHook})
