"""Opaque values we mint for agents and they echo back: signed, so an echoed one is known to be ours.

A thinking block's `signature` and a reasoning item's `encrypted_content` are ours to fill; each carries the id
of the turn that produced it (the reply id recorded with the turn) and is bound to the exact text it stands for
by an HMAC under the proxy's key. A forged value, one from another key, or one for other text does not verify:
the block is then plain text, never a failure.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
import zlib
from collections.abc import Callable
from pathlib import Path

PREFIX = "tito1"
MAX_BLOB = 4 * 1024 * 1024  # a decompressed reasoning text larger than this is refused, not inflated
OPENED_CACHE = 4096  # sealed values remembered once opened


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def new_id(prefix: str) -> str:
    """An id in the vendor's style (`msg_…`, `toolu_…`, `resp_…`): the prefix and 24 random url-safe characters."""
    return prefix + secrets.token_urlsafe(18).replace("-", "x").replace("_", "y")


class TurnSigner:
    """Signs under a key given, or one loaded on first use (a proxy that only serves chat never makes one).

    A loader is called with `create`: False only looks for an existing key (checking a value never makes one,
    so a request that is then refused changes nothing), True makes it if missing."""

    def __init__(self, key: bytes | Callable[[bool], bytes | None]) -> None:
        self._key: bytes | None = None
        self._load: Callable[[bool], bytes | None] | None = None
        self._opened: dict[tuple[str, str], tuple[str, str]] = {}
        if callable(key):
            self._load = key
        else:
            self._key = self._checked(key)

    @staticmethod
    def _checked(key: bytes) -> bytes:
        if len(key) < 16:
            raise ValueError("the signing key must be at least 16 bytes")
        return key

    @property
    def key(self) -> bytes:
        """The key, made now if there is none yet (OSError when it cannot be kept)."""
        if self._key is None:
            assert self._load is not None
            self._key = self._checked(self._load(True) or b"")
        return self._key

    def _existing(self) -> bytes | None:
        if self._key is None and self._load is not None:
            try:
                found = self._load(False)
            except OSError:
                return None
            if found is not None:
                self._key = self._checked(found)
        return self._key

    def _mac(self, purpose: str, *parts: bytes, key: bytes | None = None) -> bytes:
        mac = hmac.new(key if key is not None else self.key, purpose.encode(), hashlib.sha256)
        for part in parts:
            mac.update(len(part).to_bytes(8, "big"))
            mac.update(part)
        return mac.digest()[:18]

    def sign_text(self, purpose: str, reply_id: str, text: str) -> str:
        """A short value binding `text` to the turn `reply_id` (a thinking signature)."""
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        return ".".join((PREFIX, _b64(reply_id.encode()), _b64(self._mac(purpose, reply_id.encode(), digest))))

    def verify_text(self, purpose: str, value: object, text: str) -> str | None:
        """The reply id a signature names, if it is ours and for exactly this text; else None."""
        parts = value.split(".") if isinstance(value, str) and len(value) < 1024 else []
        if len(parts) != 3 or parts[0] != PREFIX:
            return None
        try:
            reply_id, mac = _unb64(parts[1]), _unb64(parts[2])
        except ValueError:
            return None
        key = self._existing()
        digest = hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()
        if key is None or not hmac.compare_digest(mac, self._mac(purpose, reply_id, digest, key=key)):
            return None
        return reply_id.decode("utf-8", "replace")

    def seal_text(self, purpose: str, reply_id: str, text: str) -> str:
        """A value carrying `text` itself (compressed), for clients that echo only the value (encrypted_content)."""
        body = zlib.compress(text.encode("utf-8", "surrogatepass"))
        rid = reply_id.encode()
        return ".".join((PREFIX, _b64(rid), _b64(body), _b64(self._mac(purpose, rid, body))))

    def open_text(self, purpose: str, value: object) -> tuple[str, str] | None:
        """(reply id, text) from a sealed value that is ours; None for anything else. Codex sends every earlier
        turn's sealed reasoning again on each request, so what was opened is remembered (a bounded cache)."""
        if not isinstance(value, str):
            return None
        cached = self._opened.get((purpose, value))
        if cached is not None:
            return cached
        opened = self._open(purpose, value)
        if opened is not None:
            if len(self._opened) >= OPENED_CACHE:
                self._opened.clear()
            self._opened[(purpose, value)] = opened
        return opened

    def _open(self, purpose: str, value: str) -> tuple[str, str] | None:
        parts = value.split(".") if isinstance(value, str) and len(value) < 2 * MAX_BLOB else []
        if len(parts) != 4 or parts[0] != PREFIX:
            return None
        try:
            rid, body, mac = _unb64(parts[1]), _unb64(parts[2]), _unb64(parts[3])
        except ValueError:
            return None
        key = self._existing()
        if key is None or not hmac.compare_digest(mac, self._mac(purpose, rid, body, key=key)):
            return None
        try:
            inflater = zlib.decompressobj()
            raw = inflater.decompress(body, MAX_BLOB)
            if inflater.unconsumed_tail or not inflater.eof:
                return None
            return rid.decode("utf-8"), raw.decode("utf-8", "surrogatepass")
        except (zlib.error, UnicodeDecodeError):
            return None


KEY_FILE = ".tito-signing-key"


def stored_key(record_dir: Path, create: bool = True) -> bytes | None:
    """The proxy's signing key, kept beside the recordings (mode 0600) so a restarted proxy still knows the
    signatures and sealed reasoning it handed out; made on first use (None: there is none and `create` is off)."""
    path = record_dir / KEY_FILE
    try:
        key = path.read_bytes().strip()
        if len(key) >= 32:
            return key
    except FileNotFoundError:
        pass
    if not create:
        return None
    record_dir.mkdir(parents=True, exist_ok=True)
    key = secrets.token_hex(32).encode()
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:  # another process made it first: use theirs
        return path.read_bytes().strip()
    with os.fdopen(fd, "wb") as handle:
        handle.write(key)
    return key
