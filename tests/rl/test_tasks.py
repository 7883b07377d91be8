"""The built-in tasks' prompts and rewards."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from trainer.rl.config import TaskConfig
from trainer.rl.tasks import BOS, DIGITS_VOCAB, EOS, SEP, ArithmeticTask, DigitsTask, make_task

from .helpers import build_chat_tokenizer


def test_digits_prompts() -> None:
    task = DigitsTask(length=5, mode="reverse")
    problems = task.problems(50, random.Random(0))
    for p in problems:
        assert p.prompt[0] == BOS and p.prompt[-1] == SEP and len(p.prompt) == 7
        assert p.answer == p.prompt[1:-1][::-1]
        assert all(0 <= t < DIGITS_VOCAB for t in p.prompt + p.answer)
    assert task.max_tokens == 5
    assert problems == DigitsTask(length=5, mode="reverse").problems(50, random.Random(0))


def test_digits_scores_per_position() -> None:
    task = DigitsTask(length=4, mode="copy")
    (p,) = task.problems(1, random.Random(1))
    a = p.answer
    assert task.score(p, a) == 1.0
    assert task.token_scores(p, a) == [1.0] * 4
    wrong = [(t + 1) % 10 for t in a]
    assert task.score(p, wrong) == 0.0
    half = a[:2] + wrong[2:]
    assert task.score(p, half) == 0.5
    assert task.token_scores(p, half) == [1.0, 1.0, 0.0, 0.0]
    assert task.score(p, [*a[:3], EOS]) == 0.75  # EOS where a digit should be
    assert task.score(p, a[:1]) == 0.25  # stopped early: missing positions are wrong
    assert task.score(p, [*a, 3]) == 1.0  # cannot happen (max_tokens = length), still scored


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    return build_chat_tokenizer(Path(tmp_path_factory.mktemp("tok")))


def test_arithmetic_uses_the_chat_template(tokenizer) -> None:  # type: ignore[no-untyped-def]
    task = make_task(TaskConfig(name="arithmetic", operations=["*"], max_operand=9), tokenizer)
    assert isinstance(task, ArithmeticTask)
    for p in task.problems(20, random.Random(0)):
        text = tokenizer.decode(p.prompt)
        assert text.startswith("<|im_start|>user\nWhat is ")
        assert text.endswith("<|im_start|>assistant\n")
        a, b = (int(x) for x in p.text.removeprefix("What is ").split("?")[0].split(" * "))
        assert p.solution == str(a * b)
        assert p.answer[-1] == tokenizer.eos_token_id
        assert tokenizer.decode(p.answer[:-1]) == p.solution


def test_arithmetic_reward(tokenizer) -> None:  # type: ignore[no-untyped-def]
    task = ArithmeticTask(tokenizer)
    (p,) = task.problems(1, random.Random(3))

    def score(text: str) -> float:
        return task.score(p, tokenizer.encode(text, add_special_tokens=False))

    assert score(p.solution) == 1.0
    assert score(f"The answer is {p.solution}<|im_end|>") == 1.0
    assert score(f"<think>maybe 12345</think>{p.solution}") == 1.0
    assert score(f"{p.solution}<think>no</think>") == 1.0
    assert score(f"{int(p.solution) + 1}") == 0.1
    assert score("no idea") == 0.0
    assert task.token_scores(p, []) is None
