"""Offline builders for the RL tests: a tiny chat model with its own tokenizer and template.

It stands in for Qwen3-0.6B in the arithmetic recipe's code path (tokenizer, chat template,
EOS = `<|im_end|>`, tied embeddings), with no download: a character-level tokenizer built with
`tokenizers`, and a random two-layer Qwen3 saved next to it.
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<unk>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHARS = [chr(i) for i in range(32, 127)] + ["\n"]
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_chat_tokenizer(out_dir: Path):  # type: ignore[no-untyped-def]
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIALS + CHARS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(SPECIALS)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
    )
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_chat_model(out_dir: Path, seed: int = 0) -> Path:
    """A tied Qwen3-shaped model + tokenizer in `out_dir`, loadable like a hub checkpoint."""
    from trainer.tiny import TinySpec, save_model

    tokenizer = build_chat_tokenizer(out_dir)
    spec = TinySpec(
        hidden=32,
        intermediate=64,
        max_positions=256,
        bos=None,
        eos=tokenizer.eos_token_id,
        pad=tokenizer.pad_token_id,
    )
    return save_model(spec, out_dir, seed)
