"""Faulting in a load's destination before its bytes arrive (cloudckpt/util/pages.py)."""

from __future__ import annotations

import mmap

import torch

from cloudckpt.util import pages


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * mmap.PAGESIZE


def test_populate_faults_pages_in_and_leaves_the_bytes_alone():
    """A fresh destination becomes resident in one call (what the event loop would
    otherwise fault in page by page); bytes already there stay as they were; a
    small range is not worth the call."""
    fresh = torch.empty(64 << 20, dtype=torch.uint8)
    before = _resident()
    assert pages.populate(fresh.data_ptr(), fresh.numel())
    assert _resident() - before >= 60 << 20
    held = torch.arange(1 << 20, dtype=torch.int32)
    copy = held.clone()
    assert pages.populate(held.data_ptr(), held.numel() * 4)
    assert torch.equal(held, copy)
    assert not pages.populate(held.data_ptr(), 4096)
