"""What one addon's options mean to the others: each addon publishes here what it declared, and no addon reads
another's options (`tests/fast/test_layers.py`). Addons configure in the order `tito_addon/__init__.py` lists them, so a
fact is published before the addons after its owner configure; one that an earlier addon needs is read when used.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ProxyFacts:
    record_dir: str = "recordings"  # the capture addon's `tito_record_dir`
    message_memo_bytes: int = 128 * 1024 * 1024  # the capture addon's `tito_message_memo_mb`
    session_api_key_prefix: str = ""  # episode naming's `tito_session_api_key_prefix`
    proxy_auth_password_required: bool = False  # episode naming's `tito_proxy_auth_password`, set
    replaying: bool = False  # replay's `tito_replay_dir`, set
    replay_fallback_live: bool = False  # replay's `tito_replay_fallback=live`
