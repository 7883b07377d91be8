"""Built-in tasks with verifiable rewards; prompts are generated on the fly (no dataset).

A task hands out `Problem`s (prompt tokens + the reference answer's tokens) and scores a
completion in [0, 1]. `token_scores` scores each completion token on its own (1 if it is right
at its position), which the digits task uses for per-position credit.

- `DigitsTask`: copy or reverse a short digit string, for the tiny demo model. The tiny model
  has its own 16-token vocabulary (digits are ids 0-9), so no tokenizer is involved.
- `ArithmeticTask`: "What is 37 + 58?" with the model's own tokenizer and chat template
  (Qwen3 recipes); the reward checks the number in the answer.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Protocol

# The tiny demo model's vocabulary: digits are their own ids.
DIGITS = tuple(range(10))
BOS, SEP, EOS, PAD = 10, 11, 12, 13
DIGITS_VOCAB = 16


@dataclass(frozen=True)
class Problem:
    prompt: list[int]  # token ids the model sees
    answer: list[int]  # reference completion (SFT target; scoring for digits)
    text: str  # the prompt, readable
    solution: str  # the expected answer, readable


class Task(Protocol):
    name: str

    @property
    def max_tokens(self) -> int:
        """Completion budget (tokens)."""
        ...

    def problems(self, n: int, rng: random.Random) -> list[Problem]: ...

    def score(self, problem: Problem, completion: list[int]) -> float: ...

    def token_scores(self, problem: Problem, completion: list[int]) -> list[float] | None: ...

    def render(self, tokens: list[int]) -> str: ...


@dataclass
class DigitsTask:
    """[BOS, d1..dn, SEP] → d1..dn (copy) or dn..d1 (reverse); reward = share of right digits."""

    length: int = 4
    mode: str = "copy"
    name: str = "digits"

    @property
    def max_tokens(self) -> int:
        return self.length

    def problems(self, n: int, rng: random.Random) -> list[Problem]:
        out = []
        for _ in range(n):
            digits = [rng.choice(DIGITS) for _ in range(self.length)]
            answer = digits if self.mode == "copy" else digits[::-1]
            text = "".join(map(str, digits))
            out.append(
                Problem([BOS, *digits, SEP], answer, f"{self.mode} {text}", self.render(answer))
            )
        return out

    def token_scores(self, problem: Problem, completion: list[int]) -> list[float]:
        return [
            1.0 if i < len(problem.answer) and token == problem.answer[i] else 0.0
            for i, token in enumerate(completion)
        ]

    def score(self, problem: Problem, completion: list[int]) -> float:
        return sum(self.token_scores(problem, completion)) / len(problem.answer)

    def render(self, tokens: list[int]) -> str:
        names = {BOS: "<s>", SEP: "|", EOS: "</s>", PAD: "_"}
        return "".join(str(t) if t in DIGITS else names.get(t, f"<{t}>") for t in tokens)


_NUMBER = re.compile(r"-?\d+")
_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)


@dataclass
class ArithmeticTask:
    """Synthetic arithmetic through the model's chat template.

    Reward: 1.0 when the last integer of the answer (thinking removed) is right, 0.1 when the
    answer holds an integer that is wrong (format credit), else 0.
    """

    tokenizer: Any
    max_operand: int = 99
    operations: tuple[str, ...] = ("+", "-")
    max_tokens: int = 16
    name: str = "arithmetic"

    def problems(self, n: int, rng: random.Random) -> list[Problem]:
        out = []
        for _ in range(n):
            a, b = rng.randint(0, self.max_operand), rng.randint(0, self.max_operand)
            op = rng.choice(self.operations)
            value = a + b if op == "+" else a - b if op == "-" else a * b
            question = f"What is {a} {op} {b}? Answer with the number only."
            prompt = encode_chat(self.tokenizer, question)
            answer = self.tokenizer.encode(str(value), add_special_tokens=False)
            eos = self.tokenizer.eos_token_id
            if eos is not None:
                answer.append(int(eos))
            out.append(Problem(prompt, answer, question, str(value)))
        return out

    def score(self, problem: Problem, completion: list[int]) -> float:
        text = _THINK.sub("", self.render(completion))
        numbers = _NUMBER.findall(text)
        if not numbers:
            return 0.0
        return 1.0 if numbers[-1] == problem.solution else 0.1

    def token_scores(self, problem: Problem, completion: list[int]) -> list[float] | None:
        return None

    def render(self, tokens: list[int]) -> str:
        text: str = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return text


def encode_chat(tokenizer: Any, question: str) -> list[int]:
    """The user turn + generation prompt in the model's chat template (thinking off)."""
    messages = [{"role": "user", "content": question}]
    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, enable_thinking=False
        )
    except TypeError:  # templates without the enable_thinking switch
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def make_task(config: Any, tokenizer: Any = None, max_tokens: int | None = None) -> Task:
    """Build the task named by a `TaskConfig`."""
    if config.name == "digits":
        return DigitsTask(length=config.length, mode=config.mode)
    if tokenizer is None:
        raise ValueError("task 'arithmetic' needs the model's tokenizer")
    return ArithmeticTask(
        tokenizer,
        max_operand=config.max_operand,
        operations=tuple(config.operations),
        max_tokens=max_tokens or 16,
    )
