"""The compat suite's forkserver: one server process that activated cloudckpt and
imported the frameworks once (framework_workers.py), from which each check forks, so a
child runs the frameworks' own code, bound, without paying for the imports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from knobs import start_forkserver  # tests/torture, on sys.path through conftest.py

HERE = Path(__file__).resolve().parent
TORTURE = HERE.parent / "torture"
ROLL_SRC = HERE.parents[2] / "shared" / "peers" / "roll" / "src"



def forkserver() -> Any:
    """The forkserver context (started once per process; later calls reuse it)."""
    return start_forkserver(["framework_workers"],
                            [str(HERE), str(TORTURE), str(HERE.parent), str(ROLL_SRC)])


def in_child(name: str, *args: object) -> None:
    """Run ``framework_workers.<name>`` in a forked child. The workers module is never
    imported by the test process: it activates cloudckpt and drops the peers' RLinf from
    sys.path, which the other compat tests of that process need."""
    import framework_workers

    getattr(framework_workers, name)(*args)


def in_node(host: str | None, name: str, *args: object) -> None:
    """:func:`in_child` as pid 1 of a new pid namespace called ``host`` (None: here), as a
    relaunched job on another node runs (see cloudckpt_testkit.nodes)."""
    if host is not None:
        from cloudckpt_testkit.nodes import enter_node

        enter_node(host)
    in_child(name, *args)


def run_child(forks: Any, name: str, *args: object, timeout: float = 300) -> int | None:
    """``in_child(name, *args)`` in a forked child, waited for; its exit code."""
    proc = forks.Process(target=in_child, args=(name, *args))
    proc.start()
    proc.join(timeout)
    if proc.exitcode is None:
        proc.kill()
        proc.join(10)
    return proc.exitcode
