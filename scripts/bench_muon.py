"""Time of a Muon optim-step ÷ an AdamW optim-step on Qwen3-0.6B's trainable shapes.

    python scripts/bench_muon.py --kind lora --rank 32          # LoRA r32 on every projection
    python scripts/bench_muon.py --kind full --device cuda      # full weights

An optimizer step's cost depends only on the trainable tensors, so no model is built: the
tensors have Qwen3-0.6B's names and shapes (28 layers, hidden 1024, q 2048, kv 1024, MLP 3072,
tied 151936-token embedding), with random gradients. Both arms run the engine's own steps
(`optim.adamw_step`, `muon.muon_step`: global clip included) side by side, alternating, and
report the median of `--steps` timed steps after `--warmup`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from trainer.compute import optim
from trainer.compute.muon import muon_step, new_muon
from trainer.compute.placement import Solo
from trainer.contract.muon_params import MuonParams
from trainer.contract.specs import AdamParams

HIDDEN, Q, KV, MLP, VOCAB = 1024, 2048, 1024, 3072, 151936
PROJ = {  # name: (out, in)
    "self_attn.q_proj": (Q, HIDDEN),
    "self_attn.k_proj": (KV, HIDDEN),
    "self_attn.v_proj": (KV, HIDDEN),
    "self_attn.o_proj": (HIDDEN, Q),
    "mlp.gate_proj": (MLP, HIDDEN),
    "mlp.up_proj": (MLP, HIDDEN),
    "mlp.down_proj": (HIDDEN, MLP),
}


def shapes(kind: str, layers: int, rank: int) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    if kind == "full":
        out["model.embed_tokens.weight"] = (VOCAB, HIDDEN)
    for i in range(layers):
        for proj, (o, n) in PROJ.items():
            base = f"model.layers.{i}.{proj}"
            if kind == "lora":
                out[f"{base}.lora_A.weight"] = (rank, n)
                out[f"{base}.lora_B.weight"] = (o, rank)
            else:
                out[f"{base}.weight"] = (o, n)
        if kind == "full":
            for norm in ("input_layernorm", "post_attention_layernorm"):
                out[f"model.layers.{i}.{norm}.weight"] = (HIDDEN,)
            out[f"model.layers.{i}.self_attn.q_norm.weight"] = (128,)
            out[f"model.layers.{i}.self_attn.k_norm.weight"] = (128,)
    if kind == "lora":  # train_unembed: a LoRA on the (tied) head
        out["lm_head.lora_A.weight"] = (rank, HIDDEN)
        out["lm_head.lora_B.weight"] = (VOCAB, rank)
    else:
        out["model.norm.weight"] = (HIDDEN,)
    return out


def _params(spec: dict[str, tuple[int, ...]], device: str) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        n: torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02)
        for n, s in spec.items()
    }


def _grads(params: dict[str, torch.nn.Parameter], seed: int) -> None:
    gen = torch.Generator(device=next(iter(params.values())).device).manual_seed(seed)
    for p in params.values():
        p.grad = torch.randn(p.shape, device=p.device, generator=gen) * 1e-3


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kind", choices=("lora", "full"), default="lora")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    spec = shapes(args.kind, args.layers, args.rank)
    adam_params, muon_params = _params(spec, args.device), _params(spec, args.device)
    adamw = optim.new_adamw(list(adam_params.values()))
    muon = new_muon(muon_params, "MUON_SCALING_STRATEGY_MATCH_ADAM")
    comm = Solo()
    times: dict[str, list[float]] = {"adamw": [], "muon": []}
    for step in range(args.warmup + args.steps):
        for arm, params in (("adamw", adam_params), ("muon", muon_params)):
            _grads(params, step)
            _sync(args.device)
            start = time.perf_counter()
            if arm == "adamw":
                optim.adamw_step(adamw, list(params.values()), AdamParams(), comm)
            else:
                muon_step(muon, list(params.values()), MuonParams(), comm)
            _sync(args.device)
            if step >= args.warmup:
                times[arm].append(time.perf_counter() - start)
    a, m = statistics.median(times["adamw"]), statistics.median(times["muon"])
    numel = sum(p.numel() for p in adam_params.values())
    print(
        f"| {args.kind}{f' r{args.rank}' if args.kind == 'lora' else ''}, {args.layers} layers "
        f"| {numel / 1e6:.1f} M | {args.device} | AdamW {a * 1e3:.1f} ms | Muon {m * 1e3:.1f} ms "
        f"| **{m / a:.2f}×** |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
