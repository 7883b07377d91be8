"""The conformance table: every model family the worker knows, what it should do with it, and
the plain-transformers references the suite compares with.

One row per family: the trainer path its self-check must choose (`trainer.compute.selfcheck`),
or the refusal it must give. Adding a family is one row here (and, for a new architecture, one
tiny config in `trainer/tiny_families.py` or `EXTRA` below). The README's supported-models
table is generated from these rows and the loaded models (`python -m tests.models.readme_table
--write`), and `test_conformance.py` checks that it is current.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from trainer.tiny_families import FAMILIES, build_from_config, save_family

PACKED_VARLEN = "packed varlen (packed_sdpa)"
ROWS_SDPA = "one sample per row (packed_sdpa)"
ROWS_EAGER = "one sample per row (eager)"


@dataclass(frozen=True)
class Row:
    family: str
    path: str | None  # the trainer path it must take; None: refused
    refusal: str | None = None  # a regex the refusal message must match
    note: str = ""


ROWS: tuple[Row, ...] = (
    Row("qwen3", PACKED_VARLEN),
    Row("llama", PACKED_VARLEN),
    Row("qwen3_moe", PACKED_VARLEN),
    Row("qwen3_5", ROWS_SDPA, note="Gated DeltaNet"),
    Row("qwen3_5_moe", ROWS_SDPA, note="Gated DeltaNet"),
    Row("qwen3_next", ROWS_SDPA, note="Gated DeltaNet"),
    Row("gemma3", PACKED_VARLEN),
    Row("gemma3_composite", PACKED_VARLEN, note="composite: text-only training"),
    Row("qwen3_5_composite", ROWS_SDPA, note="composite: text-only training"),
    Row("gemma4", PACKED_VARLEN),
    Row("gpt_oss", ROWS_EAGER),
    Row("olmo3", PACKED_VARLEN),
    Row("mistral", PACKED_VARLEN),
    Row("phi3", PACKED_VARLEN),
    Row("deepseek_v3", PACKED_VARLEN),
    Row("glm4_moe", PACKED_VARLEN),
    Row("qwen2", PACKED_VARLEN, note="sliding only above `max_window_layers`"),
    Row("lfm2", ROWS_SDPA, note="short convolutions"),
    Row("granitemoehybrid", ROWS_SDPA, note="Mamba-2, experts"),
    Row("jamba", ROWS_SDPA, note="Mamba, experts"),
    Row("nemotron_h", ROWS_SDPA, note="Mamba-2"),
    Row(
        "minimax",
        None,
        refusal=r"model type 'minimax' .*refused: sampling left-pads the prompts",
        note="its lightning attention lets a batch's left padding into its state",
    ),
    Row("cohere2", PACKED_VARLEN, note="logit scale"),
    Row("smollm3", PACKED_VARLEN, note="NoPE layers"),
    Row(
        "falcon_h1",
        None,
        refusal=r"model type 'falcon_h1' .*refused: its logits are not its output head",
        note="its `lm_head_multiplier` is not reproduced by the trainer's head",
    ),
)
BY_FAMILY = {row.family: row for row in ROWS}


# the tiny shape every extra family shares (`trainer/tiny_families.py`'s)
COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 0,
}


def _falcon_h1() -> Any:
    """A Mamba-2 / attention hybrid whose logits are `lm_head(h) · lm_head_multiplier`: a head
    transform the trainer does not reproduce, so the worker must refuse it."""
    from transformers import AutoModelForCausalLM, FalconH1Config

    config = FalconH1Config(
        **COMMON,
        num_hidden_layers=2,
        head_dim=16,
        mamba_d_ssm=64,
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        lm_head_multiplier=2.0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)  # raw init: the head check refuses it


def _qwen2() -> Any:
    """Qwen2 with `use_sliding_window`: layers from `max_window_layers` on slide, those below
    attend to everything (per-layer windows read from the config)."""
    from transformers import Qwen2Config

    config = Qwen2Config(
        **COMMON,
        num_hidden_layers=3,
        use_sliding_window=True,
        sliding_window=4,
        max_window_layers=1,
    )
    return build_from_config(config)


def _lfm2() -> Any:
    """LFM2: gated short-convolution layers beside attention layers."""
    from transformers import Lfm2Config

    layers = ["conv", "full_attention", "conv"]
    config = Lfm2Config(**COMMON, num_hidden_layers=3, layer_types=layers, conv_L_cache=3)
    config.block_auto_adjust_ff_dim = False
    return build_from_config(config)


def _granitemoehybrid() -> Any:
    """Granite 4 hybrid: Mamba-2 and attention layers, each with a mixture of experts."""
    from transformers import GraniteMoeHybridConfig

    config = GraniteMoeHybridConfig(
        **COMMON,
        num_hidden_layers=2,
        layer_types=["mamba", "attention"],
        mamba_n_heads=4,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=1,
        mamba_chunk_size=16,
        mamba_expand=1,
        num_local_experts=4,
        num_experts_per_tok=2,
        shared_intermediate_size=64,
        position_embedding_type="rope",
    )
    return build_from_config(config)


def _jamba() -> Any:
    """Jamba: Mamba (selective scan) and attention layers, experts on every other one."""
    from transformers import JambaConfig

    config = JambaConfig(
        **COMMON,
        num_hidden_layers=2,
        attn_layer_period=2,
        attn_layer_offset=1,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=4,
        num_experts_per_tok=2,
        mamba_d_state=8,
        mamba_d_conv=4,
        mamba_expand=2,
        use_mamba_kernels=False,
    )
    return build_from_config(config)


def _nemotron_h() -> Any:
    """Nemotron-H: Mamba-2, attention and MLP layers by a pattern (`M*-`)."""
    from transformers import NemotronHConfig

    config = NemotronHConfig(
        **COMMON,
        num_hidden_layers=3,
        hybrid_override_pattern="M*-",
        mamba_num_heads=4,
        mamba_head_dim=16,
        ssm_state_size=16,
        n_groups=1,
        chunk_size=16,
        head_dim=16,
    )
    return build_from_config(config)


def _minimax() -> Any:
    """MiniMax: lightning (linear) attention and full attention layers, with experts."""
    from transformers import MiniMaxConfig

    config = MiniMaxConfig(
        **COMMON,
        num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"],
        num_local_experts=4,
        num_experts_per_tok=2,
        head_dim=16,
        block_size=8,
    )
    return build_from_config(config)


def _cohere2() -> Any:
    """Command R7B: sliding and global attention, a logit scale on the head."""
    from transformers import Cohere2Config

    config = Cohere2Config(**COMMON, num_hidden_layers=4, sliding_window=4, head_dim=16)
    return build_from_config(config)


def _smollm3() -> Any:
    """SmolLM3: every other layer without rotary positions (NoPE)."""
    from transformers import SmolLM3Config

    config = SmolLM3Config(**COMMON, num_hidden_layers=4, no_rope_layer_interval=2)
    return build_from_config(config)


EXTRA: dict[str, Callable[[], Any]] = {
    "falcon_h1": _falcon_h1,
    "qwen2": _qwen2,
    "lfm2": _lfm2,
    "granitemoehybrid": _granitemoehybrid,
    "jamba": _jamba,
    "nemotron_h": _nemotron_h,
    "minimax": _minimax,
    "cohere2": _cohere2,
    "smollm3": _smollm3,
}


def save(family: str, out_dir: Path) -> Path:
    """The family's tiny checkpoint in `out_dir` (built once)."""
    if (out_dir / "config.json").exists():
        return out_dir
    if family in FAMILIES:
        return save_family(family, out_dir)
    model = EXTRA[family]()
    model.save_pretrained(out_dir)
    return out_dir


def own_class(model_dir: Path) -> Any:
    """The class a checkpoint names in its config (`architectures`), as transformers exports it."""
    import transformers

    config = json.loads((model_dir / "config.json").read_text())
    return getattr(transformers, config["architectures"][0])


def plain(model_dir: Path) -> Any:
    """The reference: the checkpoint with its own class, eager attention, float32, eval."""
    model = own_class(model_dir).from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def sequence_logprobs(model: Any, tokens: list[int], targets: list[int]) -> torch.Tensor:
    """Reference: one unpadded sequence alone, full logits, log_softmax, gather."""
    logits = model(input_ids=torch.tensor([tokens]), use_cache=False).logits[0].float()
    index = torch.tensor(targets)[:, None]
    return torch.log_softmax(logits, -1).gather(-1, index).squeeze(-1)


def close(got: torch.Tensor | None, want: torch.Tensor | None, rel: float, where: str) -> None:
    """`‖got − want‖ ≤ rel · ‖want‖` (Frobenius; both None passes)."""
    if got is None or want is None:
        assert got is None and want is None, where
        return
    err, scale = float((got - want).double().norm()), float(want.double().norm())
    assert err <= rel * max(scale, 1e-12), f"{where}: ‖diff‖ {err:.3g} vs ‖want‖ {scale:.3g}"
