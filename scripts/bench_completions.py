"""Completions against the same generator's Tinker `asample`, and hot-load against writing the
weights, on one worker, in one run.

    python scripts/bench_completions.py --rounds 5 --tokens 64

A worker in this process serves a tiny Qwen3 at init scale (near-uniform next tokens, so a
row rarely ends early at EOS; every arm samples at the same seed, so the same tokens). One LoRA
sampler checkpoint is saved through the Tinker face; each round then samples it, at batch 1, 8
and 32 (`n` / `num_samples`), `--tokens` new tokens each with no stop, three ways over HTTP:
Tinker's `asample` (a future, polled), `/inference/v1/completions` answered whole, and the same
route streamed (SSE, read to `[DONE]`). Reported: the median tokens/s of each arm per batch and
each route's ratio to `asample` (the HTTP and SSE cost of the completions route).

Then, `--rounds` times: `save_weights_for_sampler` of a LoRA model and of a full-weight model
(the write), and the hot-load of each into a deployment (POST until it has loaded). Reported:
the median seconds of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.api.conftest import TOKEN, serve_in_thread  # noqa: E402
from tests.fireworks.conftest import QWEN  # noqa: E402
from tests.tinker import tinker_http as th  # noqa: E402
from tests.tinker.conftest import build_served_model  # noqa: E402

PROMPT = [3, 17, 22, 9, 27, 5, 11, 4]
BATCHES = (1, 8, 32)


def trained(http: httpx.Client, rank: int, name: str) -> tuple[str, float]:
    """A model one step from the base (LoRA rank `rank`, 0: full weights), saved for the
    sampler: its tinker path and the seconds the save took."""
    session = th.new_session(http)
    lora = {"rank": rank, "seed": 0}
    body = {"session_id": session, "model_seq_id": 0, "base_model": QWEN, "lora_config": lora}
    model_id = th.ok(http, "/create_model", body)["model_id"]
    data = {"data": [th.datum(PROMPT)], "loss_fn": "cross_entropy"}
    th.ok(http, "/forward_backward", {"model_id": model_id, "forward_backward_input": data})
    th.ok(http, "/optim_step", th.optim_body(model_id, lr=1e-2))
    start = time.perf_counter()
    saved = th.ok(http, "/save_weights_for_sampler", {"model_id": model_id, "path": name})
    return str(saved["path"]), time.perf_counter() - start


def asample(http: httpx.Client, path: str, n: int, tokens: int) -> int:
    body = {
        "model_path": path,
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "num_samples": n,
        "sampling_params": {"max_tokens": tokens, "temperature": 1.0, "seed": 7},
    }
    response = http.post("/asample", json=body)
    response.raise_for_status()
    result = th.wait(http, response.json()["request_id"])
    return sum(len(s["tokens"]) for s in result["sequences"])


def completion(http: httpx.Client, path: str, n: int, tokens: int, stream: bool) -> int:
    body = {
        "model": path,
        "prompt": PROMPT,
        "n": n,
        "max_tokens": tokens,
        "temperature": 1.0,
        "seed": 7,
        "logprobs": True,
        "raw_output": True,
        "stream": stream,
    }
    if not stream:
        response = http.post("/inference/v1/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])
    count = 0
    with http.stream("POST", "/inference/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if '"usage"' in line:  # the last chunk; the others are read, not parsed
                count = int(json.loads(line[6:])["usage"]["completion_tokens"])
    return count


def sampling(url: str, path: str, rounds: int, tokens: int) -> dict[str, Any]:
    tinker = httpx.Client(base_url=f"{url}{th.PREFIX}", headers={"X-API-Key": TOKEN}, timeout=600)
    plain = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600)
    arms = {
        "asample": lambda n: asample(tinker, path, n, tokens),
        "completions": lambda n: completion(plain, path, n, tokens, stream=False),
        "completions_sse": lambda n: completion(plain, path, n, tokens, stream=True),
    }
    for arm in arms.values():  # warm up: the sampler session opens on the first call
        arm(1)
    rates: dict[int, dict[str, list[float]]] = {b: {a: [] for a in arms} for b in BATCHES}
    for _ in range(rounds):
        for batch in BATCHES:
            for name, arm in arms.items():
                start = time.perf_counter()
                generated = arm(batch)
                rates[batch][name].append(generated / (time.perf_counter() - start))
    out: dict[str, Any] = {}
    for batch, by_arm in rates.items():
        medians = {a: statistics.median(r) for a, r in by_arm.items()}
        out[f"batch_{batch}"] = {
            "tokens_per_s": {a: round(m, 1) for a, m in medians.items()},
            "completions_over_asample": round(medians["completions"] / medians["asample"], 3),
            "sse_over_asample": round(medians["completions_sse"] / medians["asample"], 3),
        }
    return out


def hot_loads(url: str, rounds: int) -> dict[str, Any]:
    tinker = httpx.Client(base_url=f"{url}{th.PREFIX}", headers={"X-API-Key": TOKEN}, timeout=600)
    plain = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=600)
    account = plain.get("/v1/accounts").json()["accounts"][0]["name"].split("/")[1]
    body = {"baseModel": QWEN, "deploymentShape": "accounts/local/deploymentShapes/bench"}
    created = plain.post(f"/v1/accounts/{account}/deployments?deploymentId=bench", json=body)
    created.raise_for_status()
    header = {"fireworks-deployment": f"accounts/{account}/deployments/bench"}
    times: dict[str, list[float]] = {"lora_save": [], "lora_hot_load": []}
    times.update(full_save=[], full_hot_load=[])
    for i in range(rounds):
        for kind, rank in (("lora", 8), ("full", 0)):
            path, saved_s = trained(tinker, rank, f"{kind}-{i}")
            start = time.perf_counter()
            identity = {"identity": path}
            posted = plain.post("/hot_load/v1/models/hot_load", json=identity, headers=header)
            posted.raise_for_status()
            while True:
                replica = plain.get("/hot_load/v1/models/hot_load", headers=header).json()
                if replica["replicas"][0]["current_snapshot_identity"] == path:
                    break
                assert replica["replicas"][0]["loading_state"]["stage"] != "error", replica
                time.sleep(0.01)
            times[f"{kind}_save"].append(saved_s)
            times[f"{kind}_hot_load"].append(time.perf_counter() - start)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {
        "median_s": {k: round(v, 4) for k, v in medians.items()},
        "lora_hot_load_over_save": round(medians["lora_hot_load"] / medians["lora_save"], 3),
        "full_hot_load_over_save": round(medians["full_hot_load"] / medians["full_save"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="bench-completions-"))
    model = build_served_model(root / "model", scale=1.0, seed=0, tokenizer_dir=root / "model")
    with serve_in_thread(root / "storage", {QWEN: model}) as server:
        with httpx.Client(
            base_url=f"{server.url}{th.PREFIX}", headers={"X-API-Key": TOKEN}, timeout=600
        ) as http:
            path, _ = trained(http, 8, "bench")
        report = {
            "rounds": args.rounds,
            "tokens": args.tokens,
            "sampling": sampling(server.url, path, args.rounds, args.tokens),
            "hot_load": hot_loads(server.url, args.rounds),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
