"""Shared fixtures, for every tier's folder (fast/, full/, e2e/, trainer_checks/): the sglang replica, redis, a
mitmdump per test, the engines, and the session-wide audit that no credential reached a recording or a log. Their
helpers, and every helper a test module uses, are in support/ (`support.basics`: the real tokenizers in
../shared/tokenizers, HF hub names when shared/ is absent); no test module imports another test module, or this
file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings
from support.basics import cached_engine, credential_leaks, tokenizer_path

# Hypothesis profiles: `ci` (`make test-all`, CI: `--hypothesis-profile=ci`) runs every generated test with the example
# count written at it; `dev` (the default: `make test`, a bare `pytest`) runs a quarter of it for the sweeps that cost
# seconds. Both assert the same properties; only how many inputs are drawn differs.
settings.register_profile("ci", max_examples=100)
settings.register_profile("dev", max_examples=25)
settings.load_profile("dev")  # the hypothesis plugin loads `--hypothesis-profile` after this, when it is given


@pytest.fixture(scope="module")
def replica():
    """The sglang replica over the real Qwen3 tokenizer, one per test module (modules may define their own)."""
    from tito_addon.replicas.sglang_replica import ReplicaConfig, ReplicaThread

    with ReplicaThread(ReplicaConfig(tokenizer=tokenizer_path("qwen3"))) as running:
        yield running


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A real redis-server on loopback (append-only file, so a stop and start keeps its data), one per module."""
    import shutil

    from tito_addon.replicas.fleet import RedisServer

    if shutil.which("redis-server") is None:
        if os.environ.get("TITO_REDIS_REQUIRED") == "1":
            pytest.fail("redis-server is required here (CI installs Debian's redis-server)")
        pytest.skip("redis-server is not installed")
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture
def proxy(replica, tmp_path: Path):
    """A real mitmdump with the addon in front of `replica`, recording to `proxy.record_dir`, per test."""
    from tito_addon.replicas.proxy_process import Mitmdump

    replica.backend.reset()
    record_dir = tmp_path / "rec"
    with Mitmdump(replica.url, tokenizer=tokenizer_path("qwen3"), record_dir=record_dir, cwd=tmp_path) as running:
        running.record_dir = record_dir
        yield running


@pytest.fixture
def qwen3_engine():
    return cached_engine("qwen3")


@pytest.fixture
def qwen25_engine():
    return cached_engine("qwen2.5")


@pytest.fixture(scope="session", autouse=True)
def mitmdump_forks():
    """Each mitmdump a test starts is forked from one warmed interpreter per pytest process (half of a start is
    importing mitmproxy and transformers); `TITO_MITMDUMP_FORKS=0` starts each from scratch (the serial tier does)."""
    from tito_addon.replicas.mitmdump_forks import ForkServer
    from tito_addon.replicas.proxy_process import Mitmdump

    if os.environ.get("TITO_MITMDUMP_FORKS", "1") == "0":
        yield None
        return
    Mitmdump.forks = forks = ForkServer({**os.environ, "PYTHONUNBUFFERED": "1"}).start()
    yield forks
    Mitmdump.forks = None
    forks.close()


@pytest.fixture(scope="session", autouse=True)
def no_credentials_in_any_recording_or_log():
    """Across every test: no Authorization header value or API key in any mitmdump log or file a proxy recorded."""
    yield
    from tito_addon.replicas.proxy_process import Mitmdump

    leaks: list[str] = []
    for proxy in Mitmdump.instances:
        leaks += credential_leaks(proxy.output(), f"log of mitmdump in {proxy.cwd}")
        if proxy.record_dir.is_dir():
            for path in sorted(proxy.record_dir.rglob("*")):
                if path.is_file():
                    leaks += credential_leaks(path.read_bytes().decode("utf-8", "replace"), str(path))
    assert not leaks, "credentials leaked:\n" + "\n".join(leaks[:20])
