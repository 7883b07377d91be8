"""Row 2, TRL's side: `GRPOTrainer.compute_loss` (loss_type "dapo", β=0) + backward.

The trainer is built the ordinary way (`GRPOTrainer(model, reward_funcs, args, ...)`, which
patches the model with TRL's fused LM head), then fed the same prompts, completions,
advantages and sampler logprobs as our session: prompts left-padded, completions
right-padded, as TRL's generation step lays them out. `num_items_in_batch` is the number of
completion tokens, the normaliser of "dapo" for one accumulation window.
"""

from __future__ import annotations

import tempfile
from typing import Any

import torch

from benchmarks.arms_engine import batch_from, sampler_logprobs
from benchmarks.harness import Measurement, measure


def _tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "[PAD]": 1, "a": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[PAD]"
    )


def trl_inputs(params: dict[str, Any]) -> dict[str, torch.Tensor]:
    batch = batch_from(params)
    old = sampler_logprobs(params, batch)
    n = len(batch.prompts)
    p_max = max(len(p) for p in batch.prompts)
    c_max = max(len(c) for c in batch.completions)
    prompt_ids = torch.ones(n, p_max, dtype=torch.long)
    prompt_mask = torch.zeros(n, p_max, dtype=torch.long)
    completion_ids = torch.ones(n, c_max, dtype=torch.long)
    completion_mask = torch.zeros(n, c_max, dtype=torch.long)
    old_logps = torch.zeros(n, c_max)
    for i, (prompt, completion) in enumerate(zip(batch.prompts, batch.completions)):
        prompt_ids[i, p_max - len(prompt) :] = torch.tensor(prompt)
        prompt_mask[i, p_max - len(prompt) :] = 1
        completion_ids[i, : len(completion)] = torch.tensor(completion)
        completion_mask[i, : len(completion)] = 1
        old_logps[i, : len(completion)] = torch.tensor(old[i])
    return {
        "prompt_ids": prompt_ids,
        "prompt_mask": prompt_mask,
        "completion_ids": completion_ids,
        "completion_mask": completion_mask,
        "advantages": torch.tensor(batch.advantages_B),
        "old_per_token_logps": old_logps,
        "num_items_in_batch": completion_mask.sum().float(),
    }


def grpo_trl_arm(params: dict[str, Any]) -> Measurement:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(params["model_dir"], dtype=torch.float32)
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        loss_type="dapo",
        beta=0.0,
        epsilon=0.2,
        epsilon_high=0.28,
        per_device_train_batch_size=params["batch"]["n"],
        num_generations=params["batch"]["n"],
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a"] * params["batch"]["n"]}),
        processing_class=_tokenizer(),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop; one window here
    inputs = trl_inputs(params)
    model.train()
    losses: list[float] = []

    def step() -> None:
        loss = trainer.compute_loss(model, inputs)
        loss.backward()
        losses.append(float(loss.detach()))

    def zero() -> None:
        model.zero_grad(set_to_none=True)

    result = measure(step, reps=params["reps"], warmup=params.get("warmup", 0), after=zero)
    import trl

    result.extra = {"loss": losses[-1], "trl_version": trl.__version__}
    return result
