"""The compatibility suite: the frameworks' own classes drive cloudckpt.

AReaL and verl come from PyPI (``make compat`` installs them); ROLL's and RLinf's upstream
checkpoint code is read from ``../shared/peers/*/src``, put first on ``sys.path`` here.
A missing piece fails the run with what to do; nothing is skipped.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

PEERS = Path(__file__).resolve().parents[3] / "shared" / "peers"


def _require() -> None:
    missing = [str(PEERS / f"{name}/src") for name in ("roll", "rlinf")
               if not (PEERS / f"{name}/src").is_dir()]
    if missing:
        raise pytest.UsageError(f"the frameworks' code is missing: {missing} "
                                "(expected ../shared/peers beside the project)")
    for name, pin in (("areal", "areal==1.0.4"), ("verl", "verl==0.9.1")):
        if importlib.util.find_spec(name) is None:
            raise pytest.UsageError(f"{name} is not installed: run `make compat`, which "
                                    f"installs {pin} and tests/compat/requirements.txt")


_require()
# The torture's crash workers and knobs, shared with the frameworks' crash tests.
_torture = str(Path(__file__).resolve().parent.parent / "torture")
if _torture not in sys.path:
    sys.path.insert(0, _torture)
for _name in ("rlinf", "roll"):
    _src = str(PEERS / _name / "src")
    if _src not in sys.path:
        sys.path.insert(0, _src)


@pytest.fixture(scope="session")
def verl_sft_reference(tmp_path_factory) -> dict[int, list[dict]]:
    """verl's SFT handler saving four steps on local disk, never stopped: the run every
    verl SFT relaunch test compares with, made once a session (a whole job)."""
    from test_relaunch import node_disks, run_node, sft_reports, sft_saved, verl_sft_launch

    tmp = tmp_path_factory.mktemp("verl-sft-reference")
    with node_disks() as disks:
        launch, out = verl_sft_launch(tmp, disks, "reference", {
            "root": str(tmp / "ckpts"), "steps": [1, 2, 3, 4]}, "node-r")
        run_node(launch, tmp, {}, "reference")
    return sft_saved(sft_reports(out))
