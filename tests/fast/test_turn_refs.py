"""Signed values agents echo back: thinking signatures and sealed reasoning verify only for our key and the exact
text, anything else is refused without an error, and the key kept in the record dir survives a restart."""

from __future__ import annotations

import stat
import zlib
from pathlib import Path

from tito_addon.protocols.turn_refs import KEY_FILE, PREFIX, TurnSigner, _b64, stored_key


def test_a_signature_verifies_for_its_text_and_key_only() -> None:
    signer = TurnSigner(b"k" * 32)
    value = signer.sign_text("thinking", "msg_1", "I should look it up.")
    assert value.startswith(PREFIX + ".")
    assert signer.verify_text("thinking", value, "I should look it up.") == "msg_1"
    assert signer.verify_text("thinking", value, "I should look it up!") is None  # other text
    assert signer.verify_text("reasoning", value, "I should look it up.") is None  # other purpose
    assert TurnSigner(b"x" * 32).verify_text("thinking", value, "I should look it up.") is None  # other key
    for forged in (None, 7, "", "tito1", "tito1.a.b", "tito1.!!.??", value[:-2] + "AA", "x" * 5000, value + ".x"):
        assert signer.verify_text("thinking", forged, "I should look it up.") is None


def test_sealed_reasoning_opens_to_its_exact_text() -> None:
    signer = TurnSigner(b"k" * 32)
    text = "Think é 東京 🙂\n" * 50
    sealed = signer.seal_text("reasoning", "resp_1", text)
    assert signer.open_text("reasoning", sealed) == ("resp_1", text)
    parts = sealed.split(".")
    tampered = ".".join([parts[0], parts[1], _b64(zlib.compress(b"other")), parts[3]])
    assert signer.open_text("reasoning", tampered) is None
    assert TurnSigner(b"y" * 32).open_text("reasoning", sealed) is None
    assert signer.open_text("reasoning", {"not": "a string"}) is None


def test_a_sealed_bomb_is_refused_not_inflated() -> None:
    signer = TurnSigner(b"k" * 32)
    bomb = zlib.compress(b"\0" * (64 * 1024 * 1024))  # 64 MiB of zeros in a few dozen KiB
    rid = b"resp_b"
    value = ".".join((PREFIX, _b64(rid), _b64(bomb), _b64(signer._mac("reasoning", rid, bomb))))
    assert signer.open_text("reasoning", value) is None


def test_the_stored_key_is_made_once_private_and_only_when_signing(tmp_path: Path) -> None:
    record_dir = tmp_path / "rec"
    signer = TurnSigner(lambda create: stored_key(record_dir, create))
    assert signer.verify_text("thinking", "tito1.bXNn.AAAA", "x") is None
    assert not (record_dir / KEY_FILE).exists(), "checking a value never makes a key"
    value = signer.sign_text("thinking", "msg_1", "text")
    key_file = record_dir / KEY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    restarted = TurnSigner(lambda create: stored_key(record_dir, create))
    assert restarted.verify_text("thinking", value, "text") == "msg_1"
    assert key_file.read_bytes() == restarted.key
