"""The replicas' tokenizer: a real Hugging Face tokenizer, shared per path, and the non-canonical ids they emit.

:class:`ReplicaTokenizer` is a thin, thread-safe wrapper with the ids the replicas need (``<|im_end|>``, ``</think>``,
where the added tokens begin). :func:`noncanonical_ids` encodes a completion canonically and then, on purpose, splits
one or two ordinary tokens into two vocab pieces that concatenate to the original: decoding is unchanged, but a proxy
that re-tokenizes text instead of forwarding ids loses those ids.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from tito_addon.replicas.scripted_model import IM_END, THINK_END, stable_int


class ReplicaTokenizer:
    """Thin, thread-safe wrapper over an HF tokenizer with the ids the replica needs."""

    def __init__(self, name: str) -> None:
        from transformers import AutoTokenizer  # heavy import; keep module import cheap

        self.name = name
        self.tok: Any = AutoTokenizer.from_pretrained(name, trust_remote_code=False)
        self.lock = threading.RLock()
        self.vocab: dict[str, int] = dict(self.tok.get_vocab())
        self.size: int = len(self.tok)
        added = list(getattr(self.tok, "added_tokens_decoder", {}) or {})
        #: ids at or above this are added/special tokens; never used for splits
        self.first_added: int = min(added) if added else self.size
        self.im_end: int = self._id(IM_END)
        self.think_end: int | None = self.vocab.get(THINK_END)

    def _id(self, token: str) -> int:
        tid = self.tok.convert_tokens_to_ids(token)
        if not isinstance(tid, int) or tid < 0:
            raise ValueError(f"tokenizer {self.name!r} has no {token!r} token")
        return tid

    def render(self, messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]) -> str:
        with self.lock:
            out = self.tok.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
            )
        if not isinstance(out, str):  # pragma: no cover - defensive (return_dict variants)
            raise TypeError("chat template did not render to a string")
        return out

    def encode(self, text: str) -> list[int]:
        with self.lock:
            return list(self.tok.encode(text, add_special_tokens=False))

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        with self.lock:
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        with self.lock:
            return str(
                self.tok.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)
            )

    def stop_in(self, ids: list[int], stop: Any) -> tuple[int, str] | None:
        """Where an engine stops on a request's `stop` (a string or a list): the fewest of the output `ids` whose text
        holds one, and the first found; the engine checks a token at a time, over this request's own output."""
        stops = [stop] if isinstance(stop, str) else [s for s in stop or [] if isinstance(s, str)]
        stops = [s for s in stops if s]
        for count in range(1, len(ids) + 1) if stops else ():
            text = self.decode(ids[:count])
            matched = min((s for s in stops if s in text), key=text.find, default=None)
            if matched is not None:
                return count, matched
        return None

    def token_texts(self, ids: list[int]) -> list[str]:
        """Per-token text, as sglang's ``return_text_in_logprobs`` gives it."""
        with self.lock:
            return [
                str(self.tok.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)) for i in ids
            ]

    def piece(self, tid: int) -> str:
        with self.lock:
            return str(self.tok.convert_ids_to_tokens(tid))

    def split_of(self, tid: int) -> tuple[int, int] | None:
        """Two ordinary vocab ids whose pieces concatenate to ``tid``'s piece (middle-most cut)."""
        piece = self.piece(tid)
        cuts = sorted(range(1, len(piece)), key=lambda k: (abs(2 * k - len(piece)), k))
        for k in cuts:
            a, b = self.vocab.get(piece[:k]), self.vocab.get(piece[k:])
            if a is not None and b is not None and a < self.first_added and b < self.first_added:
                return a, b
        return None


_TOKENIZERS: dict[str, ReplicaTokenizer] = {}
_TOKENIZERS_LOCK = threading.Lock()


def load_tokenizer(name: str) -> ReplicaTokenizer:
    key = str(Path(name).resolve()) if Path(name).exists() else name
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            tok = ReplicaTokenizer(name)
            _TOKENIZERS[key] = tok
        return tok


# --------------------------------------------------------------------------------------
# non-canonical token splits
# --------------------------------------------------------------------------------------


def noncanonical_ids(
    tok: ReplicaTokenizer, text: str, spans: list[tuple[int, int]], fallback: list[tuple[int, int]], *, enabled: bool
) -> tuple[list[int], list[int]]:
    """Encode ``text`` canonically, then split one ordinary token per span (at most two).

    Returns the ids and the completion indices where each split pair starts.
    """
    ids, offsets = tok.encode_with_offsets(text)
    if not enabled:
        return ids, []
    chosen = _pick_splits(tok, text, ids, offsets, spans) or _pick_splits(tok, text, ids, offsets, fallback[:1])
    out = list(ids)
    for i, pair in sorted(chosen, reverse=True):
        out[i : i + 1] = list(pair)
    if tok.decode(out) != tok.decode(ids):  # pragma: no cover - byte-level BPE guarantees this
        return ids, []
    starts = sorted(i for i, _ in chosen)
    return out, [s + k for k, s in enumerate(starts)]


def _pick_splits(
    tok: ReplicaTokenizer, text: str, ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]
) -> list[tuple[int, tuple[int, int]]]:
    seed = stable_int("split", text)
    chosen: list[tuple[int, tuple[int, int]]] = []
    for lo, hi in spans[:2]:
        cands: list[tuple[int, tuple[int, int]]] = []
        for i, (tid, (s, e)) in enumerate(zip(ids, offsets, strict=True)):
            if tid >= tok.first_added or not (lo <= s and e <= hi):
                continue
            core = tok.piece(tid).removeprefix("Ġ")
            if len(core) < 3 or not (core.isascii() and core.isalpha()):
                continue
            pair = tok.split_of(tid)
            if pair is not None:
                cands.append((i, pair))
        if cands:
            chosen.append(cands[seed % len(cands)])
    return chosen
