"""`python -m tito_addon` run over recordings, as a user runs it: offline replay as a mitmdump, redrive against a
live backend, and any subcommand that must succeed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from .proxy_harness import REPO, Mitmdump


def replay_proxy(record_dir: Path, cwd: Path, *options: str) -> Mitmdump:
    proxy = Mitmdump("", tokenizer="", record_dir=record_dir, cwd=cwd, via_module=True)
    proxy.argv = [sys.executable, "-m", "tito_addon", "replay", str(record_dir), "--listen-host", "127.0.0.1",
                  "-p", "0", *options]  # fmt: skip
    return proxy


def redrive(record_dir: Path, url: str, out: Path, kind: str = "sglang") -> dict:
    """`python -m tito_addon redrive` against `url` (a backend of `kind`), its JSON report."""
    result = subprocess.run(
        [sys.executable, "-m", "tito_addon", "redrive", str(record_dir), "--backend", url, "--backend-kind", kind,
         "--json", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert "total:" in result.stdout
    return json.loads(out.read_text())


def run_cli(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "tito_addon", *args], cwd=REPO, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result
