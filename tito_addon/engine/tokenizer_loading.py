"""Loading a tokenizer for the engine: the transformers tokenizer (never a model), the stop ids its local
generation config declares, and the Rust tokenizer underneath when it gives the same ids (with `ascii_words` in front
of it for ASCII text).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import tokenizers

from tito_addon.engine.ascii_words import ascii_words, tokenizer_json

logger = logging.getLogger(__name__)


def auto_tokenizer() -> Any:
    """transformers' AutoTokenizer, imported without its advice that PyTorch is missing: we load tokenizers only, so
    "Models won't be available" would read as a fault in every proxy's first log lines."""
    if "transformers" not in sys.modules:
        previous = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
        os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
        try:
            import transformers  # noqa: F401
        finally:
            if previous is None:
                del os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"]
            else:
                os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = previous
    from transformers import AutoTokenizer

    return AutoTokenizer


def load_tokenizer(name_or_path: str, *, trust_remote_code: bool) -> Any:
    """Load a tokenizer only (never a model; transformers runs here without torch)."""
    return auto_tokenizer().from_pretrained(name_or_path, trust_remote_code=trust_remote_code)


def tokenizer_sha256(tokenizer: Any) -> str:
    """The fingerprint a record names its tokenizer by: its whole pipeline's JSON, or its vocabulary where it has no
    Rust tokenizer underneath."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return hashlib.sha256(tokenizer_json(backend).encode()).hexdigest()
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()), ensure_ascii=False)
    return hashlib.sha256(vocab.encode()).hexdigest()


def generation_config(name_or_path: str) -> dict[str, Any]:
    """A local model directory's generation_config.json ({} when there is none, or it is unreadable)."""
    config = Path(name_or_path) / "generation_config.json"
    if not config.is_file():
        return {}
    try:
        value = json.loads(config.read_text("utf-8"))
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def sampling_defaults(name_or_path: str) -> dict[str, Any]:
    """The sampling params the model recommends (its generation_config.json), as sglang's chat endpoint reads them."""
    config = generation_config(name_or_path)
    names = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
    return {name: config[name] for name in names if isinstance(config.get(name), int | float)}


def generation_eos_ids(name_or_path: str) -> list[int]:
    value = generation_config(name_or_path).get("eos_token_id")
    if isinstance(value, int):
        return [value]
    return [v for v in value or [] if isinstance(v, int)]


def rust_fast_path(tokenizer: Any, template: str) -> tokenizers.Tokenizer | None:
    """The Rust tokenizer under a transformers one: the same ids without the wrapper's per-call overhead (a
    few percent of a proxy's CPU). Used only if it agrees with the wrapper on text shaped like our prompts."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        return None
    specials = [str(t) for t in getattr(tokenizer, "all_special_tokens", [])][:50]
    probes = [
        template[:4000],
        "\n",
        " ",
        "  Hello,\n\nworld  ",
        "é\u0301 — 東京 🙂\t",
        *specials,
        "".join(specials),
    ]
    for text in probes:
        if backend.encode(text, add_special_tokens=False).ids != list(tokenizer.encode(text, add_special_tokens=False)):
            logger.info("tokenizer fast path disagrees with transformers; using transformers")
            return None
    return backend


def text_encoder(tokenizer: Any, fast: tokenizers.Tokenizer | None) -> Callable[[str], list[int]]:
    """The quickest way to the tokenizer's own ids for a text (no special tokens added): ASCII text through
    `ascii_words` where the tokenizer's pipeline allows, the rest through the Rust tokenizer, else the wrapper."""
    if fast is None:
        return lambda text: list(tokenizer.encode(text, add_special_tokens=False))
    # (its fallback for text that is not ASCII is the Rust tokenizer)
    return ascii_words(fast) or (lambda text: fast.encode(text, add_special_tokens=False).ids)


class RecordTokenizers:
    """The tokenizer that names a record's ids, found the same way wherever ids are shown (the content view, the
    record browser): `preferred()` (a running token engine: its `tokenizer` and `tokenizer_sha256`) when the record's
    fingerprint is its; else `override` (a user's choice, taken as is); else the record's tokenizer directory when it
    is a local one with that fingerprint; else none, and why. Never a download for a record's name, never remote code;
    the last few loaded are kept."""

    KEPT = 4  # tokenizers held loaded (each is tens of MB)

    def __init__(self, preferred: Callable[[], Any | None] = lambda: None, override: str | None = None) -> None:
        self.preferred = preferred
        self.override = override
        self._loaded: OrderedDict[str, tuple[Any | None, str]] = OrderedDict()  # name -> (tokenizer, sha256 or why not)
        self._lock = threading.Lock()  # the record browser asks from its worker threads

    def for_record(self, name: str, sha256: str) -> tuple[Any | None, str | None]:
        """(tokenizer, None), or (None, why the ids are shown alone)."""
        engine = self.preferred()
        if engine is not None and engine.tokenizer_sha256 == sha256:
            return engine.tokenizer, None
        if self.override is not None:
            tokenizer, why = self._load(self.override, local_only=False)
            return (tokenizer, None) if tokenizer is not None else (None, why)
        tokenizer, fingerprint = self._load(name, local_only=True)
        if tokenizer is None:
            return None, fingerprint
        if fingerprint != sha256:
            return None, f"the tokenizer in {name} is not the one this turn was recorded with (its sha256 differs)"
        return tokenizer, None

    def _load(self, name: str, *, local_only: bool) -> tuple[Any | None, str]:
        with self._lock:
            if name in self._loaded:
                self._loaded.move_to_end(name)
                return self._loaded[name]
            found: tuple[Any | None, str]
            if local_only and not Path(name).is_dir():
                found = (None, f"the recorded tokenizer {name!r} is not a local directory here")
            else:
                try:
                    tokenizer = load_tokenizer(name, trust_remote_code=False)
                    found = (tokenizer, tokenizer_sha256(tokenizer))
                except Exception as exc:  # noqa: BLE001 - transformers raises OSError, ValueError, hub errors...
                    found = (None, f"the tokenizer {name!r} does not load: {exc}")
            self._loaded[name] = found
            while len(self._loaded) > self.KEPT:
                self._loaded.popitem(last=False)
            return found
