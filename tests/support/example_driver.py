"""The example rollout driver (examples/rollout_driver.py) as its tests run it: a subprocess beside a proxy in regular
mode that serves the control API; for the first run and the preflight refusals (test_example_driver.py) and the runs
that take three driver runs each (test_example_driver_runs.py, the full tier)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from .basics import tokenizer_path
from .proxy_harness import REPO, Mitmdump

TOKEN = "driver-token-0123456789abcdef"


def drive(*args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TITO_CONTROL_TOKEN"}
    return subprocess.run(
        [sys.executable, str(REPO / "examples" / "rollout_driver.py"), *args],
        cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def regular_proxy(tmp_path: Path, **options: str) -> Mitmdump:
    return Mitmdump("", tokenizer=tokenizer_path("qwen3"), record_dir=tmp_path / "rec", cwd=tmp_path, mode="regular",
                    options={"tito_control_token": TOKEN, **options})  # fmt: skip
