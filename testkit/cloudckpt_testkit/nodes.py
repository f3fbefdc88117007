"""Another "node" for a command: a fresh pid namespace, its own hostname and local disk.

A job relaunched on a cluster comes back in a new container or on another node: the
crashed attempt's pids, hostname and local directories are gone or mean nothing there.
Relaunching a test's process in the same pid namespace hides exactly the bugs that
judge ownership by pid, so recovery tests launch each attempt through :func:`as_node`:
``unshare --pid --fork --mount-proc --uts`` (a new pid namespace with its own
``/proc``, and a hostname of its own), with ``TMPDIR`` and ``HOME`` on a directory of
that node. Needs root or unprivileged user namespaces; fails loudly without them.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import select
import shutil
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

# Set the node's hostname, then become the command (pid 1 of the new namespace is the
# shell; exec keeps it so, and SIGKILL of the unshare's child ends the whole node).
_ENTER = 'hostname "$0" && exec "$@"'


def as_node(command: Sequence[str], host: str) -> list[str]:
    """``command`` run as on a node called ``host``: a new pid namespace with its own
    ``/proc`` and its own hostname (and so no pid, host or namespace of the caller's)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        raise RuntimeError("unshare (util-linux) is not installed: recovery tests launch "
                           "each attempt in a new pid namespace with it")
    return [unshare, "--pid", "--fork", "--mount-proc", "--uts", "--kill-child",
            "sh", "-c", _ENTER, host, *command]


def node_env(base: Path, host: str, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a process on node ``host``: ``TMPDIR`` and ``HOME`` on a
    directory of its own below ``base`` (a node's local disk), over ``env``."""
    local = base / f"node-{host}"
    (local / "tmp").mkdir(parents=True, exist_ok=True)
    return {**(os.environ if env is None else env), "TMPDIR": str(local / "tmp"),
            "HOME": str(local)}


def check_unshare() -> None:
    """Fail (not skip) where this machine cannot make a node: tests need it."""
    out = subprocess.run(as_node(["cat", "/proc/self/stat"], "probe-node"),
                         capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not out.stdout.startswith("1 "):
        raise RuntimeError(f"cannot start a process in a new pid namespace here "
                           f"(rc {out.returncode}): {out.stderr.strip()}")


_CLONE_NEWNS, _CLONE_NEWUTS, _CLONE_NEWPID = 0x00020000, 0x04000000, 0x20000000
_MS_REC, _MS_PRIVATE = 0x4000, 1 << 18
_PR_SET_PDEATHSIG = 1


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)} (recovery tests need root or "
                           "unprivileged user namespaces to make another node)")


def enter_node(host: str, env: Mapping[str, str] | None = None) -> None:
    """Carry on as pid 1 of a new pid namespace, with its own ``/proc`` and hostname
    ``host`` (and ``env`` set): :func:`as_node` for a process forked from a server that
    imported everything once. Call it first thing in a freshly forked, single-threaded
    child. The caller stays behind as the node's parent: it waits for the node and ends
    with it, and its death (a SIGKILL of the process the test started) kills the node."""
    libc = _libc()
    _check(libc.unshare(_CLONE_NEWPID | _CLONE_NEWUTS | _CLONE_NEWNS), "unshare")
    alive, held = os.pipe()  # the parent holds ``held`` open until it ends
    pid = os.fork()
    if pid:  # outside the node: mirror how it ended
        os.close(alive)
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        os._exit(code if code >= 0 else 128 - code)
    os.close(held)
    _check(libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl")
    if select.select([alive], [], [], 0)[0]:  # EOF: the parent died before the line above
        os._exit(137)
    os.close(alive)
    _check(libc.mount(b"none", b"/", None, _MS_REC | _MS_PRIVATE, None), "mount --make-rprivate")
    _check(libc.mount(b"proc", b"/proc", b"proc", 0, None), "mount /proc")
    name = host.encode()
    _check(libc.sethostname(name, len(name)), "sethostname")
    os.environ.update(env or {})
