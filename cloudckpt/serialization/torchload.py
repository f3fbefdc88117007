"""``torch.load`` with ``weights_only=True``, and the one-line reason it refuses.

Whatever a checkpoint holds is loaded as tensors and plain data or refused, so a
pickle in it can never execute code; the refusal is reported without torch's
advice to load unsafely.
"""

from __future__ import annotations

import io
import re
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from cloudckpt.errors import CorruptCheckpointError

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

_PLAIN_TYPES = (str, int, float, bool, type(None), torch.dtype, torch.device, torch.Size)
#: Classes a state may hold besides tensors and plain data, that loading only builds
#: from bytes (no code of the checkpoint's runs): a ``BytesIO``, which DCP saves as
#: itself and torch's own DCP tests keep in a training state.
_BUILT_FROM_BYTES: list[Any] = [io.BytesIO]


def _weights_only_load(f: Any) -> Any:
    with torch.serialization.safe_globals(_BUILT_FROM_BYTES):
        return torch.load(f, map_location="cpu", weights_only=True)


def safe_torch_load(f: Any, source: str) -> Any:
    """``torch.load(f, weights_only=True)`` on the CPU: tensors and plain data only
(and a ``BytesIO`` of bytes).

    Anything else (pickled code, unknown classes, a damaged file) raises
    :class:`CorruptCheckpointError` naming ``source``, with torch's reason on one
    line (terminal colour codes removed).
    """
    try:
        return _weights_only_load(f)
    except Exception as exc:  # noqa: BLE001 - any failure: refuse the object
        raise CorruptCheckpointError(
            f"{source} cannot be loaded safely ({refusal(exc)}); checkpoints must hold only "
            "tensors and plain data", {source: "unsafe or malformed"}) from None


def _numpy_globals() -> list[Any]:
    import numpy as np

    from cloudckpt.compat import numpy_private

    return [numpy_private.reconstruct(), np.ndarray, np.dtype, type(np.dtype(np.uint32))]


@contextmanager
def numpy_rng_allowed() -> Iterator[None]:
    """Let :func:`safe_torch_load` (and DCP's loads) read a numpy RNG state: the tuple
    ``np.random.get_state()`` returns, holding a ``uint32`` ndarray, which frameworks
    keep in their checkpoints' ``rng``. Only numpy's array reconstruction is allowed
    (no other callable), so loading still executes no code from the checkpoint."""
    with torch.serialization.safe_globals(_numpy_globals()):
        yield


def torch_bytes(obj: Any) -> bytes:
    """``obj`` as ``torch.save`` writes it, in memory."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def load_storage_bytes(data: bytes) -> Any:
    """A storage that plain ``pickle`` wrote as ``torch.save`` bytes (what
    ``torch.storage._load_from_bytes`` reads), loaded with ``weights_only``."""
    return torch.load(io.BytesIO(data), weights_only=True)


def refusal(exc: BaseException) -> str:
    """The line of an error that says what is wrong, without terminal colour codes, at
    most 200 chars. For torch's weights-only refusal that is its unpickler's reason
    (the rest of that message is advice to load unsafely, which we do not give)."""
    text = _ANSI.sub("", str(exc)).strip()
    for line in text.splitlines():
        if "WeightsUnpickler error:" in line:
            reason = line.split("WeightsUnpickler error:", 1)[1].split(". Please use")[0]
            return reason.strip()[:200]
    return (text.splitlines()[0] if text else type(exc).__name__)[:200]


def weights_only_refusal(value: Any) -> str | None:
    """None when ``torch.load(weights_only=True)`` would load ``value`` back after
    ``torch.save``; else its :func:`refusal` (a DataLoader, a generator, a lambda)."""
    if _plain(value):
        return None  # the common case, without serialising tensors a second time
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        _weights_only_load(buf)
    except Exception as exc:  # noqa: BLE001 - any failure: a restore would fail too
        return refusal(exc)
    return None


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is, by its types alone, something ``weights_only`` loads:
    plain scalars, tensors, and lists, tuples and dicts of them. (Anything else is
    judged by a round trip through ``torch.save``.)"""
    if depth > 64:
        return False
    if isinstance(value, _PLAIN_TYPES) or type(value) in (torch.Tensor, torch.nn.Parameter):
        return True
    if type(value) in (list, tuple):
        return all(_plain(v, depth + 1) for v in value)
    if type(value) in (dict, OrderedDict):
        return all(_plain(k, depth + 1) and _plain(v, depth + 1) for k, v in value.items())
    return False
