"""Every public name of torch's FSDP2 in this torch is in fsdp_patch and in the table of docs/fsdp2-api.md.

FSDP2's public names are those ``torch.distributed.fsdp`` exports from its ``_fully_shard``
package; its ``FSDPModule`` methods and ``fully_shard`` arguments are read from torch itself,
so that a torch release adding one fails here until it is implemented (or refused) and listed.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import torch.distributed.fsdp as torch_fsdp
import torch.distributed.fsdp._fully_shard as fsdp2_package

import fsdp_patch

API_PAGE = Path(__file__).resolve().parents[1] / "docs" / "fsdp2-api.md"


def _fsdp2_names() -> list[str]:
    # torch sets these objects' __module__ to torch.distributed.fsdp: FSDP2's are told apart by
    # being the objects its _fully_shard package holds (FSDP1's are not there).
    return sorted(
        name for name in torch_fsdp.__all__ if getattr(fsdp2_package, name, None) is getattr(torch_fsdp, name)
    )


def _fsdp2_methods() -> list[str]:
    return sorted(name for name, _ in inspect.getmembers(torch_fsdp.FSDPModule) if not name.startswith("_"))


def _fsdp2_arguments() -> list[str]:
    return list(inspect.signature(torch_fsdp.fully_shard).parameters)


def _api_table() -> str:
    # The page is the table and the lines that introduce it (which name FSDPModule itself).
    return API_PAGE.read_text(encoding="utf-8")


def test_fsdp2_names_are_exported() -> None:
    missing = [name for name in _fsdp2_names() if not hasattr(fsdp_patch, name)]
    assert missing == [], f"torch.distributed.fsdp exports {missing} of FSDP2, which fsdp_patch lacks"
    assert len(_fsdp2_names()) >= 7, f"found too few FSDP2 names to trust the filter: {_fsdp2_names()}"


def test_fsdp2_module_methods_exist() -> None:
    missing = [name for name in _fsdp2_methods() if not hasattr(fsdp_patch.FSDPModule, name)]
    assert missing == [], f"torch's FSDPModule has {missing}, which fsdp_patch.FSDPModule lacks"


def test_fully_shard_takes_every_fsdp2_argument() -> None:
    ours = inspect.signature(fsdp_patch.fully_shard).parameters
    missing = [name for name in _fsdp2_arguments() if name not in ours]
    assert missing == [], f"torch's fully_shard takes {missing}, which fsdp_patch.fully_shard lacks"


def test_the_api_page_table_lists_every_fsdp2_name_method_and_argument() -> None:
    table = _api_table()
    listed = set(re.findall(r"`(?:FSDPModule\.)?(\w+)", table))
    wanted = set(_fsdp2_names()) | set(_fsdp2_methods()) | {a for a in _fsdp2_arguments() if a != "module"}
    missing = sorted(wanted - listed)
    assert missing == [], f"docs/fsdp2-api.md's FSDP2 table does not list {missing}"
