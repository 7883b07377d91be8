"""Rows 2 (our side), 4, 5, 8: engine code paths on Qwen3-shaped models (6: arms_ckpt)."""

from __future__ import annotations

import time
from typing import Any

import torch

from benchmarks.engine_setup import ce_samples, grpo_samples, make_resource, make_session
from benchmarks.harness import Measurement, measure
from benchmarks.shapes import old_logprobs, rl_batch, shape_from
from trainer.compute.attention import PACKED_SDPA, use_packed_sdpa
from trainer.compute.batch import PreparedSample, pack, prepare_samples
from trainer.compute.logprobs import token_logprobs
from trainer.contract.specs import AdamParams, LossConfig

GRPO_LOSS = {
    "type": "LOSS_TYPE_GRPO",
    "grpo_params": {
        "clip_low_threshold": 0.8,
        "clip_high_threshold": 1.28,
        "beta": 0.0,
        "agg_type": "GRPO_LOSS_AGGREGATION_TYPE_TOKEN_MEAN",
    },
}


def batch_from(params: dict[str, Any]) -> Any:
    b = params["batch"]
    shape = shape_from(params)
    return rl_batch(b["seed"], b["n"], tuple(b["prompt"]), tuple(b["completion"]), shape.vocab)


def sampler_logprobs(params: dict[str, Any], batch: Any) -> list[list[float]]:
    """Near-uniform random model: current logprobs ≈ −log V; jitter them to clip some ratios."""
    base = -float(torch.log(torch.tensor(float(shape_from(params).vocab))))
    return old_logprobs(params["batch"]["seed"], [[base] * len(c) for c in batch.completions])


def grpo_ours_arm(params: dict[str, Any]) -> Measurement:
    """One GRPO (TOKEN_MEAN, β=0) forward-backward through a full-weights session."""
    resource = make_resource(params["model_dir"], lora=False, options=params.get("options"))
    session = make_session(resource)
    batch = batch_from(params)
    samples = grpo_samples(batch, sampler_logprobs(params, batch))
    loss = LossConfig.model_validate(GRPO_LOSS)
    losses: list[float] = []

    def step() -> None:
        losses.append(session.forward_backward(loss, samples)["loss"])

    def zero() -> None:
        session.optimizer.zero_grad(set_to_none=True)

    result = measure(step, reps=params["reps"], warmup=params.get("warmup", 0), after=zero)
    result.extra = {"loss": losses[-1], "tokens": batch.num_tokens}
    return result


def padded_layout(
    prepared: list[PreparedSample],
) -> tuple[dict[str, torch.Tensor], torch.Tensor, torch.Tensor]:
    """The layout packing replaces: one sample per row, right-padded to the longest, with a 2D
    padding mask; (decoder inputs, kept positions of the flattened `[R*L]` hidden states in
    sample order, their targets)."""
    width = max(s.length for s in prepared)
    ids = torch.zeros(len(prepared), width, dtype=torch.long)
    mask = torch.zeros(len(prepared), width, dtype=torch.long)
    keep_P, targets_P = [], []
    for r, s in enumerate(prepared):
        ids[r, : s.length] = s.tokens_T
        mask[r, : s.length] = 1
        kept = torch.nonzero(s.mask_T != 0).squeeze(-1)
        keep_P.append(r * width + kept)
        targets_P.append(s.targets_T[kept])
    return {"input_ids": ids, "attention_mask": mask}, torch.cat(keep_P), torch.cat(targets_P)


def packing_arm(params: dict[str, Any]) -> Measurement:
    """Cross entropy forward-backward on a mixed-length batch, in one of three layouts.

    All run the same decoder + head + loss code; only the layout differs:
    - "packed": the engine's `pack`, fed as one unpadded row to `packed_sdpa` (varlen);
    - "packed_mask": `pack`'s padded rows with the dense block-diagonal causal mask;
    - "padded": one sample per row, right-padded to the longest, with a 2D padding mask.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(params["model_dir"], dtype=torch.float32)
    model.train()
    shape = shape_from(params)
    batch = batch_from(params)
    prepared = prepare_samples(
        ce_samples(batch), vocab_size=shape.vocab, max_seq_length=1 << 20, max_batch_size=4096
    )
    head = model.get_output_embeddings()
    decoder = model.get_decoder()
    if params["layout"] in ("packed", "packed_mask"):
        (micro,) = pack(prepared, row_tokens=params["row_tokens"], token_budget=1 << 30)
        impl = "sdpa"
        if params["layout"] == "packed":
            use_packed_sdpa(model)
            impl = PACKED_SDPA
        inputs, keep = micro.decoder_inputs(impl)
        targets = micro.targets_P
    else:
        inputs, keep, targets = padded_layout(prepared)

    def step() -> None:
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        hidden_P_H = hidden.reshape(-1, hidden.shape[-1])[keep]
        lp, _ = token_logprobs(hidden_P_H, head, targets)
        (-lp.sum()).backward()

    def zero() -> None:
        model.zero_grad(set_to_none=True)

    result = measure(step, reps=params["reps"], warmup=params.get("warmup", 1), after=zero)
    result.extra = {"tokens": batch.num_tokens, "trained_tokens": int(targets.shape[0])}
    return result


def lora_sync_arm(params: dict[str, Any]) -> Measurement:
    """weights-sync (SYNCHRONOUS) of a LoRA session; `extra.copy_times`: copying the same
    adapter tensors into preallocated buffers with one `torch._foreach_copy_`, interleaved."""
    resource = make_resource(params["model_dir"], lora=True, generator=True)
    session = make_session(resource, lora_rank=params["rank"])
    sources = [p.detach() for p in session.policy.trainable.values()]
    targets = [torch.empty_like(p) for p in sources]
    copy_times: list[float] = []

    def sync() -> None:
        session.weights_sync("WEIGHT_SYNC_TYPE_SYNCHRONOUS")

    def copy() -> None:
        start = time.perf_counter()
        torch._foreach_copy_(targets, sources)
        copy_times.append(time.perf_counter() - start)

    result = measure(sync, reps=params["reps"], warmup=params.get("warmup", 3), after=copy)
    adapter_bytes = sum(p.numel() * p.element_size() for p in sources)
    result.extra = {"copy_times": copy_times, "adapter_mb": adapter_bytes / 2**20}
    return result


def train_memory_arm(params: dict[str, Any]) -> Measurement:
    """forward-backward + optim-step, LoRA or full weights; peak is measured from the bare
    process (weights, gradients, AdamW moments, activations all counted)."""
    lora = params["kind"] == "lora"
    resource = make_resource(params["model_dir"], lora=lora, options=params.get("options"))
    session = make_session(resource, lora_rank=params.get("rank") if lora else None)
    batch = batch_from(params)
    samples = ce_samples(batch)
    loss = LossConfig(type="LOSS_TYPE_CROSS_ENTROPY")

    def step() -> None:
        session.forward_backward(loss, samples)
        session.optim_step(AdamParams())

    result = measure(step, reps=params["reps"], warmup=0)
    trainable = sum(p.numel() for p in session.policy.trainable.values())
    result.extra = {"trainable_params": trainable, "tokens": batch.num_tokens}
    return result


def inprocess_fb_arm(params: dict[str, Any]) -> Measurement:
    """Row 7, in-process side: a LoRA session's cross-entropy forward-backward."""
    resource = make_resource(params["model_dir"], lora=True)
    session = make_session(resource, lora_rank=params["rank"])
    samples = ce_samples(batch_from(params))
    loss = LossConfig(type="LOSS_TYPE_CROSS_ENTROPY")
    return measure(
        lambda: session.forward_backward(loss, samples),
        reps=params["reps"],
        warmup=params.get("warmup", 1),
    )
