"""The load-time self-check (`trainer.compute.selfcheck.prove`): a layout that leaks across
samples is measured and left for the next one; when none agrees, the model is refused with the
measured differences, naming its type and features."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.models.conformance import EXTRA, save
from trainer.compute import architecture, selfcheck
from trainer.compute.architecture import PACKED, ROWS
from trainer.compute.attention import use_packed_sdpa


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoModelForCausalLM

    model_dir: Path = save("qwen3_5", tmp_path_factory.mktemp("qwen3_5"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    use_packed_sdpa(model)
    return model.eval()


def _offer(monkeypatch: pytest.MonkeyPatch, candidates: tuple[str, ...]) -> None:
    real = architecture.describe

    def describe(model: Any) -> architecture.Architecture:
        return dataclasses.replace(real(model), candidates=candidates)

    monkeypatch.setattr(selfcheck, "describe", describe)


def test_a_leaking_layout_moves_to_the_next(hybrid: Any, monkeypatch) -> None:
    _offer(monkeypatch, (PACKED, ROWS))  # as if packing were thought safe for it
    arch = selfcheck.prove(hybrid)
    assert arch.layout == ROWS
    assert arch.checked[PACKED] > 0.1  # the linear-attention state crossed samples
    assert arch.checked[ROWS] <= 1e-4
    assert architecture.of(hybrid) is arch


def test_no_exact_layout_is_a_refusal(hybrid: Any, monkeypatch) -> None:
    _offer(monkeypatch, (PACKED,))
    with pytest.raises(selfcheck.ModelRefused) as info:
        selfcheck.prove(hybrid)
    message = str(info.value)
    assert "model type 'qwen3_5_text'" in message and "linear_attention" in message
    assert "packed: " in message and "tolerance 0.001" in message


def test_probe_sequences_cross_the_smallest_window() -> None:
    arch = architecture.Architecture(
        model_type="t",
        layer_types=("sliding_attention",),
        windows=(4, 16),
        sinks=False,
        attn_softcap=None,
        stateful=(),
        head=architecture.Head(),
        attn_implementation="eager",
        candidates=(ROWS,),
    )
    assert min(selfcheck.probe_lengths(arch, None)) > 4
    assert selfcheck.probe_lengths(arch, 6) == [6, 6, 6]


def test_a_catalogue_entry_chooses_the_attention(tmp_path: Path) -> None:
    """`attn_implementation` overrides the default: Qwen3 with eager attention packs its
    samples with the block-diagonal mask, and the check proves that path too."""
    from trainer.compute.model import load_base_model
    from trainer.contract.specs import ModelEntry

    model_dir = save("qwen3", tmp_path / "qwen3")
    entry = ModelEntry(name="q", location=str(model_dir), attn_implementation="eager")
    model, _ = load_base_model(entry, torch.device("cpu"))
    arch = architecture.of(model)
    assert arch.path() == "packed, block mask (eager)" and arch.checked[PACKED] <= 1e-4


def test_an_attention_the_model_refuses_is_an_error_naming_it(tmp_path: Path) -> None:
    from trainer.compute.model import load_base_model
    from trainer.contract.specs import ModelEntry

    model_dir = save("gpt_oss", tmp_path / "gpt_oss")
    entry = ModelEntry(name="g", location=str(model_dir), attn_implementation="sdpa")
    with pytest.raises(
        ValueError, match=r"attn_implementation: gpt_oss .* does not support .sdpa."
    ):
        load_base_model(entry, torch.device("cpu"))


def test_layer_windows_read_from_either_transformers_shape(monkeypatch) -> None:
    """transformers 5.17 (the GPU image's) returns one kwargs dict for every layer, later ones a
    dict per layer: both give each layer its own window (None for the full-attention ones)."""
    import transformers.cache_utils as cache_utils

    types = ["sliding_attention", "full_attention", "chunked_attention", "mlp"]
    per_layer = [{"sliding_window": 4}, {}, {"sliding_window": 8}, {}]
    monkeypatch.setattr(cache_utils, "get_layer_types_and_kwargs", lambda c: (types, per_layer))
    assert architecture.layer_types(None) == (types, [4, None, 8, None])
    one = {"sliding_window": 4, "number_of_states": 1}
    monkeypatch.setattr(cache_utils, "get_layer_types_and_kwargs", lambda c: (types[:2], one))
    assert architecture.layer_types(None) == (types[:2], [4, None])


@pytest.mark.parametrize(("family", "refused"), [("minimax", True), ("smollm3", False)])
def test_left_padding_is_checked_in_a_short_context(family: str, refused: bool) -> None:
    """A context shorter than the probes clamps them to one length, which pads nothing: the
    check still left-pads one of them, so MiniMax's leak is found there too."""
    model = EXTRA[family]()
    model.config.max_position_embeddings = 10
    assert len(set(selfcheck.probe_lengths(selfcheck.describe(model), 10))) == 1
    if refused:
        with pytest.raises(selfcheck.ModelRefused, match="left-pads the prompts"):
            selfcheck.prove(model)
    else:
        selfcheck.prove(model)
