"""The scripted model's mixture-of-experts routing ("routed experts", for rollout routing replay), which both replicas
return as their servers do when started with ``--enable-return-routed-experts``.

A route is a function of the token and its position only (:func:`expert_routes`), so a test can recompute what any
answer must hold, and a route shifted by one position is detectably wrong. Rows cover sequence positions (prompt then
output): a server returns ``[start, seqlen - 1)``, the last sampled token never having been forwarded. The encodings
are the servers': sglang's raw little-endian int32 bytes (:func:`sglang_routes_b64`), vLLM's ``.npy`` file in the
narrowest unsigned type its capturer picks (:func:`vllm_routes_b64`). numpy is imported only when routes are made.
"""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import TYPE_CHECKING, Self

from pydantic import BaseModel, Field, model_validator

if TYPE_CHECKING:
    import numpy as np


class ExpertRoutingFields(BaseModel):
    """The routing knobs both replicas' configs share: the server flag and the model's MoE shape."""

    routed_experts: bool = Field(
        default=False,
        description="the server's --enable-return-routed-experts: a request asking for routes gets them (off: sglang "
        "leaves the field out, vLLM answers null)",
    )
    moe_layers: int = Field(default=4, gt=0, description="rows per token: the model's hidden layers (dense ones too)")
    moe_topk: int = Field(default=2, gt=0, description="experts chosen per token and layer (num_experts_per_tok)")
    moe_experts: int = Field(default=8, gt=0, description="experts per layer (vLLM: <= 256 is uint8, else uint16)")

    @model_validator(mode="after")
    def _topk_within_experts(self) -> Self:
        if self.moe_topk > self.moe_experts:
            raise ValueError(f"moe_topk ({self.moe_topk}) must not exceed moe_experts ({self.moe_experts})")
        return self


def expert_routes(ids: Sequence[int], start: int, end: int, layers: int, topk: int, experts: int) -> np.ndarray:
    """int32 ``(end - start, layers, topk)``: row ``r`` routes sequence position ``p = start + r`` (``ids`` is the whole
    sequence, prompt then output); slot ``k`` of layer ``l`` is ``(ids[p] * 31 + p * 17 + l * 7 + k) % experts``."""
    import numpy as np

    positions = np.arange(start, max(start, end), dtype=np.int64)
    tokens = np.asarray(ids, dtype=np.int64)[positions] if len(positions) else positions
    base = tokens * 31 + positions * 17
    layer = np.arange(layers, dtype=np.int64) * 7
    slot = np.arange(topk, dtype=np.int64)
    rows = (base[:, None, None] + layer[None, :, None] + slot[None, None, :]) % experts
    return rows.astype(np.int32)


def sglang_routes_b64(rows: np.ndarray) -> str:
    """sglang's encoding: base64 of the raw little-endian int32 bytes, no header and no shape (an empty array is
    ``""``)."""
    return base64.b64encode(rows.astype("<i4").tobytes()).decode()


def vllm_routes_b64(rows: np.ndarray, experts: int) -> str:
    """vLLM's: base64 of the ``.npy`` file (``np.save``, ``allow_pickle=False``), uint8 for up to 256 experts else
    uint16, as its capturer narrows them."""
    import numpy as np

    buffer = io.BytesIO()
    np.save(buffer, rows.astype(np.uint8 if experts <= 256 else np.uint16), allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def route_rows(config: ExpertRoutingFields, ids: Sequence[int], start: int) -> np.ndarray:
    """The rows a server returns for the sequence ``ids`` from ``start``: ``[start, len(ids) - 1)``."""
    return expert_routes(ids, start, len(ids) - 1, config.moe_layers, config.moe_topk, config.moe_experts)
