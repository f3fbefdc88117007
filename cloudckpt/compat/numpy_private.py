"""numpy's private internal: the function its pickles rebuild an ndarray with.

A numpy RNG state in a checkpoint holds an ndarray, and ``torch.load(weights_only=True)``
rebuilds it only through the globals it is told are safe; numpy's pickles name
``_reconstruct`` (in ``numpy._core.multiarray`` since numpy 2, ``numpy.core`` before).
"""

from __future__ import annotations

import importlib
from typing import Any

import numpy as np

from cloudckpt.compat import Internal

_MULTIARRAY = ("numpy._core.multiarray" if int(np.__version__.split(".")[0]) >= 2
               else "numpy.core.multiarray")

INTERNALS = {
    f"{_MULTIARRAY}._reconstruct": Internal(
        "the global numpy's ndarray pickles name: allowed for torch.load, so that a "
        "checkpoint's numpy RNG state loads"),
}


def reconstruct() -> Any:
    """``numpy._core.multiarray._reconstruct`` (``numpy.core``'s before numpy 2)."""
    return importlib.import_module(_MULTIARRAY)._reconstruct
