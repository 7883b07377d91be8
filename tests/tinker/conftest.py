"""A live worker for the official `tinker` SDK, and the offline pieces the SDK and cookbook need.

The catalogue serves tiny random Qwen3-shaped models (`trainer.tiny`, under a seed) under names
tinker-cookbook knows (`model_info`), each saved with a word-level tokenizer built here, offline,
that has the special tokens of the cookbook's Qwen3 renderers. The model's vocabulary is exactly
the tokenizer's, so every sampled id decodes.

- `Qwen/Qwen3-4B-Instruct-2507` (renderer `qwen3_instruct`), weights at init scale: its next-token
  distribution is nearly uniform, so the cookbook's RL loop samples `\\boxed{0}` about as often as
  `\\boxed{1}` and its groups get non-zero advantages.
- `Qwen/Qwen3-8B` (renderer `qwen3`), weights scaled 8x: logprobs far from uniform, for the SDK
  checks that compare numbers.
- `meta-llama/Llama-3.1-8B`, a tiny Llama with an untied head (`UNTIED_MODEL`; the two Qwen3s
  tie theirs, as Qwen3 up to 4B does), weights scaled 8x: the weight-export checks on both.
- `Qwen/Qwen3.5-9B` (renderer `qwen3_5_disable_thinking`): a tiny Gated DeltaNet hybrid like the
  real Qwen3.5 (`trainer.tiny_families`), weights scaled 8x under another seed, 4096 positions:
  the second base model the cookbook's recipes sample beside the one they train
  (their default distillation teacher and twenty-questions answerer, the rubric grader, whose
  `max_tokens` is 2048).

The SDK (tinker 0.38, which `together` cannot share an environment with) runs in the venv of
`tests/tinker/venv.py`, as a subprocess: `run_in_venv` runs a script there with
`TINKER_BASE_URL` / `TINKER_API_KEY` pointing at the worker and returns the JSON it prints last.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api.conftest import TOKEN, LiveServer, serve_in_thread
from tests.cached_venv import run_json
from tests.tinker import tinker_http as th
from tests.tinker.venv import tinker_python
from trainer.tiny import TinySpec, save_model

HERE = Path(__file__).parent
SCRIPTS = HERE / "sdk_scripts"
REPO = HERE.parent.parent

COOKBOOK_MODEL = "Qwen/Qwen3-4B-Instruct-2507"
SDK_MODEL = "Qwen/Qwen3-8B"
UNTIED_MODEL = "meta-llama/Llama-3.1-8B"
SECOND_MODEL = "Qwen/Qwen3.5-9B"

SPECIAL = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<think>", "</think>", "[UNK]"]
BOXED = ["\\boxed{0}", "\\boxed{1}"]
WORDS = [
    *("user", "assistant", "system", "what", "is", "two", "plus", "three", "five", "the"),
    *("cat", "sat", "on", "a", "mat", "hello", "world", "answer", "0", "1", "2", "3", "4"),
    *("?", ".", ","),
]
VOCAB = [*SPECIAL, *BOXED, *WORDS]  # id = index; <|endoftext|> = 0 (pad), <|im_end|> = 1 (eos)


def build_tokenizer(out_dir: Path, extra: tuple[str, ...] = ()) -> Path:
    """A word-level HF tokenizer over `VOCAB` and then `extra` (more tokens decoded as they are
    written), saved to `out_dir` (loads with AutoTokenizer)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = [*VOCAB, *extra]
    backend = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in (*BOXED, *extra)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="[UNK]",
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        clean_up_tokenization_spaces=False,
    )
    assert len(tokenizer) == len(vocab), (len(tokenizer), len(vocab))
    tokenizer.save_pretrained(out_dir)
    return out_dir


def build_served_model(
    out_dir: Path,
    scale: float,
    seed: int,
    tokenizer_dir: Path,
    arch: str = "qwen3",
    positions: int = 512,
    extra: tuple[str, ...] = (),
) -> Path:
    """A tiny Qwen3 (tied head), Llama (untied), Qwen3-MoE (tied; 4 experts, top-2) or Qwen3.5
    (a Gated DeltaNet hybrid, as the real Qwen3.5 is) with the tokenizer's vocabulary; the
    tokenizer saved to `tokenizer_dir` (the model's own directory, or another one that the
    catalogue entry names)."""
    build_tokenizer(tokenizer_dir, extra)
    if arch == "qwen3_5":
        assert not extra, "the hybrid keeps the plain vocabulary"
        return _save_hybrid(out_dir, scale, seed, positions)
    spec = TinySpec(
        arch="llama" if arch == "llama" else "qwen3_moe" if arch == "qwen3_moe" else "qwen3",
        vocab=len(VOCAB) + len(extra),
        tied=arch != "llama",
        bos=None,
        eos=1,
        pad=0,
        scale=scale,
        max_positions=positions,
    )
    save_model(spec, out_dir, seed)
    return out_dir


def _save_hybrid(out_dir: Path, scale: float, seed: int, positions: int) -> Path:
    """`trainer.tiny_families`' Qwen3.5 (linear and full attention layers) on the
    tokenizer's vocabulary, weights scaled by `scale` under `seed`."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.tiny_families import family_config

    config = family_config("qwen3_5")
    config.vocab_size, config.max_position_embeddings = len(VOCAB), positions
    config.bos_token_id, config.eos_token_id, config.pad_token_id = None, 1, 0
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() in (2, 3):
                param.mul_(scale)
    model.generation_config.eos_token_id = 1
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def venv_python() -> Path:
    return tinker_python()


@pytest.fixture(scope="session")
def served_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tinker-models")
    cookbook, sdk, untied = root / "cookbook", root / "sdk", root / "untied"
    second = root / "second"
    return {
        COOKBOOK_MODEL: build_served_model(cookbook, scale=1.0, seed=3, tokenizer_dir=cookbook),
        SDK_MODEL: build_served_model(sdk, scale=8.0, seed=0, tokenizer_dir=root / "tokenizer"),
        UNTIED_MODEL: build_served_model(untied, 8.0, 1, tokenizer_dir=untied, arch="llama"),
        SECOND_MODEL: build_served_model(
            second, 8.0, seed=5, tokenizer_dir=second, arch="qwen3_5", positions=4096
        ),
    }


def tokenizer_of(served_models: dict[str, Path], name: str) -> Path:
    """The cookbook model keeps its tokenizer in its own directory (the entry's `location`); the
    SDK model's entry names a separate one (`tokenizer`)."""
    return served_models[name].parent / "tokenizer" if name == SDK_MODEL else served_models[name]


def catalogue(served_models: dict[str, Path], *names: str) -> list[dict[str, str]]:
    """`[[model]]` entries for `names` (default: all), with `tokenizer` where it is apart."""
    entries = []
    for name in names or tuple(served_models):
        entry = {"name": name, "location": str(served_models[name])}
        if tokenizer_of(served_models, name) != served_models[name]:
            entry["tokenizer"] = str(tokenizer_of(served_models, name))
        entries.append(entry)
    return entries


@pytest.fixture(scope="module")
def tinker_server(
    served_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    storage = tmp_path_factory.mktemp("tinker-storage")
    with serve_in_thread(storage, {}, model=catalogue(served_models)) as live:
        yield live


def sdk_env(server: LiveServer, **extra: str) -> dict[str, str]:
    """The environment a Tinker user sets: the worker's URL and `tml-<token>` as the key."""
    env = dict(os.environ)
    env.update(
        TINKER_BASE_URL=server.url,
        TINKER_API_KEY=f"tml-{TOKEN}",
        HF_HUB_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        PYTHONPATH=str(REPO),
        **extra,
    )
    return env


def run_in_venv(
    python: Path, server: LiveServer, argv: list[str], timeout: float = 300, **env: str
) -> dict[str, Any]:
    """Run `python argv...` against `server`; the JSON object on its last stdout line."""
    return run_json(python, argv, sdk_env(server, **env), timeout, REPO)


# A worker on the tiny model for one test module, its raw-HTTP client and a Tinker model on it
# (test modules that need another set-up define their own `live`).
@pytest.fixture(scope="module")
def live(tiny_qwen_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    storage = tmp_path_factory.mktemp("tinker-live")
    with serve_in_thread(storage, {th.BASE: tiny_qwen_dir}) as server:
        yield server


@pytest.fixture(scope="module")
def http(live: LiveServer) -> Iterator[httpx.Client]:
    with th.client(live) as client:
        yield client


@pytest.fixture(scope="module")
def model(http: httpx.Client) -> str:
    return th.new_model(http)
