"""tests/gpu: CUDA tensors through cloudckpt on a real GPU. They fail, loudly, where
there is no CUDA device: `make gpu-check` runs them only where there is one, and
`make test` leaves this folder out."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def cuda_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.fail("tests/gpu needs a CUDA device, and this machine has none: run "
                    "`make gpu-check`, which runs them only where CUDA is available")
    return torch.device("cuda", torch.cuda.current_device())
