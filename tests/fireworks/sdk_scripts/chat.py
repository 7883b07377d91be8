"""Chat completions through the Fireworks SDK's own client, `Fireworks().chat.completions`.

    python chat.py <model> <messages JSON>

Prints one JSON object: `whole` (a greedy answer with logprobs, token ids and raw output, as
the SDK's types parse it), `streamed` (the same request streamed, put together from the
SDK's `ChatCompletionChunk`s) and `text` (`completions.create` of the rendered prompt's ids,
greedy, read through the SDK's typed `NewLogProbs` and `RawOutput`).
"""

from __future__ import annotations

import json
import os
import sys

from fireworks import Fireworks


def main() -> None:
    model, messages = sys.argv[1], json.loads(sys.argv[2])
    client = Fireworks(
        api_key=os.environ["FIREWORKS_API_KEY"], base_url=os.environ["FIREWORKS_BASE_URL"]
    )
    asked = {"model": model, "messages": messages, "max_tokens": 12, "temperature": 0}
    r = client.chat.completions.create(
        **asked, logprobs=True, top_logprobs=2, return_token_ids=True, raw_output=True
    )
    (choice,) = r.choices
    assert choice.logprobs is not None and choice.raw_output is not None and r.usage
    whole = {
        "object": r.object,
        "role": choice.message.role,
        "content": choice.message.content,
        "finish_reason": choice.finish_reason,
        "token_ids": choice.token_ids,
        "prompt_token_ids": r.prompt_token_ids,
        "raw_prompt_token_ids": choice.raw_output.prompt_token_ids,
        "logprobs": [row.logprob for row in choice.logprobs.content or []],
        "completion_tokens": r.usage.completion_tokens,
    }
    content, roles, finish = "", [], None
    for chunk in client.chat.completions.create(**asked, stream=True):
        for part in chunk.choices:
            content += part.delta.content or ""
            roles += [part.delta.role] if part.delta.role else []
            finish = part.finish_reason or finish
    streamed = {"content": content, "roles": roles, "finish_reason": finish}
    t = client.completions.create(
        model=model,
        prompt=r.prompt_token_ids,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        raw_output=True,
    )
    (c,) = t.choices
    assert c.logprobs is not None and c.raw_output is not None
    text = {
        "text": c.text,
        "token_ids": c.raw_output.completion_token_ids,
        "logprobs": [row.logprob for row in c.logprobs.content or []],
        "offsets": [row.text_offset for row in c.logprobs.content or []],
        "fragments": c.raw_output.prompt_fragments,
    }
    print(json.dumps({"whole": whole, "streamed": streamed, "text": text}))


if __name__ == "__main__":
    main()
