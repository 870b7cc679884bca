"""Validated settings, parsed from the addon's `tito_*` options (or built directly by embedders and tests)."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tito_addon.backends.backend_routes import normalize_backend_url, parse_backends
from tito_addon.engine.model_families import FAMILIES
from tito_addon.engine.token_engine import APPENDABLE_ROLES, FORBIDDEN_KWARGS

BACKEND_KINDS = ("sglang", "vllm")
STORE_SCHEMES = ("redis", "rediss", "unix")


class TitoSettings(BaseModel):
    model_config = ConfigDict(frozen=True)

    backend_kind: str = "sglang"
    backend_url: str | None = None
    backends: dict[tuple[str, int | None], str | None] = Field(default_factory=dict)
    tokenizer: str
    model_family: str = "default"
    record_dir: str = "recordings"
    append_roles: tuple[str, ...] = ()  # (): the family's own (see TitoAddon._build_engine)
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    session_header: str = "x-session-id"
    trust_remote_code: bool = False
    upstream_timeout: float = 600.0
    verify_prompt_echo: bool = False
    record_message_text: bool = True
    prefix_cache_mb: int = Field(default=256, ge=0, le=1024 * 1024)
    message_memo_mb: int = Field(default=128, ge=0, le=1024 * 1024)
    gc_threshold: int = Field(default=50_000, ge=0, le=10_000_000)
    session_idle_timeout: float = 1800.0
    max_sessions: int = 10000
    signing_key: str = ""  # "": a key kept in the record dir
    session_store: str = "memory"  # or a Redis URL: sessions shared by every proxy that names it
    after_close: Literal["refuse", "new"] = "refuse"  # a name its driver closed: refused, or a new tree

    @field_validator("session_store")
    @classmethod
    def _store(cls, value: str) -> str:
        value = value.strip() or "memory"
        if value == "memory":
            return value
        scheme, sep, rest = value.partition("://")
        if not sep or scheme not in STORE_SCHEMES or not rest:
            raise ValueError(f"must be memory or a Redis URL ({', '.join(s + '://…' for s in STORE_SCHEMES)})")
        return value

    @field_validator("signing_key")
    @classmethod
    def _signing_key(cls, value: str) -> str:
        if value and len(value.encode()) < 16:
            raise ValueError("must be at least 16 bytes (or empty: a key kept in the record dir)")
        return value

    @field_validator("backend_kind")
    @classmethod
    def _kind(cls, value: str) -> str:
        if value not in BACKEND_KINDS:
            raise ValueError(f"unknown backend kind {value!r}; choose one of: {', '.join(BACKEND_KINDS)}")
        return value

    @field_validator("backend_url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        return normalize_backend_url(value) if value else None

    @field_validator("backends", mode="before")
    @classmethod
    def _backends(cls, value: Any) -> Any:
        if isinstance(value, str):
            return parse_backends(value)
        return value

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("a tokenizer (HF name or local directory) is required")
        return value.strip()

    @field_validator("model_family")
    @classmethod
    def _family(cls, value: str) -> str:
        if value not in FAMILIES:
            raise ValueError(f"unknown model family {value!r}; choose one of: {', '.join(FAMILIES)}")
        return value

    @field_validator("append_roles", mode="before")
    @classmethod
    def _roles(cls, value: Any) -> tuple[str, ...]:
        if isinstance(value, str) and value.strip().lower() == "auto":
            return ()
        if isinstance(value, str):
            value = [part for part in value.replace(" ", "").split(",") if part]
        roles = tuple(dict.fromkeys(str(v).lower() for v in value))
        if not roles:
            raise ValueError(f"at least one role is required; choose from {', '.join(APPENDABLE_ROLES)}")
        unknown = [r for r in roles if r not in APPENDABLE_ROLES]
        if unknown:
            raise ValueError(f"unknown role(s) {', '.join(unknown)}; choose from {', '.join(APPENDABLE_ROLES)}")
        return roles

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _kwargs(cls, value: Any) -> dict[str, Any]:
        if isinstance(value, str):
            if not value.strip():
                return {}
            try:
                value = json.loads(value)
            except ValueError as exc:
                raise ValueError(f"not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise ValueError("must be a JSON object")
        bad = FORBIDDEN_KWARGS & set(value)
        if bad:
            raise ValueError(f"may not set {', '.join(sorted(bad))}")
        return value

    @field_validator("session_header")
    @classmethod
    def _header(cls, value: str) -> str:
        value = value.strip().lower()
        if not value or not all(c.isalnum() or c in "-_" for c in value):
            raise ValueError(f"not a valid header name: {value!r}")
        return value

    @field_validator("upstream_timeout")
    @classmethod
    def _timeout(cls, value: float) -> float:
        if value <= 0:
            raise ValueError("must be positive")
        return value

    @field_validator("session_idle_timeout", "max_sessions")
    @classmethod
    def _not_negative(cls, value: float) -> float:
        if value < 0:
            raise ValueError("must be 0 (no limit) or positive")
        return value
