"""From wire samples to tensors: validation, then padding-free packing into micro-batches.

Validation happens here, before any weight is touched: the rulebook's checks
(`trainer.contract.rules`), with the vocabulary, and every refusal names the field
(`samples[3].loss_fn_inputs.target_tokens[7]: token id 999 out of range [0, 128)`).

Packing: the samples of a call are laid end to end into rows of at most `row_tokens` tokens
(first-fit, longest first; a sample is never split), with position ids restarting at each
sample and a block-diagonal causal mask, so each sample attends only to itself. Rows are
grouped into micro-batches of at most `token_budget` tokens. Loss denominators are computed
over the whole call before the first micro-batch (`LossNorm`), so the gradient does not depend
on how the call was split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt
import torch

from trainer.compute.attention import BOOLEAN_MASK_ATTENTION, is_varlen
from trainer.contract.arrays import as_float32
from trainer.contract.losses import FLOAT_INPUTS, InputRule
from trainer.contract.options import ROW_TOKENS, TOKEN_BUDGET
from trainer.contract.rules import Limits, Needs, check_conditional, check_samples
from trainer.contract.specs import Gradient, Sample


@dataclass
class PreparedSample:
    """One validated sample. T = its token count."""

    index: int
    tokens_T: torch.Tensor
    targets_T: torch.Tensor  # [T], or [T, K]: K weighted targets per position (soft targets)
    mask_T: torch.Tensor  # fp32 0/1
    # fp32 per-token inputs: [T], or [T, K] for soft targets' `weights`
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    keep_all: bool = False  # compute (and return) every position; the loss still reads mask_T
    # MoE routing replay: recorded expert ids [positions, layers, k] of its first positions
    # (`moe_replay_keys.attach_routed_experts`); they follow the sample wherever it is packed
    # (`moe_replay.plan`)
    routed_experts: torch.Tensor | None = None

    @property
    def length(self) -> int:
        return int(self.tokens_T.shape[0])

    @property
    def kept_T(self) -> torch.Tensor:
        """The positions whose logprobs are computed: mask != 0, or all with `keep_all`."""
        if self.keep_all:
            return torch.ones(self.length, dtype=torch.bool)
        return self.mask_T != 0


def prepare_samples(
    samples: list[Sample],
    *,
    vocab_size: int,
    max_seq_length: int,
    max_batch_size: int,
    required: tuple[str, ...] = (),
    weights_are_mask: bool = True,
    soft_targets: bool = False,
    gradients: list[Gradient] | None = None,
) -> list[PreparedSample]:
    """Check a call's samples against the rulebook (`trainer.contract.rules.check_samples`,
    with the vocabulary) and turn them into tensors (CPU).

    With `weights_are_mask` (every loss but cross entropy), non-zero weights become mask 1.
    Cross entropy keeps fractional `weights` and masks where `w == 0` (with `soft_targets`,
    [T, K] targets and weights: a position where all K weights are 0).
    """
    limits = Limits(max_seq_length, max_batch_size, vocab_size=vocab_size)
    needs = Needs(required, soft_targets=soft_targets)
    checked = check_samples(samples, limits, needs, gradients)
    prepared = []
    for i, (sample, (tokens, targets)) in enumerate(zip(samples, checked, strict=True)):
        gradient = gradients[i] if gradients is not None else None
        prepared.append(_prepare_one(i, sample, tokens, targets, weights_are_mask, gradient))
    return prepared


def _prepare_one(
    i: int,
    sample: Sample,
    tokens: npt.NDArray[np.int64],
    targets: npt.NDArray[np.int64],
    weights_are_mask: bool,
    gradient: Gradient | None,
) -> PreparedSample:
    """One checked sample as tensors: its ids, the per-token float inputs and the mask."""
    inputs = sample.loss_fn_inputs
    # float64 then float32, as `torch.tensor([float(v) ...], dtype=float32)` rounds
    floats: dict[str, torch.Tensor] = {}
    for name in FLOAT_INPUTS:
        if name in inputs:
            values = torch.from_numpy(as_float32(inputs[name].data))
            shape = inputs[name].shape
            floats[name] = values.reshape(shape) if shape is not None else values
    if gradient is not None:
        floats["gradients"] = torch.from_numpy(as_float32(gradient.data))
    if "mask" in floats:
        mask = (floats["mask"] != 0).float()
    elif "weights" in floats:
        nonzero = floats["weights"] != 0
        mask = (nonzero.any(-1) if nonzero.ndim == 2 else nonzero).float()
        if weights_are_mask:
            floats["weights"] = mask
    else:
        mask = torch.ones(len(tokens), dtype=torch.float32)
    return PreparedSample(
        index=i,
        tokens_T=torch.from_numpy(tokens),
        targets_T=torch.from_numpy(targets),
        mask_T=mask,
        inputs=floats,
    )


def check_rules(samples: list[PreparedSample], rules: tuple[InputRule, ...]) -> None:
    """The inputs a loss needs only with its params (`LossSpec.rules_for`), after every sample
    passed `prepare_samples` (`trainer.contract.rules.check_conditional`)."""
    for s in samples:
        check_conditional(f"samples[{s.index}]", s.inputs, rules)


@dataclass(frozen=True)
class LossNorm:
    """Call-level denominators, fixed before the first micro-batch of a call."""

    total_mask: float  # Σ m_t over the whole call
    total_samples: int  # number of samples in the whole call
    horizon: int  # longest sample's token count in the whole call (FIXED_HORIZON's H)


def loss_norm(samples: list[PreparedSample]) -> LossNorm:
    """The call-level denominators, fixed before the first micro-batch."""
    return LossNorm(
        total_mask=float(sum(float(s.mask_T.sum()) for s in samples)),
        total_samples=len(samples),
        horizon=max(s.length for s in samples),
    )


@dataclass
class MicroBatch:
    """Packed rows. R = rows, L = longest row; P = tokens kept for the loss (mask != 0).

    `tokens_R_L`, `position_ids_R_L` and `attention_mask_R_1_L_L` feed the decoder;
    `keep_index_P` indexes the flattened `[R*L]` hidden states of the kept positions, in the
    order of `samples` and then position; `sample_index_P` is the micro-batch-local sample index.
    `segment_R_L`: the sample index at each position (-1: padding); the dense mask is built from
    it only when an attention asks for one (a varlen attention never does).
    """

    samples: list[PreparedSample]
    tokens_R_L: torch.Tensor
    position_ids_R_L: torch.Tensor
    segment_R_L: torch.Tensor
    keep_index_P: torch.Tensor
    sample_index_P: torch.Tensor
    targets_P: torch.Tensor
    row_lengths: list[int] = field(default_factory=list)  # real tokens per row, left-aligned
    one_per_row: bool = False  # the `ROWS` layout (`trainer.compute.architecture`)

    @property
    def num_tokens(self) -> int:
        return sum(s.length for s in self.samples)

    @property
    def attention_mask_R_1_L_L(self) -> torch.Tensor:
        """The block-diagonal causal mask (True = attend), built on each call."""
        segment = self.segment_R_L
        width = segment.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        same = segment[:, :, None] == segment[:, None, :]
        mask = (causal[None] & same & (segment[:, :, None] >= 0))[:, None]
        # Padding rows attend to themselves only, so no softmax row is empty.
        eye = torch.eye(width, dtype=torch.bool)[None, None]
        return mask | (eye & (segment[:, None, :, None] < 0))

    def gather(self, name: str) -> torch.Tensor | None:
        """A per-token input of the samples, at the kept positions, in `_P` order."""
        if not all(name in s.inputs for s in self.samples):
            return None
        return torch.cat([s.inputs[name][s.kept_T] for s in self.samples])

    def mask_P(self) -> torch.Tensor:
        """m_t at the kept positions: all ones unless a sample keeps every position."""
        if not any(s.keep_all for s in self.samples):
            return torch.ones(self.keep_index_P.shape[0], dtype=torch.float32)
        return torch.cat([s.mask_T[s.kept_T] for s in self.samples])

    def decoder_inputs(
        self,
        attn_implementation: str | None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """Keyword arguments for the decoder's forward, and the index of the kept positions in
        its flattened `last_hidden_state` (use it in place of `keep_index_P`).

        With a varlen attention (FlashAttention, or `packed_sdpa` below), the rows go in as one
        `[1, Σ tokens]` row without padding or mask: the kernel splits it where the position
        ids restart, so no `L×L` mask is built or applied and no padding is computed. Any other
        implementation (sdpa, eager) gets the padded rows and the block-diagonal causal mask,
        in the form it takes (`attention_mask`; `dtype`: the model's). A batch of one sample
        per row (the `ROWS` layout) goes in as padded rows with a `[R, L]` padding mask, from
        which the model builds each layer's own mask.
        """
        if self.one_per_row:
            real = self.segment_R_L >= 0
            inputs = {
                "input_ids": self.tokens_R_L.to(device),
                "position_ids": self.position_ids_R_L.to(device),
                "attention_mask": real.long().to(device),
            }
            return inputs, self.keep_index_P.to(device)
        if not self.varlen(attn_implementation):
            inputs = {
                "input_ids": self.tokens_R_L.to(device),
                "position_ids": self.position_ids_R_L.to(device),
                "attention_mask": self.attention_mask(attn_implementation, device, dtype),
            }
            return inputs, self.keep_index_P.to(device)
        width = self.tokens_R_L.shape[1]
        lengths = torch.tensor(self.row_lengths, dtype=torch.long)
        real = torch.arange(width)[None, :] < lengths[:, None]
        offsets = torch.cumsum(lengths, 0) - lengths
        rows, cols = self.keep_index_P // width, self.keep_index_P % width
        inputs = {
            "input_ids": self.tokens_R_L[real][None].to(device),
            "position_ids": self.position_ids_R_L[real][None].to(device),
        }
        return inputs, (offsets[rows] + cols).to(device)

    def varlen(self, attn_implementation: str | None) -> bool:
        """Whether the decoder takes this batch as one unpadded row (`decoder_inputs`)."""
        return not self.one_per_row and is_varlen(attn_implementation)

    def attention_mask(
        self,
        attn_implementation: str | None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The block-diagonal causal mask as the attention takes it: boolean (True = attend)
        for SDPA; additive in `dtype` for any other (eager adds the mask to the scores, so a
        boolean True would become +1 and mask nothing): 0 where a token may attend, the
        dtype's lowest value elsewhere, as transformers builds its own eager masks."""
        allowed = self.attention_mask_R_1_L_L.to(device)
        if attn_implementation in BOOLEAN_MASK_ATTENTION:
            return allowed
        additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
        return additive.masked_fill_(~allowed, torch.finfo(dtype).min)


def pack_rows(
    samples: list[PreparedSample], row_tokens: int, one_per_row: bool = False
) -> list[list[PreparedSample]]:
    """First-fit-decreasing packing into rows of `row_tokens` (or the longest sample's); with
    `one_per_row` (the `ROWS` layout), each sample alone in its row, longest first."""
    if one_per_row:
        return [[s] for s in sorted(samples, key=lambda s: (-s.length, s.index))]
    capacity = max(row_tokens, max(s.length for s in samples))
    rows: list[list[PreparedSample]] = []
    room: list[int] = []
    for sample in sorted(samples, key=lambda s: (-s.length, s.index)):
        for r, free in enumerate(room):
            if sample.length <= free:
                rows[r].append(sample)
                room[r] -= sample.length
                break
        else:
            rows.append([sample])
            room.append(capacity - sample.length)
    return rows


def pack(
    samples: list[PreparedSample],
    *,
    row_tokens: int = ROW_TOKENS,
    token_budget: int = TOKEN_BUDGET,
    one_per_row: bool = False,
) -> list[MicroBatch]:
    """`pack_rows`, rows grouped into micro-batches by token budget (with `one_per_row`, by
    padded size: rows × the longest row)."""
    rows = pack_rows(samples, row_tokens, one_per_row)
    if one_per_row:
        return [build_micro_batch(group, True) for group in _padded_groups(rows, token_budget)]
    batches: list[list[list[PreparedSample]]] = [[]]
    used = 0
    for row in rows:
        size = sum(s.length for s in row)
        if batches[-1] and used + size > token_budget:
            batches.append([])
            used = 0
        batches[-1].append(row)
        used += size
    return [build_micro_batch(group) for group in batches]


def _padded_groups(
    rows: list[list[PreparedSample]], token_budget: int
) -> list[list[list[PreparedSample]]]:
    """Rows (longest first) in groups whose padded size, rows × the first row's length, fits
    `token_budget` (a row longer than the budget goes alone)."""
    groups: list[list[list[PreparedSample]]] = []
    for row in rows:
        if groups and (len(groups[-1]) + 1) * groups[-1][0][0].length <= token_budget:
            groups[-1].append(row)
        else:
            groups.append([row])
    return groups


def build_micro_batch(rows: list[list[PreparedSample]], one_per_row: bool = False) -> MicroBatch:
    width = max(sum(s.length for s in row) for row in rows)
    tokens = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.zeros(len(rows), width, dtype=torch.long)
    segment = torch.full((len(rows), width), -1, dtype=torch.long)
    placed: list[tuple[PreparedSample, int, int]] = []  # sample, row, offset
    for r, row in enumerate(rows):
        offset = 0
        for sample in row:
            n = sample.length
            tokens[r, offset : offset + n] = sample.tokens_T
            positions[r, offset : offset + n] = torch.arange(n)
            segment[r, offset : offset + n] = sample.index
            placed.append((sample, r, offset))
            offset += n
    placed.sort(key=lambda item: item[0].index)
    keep, sample_index, targets = [], [], []
    for local, (sample, r, offset) in enumerate(placed):
        kept = torch.nonzero(sample.kept_T).squeeze(-1)
        keep.append(r * width + offset + kept)
        sample_index.append(torch.full((kept.shape[0],), local, dtype=torch.long))
        targets.append(sample.targets_T[kept])
    return MicroBatch(
        samples=[item[0] for item in placed],
        tokens_R_L=tokens,
        position_ids_R_L=positions,
        segment_R_L=segment,
        keep_index_P=torch.cat(keep),
        sample_index_P=torch.cat(sample_index),
        targets_P=torch.cat(targets),
        row_lengths=[sum(s.length for s in row) for row in rows],
        one_per_row=one_per_row,
    )
