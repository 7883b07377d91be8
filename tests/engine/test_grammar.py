"""Constrained decoding (docs/semantics.md §17.2) on the decode loop, on two families (a tied
Qwen3, an untied Llama) with a byte-level BPE tokenizer. References: llguidance's own matcher,
driven here by hand, says which tokens may come next (and each of them must keep the completion
a prefix of a sentence of the grammar's finite language: the naive check, which also holds
llguidance to the language); each drawn token must be one of them, its `logprobs` the plain
transformers forward's, and its `sampling_logprobs` the log-softmax of that forward's logits
with every other token masked out, tempered and cut to top-p by hand.

(llguidance drops a token whose bytes lie inside the bytes the grammar forces next where a
longer one covers them: after "m", "ay" but not "a". So its set is checked to lie within the
naive one, not to equal it.)"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.host_transfers import HostTransfers
from tests.engine.helpers import make_resource, model_input
from trainer.compute import sampler
from trainer.compute.attention import use_packed_sdpa
from trainer.compute.grammar import Compiled, GrammarRows
from trainer.contract.errors import OperationError
from trainer.contract.grammar import OutputGrammar
from trainer.contract.specs import STOP_STOP, LoraConfig, SamplingParams, SessionSpec
from trainer.tiny import TinySpec, save_model

LANGUAGE = ("yes", "no", "maybe so", "maybe not")
GBNF = 'root ::= "yes" | "no" | "maybe " ("so" | "not")'
CORPUS = ['{"answer": "yes"}', '{"answer": "no"}', "maybe so, maybe not", "hello world"]
SPECIAL = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
EOS = 1  # <|im_end|>


def build_bpe_tokenizer(out_dir: Path) -> Path:
    """A byte-level BPE tokenizer (every byte a token, then merges of a small corpus)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(CORPUS * 20, vocab_size=300, special_tokens=SPECIAL, min_frequency=2)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe._tokenizer, eos_token=SPECIAL[EOS], pad_token=SPECIAL[0]
    )
    assert tokenizer.convert_tokens_to_ids(SPECIAL[EOS]) == EOS
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp(f"bpe-{request.param}")
    build_bpe_tokenizer(out)
    vocab = len(AutoTokenizer.from_pretrained(out))
    arch = request.param
    spec = TinySpec(arch=arch, vocab=vocab, tied=arch == "qwen3", bos=None, eos=EOS, scale=4.0)
    save_model(spec, out, seed=2)
    return out


class Reference:
    """llguidance's matcher of the grammar, fed by hand: the tokens allowed next."""

    def __init__(self, tokenizer: Any, vocab: int) -> None:
        import llguidance
        import llguidance.hf
        from llguidance.gbnf_to_lark import gbnf_to_lark

        lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=[EOS])
        grammar = llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(GBNF))
        self.matcher = llguidance.LLMatcher(lltok, grammar)
        self.vocab = vocab

    def allowed(self) -> set[int]:
        bias = self.matcher.compute_logit_bias()
        return {t for t in range(self.vocab) if bias[t]}

    def take(self, token: int) -> None:
        assert self.matcher.consume_token(token)


def _naive_allowed(tokenizer: Any, completion: list[int], vocab: int) -> set[int]:
    text = tokenizer.decode(completion)
    if text in LANGUAGE:
        return {EOS}  # every sentence is a whole one: nothing continues it
    allowed = set()
    for token in range(vocab):
        if token in (0, 1, 2):
            continue
        longer = tokenizer.decode([*completion, token])
        if any(s.startswith(longer) for s in LANGUAGE):
            allowed.add(token)
    return allowed


def _sample(session: Any, prompt: list[int], n: int, **params: Any) -> list[dict[str, Any]]:
    out = session.sample(
        [model_input(prompt)],
        num_samples=n,
        sampling_params=SamplingParams(max_tokens=12, **params),
        sampling_logprobs=True,
        grammar=OutputGrammar("gbnf", GBNF),
    )
    sequences: list[dict[str, Any]] = out["results"][0]["sequences"]
    return sequences


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.8, 0.9)])
def test_every_draw_is_the_grammars_and_its_logprobs_the_references(
    model_dir: Path, tmp_path: Path, temperature: float, top_p: float
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vocab = plain.config.vocab_size
    resource = make_resource(model_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(seed=1)))
    prompt = tokenizer.encode("hello world")
    sequences = _sample(session, prompt, 12, temperature=temperature, top_p=top_p, seed=4)
    texts = set()
    for seq in sequences:
        tokens = seq["tokens"]
        assert seq["stop_reason"] == STOP_STOP and tokens[-1] == EOS
        texts.add(tokenizer.decode(tokens[:-1]))
        with torch.no_grad():
            logits = plain(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
        reference = Reference(tokenizer, vocab)
        for t, token in enumerate(tokens):
            allowed = reference.allowed()
            assert token in allowed, (tokenizer.decode(tokens[:t]), token)
            assert allowed <= _naive_allowed(tokenizer, tokens[:t], vocab)
            if token != EOS:
                reference.take(token)
            raw = torch.log_softmax(logits[t].float(), -1)
            assert seq["logprobs"][t] == pytest.approx(float(raw[token]), abs=1e-4)
            masked = torch.full_like(logits[t], float("-inf"))
            keep = sorted(allowed)
            masked[keep] = logits[t][keep].float() / temperature
            want = _nucleus_logprob(masked, token, top_p)
            assert seq["sampling_logprobs"][t] == pytest.approx(want, abs=1e-4)
    assert texts <= set(LANGUAGE) and len(texts) > 1  # drawn, not one forced answer


def _nucleus_logprob(logits: torch.Tensor, token: int, top_p: float) -> float:
    """The drawn-from logprob of `token` under top-p of `logits`, written out by hand."""
    probs = torch.softmax(logits, -1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept, mass = [], 0.0
    for i in order:
        if mass >= top_p and kept:
            break
        kept.append(i)
        mass += probs[i]
    assert token in kept
    return math.log(probs[token] / sum(probs[i] for i in kept))


def test_the_same_seed_draws_the_same_and_greedy_is_the_best_allowed(
    model_dir: Path, tmp_path: Path
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    resource = make_resource(model_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(seed=1)))
    prompt = tokenizer.encode("maybe")
    first = _sample(session, prompt, 4, temperature=1.0, seed=9)
    again = _sample(session, prompt, 4, temperature=1.0, seed=9)
    assert [s["tokens"] for s in first] == [s["tokens"] for s in again]
    (greedy,) = _sample(session, prompt, 1, temperature=0.0)
    plain = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokens = greedy["tokens"]
    with torch.no_grad():
        logits = plain(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 :]
    reference = Reference(tokenizer, plain.config.vocab_size)
    for t, token in enumerate(tokens):
        allowed = sorted(reference.allowed())
        assert token == allowed[int(logits[t][allowed].argmax())]
        if token != EOS:
            reference.take(token)


def test_a_json_schema_gives_json_that_fits_it(model_dir: Path, tmp_path: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    schema = {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    resource = make_resource(model_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(seed=1)))
    out = session.sample(
        [model_input(tokenizer.encode("hello"))],
        num_samples=6,
        sampling_params=SamplingParams(max_tokens=40, temperature=1.0, seed=5),
        grammar=OutputGrammar("json_schema", json.dumps(schema)),
    )
    finished = 0
    for seq in out["results"][0]["sequences"]:
        text = tokenizer.decode([t for t in seq["tokens"] if t != EOS])
        if seq["stop_reason"] == STOP_STOP:
            finished += 1
            value = json.loads(text)
            assert set(value) == {"answer"} and value["answer"] in ("yes", "no")
        else:  # cut by max_tokens (whitespace may run on): still a prefix of such JSON
            assert text.lstrip().startswith("{")
    assert finished


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        (OutputGrammar("gbnf", "root ::= ("), "response_format"),
        (OutputGrammar("json_schema", '{"type": "frobnicate"}'), "response_format"),
        (OutputGrammar("gbnf", 'root ::= "\\u00e9t\\u00e9" | missing'), "response_format"),
    ],
)
def test_a_grammar_that_does_not_compile_is_a_refusal_naming_the_field(
    model_dir: Path, tmp_path: Path, grammar: OutputGrammar, message: str
) -> None:
    resource = make_resource(model_dir, tmp_path)
    session = resource.create_session("a", SessionSpec(lora_config=LoraConfig(seed=1)))
    with pytest.raises(OperationError, match=rf"^{message}: ") as info:
        session.sample([model_input([5, 6])], grammar=grammar)
    assert info.value.code == "INVALID_INPUT"


class _Blank(GrammarRows):
    """The real matchers, with every token masked out: a vocabulary that cannot continue the
    text (which no tokenizer here can be made to show)."""

    def bias(self, done: list[bool], device: torch.device) -> torch.Tensor:
        return torch.full_like(super().bias(done, device), float("-inf"))


@torch.no_grad()
def test_a_constrained_job_batches_with_others_at_one_copy_per_step(model_dir: Path) -> None:
    """One generation of a plain job, a constrained one and one whose rows can draw nothing:
    still one host copy per step; the plain job draws what it draws alone, the constrained
    one sentences of the grammar, and the third fails alone, naming the field."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    use_packed_sdpa(model)
    compiled = Compiled(OutputGrammar("gbnf", GBNF), tokenizer, model.config.vocab_size, {EOS})
    params = SamplingParams(max_tokens=10, temperature=1.0, seed=1)

    def job(seed: int, grammar: Any = None, rows: int = 2) -> sampler.DecodeJob:
        prompt = tokenizer.encode("hello world" if grammar is None else "maybe")
        return sampler.DecodeJob([prompt], rows, params, {EOS}, seed, grammar=grammar)

    told: dict[int, OperationError | None] = {}

    def report(i: int, _groups: Any, error: OperationError | None) -> None:
        told[i] = error

    jobs = [job(21), job(22, compiled.rows(3), 3), job(23, _Blank(compiled, 2))]
    with HostTransfers() as transfers:
        groups = sampler.generate(model, jobs, forward=transfers.stepping(model), report=report)
    assert max(transfers.per_step) <= 1 and transfers.total == transfers.steps
    (alone,) = sampler.generate(model, [job(21)])
    assert [s.tokens for s in groups[0][0]] == [s.tokens for s in alone[0]]
    for seq in groups[1][0]:
        assert seq.tokens[-1] == EOS and tokenizer.decode(seq.tokens[:-1]) in LANGUAGE
    assert told[0] is None and told[1] is None
    failed = told[2]
    assert failed is not None and failed.code == "INVALID_INPUT"
    assert failed.message.startswith("response_format: no token of this model continues")
