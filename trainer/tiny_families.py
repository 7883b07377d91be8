"""Tiny random models of every supported family, for the conformance suite.

One entry per model family, each built from transformers' own config classes with the
shapes of the real checkpoints shrunk to a toy: hidden 64 (or the nearest the family takes),
vocabulary 128, 4 heads / 2 kv heads, bos 0, eos 1, pad 0, 512 positions, float32. Each
family gets enough layers that every layer type it has is present (linear and full
attention, sliding and full attention, dense and MoE MLPs), and every sliding window is
4 tokens so that test sequences of 8-24 tokens cross it. Each model has well under 2 M
parameters, so a CPU forward takes milliseconds.

`build_family` random-inits a family under a seed (no download) and rescales its weights so
that the logits are not degenerate: every 2-D and 3-D weight is multiplied by `WEIGHT_SCALE`
(the layers then mix context instead of passing the embedding through), then the final norm
is rescaled so that the logits of a fixed probe have a standard deviation of about 1.
`save_family` writes it the way a hub checkpoint looks (safetensors, a config.json with
`architectures`, a generation_config.json). The composites (`gemma3_composite`,
`qwen3_5_composite`) are the ForConditionalGeneration layouts, with a tiny vision tower, that
the real multimodal checkpoints ship; every other family is a ForCausalLM model.

Layer layouts: qwen3_5, qwen3_5_moe, qwen3_next: linear (Gated DeltaNet) + full attention;
gemma3, gemma4, gpt_oss, olmo3: sliding + full attention; mistral: every layer sliding;
deepseek_v3, glm4_moe: layer 0 dense, layer 1 MoE; qwen3_moe, qwen3_5_moe, qwen3_next,
gpt_oss: every layer MoE. phi3 keeps its windowless attention; gpt_oss has attention sinks
(eager attention only); gemma4 has a final logit softcap of 30 and per-layer embeddings.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

FAMILIES: tuple[str, ...] = (
    "qwen3",
    "llama",
    "qwen3_moe",
    "qwen3_5",
    "qwen3_5_moe",
    "qwen3_next",
    "gemma3",
    "gemma3_composite",
    "qwen3_5_composite",
    "gemma4",
    "gpt_oss",
    "olmo3",
    "mistral",
    "phi3",
    "deepseek_v3",
    "glm4_moe",
)

VOCAB = 128
HIDDEN = 64
HEADS = 4
KV_HEADS = 2
HEAD_DIM = 16
MOE_INTERMEDIATE = 24  # per expert: fused gate_up is 48 x 64, so no expert stack is square
WINDOW = 4  # every sliding window, in tokens
MAX_POSITIONS = 512
BOS, EOS, PAD = 0, 1, 0
WEIGHT_SCALE = 8.0  # every 2-D / 3-D weight is multiplied by it after init
LOGIT_STD = 1.0  # the final norm is rescaled so the probe's logits have this std
# composites: the multimodal special tokens, at the top of the vocabulary
IMAGE_TOKEN, VIDEO_TOKEN, VISION_START, VISION_END = 124, 125, 126, 127

_COMPOSITE_CLASSES = {  # the architecture the multimodal hub checkpoints name
    "gemma3_composite": "Gemma3ForConditionalGeneration",
    "qwen3_5_composite": "Qwen3_5ForConditionalGeneration",
}


def _common(**extra: Any) -> dict[str, Any]:
    """The fields every decoder config shares; `extra` adds or overrides."""
    fields: dict[str, Any] = dict(
        num_hidden_layers=2,
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=96,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=PAD,
        dtype="float32",
    )
    fields.update(extra)
    return fields


def _qwen3() -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(**_common(head_dim=HEAD_DIM, tie_word_embeddings=True))


def _llama() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_common(head_dim=HEAD_DIM, tie_word_embeddings=False))


def _qwen_experts(**extra: Any) -> dict[str, Any]:
    """Qwen-style experts (Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next): 4, 2 per token."""
    return dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=MOE_INTERMEDIATE, **extra
    )


def _qwen3_moe() -> Any:
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_common(
            head_dim=HEAD_DIM,
            tie_word_embeddings=False,
            norm_topk_prob=True,
            **_qwen_experts(decoder_sparse_step=1, mlp_only_layers=[]),
        )
    )


_HYBRID_LAYERS = ["linear_attention", "full_attention"]
_LINEAR_ATTENTION = dict(
    linear_conv_kernel_dim=4,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
)


def _qwen3_5_text() -> Any:
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        **_common(
            head_dim=HEAD_DIM,
            layer_types=list(_HYBRID_LAYERS),
            rope_parameters=_qwen3_5_rope(),
            tie_word_embeddings=False,
            **_LINEAR_ATTENTION,
        )
    )


def _qwen3_5_rope() -> dict[str, Any]:
    """The hub checkpoints' interleaved M-RoPE on a quarter of each head (4 of 16 dims)."""
    return dict(
        rope_type="default",
        rope_theta=10_000.0,
        partial_rotary_factor=0.25,
        mrope_section=[1, 1, 0],  # halves of the rotary dims: temporal, height, width
        mrope_interleaved=True,
    )


def _qwen3_5_moe() -> Any:
    from transformers import Qwen3_5MoeTextConfig

    fields = _common(
        head_dim=HEAD_DIM,
        layer_types=list(_HYBRID_LAYERS),
        rope_parameters=_qwen3_5_rope(),
        tie_word_embeddings=False,
        **_qwen_experts(shared_expert_intermediate_size=32),
        **_LINEAR_ATTENTION,
    )
    del fields["intermediate_size"]  # every layer is sparse
    return Qwen3_5MoeTextConfig(**fields)


def _qwen3_next() -> Any:
    from transformers import Qwen3NextConfig

    return Qwen3NextConfig(
        **_common(
            head_dim=HEAD_DIM,
            layer_types=list(_HYBRID_LAYERS),
            tie_word_embeddings=False,
            **_qwen_experts(
                shared_expert_intermediate_size=32, decoder_sparse_step=1, mlp_only_layers=[]
            ),
            **_LINEAR_ATTENTION,
        )
    )


def _gemma3_text() -> Any:
    from transformers import Gemma3TextConfig

    return Gemma3TextConfig(
        **_common(
            head_dim=HEAD_DIM,
            query_pre_attn_scalar=HEAD_DIM,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=True,
        )
    )


def _gemma3_composite() -> Any:
    from transformers import Gemma3Config, SiglipVisionConfig

    vision = SiglipVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=28,
        patch_size=14,
        vision_use_head=False,
    )
    return Gemma3Config(
        text_config=_gemma3_text(),
        vision_config=vision,
        mm_tokens_per_image=4,  # 2x2 patches, pooled by 1
        boi_token_index=VISION_START,
        eoi_token_index=VISION_END,
        image_token_index=IMAGE_TOKEN,
        tie_word_embeddings=True,
        dtype="float32",
    )


def _qwen3_5_composite() -> Any:
    from transformers import Qwen3_5Config, Qwen3_5VisionConfig

    vision = Qwen3_5VisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=HIDDEN,
        num_position_embeddings=16,  # a 4x4 grid
    )
    return Qwen3_5Config(
        text_config=_qwen3_5_text(),
        vision_config=vision,
        image_token_id=IMAGE_TOKEN,
        video_token_id=VIDEO_TOKEN,
        vision_start_token_id=VISION_START,
        vision_end_token_id=VISION_END,
        tie_word_embeddings=False,
        dtype="float32",
    )


def _gemma4() -> Any:
    from transformers import Gemma4TextConfig

    return Gemma4TextConfig(
        **_common(
            head_dim=HEAD_DIM,
            global_head_dim=2 * HEAD_DIM,  # full-attention layers: wider heads
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            final_logit_softcapping=30.0,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,  # per-layer embeddings (PLE)
            tie_word_embeddings=True,
        )
    )


def _gpt_oss() -> Any:
    from transformers import GptOssConfig

    return GptOssConfig(
        **_common(
            head_dim=HEAD_DIM,
            intermediate_size=MOE_INTERMEDIATE,  # per expert
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters=dict(  # gpt-oss's YaRN, its original context shrunk to 512 / 32
                rope_type="yarn",
                rope_theta=150_000.0,
                factor=32.0,
                original_max_position_embeddings=MAX_POSITIONS // 32,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
            ),
            tie_word_embeddings=False,
        )
    )


def _olmo3() -> Any:
    from transformers import Olmo3Config

    return Olmo3Config(
        **_common(
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            tie_word_embeddings=False,
        )
    )


def _mistral() -> Any:
    from transformers import MistralConfig

    return MistralConfig(
        **_common(
            head_dim=HEAD_DIM,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
        )
    )


def _phi3() -> Any:
    from transformers import Phi3Config

    return Phi3Config(
        **_common(
            original_max_position_embeddings=MAX_POSITIONS,
            tie_word_embeddings=False,
        )
    )


def _deepseek_experts(n_group: int) -> dict[str, Any]:
    """DeepSeek-style experts (DeepSeek-V3, GLM-4-MoE): 4 routed in `n_group` groups, 2 per
    token, one shared; layer 0 dense, layer 1 MoE."""
    return dict(
        moe_intermediate_size=MOE_INTERMEDIATE,
        n_shared_experts=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=n_group,
        topk_group=1,
        first_k_dense_replace=1,
    )


def _deepseek_v3() -> Any:
    from transformers import DeepseekV3Config

    return DeepseekV3Config(
        **_common(
            num_key_value_heads=HEADS,  # MLA: every head has its own key and value
            intermediate_size=96,
            **_deepseek_experts(n_group=2),
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            tie_word_embeddings=False,
        )
    )


def _glm4_moe() -> Any:
    from transformers import Glm4MoeConfig

    return Glm4MoeConfig(
        **_common(
            head_dim=HEAD_DIM,
            **_deepseek_experts(n_group=1),
            use_qk_norm=True,
            tie_word_embeddings=False,
        )
    )


_BUILDERS: dict[str, Callable[[], Any]] = {
    "qwen3": _qwen3,
    "llama": _llama,
    "qwen3_moe": _qwen3_moe,
    "qwen3_5": _qwen3_5_text,
    "qwen3_5_moe": _qwen3_5_moe,
    "qwen3_next": _qwen3_next,
    "gemma3": _gemma3_text,
    "gemma3_composite": _gemma3_composite,
    "qwen3_5_composite": _qwen3_5_composite,
    "gemma4": _gemma4,
    "gpt_oss": _gpt_oss,
    "olmo3": _olmo3,
    "mistral": _mistral,
    "phi3": _phi3,
    "deepseek_v3": _deepseek_v3,
    "glm4_moe": _glm4_moe,
}


def is_composite(name: str) -> bool:
    """Whether `name` is a multimodal ForConditionalGeneration layout (vision tower included)."""
    _check(name)
    return name in _COMPOSITE_CLASSES


def family_config(name: str) -> PretrainedConfig:
    """A fresh transformers config of family `name` (a new object on every call)."""
    _check(name)
    return _BUILDERS[name]()


def build_family(name: str, seed: int = 0) -> torch.nn.Module:
    """A random-init model of family `name` in eval mode, drawn under `torch.manual_seed(seed)`
    and rescaled so its logits have a std of about `LOGIT_STD` (same name and seed, same
    weights). Composites are their ForConditionalGeneration model, the rest ForCausalLM."""
    import transformers

    cls = getattr(transformers, _COMPOSITE_CLASSES[name]) if is_composite(name) else None
    return build_from_config(family_config(name), seed, cls)


def build_from_config(config: Any, seed: int = 0, cls: Any = None) -> torch.nn.Module:
    """`build_family` for any config (a family not in the table): random init under `seed`
    with `cls` (default: the config's causal LM), every 2-D / 3-D weight scaled by
    `WEIGHT_SCALE`, the logits calibrated to `LOGIT_STD`; eval mode."""
    import torch
    import transformers

    torch.manual_seed(seed)
    if cls is not None:
        model = cls._from_config(config, dtype=torch.float32)
    else:
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() in (2, 3):  # 3-D: fused experts, conv kernels
                param.mul_(WEIGHT_SCALE)
        _calibrate_logits(model)
    return model


def save_family(name: str, out_dir: Path, seed: int = 0) -> Path:
    """`build_family(name, seed)` saved to `out_dir` (created if missing) as safetensors, a
    config.json with `architectures` and a generation_config.json; returns `out_dir`."""
    from transformers import GenerationConfig

    model: Any = build_family(name, seed)  # a PreTrainedModel
    out_dir.mkdir(parents=True, exist_ok=True)
    generation = GenerationConfig(bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    model.generation_config = generation
    model.save_pretrained(out_dir)
    generation.save_pretrained(out_dir)  # also where the class does not generate
    return out_dir


def _check(name: str) -> None:
    if name not in _BUILDERS:
        raise ValueError(f"family: unknown tiny family {name!r} (known: {', '.join(FAMILIES)})")


def _calibrate_logits(model: Any) -> None:
    """Rescale the final norm so that the logits of a fixed probe have std `LOGIT_STD`."""
    import torch

    decoder = model.get_decoder()
    names = ("norm", "final_layernorm", "norm_f", "embedding_norm")  # LFM2's is applied last
    norm = next(getattr(decoder, n) for n in names if hasattr(decoder, n))
    probe = torch.randint(2, VOCAB - 4, (2, 16), generator=torch.Generator().manual_seed(1234))
    std = float(model(input_ids=probe, use_cache=False).logits.float().std())
    if not std > 0:
        return
    factor = LOGIT_STD / std
    weight = norm.weight
    saved = weight.detach().clone()
    weight.zero_()  # a zero-centered norm (x * (1 + w)) still passes x through with w = 0
    offset = 1.0 if float(norm(torch.ones(1, weight.shape[-1])).abs().mean()) > 0.5 else 0.0
    weight.copy_((saved + offset) * factor - offset)
