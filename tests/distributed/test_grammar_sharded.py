"""Constrained decoding (docs/semantics.md §17.2) under two CPU ranks (FSDP2, gloo): a GBNF
grammar and a JSON Schema, full weights and LoRA. Every rank's matchers take the tokens the
ranks agree on, so the samples equal one process's token for token (logprobs within 1e-5),
and each is a sentence of the grammar or JSON that fits the schema (checked here by hand)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoTokenizer

from tests.distributed.launch import two_rank_case
from tests.distributed.scenario import OPTIONS, entry, grammar_samples, resource_spec
from tests.engine.test_grammar import GBNF, LANGUAGE, build_bpe_tokenizer
from trainer.checkpoint.store import CheckpointStore
from trainer.contract.grammar import OutputGrammar
from trainer.contract.specs import STOP_STOP
from trainer.engine.resource import ModelResource
from trainer.tiny import TinySpec, save_model

pytestmark = pytest.mark.distributed

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}
GRAMMARS = {
    "gbnf": OutputGrammar("gbnf", GBNF),
    "json": OutputGrammar("json_schema", json.dumps(SCHEMA)),
}
KINDS = ("full", "lora")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any], dict[str, Any]]:
    work = tmp_path_factory.mktemp("grammar-sharded")
    model_dir = build_bpe_tokenizer(work / "model")
    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    spec = TinySpec(arch="qwen3", vocab=vocab, tied=True, bos=None, eos=1, scale=4.0)
    save_model(spec, model_dir, seed=4)
    store = CheckpointStore(work / "storage")
    one = {}
    for kind in KINDS:
        resource = ModelResource(
            entry(str(model_dir)), resource_spec(kind), store, device="cpu", options=OPTIONS
        )
        one[kind] = grammar_samples(resource, kind, GRAMMARS)
        resource.close()
    store.close()
    two = two_rank_case("grammar", model_dir, work / "storage", work)
    return model_dir, one, two


@pytest.mark.parametrize("kind", KINDS)
def test_constrained_samples_equal_one_process_and_fit(
    runs: tuple[Path, dict[str, Any], dict[str, Any]], kind: str
) -> None:
    model_dir, one, two = runs
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    for name in GRAMMARS:
        ones, twos = one[kind][name], two[kind][name]
        assert [s["tokens"] for s in twos] == [s["tokens"] for s in ones]
        for a, b in zip(ones, twos, strict=True):
            torch.testing.assert_close(
                torch.tensor(b["logprobs"]), torch.tensor(a["logprobs"]), atol=1e-5, rtol=0
            )
        finished = [s for s in twos if s["stop_reason"] == STOP_STOP]
        assert len(finished) >= 2, twos
        for seq in finished:
            text = tokenizer.decode([t for t in seq["tokens"] if t != 1])
            if name == "gbnf":
                assert text in LANGUAGE, text
            else:
                assert json.loads(text)["answer"] in ("yes", "no") and len(json.loads(text)) == 1
