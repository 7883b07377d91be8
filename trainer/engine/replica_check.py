"""Whether a resource's vLLM replicas serve its model exactly, checked when they start.

vLLM serves a model family with its own implementation and kernels, and some families (or
features: attention sinks, MoE, linear attention, a head size) it cannot serve on a given
device, or serves with other numbers. A resource never samples wrong numbers for that
(docs/semantics.md §20): when its replicas start, the first one greedily continues a short
fixed prompt, and the trainer's own forward of the same tokens (the loaded model, one
sequence alone: the layout self-check makes it the trainer's) must agree within float noise
(float32: a max absolute logprob difference of 1e-3; 16-bit: a mean of 0.05); a full-weight
resource's replicas then reload the same weights in place, as a session's first sync makes
them, and are checked again. When they do not agree or cannot reload, or a replica cannot
start with a reason that says the architecture or a feature is unsupported, the resource's
samples run on the in-process loop instead (`GeneratorFallback`: a logged warning, and
`status_details.generator` says `backend: hf` with the `fallback` reason). Other start
failures (no such interpreter, a timeout, a crash, vLLM refusing the configuration) fail
the resource with vLLM's reason, as before.

A LoRA adapter vLLM does not take for the family (its output head or embeddings, say) is
refused when the adapter loads; that session's samples then run in-process
(`VllmGenerator`).
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

PROMPT_TOKENS = 16
NEW_TOKENS = 16
MAX_TOL = 1e-3  # float32 on both sides: max |logprob difference|
MEAN_TOL = 0.05  # a 16-bit side: mean |logprob difference|

# vLLM's reasons that mean "this architecture / feature is not served here" (not a bad
# configuration, a missing interpreter or a crash): the model falls back, never fails
_UNSUPPORTED = re.compile(
    r"NotImplementedError|not (?:yet )?supported|unsupported|does not support|"
    r"failed to be inspected|triton|expected target modules|"
    r"requires (?:BF16|FP16|bfloat16|float16)",
    re.IGNORECASE,
)


class Pool(Protocol):
    """What the check needs of a `replicas.ReplicaPool` (which imports this module)."""

    workdir: Path

    def generate(
        self, rows: list[dict[str, Any]], params: dict[str, Any]
    ) -> list[dict[str, Any]]: ...

    def load_weights(self, path: Path, restarts: bool = True) -> None: ...


class GeneratorFallback(Exception):
    """vLLM cannot serve this model exactly: its samples run in-process (the message: why)."""


def unsupported(reason: str) -> bool:
    """Whether vLLM's `reason` says the architecture or one of its features is unsupported."""
    return bool(_UNSUPPORTED.search(reason))


def model_type(model: Any, model_dir: Path) -> str:
    """The `model_type` of the loaded model, else of the checkpoint's config."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None):
        return str(config.model_type)  # type: ignore[union-attr]
    try:
        return str(json.loads((model_dir / "config.json").read_text())["model_type"])
    except (OSError, ValueError, KeyError):
        return model_dir.name


_WRAPPERS = ("ValidationError", "Error raised in subprocess", "CalledProcessError")


def logged_cause(log: Path, error: str) -> str:
    """` (cause: ...)`: the innermost error a replica's log holds, when vLLM's own reason only
    says to read the logs (a model class that failed to import, say); else empty."""
    if "logs" not in error:
        return ""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    for line in reversed(lines):
        text = re.sub(r"^.*?\[[\w.]+:\d+\] ", "", line).strip()  # vLLM's log prefix
        if re.match(r"[\w.]*(Error|Exception): ", text) and not any(w in text for w in _WRAPPERS):
            return f" (cause: {text})"
    return ""


def check_prompt(vocab: int) -> list[int]:
    """A fixed prompt of distinct-looking tokens that every vocabulary has (ids 2 and up)."""
    span = max(1, min(vocab, 1024) - 2)
    return [2 + (37 * i + 11) % span for i in range(PROMPT_TOKENS)]


def model_logprobs(model: Any, prompt: list[int], tokens: list[int]) -> list[float]:
    """The loaded model's logprobs of `tokens` after `prompt` (one sequence, eval mode)."""
    import torch

    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            logits = model(input_ids=ids, use_cache=False).logits[0].float()
    finally:
        model.train(training)
    logprobs = logits.log_softmax(-1)[len(prompt) - 1 : -1]
    picked = logprobs.gather(-1, torch.tensor(tokens, device=device)[:, None])[:, 0]
    return [float(x) for x in picked.cpu()]


def disagreement(pool: Pool, model: Any, replica_dtype: str) -> str | None:
    """None when a replica's logprobs of a greedy continuation are the trainer's (module
    docstring); else what differs, in words."""
    import torch

    head = model.get_output_embeddings()
    config = getattr(model.config, "text_config", None) or model.config
    vocab = int(head.weight.shape[0]) if head is not None else int(config.vocab_size)
    prompt = check_prompt(vocab)
    params: dict[str, Any] = {
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": 0,
        "max_tokens": NEW_TOKENS,
        "stop": None,
        "stop_token_ids": [],
    }
    (row,) = pool.generate([{"prompt": prompt, "seed": 0, "adapter": None}], params)
    tokens, served = list(row["tokens"]), [float(x) for x in row["logprobs"]]
    if not tokens or len(served) != len(tokens):
        return f"it returned {len(tokens)} tokens and {len(served)} logprobs"
    want = model_logprobs(model, prompt, tokens)
    diffs = [abs(a - b) if math.isfinite(a) else math.inf for a, b in zip(served, want)]
    exact = replica_dtype == "float32" and next(model.parameters()).dtype == torch.float32
    if exact:
        value, tolerance, what = max(diffs), MAX_TOL, "max"
    else:
        value, tolerance, what = sum(diffs) / len(diffs), MEAN_TOL, "mean"
    if value <= tolerance:
        return None
    return (
        f"its sampled logprobs differ from the trainer's forward of the same tokens by "
        f"{value:.2e} ({what} absolute difference, tolerance {tolerance:g}, replica dtype "
        f"{replica_dtype})"
    )


def write_full_weights(model: Any, weights: dict[str, torch.Tensor], directory: Path) -> None:
    """Full weights (CPU tensors, canonical names) as `directory/model.safetensors` under the
    checkpoint's names and shapes, which vLLM's loader reads: transformers' load-time
    conversions of `model`'s class reverted (a fused MoE expert stack back to one tensor per
    expert, as the checkpoint has them)."""
    from safetensors.torch import save_file

    if model is not None:
        from transformers.core_model_loading import revert_weight_conversion

        reverted: dict[str, torch.Tensor] = revert_weight_conversion(model, dict(weights))
        if reverted.keys() != weights.keys():  # split views of one tensor: saved apart
            weights = {name: t.contiguous().clone() for name, t in reverted.items()}
    save_file(weights, str(directory / "model.safetensors"))


def check(pool: Pool, model: Any, replica_dtype: str, *, lora: bool) -> str | None:
    """`disagreement` on the weights the replicas loaded; for full weights, once more after
    they reload the same weights in place, as a session's first sync makes them (what vLLM
    cannot reload in place, or reloads into other numbers, is not served)."""
    why = disagreement(pool, model, replica_dtype)
    if why is not None or lora:
        return why
    directory = pool.workdir / "start-check"
    directory.mkdir()
    try:
        weights = {n: p.detach().to("cpu").contiguous() for n, p in model.named_parameters()}
        write_full_weights(model, weights, directory)
        pool.load_weights(directory, restarts=False)
    except RuntimeError as exc:
        return f"it cannot reload its full weights in place: {exc}"
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    again = disagreement(pool, model, replica_dtype)
    return None if again is None else f"after an in-place reload, {again}"


def fallback_message(kind: str, why: str) -> str:
    """Why the model of type `kind` is not served by vLLM (warning, status and errors)."""
    return f"vLLM cannot serve model type {kind!r} exactly on this device: {why}"
