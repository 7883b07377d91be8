"""One vLLM generator replica: a child process of the worker that owns one vLLM engine.

Run by `trainer/engine/replicas.py` in the interpreter that has vLLM (its own environment, so
this file imports nothing of `trainer`, only the standard library, torch, safetensors and
vllm):

    python vllm_replica.py --socket PATH --config JSON

It listens on the Unix socket `PATH`, starts the engine, then serves one connection: one JSON
object per line each way. Requests carry an `id` that their reply repeats:

- `{"op": "generate", "rows": [{"prompt", "seed", "adapter"}], "params": {...}}`: every row is
  one vLLM request; the reply comes once all rows of this request are done, so a short job
  never waits for a long one (continuous batching). `{"rows": [{"tokens", "logprobs",
  "finish", "top"}]}` (`top`: with `params.top_logprobs` k, each token's ranked ids and
  logprobs, the k most likely first; else null). With `"watch": true`, each engine step that
  makes tokens for the request's unfinished rows also writes `{"id", "progress": [[row,
  tokens, logprobs], ...]}` (the new tokens only) before the reply, and the request can be
  cancelled.
- `{"op": "cancel", "job": ID}`: the watched request `ID` ends at the next step: its
  unfinished rows stop with the tokens they have (`"finish": "cancelled"`), its reply comes
  then; answers `{"ok": true}` (also when `ID` has already ended).
- `{"op": "load_adapter", "adapter": {"name", "id", "path"}}` / `{"op": "drop_adapter", "id"}`:
  a PEFT adapter directory in and out of the engine. A row names its adapter the same way, so
  an adapter vLLM evicted from its cache is read again from its path, never missing.
- `{"op": "load_weights", "path"}`: full weights, in place, from a directory of safetensors in
  checkpoint layout (whole packed groups), then the prefix cache dropped.
- `{"op": "health"}`.

The first line it writes is `{"ready": true, ...}` once the engine is up, or `{"ready":
false, "error": ...}` with vLLM's own reason. Failures of one request are that request's
reply (`{"error": ...}`); the engine keeps serving.

Distinct adapters among running rows stay below `max_loras`: with every slot taken, vLLM was
seen to apply part of an adapter to rows that have none (docs/design/vllm.md), so a row whose
adapter would take the last slot waits until one frees.
"""

from __future__ import annotations

import argparse
import json
import os
import selectors
import socket
import sys
import time
import traceback
from collections import deque
from typing import Any


def _extension_cls() -> str:
    """The worker extension that vLLM mixes into its worker, by import path (this folder is
    the child's `PYTHONPATH`)."""
    return "vllm_replica.WeightsExtension"


class WeightsExtension:
    """Mixed into vLLM's worker (`worker_extension_cls`): full weights in place from a path."""

    def trainer_load_weights(self, path: str) -> int:
        import torch
        from safetensors.torch import load_file

        worker: Any = self
        runner = worker.model_runner
        tensors: dict[str, torch.Tensor] = {}
        for name in sorted(os.listdir(path)):
            if name.endswith(".safetensors"):
                tensors.update(load_file(os.path.join(path, name)))
        worker.reload_weights(weights_iterator=iter(tensors.items()))
        _repack_output_heads(runner.get_model())
        return len(tensors)


def _repack_output_heads(model: Any) -> None:
    """On the CPU, vLLM serves an output head (and an embedding tied to it) from a packed copy
    made when the weights were first loaded; a reload leaves that copy stale. Pack again every
    module whose packed GEMM keeps its weight (the embeddings; linear layers drop theirs and
    are rebuilt by the reload itself)."""
    import torch

    if not hasattr(torch.ops, "_C") or next(model.parameters()).device.type != "cpu":
        return
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    for module in model.modules():
        weight = getattr(module, "weight", None)
        if hasattr(module, "cpu_linear") and weight is not None and weight.numel() > 0:
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def _request_amx() -> bool:
    """AMX permission for this process before vLLM's kernels run (`sitecustomize.py` asked
    already, at start-up; torch's own request where it has one). False without AMX."""
    try:
        import torch

        init = getattr(torch.cpu, "_init_amx", None)
        if init is not None and init():
            return True
        from sitecustomize import request_amx

        return bool(request_amx())
    except Exception:  # no AMX, or no way to ask: vLLM's kernels then do without it
        return False


def _top(position: dict[int, Any]) -> tuple[list[int], list[float]]:
    """One position's ranked logprobs (the top k, and the chosen token's if it ranks below
    them), most likely first: ids and logprobs."""
    ranked = sorted(position.items(), key=lambda item: item[1].rank)
    return [int(t) for t, _ in ranked], [float(lp.logprob) for _, lp in ranked]


def _made() -> dict[str, Any]:
    return {"tokens": [], "logprobs": [], "top": []}


def _extend(made: dict[str, Any], seq: Any, top: bool) -> tuple[list[int], list[float]]:
    """A watched row's new tokens and their logprobs since the last step (vLLM's outputs
    are cumulative), also added to `made`."""
    start = len(made["tokens"])
    tokens = [int(t) for t in seq.token_ids[start:]]
    positions = list(seq.logprobs or [])[start : start + len(tokens)]
    logprobs = [float(lp[t].logprob) for lp, t in zip(positions, tokens)]
    made["tokens"] += tokens
    made["logprobs"] += logprobs
    if top:
        made["top"] += [_top(lp) for lp in positions]
    return tokens, logprobs


class Replica:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.max_active_adapters = max(1, int(config["max_loras"]) - 1)
        self.engine: Any = None
        self.pending: deque[tuple[str, dict[str, Any], Any, Any]] = deque()
        self.jobs: dict[str, dict[str, Any]] = {}
        self.row_adapter: dict[str, int | None] = {}
        self.adapters: dict[int, Any] = {}  # loaded LoRARequests by id

    def start(self) -> None:
        from vllm import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        _request_amx()
        c = self.config
        args: dict[str, Any] = {
            "model": c["model"],
            "tokenizer": c.get("tokenizer"),
            "skip_tokenizer_init": c.get("tokenizer") is None,
            "dtype": c["dtype"],
            "max_model_len": c["max_model_len"],
            "enforce_eager": c["enforce_eager"],
            "seed": 0,
            "enable_prefix_caching": True,
            "worker_extension_cls": _extension_cls(),
            "trust_remote_code": c.get("trust_remote_code", False),
        }
        if c.get("enable_lora"):
            args.update(
                enable_lora=True,
                max_loras=c["max_loras"],
                max_lora_rank=c["max_lora_rank"],
                max_cpu_loras=max(c["max_loras"], 4 * c["max_loras"]),
            )
        if c.get("gpu_memory_utilization") is not None and c.get("device") == "cuda":
            args["gpu_memory_utilization"] = c["gpu_memory_utilization"]
        args.update(c.get("extra_engine_args") or {})
        self.engine = LLMEngine.from_engine_args(EngineArgs(**args))
        self._probe()

    def _probe(self) -> None:
        """One token generated: a replica is healthy once it can decode (some failures, an
        attention shape the CPU kernels lack, show only then)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
        self.engine.add_request("probe", TokensPrompt(prompt_token_ids=[0]), params)
        while self.engine.has_unfinished_requests():
            self.engine.step()

    # -- requests --------------------------------------------------------------------------

    def handle(self, message: dict[str, Any]) -> dict[str, Any] | None:
        op = message.get("op")
        if op == "generate":
            self._add_job(message)
            return None
        if op == "load_adapter":
            start = time.perf_counter()
            self.engine.add_lora(self._lora(message["adapter"]))
            return {"ok": True, "seconds": time.perf_counter() - start}
        if op == "drop_adapter":
            lora_id = int(message["adapter_id"])
            self.adapters.pop(lora_id, None)
            if lora_id in self.engine.list_loras():
                self.engine.remove_lora(lora_id)
            return {"ok": True}
        if op == "load_weights":
            start = time.perf_counter()
            (count,) = self.engine.collective_rpc("trainer_load_weights", args=(message["path"],))
            self.engine.reset_prefix_cache()
            return {"ok": True, "tensors": count, "seconds": time.perf_counter() - start}
        if op == "cancel":
            job = self.jobs.get(str(message.get("job")))
            if job is not None and job["watch"]:
                job["cancelled"] = True
            return {"ok": True}
        if op == "health":
            return {"ok": True, "running": len(self.jobs), "pending": len(self.pending)}
        return {"error": f"unknown op {op!r}"}

    def _lora(self, adapter: dict[str, Any]) -> Any:
        from vllm.lora.request import LoRARequest

        lora_id = int(adapter["id"])
        request = self.adapters.get(lora_id)
        if request is None:
            request = LoRARequest(adapter["name"], lora_id, adapter["path"])
            self.adapters[lora_id] = request
        return request

    def _add_job(self, message: dict[str, Any]) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        job_id = message["id"]
        p = message["params"]
        rows = message["rows"]
        self.jobs[job_id] = {
            "left": len(rows),
            "rows": [None] * len(rows),
            "error": None,
            "top": bool(p.get("top_logprobs")),
            "watch": bool(message.get("watch")),
            "made": [_made() for _ in rows],  # watched rows: what each has generated so far
            "cancelled": False,
        }
        for r, row in enumerate(rows):
            params = SamplingParams(
                n=1,
                temperature=p["temperature"],
                top_p=p["top_p"],
                top_k=p["top_k"] if p["top_k"] > 0 else 0,
                max_tokens=p["max_tokens"],
                seed=row["seed"],
                stop=p["stop"] or None,
                stop_token_ids=p["stop_token_ids"],
                ignore_eos=True,  # the worker's EOS ids come in stop_token_ids
                logprobs=int(p.get("top_logprobs") or 0),  # the chosen token's, plus the top k
                detokenize=bool(p["stop"]),
                skip_special_tokens=False,  # stop strings see the text the in-process loop does
            )
            adapter = row.get("adapter")
            lora = self._lora(adapter) if adapter else None
            prompt = TokensPrompt(prompt_token_ids=row["prompt"])
            self.pending.append((f"{job_id}#{r}", params, prompt, lora))
        self._admit()

    def _active_adapters(self) -> set[int]:
        return {a for a in self.row_adapter.values() if a is not None}

    def _admit(self) -> None:
        """Pending rows into the engine, in order, while their adapters fit (module doc)."""
        waiting: deque[tuple[str, Any, Any, Any]] = deque()
        while self.pending:
            row_id, params, prompt, lora = self.pending.popleft()
            active = self._active_adapters()
            lora_id = None if lora is None else lora.lora_int_id
            full = len(active) >= self.max_active_adapters
            if lora_id is not None and lora_id not in active and full:
                waiting.append((row_id, params, prompt, lora))
                continue
            try:
                self.engine.add_request(row_id, prompt, params, lora_request=lora)
            except Exception as exc:  # this job's own bad request
                self._fail(row_id.split("#")[0], f"{type(exc).__name__}: {exc}")
                continue
            self.row_adapter[row_id] = lora_id
        self.pending = waiting

    def _fail(self, job_id: str, error: str) -> None:
        job = self.jobs.get(job_id)
        if job is not None and job["error"] is None:
            job["error"] = error

    def step(self) -> list[dict[str, Any]]:
        """One engine step; the progress of watched jobs, then the replies of the jobs whose
        rows are now all done (or that were cancelled)."""
        replies = []
        progress: dict[str, list[list[Any]]] = {}
        for out in self.engine.step():
            job_id, _, index = out.request_id.rpartition("#")
            job = self.jobs.get(job_id)
            if not out.finished:
                if job is not None and job["watch"]:
                    tokens, logprobs = _extend(job["made"][int(index)], out.outputs[0], job["top"])
                    if tokens:
                        progress.setdefault(job_id, []).append([int(index), tokens, logprobs])
                continue
            self.row_adapter.pop(out.request_id, None)
            if job is None:
                continue
            (seq,) = out.outputs
            tokens = list(seq.token_ids)
            logprobs = [float(lp[t].logprob) for lp, t in zip(seq.logprobs or [], tokens)]
            job["rows"][int(index)] = {
                "tokens": tokens,
                "logprobs": logprobs,
                "top": [_top(lp) for lp in seq.logprobs or []] if job["top"] else None,
                "finish": seq.finish_reason,
                "stop_reason": seq.stop_reason if isinstance(seq.stop_reason, int) else None,
            }
            job["left"] -= 1
        replies += [{"id": job_id, "progress": rows} for job_id, rows in progress.items()]
        ended = [j for j, job in self.jobs.items() if job["left"] <= 0 or job["error"]]
        for job_id in ended + [j for j, job in self.jobs.items() if job["cancelled"]]:
            if job_id not in self.jobs:
                continue
            job = self.jobs.pop(job_id)
            if job["cancelled"] and not job["error"] and job["left"] > 0:
                self._drop_rows(job_id)
                rows = job["rows"]
                for r, row in enumerate(rows):
                    if row is None:
                        made = job["made"][r]
                        top = made["top"] if job["top"] else None
                        rows[r] = {**made, "top": top, "finish": "cancelled", "stop_reason": None}
                replies.append({"id": job_id, "rows": rows})
            elif job["error"]:
                self._drop_rows(job_id)
                replies.append({"id": job_id, "error": job["error"]})
            else:
                replies.append({"id": job_id, "rows": job["rows"]})
        self._admit()
        return replies

    def _drop_rows(self, job_id: str) -> None:
        """A failed job's rows still queued or running: dropped."""
        prefix = f"{job_id}#"
        self.pending = deque(p for p in self.pending if not p[0].startswith(prefix))
        running = [r for r in self.row_adapter if r.startswith(prefix)]
        if running:
            self.engine.abort_request(running)
            for r in running:
                self.row_adapter.pop(r, None)

    @property
    def busy(self) -> bool:
        return bool(self.jobs) or bool(self.pending)


def serve(sock_path: str, config: dict[str, Any]) -> None:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(sock_path)
    listener.listen(1)
    conn, _ = listener.accept()
    listener.close()

    def send(obj: dict[str, Any]) -> None:
        conn.setblocking(True)
        conn.sendall((json.dumps(obj) + "\n").encode())
        conn.setblocking(False)

    replica = Replica(config)
    try:
        replica.start()
    except BaseException as exc:
        traceback.print_exc(file=sys.stderr)
        send({"ready": False, "error": f"{type(exc).__name__}: {exc}"})
        raise SystemExit(3) from exc
    send({"ready": True, "pid": os.getpid()})
    conn.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(conn, selectors.EVENT_READ)
    buffer = b""
    while True:
        events = selector.select(timeout=0 if replica.busy else 1.0)
        if events:
            try:
                chunk = conn.recv(1 << 20)
            except BlockingIOError:
                chunk = None
            if chunk == b"":  # the worker is gone: so is this replica
                return
            if chunk:
                buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            message = json.loads(line)
            try:
                reply = replica.handle(message)
            except Exception as exc:
                traceback.print_exc(file=sys.stderr)
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            if reply is not None:
                send({"id": message.get("id"), **reply})
        if replica.busy:
            try:
                replies = replica.step()
            except Exception as exc:  # the engine itself failed: fail its jobs, then exit
                traceback.print_exc(file=sys.stderr)
                for job_id in list(replica.jobs):
                    send(
                        {"id": job_id, "error": f"vLLM engine failed: {type(exc).__name__}: {exc}"}
                    )
                raise SystemExit(4) from exc
            for reply in replies:
                send(reply)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket", required=True)
    parser.add_argument("--config", required=True, help="JSON engine settings")
    args = parser.parse_args()
    config = json.loads(args.config)
    if config.get("threads"):
        os.environ.setdefault("OMP_NUM_THREADS", str(config["threads"]))
    serve(args.socket, config)


if __name__ == "__main__":
    main()
