"""transformers' private internal: a model's tied weights.

An export leaves out the weights a model ties to others (``lm_head.weight`` to the
embeddings), as ``save_pretrained`` does; a model says which they are only in
``_tied_weights_keys``. Any ``torch.nn.Module`` may be exported, so transformers is not
imported here.
"""

from __future__ import annotations

from typing import Any

from cloudckpt.compat import Internal

INTERNALS = {
    "transformers.PreTrainedModel._tied_weights_keys": Internal(
        "the weights a model ties to others, left out of an export as save_pretrained "
        "leaves them out"),
}


def tied_weight_keys(model: Any) -> set[str]:
    """The names in ``model._tied_weights_keys`` (a list, or a dict keyed by the tied
    weight, by transformers' version); none for a model without it."""
    return set(getattr(model, "_tied_weights_keys", None) or {})
