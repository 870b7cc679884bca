"""Mixture-of-experts routes: the experts each token was routed to, per layer, as the engine reports them for rollout
routing replay (R3). Read from the sources (docs/research/routed-experts.md has the files and versions):

- sglang (`--enable-return-routed-experts`; chat with `input_ids`, 0.5.13+): asked with `return_routed_experts` and
  `routed_experts_start_len`; answered as base64 of raw little-endian int32 with no shape, rows `[start, seqlen - 1)`:
  `choices[i].meta_info.routed_experts` (with `return_meta_info`), else the response's `sglext.routed_experts`, and in
  a stream in the final sglext chunk.
- vLLM (`--enable-return-routed-experts`; `/inference/v1/generate`): asked with `sampling_params.
  routed_experts_prompt_start`; answered as base64 of an `.npy` file, shape `(num_tokens - 1 - start, layers, topk)`,
  uint8 or uint16 (0.32's capturer: uint8 up to 256 experts): `choices[i].routed_experts`, in a 0.32 stream on the
  finishing chunk, in a 0.24 stream never.

Row r of an answer is the route of sequence position `start + r` (positions count the prompt, then the completion).
The last sampled token was never fed forward, so it has no route; the next turn's prompt computes it. A turn
therefore asks from where its session's routes end (`RoutesAsked`) and the record stitches the rest from its parents.
Values are kept in the narrowest unsigned dtype that holds them, so a 48-layer top-8 model's token costs 384 bytes.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tito_addon.tito_errors import UpstreamMalformed

#: The dtypes a route array is kept in, narrowest first.
ROUTE_DTYPES = ("uint8", "uint16", "int32")


@dataclass(frozen=True, slots=True)
class RouteShape:
    """Layers and experts per token of a model's routes (its `num_hidden_layers` and `num_experts_per_tok`)."""

    layers: int
    topk: int

    @classmethod
    def parse(cls, text: str) -> RouteShape | None:
        """`48x8` (layers x top-k); empty: None. ValueError for anything else."""
        text = text.strip().lower()
        if not text:
            return None
        layers, sep, topk = text.partition("x")
        if not sep or not layers.isdigit() or not topk.isdigit() or int(layers) < 1 or int(topk) < 1:
            raise ValueError(f"{text!r} is not LAYERSxTOPK (e.g. 48x8)")
        return cls(int(layers), int(topk))

    def __str__(self) -> str:
        return f"{self.layers}x{self.topk}"


@dataclass(frozen=True, slots=True)
class RoutesWanted:
    """The proxy asks for every turn's routes (`tito_routed_experts`), of a model of `shape` where it is known."""

    shape: RouteShape | None = None


@dataclass(frozen=True, slots=True)
class RouteRows:
    """Routes of the sequence positions `[start, start + rows)`: `(rows, layers, topk)`, in its narrowest dtype."""

    start: int
    array: np.ndarray

    @property
    def rows(self) -> int:
        return int(self.array.shape[0])

    @property
    def end(self) -> int:
        return self.start + self.rows

    @property
    def shape(self) -> RouteShape:
        return RouteShape(int(self.array.shape[1]), int(self.array.shape[2]))

    def head(self, end: int) -> RouteRows:
        """The rows of positions before `end` (a stop string cut the completion there)."""
        return RouteRows(self.start, self.array[: max(end - self.start, 0)])


def narrowest(array: np.ndarray) -> np.ndarray:
    """`array` in the narrowest of `ROUTE_DTYPES` that holds its values; an expert index is never negative."""
    if array.size and int(array.min()) < 0:
        raise UpstreamMalformed("backend returned a negative expert index in its routed experts")
    top = int(array.max()) if array.size else 0
    dtype = "uint8" if top < 1 << 8 else "uint16" if top < 1 << 16 else "int32"
    return np.ascontiguousarray(array, dtype=dtype)


@dataclass(frozen=True, slots=True)
class RoutesAsked:
    """What a turn asks the backend for: routes from sequence position `start` on, of a model of `shape` where known
    (sglang's answer has no shape of its own)."""

    start: int
    shape: RouteShape | None = None


@dataclass(frozen=True, slots=True)
class RoutesRead:
    """What one engine request's answer gave: its rows; or none, and why they cannot be laid on its tokens (no reason:
    it routed nothing, and nothing is missing)."""

    rows: RouteRows | None
    missing: str | None = None


def _bytes(text: Any) -> bytes | None:
    if not isinstance(text, str):
        return None
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise UpstreamMalformed("backend returned routed experts that are not base64") from None


def placed(array: np.ndarray, start: int, expected: int) -> RoutesRead:
    """`array`'s rows as those of `[start, start + expected)`. An engine that ignored the start (sglang before 0.5.13
    on `/generate`, a router that dropped the field) answers every row from 0: the ones asked are cut from it."""
    rows = int(array.shape[0])
    if rows == expected:
        return RoutesRead(RouteRows(start, narrowest(array)))
    if start and rows == start + expected:
        return RoutesRead(RouteRows(start, narrowest(array[start:])))
    return RoutesRead(None, f"the backend returned {rows} rows of routes for the {expected} positions asked")


def read_sglang(text: Any, asked: RoutesAsked, expected: int) -> RoutesRead:
    """sglang's `routed_experts` (raw int32, base64) as the rows of `[asked.start, asked.start + expected)`."""
    data = _bytes(text)
    if data is None:
        return RoutesRead(None, "the backend returned no routed experts")
    if asked.shape is None:
        return RoutesRead(None, "sglang's routes carry no shape, and tito_routed_experts_shape is not set")
    width = asked.shape.layers * asked.shape.topk
    if len(data) % (4 * width):
        return RoutesRead(None, f"the backend's routes are not whole rows of {asked.shape} int32 values")
    flat = np.frombuffer(data, dtype="<i4")
    return placed(flat.reshape(-1, asked.shape.layers, asked.shape.topk), asked.start, expected)


def read_vllm(text: Any, asked: RoutesAsked, expected: int) -> RoutesRead:
    """vLLM's `routed_experts` (an `.npy` file, base64) as the rows of `[asked.start, asked.start + expected)`."""
    data = _bytes(text)
    if data is None:
        return RoutesRead(None, "the backend returned no routed experts")
    try:
        array = np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise UpstreamMalformed(f"backend returned routed experts that are not an .npy array: {exc}") from None
    if not isinstance(array, np.ndarray) or array.ndim != 3 or array.dtype.kind not in "iu":
        raise UpstreamMalformed("backend returned routed experts that are not an integer (tokens, layers, topk) array")
    if asked.shape is not None and RouteShape(int(array.shape[1]), int(array.shape[2])) != asked.shape:
        raise UpstreamMalformed(
            f"backend returned routes of shape {array.shape[1]}x{array.shape[2]}, not tito_routed_experts_shape "
            f"{asked.shape}"
        )
    return placed(array, asked.start, expected)


Reader = Callable[[Any, RoutesAsked, int], RoutesRead]


def answered_routes(
    read: Reader, text: Any, asked: RoutesAsked, prompt_len: int, sampled: int, aborted: bool = False
) -> RoutesRead:
    """One engine request's routes: it ran on `prompt_len` ids (from `asked.start` on) and sampled `sampled` more, so
    it routed every position before its last. A request aborted before its first forward pass routed none and
    answers none: nothing is missing, the next attempt asks from the same place."""
    if text is None and aborted and sampled == 0:
        return RoutesRead(None)
    return read(text, asked, max(prompt_len + sampled - 1 - asked.start, 0))


def joined(parts: list[RouteRows]) -> RouteRows | None:
    """Contiguous rows laid end to end (a resumed generation's attempts), as one, in the widest of their dtypes."""
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    dtype = max((p.array.dtype for p in parts), key=lambda d: ROUTE_DTYPES.index(d.name))
    return RouteRows(parts[0].start, np.concatenate([p.array.astype(dtype, copy=False) for p in parts]))


@dataclass
class TurnRoutes:
    """A turn's routes as its engine requests gave them: rows laid from `asked.start`, and, where a request's answer
    could not be laid on its tokens, why (the rows end there: nothing after a gap is kept, nothing is invented)."""

    asked: RoutesAsked
    parts: list[RouteRows]
    missing: str | None = None
    attempt_starts: list[int] | None = None  # a resumed turn: where each later attempt's rows begin

    @property
    def end(self) -> int:
        """The position up to which the rows run from `asked.start`."""
        return self.parts[-1].end if self.parts else self.asked.start

    def add(self, read: RoutesRead, resumed: bool = False) -> None:
        if self.missing is not None:
            return
        if read.rows is None:
            self.missing = read.missing
            return
        if resumed and self.parts:
            self.attempt_starts = [*(self.attempt_starts or []), read.rows.start]
        if read.rows.rows:
            if self.parts and read.rows.shape != self.parts[0].shape:
                self.missing = f"the backend's routes changed shape within the turn ({self.parts[0].shape}, then "
                self.missing += f"{read.rows.shape})"
                return
            self.parts.append(read.rows)

    def truncate(self, end: int) -> None:
        """Only the rows of positions before `end` (a stop string cut the completion)."""
        self.parts = [p.head(end) for p in self.parts if p.start < end]
        if self.attempt_starts:
            self.attempt_starts = [s for s in self.attempt_starts if s < end] or None

    def rows(self) -> RouteRows | None:
        return joined(self.parts)


def without_routes(choice: dict[str, Any]) -> dict[str, Any]:
    """A generate choice without its routes: what derender reads, and never megabytes it has no use for."""
    if choice.get("routed_experts") is None:
        return choice
    return {**choice, "routed_experts": None}


def without_choice_routes(generated: dict[str, Any]) -> dict[str, Any]:
    """A generate response without its choices' routes (read by then): the same object when it carries none, as the
    answer of a server without the flag does on every turn."""
    choices = generated.get("choices")
    if not isinstance(choices, list) or not any(isinstance(c, dict) and c.get("routed_experts") for c in choices):
        return generated
    return {**generated, "choices": [without_routes(c) if isinstance(c, dict) else c for c in choices]}
