"""The rulebook: every check of a request's content, written once.

Each rule refuses with an `InputError` naming the field by the path its caller gives, so every
face says it in its own names and nothing else differs:
- the HTTP edge (`trainer.serving.requests`) runs them before an operation is queued, against
  the model's limits and, once a resource of the model has loaded, its vocabulary (before
  that, token ids are checked to be >= 0);
- the engine (`trainer.compute.batch.prepare_samples`, the generator's `_check_prompts`) runs
  them again with the vocabulary, for callers that reach it without the edge;
- the Tinker face (`trainer.api.tinker.convert`) runs them, the vocabulary included, under its
  names (`forward_backward_input.data[3]` for the RL face's `samples[3]`).

A bad token id is named by its chunk and its place in it (`token_field`).

Which inputs a loss reads, and their dtypes, come from the loss registry
(`trainer.contract.losses`). Numpy only (no torch), so the edge can run every rule.

The rules live in four modules, all imported from here:
- `limits`: the request shapes the rules read (protocols), a model's `Limits`, a loss's `Needs`;
- `numbers`: finite floats, token ids in range, the field naming a bad id;
- `samples`: a forward-backward's samples, their `loss_fn_inputs` and gradients;
- `prompts`: a sample call's prompts, counts and prompt-side options.
"""

from trainer.contract.rules.limits import (
    GradientLike,
    Limits,
    ModelLimits,
    Needs,
    SampleLike,
    Tensor,
    Tokens,
)
from trainer.contract.rules.numbers import (
    check_finite,
    check_has_tokens,
    check_ids,
    token_field,
    token_values,
)
from trainer.contract.rules.prompts import (
    MAX_TARGET_PROMPT_COLUMNS,
    MAX_TOPK_PROMPT_LOGPROBS,
    check_alt_k,
    check_last_n,
    check_num_samples,
    check_prompts,
    check_target_ids,
    check_target_table,
    check_topk,
)
from trainer.contract.rules.samples import (
    check_conditional,
    check_count,
    check_gradient,
    check_gradient_count,
    check_inputs,
    check_model_input,
    check_same_columns,
    check_samples,
    check_soft_targets,
    check_token_budget,
)

__all__ = [
    "MAX_TARGET_PROMPT_COLUMNS",
    "MAX_TOPK_PROMPT_LOGPROBS",
    "GradientLike",
    "Limits",
    "ModelLimits",
    "Needs",
    "SampleLike",
    "Tensor",
    "Tokens",
    "check_alt_k",
    "check_conditional",
    "check_count",
    "check_finite",
    "check_gradient",
    "check_gradient_count",
    "check_has_tokens",
    "check_ids",
    "check_inputs",
    "check_last_n",
    "check_model_input",
    "check_num_samples",
    "check_prompts",
    "check_same_columns",
    "check_samples",
    "check_soft_targets",
    "check_target_ids",
    "check_target_table",
    "check_token_budget",
    "check_topk",
    "token_field",
    "token_values",
]
