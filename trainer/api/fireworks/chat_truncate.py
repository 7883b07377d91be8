"""`prompt_truncate_len` on the chat route (docs/semantics.md §25a): a conversation whose
rendered prompt is longer than that many tokens loses its earliest turns until it fits.

The leading `system` and `developer` messages are kept; the rest is cut only at the start of
a user turn (a `user` message), so that no assistant reply or tool result is left without the
message that asked for it, and the last user turn, with whatever follows it, is always kept.
The kept conversation is the longest such one whose rendered prompt fits; when not even the
last turn does, the request is refused naming the field.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trainer.serving.errors import bad_request

FIELD = "prompt_truncate_len"
LEADING = ("system", "developer")


def parse_truncate_len(value: Any) -> int | None:
    """The field: a positive integer, or None (absent); a 400 naming it otherwise."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise bad_request(f"{FIELD}: a positive number of tokens", FIELD)
    return value


def fit(
    messages: list[dict[str, Any]], length: Callable[[list[dict[str, Any]]], int], limit: int
) -> list[dict[str, Any]]:
    """The longest conversation cut as the module says whose `length` (its rendered prompt's
    tokens) is at most `limit` (a 400 naming the field when there is none)."""
    lead = 0
    while lead < len(messages) and messages[lead]["role"] in LEADING:
        lead += 1
    starts = [i for i in range(lead + 1, len(messages)) if messages[i]["role"] == "user"]

    def kept(start: int) -> list[dict[str, Any]]:
        return messages[:lead] + messages[start:]

    # fewer turns render fewer tokens: the first start that fits, by bisection
    low, high = 0, len(starts)  # starts[high - 1] is the last turn
    if not starts or length(kept(starts[-1])) > limit:
        raise bad_request(
            f"{FIELD}: the leading system messages and the last user turn alone render more "
            f"than {limit} tokens",
            FIELD,
        )
    high -= 1
    while low < high:
        middle = (low + high) // 2
        if length(kept(starts[middle])) <= limit:
            high = middle
        else:
            low = middle + 1
    return kept(starts[low])
