"""Inline MoE routes (docs/semantics.md §12): a sample's routes returned as routing matrices
(the Fireworks SDK's R3 `base64_inline` format) and a training sample carrying them instead of
a key, checked against the independent plain-torch Qwen3-MoE forward of
`tests/engine/test_routing_replay.py`."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch

from tests.engine.helpers import make_resource, model_input
from tests.engine.test_routing_replay import (
    CE,
    PROMPTS,
    _forward,
    _probe,
    _ref_lp,
    _routes,
    reference,
    weights,
)
from trainer.contract import routing
from trainer.contract.errors import OperationError
from trainer.contract.specs import AdamParams, SamplingParams, SessionSpec


@pytest.fixture(scope="module")
def moe_dir(tiny_moe_dir):
    return tiny_moe_dir


def _decoded(matrices: list[str]) -> torch.Tensor:
    """`[positions, 2 layers, top-2]` ids of the tiny model's matrices ("" rows: -1)."""
    rows = [routing.decode(m, 2, 2, 4) for m in matrices]
    return torch.tensor(np.stack([np.full((2, 2), -1) if r is None else r for r in rows]))


def _sampled(session, n: int = 2, max_tokens: int = 8) -> list[dict]:
    """Each sequence with both its key and its inline matrices."""
    out = session.sample(
        [model_input(p) for p in PROMPTS],
        num_samples=n,
        sampling_params=SamplingParams(max_tokens=max_tokens, seed=3, temperature=1.0),
        return_routed_experts=True,
        return_routing_matrices=True,
    )
    seqs = []
    for prompt, result in zip(PROMPTS, out["results"], strict=True):
        for seq in result["sequences"]:
            seqs.append({"prompt": prompt, **seq, "key": seq["routed_experts_key"]})
    return seqs


def _inline(seq: dict, completion_only: bool = False):
    """The training sample of a sequence with its matrices inline (the cookbook's
    `build_r3_routing_matrices`: completion-only blanks the prompt's positions but the last)."""
    probe = _probe(seq, None)
    matrices = list(seq["routing_matrices"])
    if completion_only:
        matrices[: len(seq["prompt"]) - 1] = [""] * (len(seq["prompt"]) - 1)
    probe.routing_matrices = matrices
    return probe


def test_codec_round_trip_and_refusals() -> None:
    ids = np.array([[[0, 3], [2, 1]], [[1, 2], [3, 0]]])
    encoded = routing.encode(ids, experts=4)
    assert base64.b64decode(encoded[0]) == bytes([0, 3, 2, 1])  # uint8, layer-major
    assert [routing.decode(m, 2, 2, 4).tolist() for m in encoded] == ids.tolist()
    assert routing.decode("", 2, 2, 4) is None
    wide = routing.encode(np.array([[[300, 7]]]), experts=512)  # past 256 experts: uint16
    assert routing.decode(wide[0], 1, 2, 512).tolist() == [[300, 7]]
    for bad, why in [
        ("@@", "not base64"),
        (base64.b64encode(bytes([0, 1, 2])).decode(), "3 bytes"),
        (base64.b64encode(bytes([0, 1, 2, 9])).decode(), "out of range"),
        (base64.b64encode(bytes([0, 1, 2, 2])).decode(), "twice"),
    ]:
        with pytest.raises(ValueError, match=why):
            routing.decode(bad, 2, 2, 4)


def test_matrices_are_the_recorded_routes_and_the_routers_own_choice(moe_dir, tmp_path) -> None:
    resource = make_resource(moe_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    config = session.policy.model.config
    w = weights(session)
    for seq in _sampled(session):
        tokens = seq["prompt"] + seq["tokens"]
        got = _decoded(seq["routing_matrices"])
        assert got.shape == (len(tokens) - 1, 2, 2)  # every position the generator ran
        assert torch.equal(got, _routes(session, seq["key"]).long())
        _, own = reference(w, config, tokens[:-1], None)  # an eager forward's router top-k
        assert torch.equal(got.sort(-1).values, own.sort(-1).values)


def test_inline_replay_equals_forced_reference_after_routes_change(moe_dir, tmp_path) -> None:
    resource = make_resource(moe_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    seqs = _sampled(session)
    at_sampling = _forward(session, [_inline(s) for s in seqs])
    for seq, lp in zip(seqs, at_sampling, strict=True):
        n_prompt = len(seq["prompt"])
        torch.testing.assert_close(
            lp[n_prompt - 1 :], torch.tensor(seq["logprobs"]), atol=1e-5, rtol=0
        )
    plain = [_probe(s, None) for s in seqs]
    for _ in range(3):  # large steps on everything, routers included: routes flip
        session.forward_backward(CE, plain)
        session.optim_step(AdamParams(learning_rate=0.05, grad_clip_norm=0.0))
    config = session.policy.model.config
    w = weights(session)
    full = _forward(session, [_inline(s) for s in seqs])
    keyed = _forward(session, [_probe(s, s["key"]) for s in seqs])
    tail = _forward(session, [_inline(s, completion_only=True) for s in seqs])
    free = _forward(session, plain)
    flipped = 0
    for i, seq in enumerate(seqs):
        routes = _decoded(seq["routing_matrices"])
        probe = plain[i]
        assert torch.equal(full[i], keyed[i])  # one replay path, keyed or inline
        torch.testing.assert_close(full[i], _ref_lp(w, config, probe, routes), atol=1e-5, rtol=0)
        only = routes.clone()
        only[: len(seq["prompt"]) - 1] = reference(w, config, probe.model_input.tokens, None)[1][
            : len(seq["prompt"]) - 1
        ]  # the prompt's positions on the router's own choice
        torch.testing.assert_close(tail[i], _ref_lp(w, config, probe, only), atol=1e-5, rtol=0)
        _, own = reference(w, config, probe.model_input.tokens, None)
        flips = (own.sort(-1).values != routes.sort(-1).values).any(-1).any(-1)
        flipped += int(flips.sum())
        if bool(flips.any()):
            assert (full[i] - free[i]).abs().max() > 1e-4
    assert flipped > 0


def test_inline_gradients_equal_the_forced_reference(moe_dir, tmp_path) -> None:
    resource = make_resource(moe_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    seqs = _sampled(session, n=1)
    session.forward_backward(CE, [_probe(s, None) for s in seqs])
    session.optim_step(AdamParams(learning_rate=0.05, grad_clip_norm=0.0))
    config = session.policy.model.config
    w = {n: t.requires_grad_(True) for n, t in weights(session).items()}
    loss = sum(
        -_ref_lp(w, config, _probe(s, None), _decoded(s["routing_matrices"])).sum() for s in seqs
    )
    loss.backward()
    session.forward_backward(CE, [_inline(s) for s in seqs])
    params = dict(session.policy.model.named_parameters())
    for name in ("model.layers.0.mlp.gate.weight", "model.layers.1.mlp.experts.down_proj"):
        got = params[name].grad
        assert got is not None and got.abs().max() > 0
        torch.testing.assert_close(got, w[name].grad, atol=1e-5, rtol=1e-4)


def test_bad_matrices_are_invalid_input_naming_them(moe_dir, tmp_path, tiny_qwen_dir) -> None:
    resource = make_resource(moe_dir, tmp_path, lora=False)
    session = resource.create_session("a", SessionSpec())
    seq = _sampled(session, n=1)[0]

    def refused(change, field: str) -> None:
        probe = _inline(seq)
        change(probe)
        with pytest.raises(OperationError) as err:
            session.forward_backward(CE, [probe], forward_only=True)
        assert err.value.code == "INVALID_INPUT" and err.value.field == field, str(err.value)

    name = "samples[0].routing_matrices"
    refused(lambda p: p.routing_matrices.pop(), name)  # one fewer than the tokens
    refused(lambda p: setattr(p, "routing_matrices", []), name)
    three = base64.b64encode(bytes([0, 1, 2])).decode()
    refused(lambda p: p.routing_matrices.__setitem__(2, three), f"{name}[2]")  # wrong shape
    big = base64.b64encode(bytes([0, 1, 2, 4])).decode()
    refused(lambda p: p.routing_matrices.__setitem__(0, big), f"{name}[0]")  # expert 4 of 4
    refused(lambda p: p.routing_matrices.__setitem__(1, "not base64!"), f"{name}[1]")
    refused(lambda p: setattr(p, "routed_experts_key", seq["key"]), name)  # both
    # all empty: nothing forced, the router's own choice everywhere
    blank = _inline(seq)
    blank.routing_matrices = [""] * len(blank.routing_matrices)
    free = _forward(session, [_probe(seq, None)])[0]
    assert torch.equal(_forward(session, [blank])[0], free)

    dense = make_resource(tiny_qwen_dir, tmp_path / "dense", lora=False)
    other = dense.create_session("d", SessionSpec())
    with pytest.raises(OperationError, match="return_routing_matrices"):
        other.sample([model_input(PROMPTS[0])], return_routing_matrices=True)
    with pytest.raises(OperationError) as err:
        other.forward_backward(CE, [_inline(seq)], forward_only=True)
    assert err.value.field == name
