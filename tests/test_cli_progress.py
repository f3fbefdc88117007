"""``cloudckpt cp`` and ``download`` on a terminal: the bar ends at its total, drawn
once more when the copy is done, and the summary follows on a line of its own.

The command runs as a child whose stdout and stderr are one pseudo-terminal, as in a
shell, so the test reads exactly the bytes a terminal would show.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios

import pytest
import torch

from cloudckpt import CheckpointManager, CheckpointWriter, ManagerOptions, open_checkpoint
from cloudckpt.movement.checkpoint_copy import copy_checkpoint
from cloudckpt.runtime.state import StepInfo

#: How long the child may stay silent before the test gives up on it (no timing
#: assertion: only a bound, so a hang fails instead of blocking the suite).
SILENCE_LIMIT = 300


def on_terminal(env: dict[str, str], *args: str) -> tuple[int, str]:
    """Run ``cloudckpt ARGS`` with stdout and stderr on one pseudo-terminal 100 columns
    wide; its exit code and everything it wrote there."""
    main, child_end = pty.openpty()
    fcntl.ioctl(child_end, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
    child = subprocess.Popen([sys.executable, "-m", "cloudckpt", *args], env=env,
                             stdin=subprocess.DEVNULL, stdout=child_end, stderr=child_end)
    os.close(child_end)
    out = bytearray()
    try:
        while True:
            ready, _, _ = select.select([main], [], [], SILENCE_LIMIT)
            if not ready:
                child.kill()
                raise AssertionError(f"cloudckpt {' '.join(args)} wrote nothing for "
                                     f"{SILENCE_LIMIT} s; so far: {bytes(out)!r}")
            try:
                data = os.read(main, 65536)
            except OSError:  # EIO: every writer of the terminal is gone
                break
            if not data:
                break
            out += data
    finally:
        os.close(main)
    return child.wait(timeout=SILENCE_LIMIT), out.decode()


def terminal_lines(out: str) -> list[str]:
    """The output's lines as written, carriage returns kept (the terminal turns each
    newline into CR LF)."""
    assert out.endswith("\r\n"), repr(out[-200:])
    return out[:-2].split("\r\n")


def plain_checkpoint(s3, name: str) -> str:
    uri = s3.uri(name)
    with CheckpointWriter(uri, step=3, storage_options=s3.options) as w:
        w.put_many({f"part-{i}.bin": os.urandom((1 << 20) + i) for i in range(5)})
    return uri


def incremental_checkpoint(s3, name: str) -> str:
    """A training checkpoint whose objects lie in the run's blob area: a copy rewrites
    its part manifests rather than copying them."""
    torch.manual_seed(0)
    mgr = CheckpointManager(s3.uri(name), ManagerOptions(every_steps=1, incremental=True),
                            storage_options=s3.options)
    mgr.save(StepInfo(global_step=7), {"model": torch.nn.Linear(1024, 1024).state_dict()})
    mgr.close()
    uri = s3.uri(name, "step-7")
    assert not open_checkpoint(uri, s3.options).manifest.standard
    return uri


MAKERS = {"plain": plain_checkpoint, "incremental": incremental_checkpoint}


@pytest.mark.parametrize("kind", sorted(MAKERS))
@pytest.mark.parametrize("command", ["cp", "download"])
def test_the_bar_ends_at_its_total_and_the_summary_has_its_own_line(s3, tmp_path, command,
                                                                   kind):
    src = MAKERS[kind](s3, "src")
    dst = s3.uri("copy") if command == "cp" else str(tmp_path / "dl")
    code, out = on_terminal({**os.environ, **s3.env}, command, src, dst)
    assert code == 0, out
    label = "copy" if command == "cp" else "download"
    copied = open_checkpoint(dst, s3.options if command == "cp" else None)
    copied.verify(deep=True)
    *before, bar, summary = terminal_lines(out)
    assert summary == f"{label}: {src} -> {copied.uri} ({len(copied.files)} objects, " \
                      f"{copied.total_size / (1 << 20):.1f} MiB)", out
    # The bar's last drawing (after its last carriage return): complete, count = total.
    shown = bar.rsplit("\r", 1)[-1]
    done = re.match(rf"{label}: 100%\|█+\| (\S+)/(\S+) \[", shown)
    assert done and done[1] == done[2], out
    assert before == [], out  # nothing else was printed, and the bar drew on one line


def test_without_a_terminal_there_is_no_bar(s3, tmp_path):
    src = plain_checkpoint(s3, "src")
    out = subprocess.run([sys.executable, "-m", "cloudckpt", "download", src,
                          str(tmp_path / "dl")], env={**os.environ, **s3.env},
                         capture_output=True, text=True, timeout=SILENCE_LIMIT)
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert out.stdout == f"download: {src} -> {tmp_path / 'dl'} (5 objects, 5.0 MiB)\n"


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_progress_adds_up_to_the_source_size(s3, tmp_path, kind):
    """Part manifests rewritten by the copy count too, by their size at the source."""
    src = open_checkpoint(MAKERS[kind](s3, "src"), s3.options)
    for dst in (s3.uri("copy"), str(tmp_path / "dl")):
        counted: list[int] = []
        copy_checkpoint(src, dst, dst_options=s3.options if dst.startswith("s3") else None,
                        progress=counted.append)
        assert sum(counted) == src.total_size, dst
