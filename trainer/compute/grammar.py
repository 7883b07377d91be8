"""Constrained decoding (docs/semantics.md §17.2): an `OutputGrammar` compiled against the
model's tokenizer with llguidance, and one matcher per row that says, before each draw, which
tokens may come next.

A row draws from its logits with every other token masked out (then temperature, top-k and
top-p as usual), and its matcher takes the token it drew. The end-of-sequence ids are allowed
exactly when the text so far is complete (llguidance is given them as its end tokens); a row
whose text can go no further then draws one of them. The mask is built on the host (llguidance
computes it there), one bit per token, and copied to the logits' device once per step for the
job's rows, where it becomes a bias of 0 and -inf added to the logits; the token each row drew
comes back in the step's one copy to the host (`trainer/compute/draws.py`), which the matchers
then take.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from trainer.contract.grammar import OutputGrammar

# From this many running rows the masks are filled on llguidance's thread pool: on 2 cores and
# the Qwen3 vocabulary, 64 rows took 0.22 ms there against 0.29 ms in turn, 8 rows 0.07 ms
# against 0.03 ms (the pool's start-up).
PARALLEL_ROWS = 32

# a Hugging Face tokenizer -> ((ids, end ids), its llguidance tokenizer): about 1 s to build
_TOKENIZERS: weakref.WeakKeyDictionary[Any, tuple[Any, Any]] = weakref.WeakKeyDictionary()


class Compiled:
    """A grammar checked against one model's tokenizer and vocabulary; `rows(n)` makes the
    matchers of a generation's `n` rows."""

    def __init__(self, spec: OutputGrammar, tokenizer: Any, vocab: int, eos_ids: set[int]):
        """A ValueError saying why when the grammar or the tokenizer cannot serve."""
        import llguidance

        if tokenizer is None:
            raise ValueError("constrained decoding needs a tokenizer and this model has none")
        self.spec, self.vocab, self.eos_ids = spec, vocab, sorted(eos_ids)
        self.size = max(vocab, len(tokenizer))  # the matchers' vocabulary: the mask's width
        self.tokenizer = _llg_tokenizer(tokenizer, self.size, self.eos_ids)
        # parsed once: a matcher never raises, it holds the grammar's error instead
        self.start = llguidance.LLMatcher(self.tokenizer, _grammar(spec), log_level=0)
        if self.start.is_error():
            raise ValueError(self.start.get_error()[:500])

    def rows(self, n: int) -> GrammarRows:
        return GrammarRows(self, n)


class GrammarRows:
    """The matchers of one generation's rows (`DecodeJob.grammar`)."""

    def __init__(self, compiled: Compiled, rows: int) -> None:
        import llguidance.torch

        self.compiled = compiled
        self.matchers = [compiled.start.deep_copy() for _ in range(rows)]  # no parse again
        self.bits = llguidance.torch.allocate_token_bitmask(rows, compiled.size)  # int32, host

    @property
    def field(self) -> str:
        return self.compiled.spec.field

    def bias(self, done: list[bool], device: torch.device) -> torch.Tensor:
        """`[rows, vocab]` float32 on `device`, to add to the logits: 0 where a running row may
        draw the token next, -inf elsewhere (a finished row: 0 everywhere; its draw is not
        read). Filled on the host one bit per token, copied once, spread there by a table of
        the 256 byte values; nothing is read back. A row with none allowed draws some token,
        which `take` then refuses."""
        import llguidance.torch

        bits = self.bits
        running = [(matcher, r) for r, matcher in enumerate(self.matchers) if not done[r]]
        for r, finished in enumerate(done):
            if finished:
                bits[r] = -1
        if len(running) >= PARALLEL_ROWS:  # llguidance's threads, without the GIL
            llguidance.torch.fill_next_token_bitmask_par(_executor(), running, bits)
        else:
            for matcher, r in running:
                llguidance.torch.fill_next_token_bitmask(matcher, bits, r)
        # from pinned memory the copy is queued; the step's copy back to the host, which the
        # next fill waits for, comes after it on the stream, so the buffer is free by then
        packed = bits.to(device, non_blocking=True).view(torch.uint8)  # token 8k + j: byte k, bit j
        spread = _byte_bias(device)[packed.long()]
        return spread.view(len(self.matchers), -1)[:, : self.compiled.vocab]

    def take(self, r: int, token: int) -> str | None:
        """Row `r` drew `token`: its matcher takes it (an end id: the text must be complete).
        A message when it refuses it, which only a row with no token allowed can draw."""
        matcher = self.matchers[r]
        if token in self.compiled.eos_ids:
            return None if matcher.is_accepting() else f"token {token} ends an unfinished text"
        if matcher.consume_token(token):
            return None
        return matcher.get_error() or f"token {token} does not continue it"


_BYTE_BIAS: dict[torch.device, torch.Tensor] = {}
_EXECUTOR: list[Any] = []


def _byte_bias(device: torch.device) -> torch.Tensor:
    """`[256, 8]` float32 on `device`: for each byte value, each of its bits (lowest first) as
    0.0 when set, -inf when clear. The bitmask's int32 words are little-endian, as on every
    device torch runs on here, so byte k of the row holds tokens 8k to 8k + 7."""
    table = _BYTE_BIAS.get(device)
    if table is None:
        set_bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        table = torch.where(set_bits.bool(), 0.0, float("-inf")).to(device)
        _BYTE_BIAS[device] = table
    return table


def _executor() -> Any:
    """The process's llguidance thread pool (80% of the CPUs, at most 32), made once."""
    if not _EXECUTOR:
        import llguidance

        _EXECUTOR.append(llguidance.LLExecutor())
    return _EXECUTOR[0]


def _llg_tokenizer(tokenizer: Any, size: int, eos_ids: list[int]) -> Any:
    """The model's tokenizer as llguidance reads it over `size` ids, ending at `eos_ids` (built
    once per tokenizer, size and end ids)."""
    if not eos_ids:
        raise ValueError("constrained decoding needs an end-of-sequence token")
    key = (size, tuple(eos_ids))
    cached = _TOKENIZERS.get(tokenizer)
    if cached is not None and cached[0] == key:
        return cached[1]
    import llguidance.hf

    try:
        built = llguidance.hf.from_tokenizer(tokenizer, n_vocab=size, eos_token=eos_ids)
    except (ValueError, TypeError, AssertionError) as exc:  # e.g. a word-level tokenizer
        raise ValueError(
            f"this model's tokenizer cannot be read for constrained decoding (llguidance: {exc})"
        ) from None
    _TOKENIZERS[tokenizer] = (key, built)
    return built


def _grammar(spec: OutputGrammar) -> str:
    """The llguidance grammar of `spec` (a ValueError when its text does not convert)."""
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        if spec.kind == "json_schema":
            return str(llguidance.LLMatcher.grammar_from_json_schema(spec.text))
        if spec.kind == "llguidance":  # already llguidance's own
            return spec.text
        if spec.kind == "lark":
            return str(llguidance.LLMatcher.grammar_from_lark(spec.text))
        return str(llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.text)))
    except Exception as exc:  # the converter raises plain Exception on bad text
        raise ValueError(str(exc)[:500]) from None
