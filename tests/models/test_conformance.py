"""Every model family, exact or refused (docs/semantics.md §20): one table-driven suite.

For each row of `tests/models/conformance.py` (tiny models with every layer type of their family
and sliding windows of 4 tokens, shorter than the 8–24-token samples), through the engine as a
client drives it:
- the resource loads with the trainer path the row names, or is refused with its message;
- a multi-sample forward-backward of the full weights equals a plain eager forward of each
  sequence alone, with its own class (logprobs ≤ 1e-4; loss and every gradient ≤ 1e-4
  relative);
- a LoRA session trains a step (adapter on the head too); its logprobs equal the merged export
  reloaded with the checkpoint's own class, and the PEFT adapter loaded on the original base;
  the composites' vision towers are untouched;
- sampled and prompt logprobs equal a plain forward of that export (≤ 1e-3);
- two LoRA sessions merged into shared passes equal the same operations run solo.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.engine.helpers import grads_of, make_resource, model_input, random_batch
from tests.models.conformance import BY_FAMILY, ROWS, close, own_class, plain, save
from tests.models.conformance import sequence_logprobs as logprobs_alone
from trainer.compute.selfcheck import ModelRefused
from trainer.contract.errors import OperationError
from trainer.contract.options import EngineOptions
from trainer.contract.specs import AdamParams, LoraConfig, LossConfig, SamplingParams, SessionSpec
from trainer.engine.resource import ModelResource

CE = LossConfig(type="cross_entropy")
EXACT = [row.family for row in ROWS if row.path is not None]
REFUSED = [row.family for row in ROWS if row.path is None]
LORA = LoraConfig(rank=4, alpha=8, seed=7, train_unembed=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("families")


def _dir(checkpoints: Path, family: str) -> Path:
    return save(family, checkpoints / family)


def _batch(seed: int, n: int = 4) -> list[Any]:
    return random_batch(seed, n=n, lengths=(8, 24), weights="randn")


def _outputs(result: dict[str, Any]) -> list[torch.Tensor]:
    return [torch.tensor(o["tensors"]["logprobs"]["data"]) for o in result["loss_fn_outputs"]]


def _targets(s: Any) -> list[int]:
    return [int(t) for t in s.loss_fn_inputs["target_tokens"].data]


@pytest.mark.parametrize("family", EXACT)
def test_path_chosen_and_checked(family: str, checkpoints: Path, tmp_path: Path) -> None:
    resource = make_resource(_dir(checkpoints, family), tmp_path)
    arch = resource.model.trainer_architecture
    assert arch.path() == BY_FAMILY[family].path, arch.features()
    assert all(diff <= 1e-4 for diff in arch.checked.values()), arch.checked
    assert type(resource.model) is own_class(_dir(checkpoints, family))  # composites stay whole


@pytest.mark.parametrize("family", REFUSED)
def test_refused_with_its_reason(family: str, checkpoints: Path, tmp_path: Path) -> None:
    with pytest.raises(ModelRefused) as info:
        make_resource(_dir(checkpoints, family), tmp_path)
    refusal = BY_FAMILY[family].refusal
    assert refusal is not None and re.search(refusal, str(info.value)), str(info.value)
    assert "differ by" in str(info.value)  # with the measured difference


@pytest.mark.parametrize("family", EXACT)
def test_full_weights_forward_backward_equal_each_sequence_alone(
    family: str, checkpoints: Path, tmp_path: Path
) -> None:
    model_dir = _dir(checkpoints, family)
    resource = make_resource(model_dir, tmp_path, lora=False, generator=False)
    session = resource.create_session("a", SessionSpec())
    samples = _batch(1)
    out = session.forward_backward(CE, samples, return_loss_fn_outputs=True)

    reference = plain(model_dir)
    reference.requires_grad_(True)
    total = torch.zeros(())
    for s, got in zip(samples, _outputs(out), strict=True):
        lp = logprobs_alone(reference, s.model_input.tokens, _targets(s))
        torch.testing.assert_close(got, lp.detach(), atol=1e-4, rtol=0)
        weights = torch.tensor(s.loss_fn_inputs["weights"].data, dtype=torch.float32)
        total = total - (weights * lp).sum()
    total.backward()
    assert out["loss"] == pytest.approx(float(total), rel=1e-5, abs=1e-5)
    ours = grads_of(session)
    theirs = dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name, grad in ours.items():
        close(grad, theirs[name].grad, 1e-4, f"{family} grad {name}")
    assert any(grad is not None for grad in ours.values())
    session.optim_step(AdamParams(learning_rate=1e-2))  # a full-weight step runs


def _trained_lora(resource: ModelResource, name: str, seed: int) -> Any:
    config = LORA.model_copy(update={"seed": seed})
    session = resource.create_session(name, SessionSpec(lora_config=config))
    session.forward_backward(CE, _batch(10 + seed))
    session.optim_step(AdamParams(learning_rate=5e-2))
    return session


def _towers(model: Any) -> dict[str, torch.Tensor]:
    """The weights outside the language model and its head (a composite's vision tower)."""
    decoder = model.get_decoder()
    inside = {id(p) for p in decoder.parameters()}
    inside |= {id(p) for p in model.get_output_embeddings().parameters()}
    return {n: p.detach().clone() for n, p in model.named_parameters() if id(p) not in inside}


@pytest.mark.parametrize("family", EXACT)
def test_lora_step_exports_and_samples_exactly(
    family: str, checkpoints: Path, tmp_path: Path
) -> None:
    from peft import PeftModel

    model_dir = _dir(checkpoints, family)
    resource = make_resource(model_dir, tmp_path)
    towers = _towers(resource.model)
    session = _trained_lora(resource, "a", 1)
    probes = _batch(2, n=3)
    out = session.forward_backward(CE, probes, forward_only=True, return_loss_fn_outputs=True)
    record = session.save_inference_checkpoint()

    merged = plain(record.path / "merged")
    assert type(merged) is own_class(model_dir)
    adapted = PeftModel.from_pretrained(plain(model_dir), record.path / "adapter").eval()
    with torch.no_grad():
        for s, got in zip(probes, _outputs(out), strict=True):
            want = logprobs_alone(merged, s.model_input.tokens, _targets(s))
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
            via_peft = logprobs_alone(adapted, s.model_input.tokens, _targets(s))
            torch.testing.assert_close(got, via_peft, atol=1e-4, rtol=0)
    for name, weight in _towers(merged).items():  # vision towers exported as they were
        assert torch.equal(weight, towers[name]), name
    assert all(torch.equal(w, _towers(resource.model)[n]) for n, w in towers.items())

    session.weights_sync("WEIGHT_SYNC_TYPE_BACKGROUND_PUBLISH")
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22]]  # left padding in one batch
    params = SamplingParams(max_tokens=10, seed=3, temperature=1.0)
    result = session.sample(
        [model_input(p) for p in prompts],
        num_samples=2,
        sampling_params=params,
        prompt_logprobs=True,
    )
    with torch.no_grad():
        for prompt, res in zip(prompts, result["results"], strict=True):
            want_prompt = logprobs_alone(merged, prompt[:-1], prompt[1:])
            got_prompt = torch.tensor(res["prompt_logprobs"][1:])
            torch.testing.assert_close(got_prompt, want_prompt, atol=1e-3, rtol=0)
            for seq in res["sequences"]:
                tokens = prompt + seq["tokens"]
                want = logprobs_alone(merged, tokens[:-1], tokens[1:])[len(prompt) - 1 :]
                torch.testing.assert_close(torch.tensor(seq["logprobs"]), want, atol=1e-3, rtol=0)


def _plan(session: Any, seed: int) -> list[dict[str, Any]]:
    """forward-backward, optim-step, forward only: each call's result and the gradients."""
    records = []
    first = session.forward_backward(CE, _batch(seed), return_loss_fn_outputs=True)
    records.append({"result": first, "grads": grads_of(session)})
    records.append({"result": session.optim_step(AdamParams(learning_rate=5e-2))})
    again = session.forward_backward(
        CE, _batch(seed + 1), forward_only=True, return_loss_fn_outputs=True
    )
    records.append({"result": again})
    return records


@pytest.mark.parametrize("family", EXACT)
def test_two_sessions_merged_equal_solo(family: str, checkpoints: Path, tmp_path: Path) -> None:
    model_dir = _dir(checkpoints, family)
    solo = make_resource(model_dir, tmp_path / "solo", options=EngineOptions(merge=False))
    want = []
    for i in range(2):
        session = solo.create_session(f"s{i}", SessionSpec(lora_config=LORA))
        want.append(_plan(session, 30 + 10 * i))

    merging = make_resource(
        model_dir, tmp_path / "merged", options=EngineOptions(merge_window_ms=200.0)
    )
    sessions = [merging.create_session(f"s{i}", SessionSpec(lora_config=LORA)) for i in range(2)]
    got: list[Any] = [None, None]
    barrier = threading.Barrier(2)

    def drive(i: int) -> None:
        barrier.wait(timeout=60)
        try:
            got[i] = _plan(sessions[i], 30 + 10 * i)
        except OperationError as exc:  # reported below
            got[i] = exc

    threads = [threading.Thread(target=drive, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    for i in range(2):
        assert not isinstance(got[i], OperationError), got[i]
        for k, (record, ref) in enumerate(zip(got[i], want[i], strict=True)):
            where = f"{family} session {i} op {k}"
            result, expected = record["result"], ref["result"]
            if "loss" in expected:
                assert result["loss"] == pytest.approx(expected["loss"], rel=1e-5), where
            for a, b in (
                zip(_outputs(result), _outputs(expected), strict=True)
                if ("loss_fn_outputs" in expected)
                else ()
            ):
                close(a, b, 1e-5, where)
            for name, grad in ref.get("grads", {}).items():
                close(record["grads"][name], grad, 1e-5, f"{where} grad {name}")
    if sessions[0].policy.segmentable:  # LoRA on modules only: the calls shared passes
        assert merging.scheduler.counters()["merged_passes"] >= 1


def test_readme_table_is_generated_from_this_suite(checkpoints: Path) -> None:
    from tests.models.readme_table import README, current, table

    assert current(README.read_text()) == table(checkpoints), (
        "README.md's supported-models table is stale: python -m tests.models.readme_table --write"
    )


@pytest.mark.parametrize("family", EXACT)
def test_two_sessions_batched_samples_equal_solo(
    family: str, checkpoints: Path, tmp_path: Path
) -> None:
    """Concurrent samples of two sessions run as one generation batch, each row with its
    session's adapter, and equal each session's samples alone."""
    from concurrent.futures import ThreadPoolExecutor

    model_dir = _dir(checkpoints, family)
    prompts = [model_input([5, 6, 7, 8, 9, 10, 11]), model_input([30, 31])]

    def run(resource: ModelResource, together: bool) -> list[dict[str, Any]]:
        sessions = [_trained_lora(resource, f"s{i}", 20 + i) for i in range(2)]
        for session in sessions:
            session.weights_sync("WEIGHT_SYNC_TYPE_SYNCHRONOUS")

        def draw(i: int) -> dict[str, Any]:
            params = SamplingParams(max_tokens=8, seed=40 + i, temperature=1.0)
            return sessions[i].sample(prompts, num_samples=2, sampling_params=params)

        if not together:
            return [draw(i) for i in range(2)]
        with ThreadPoolExecutor(2) as pool:
            return list(pool.map(draw, range(2)))

    want = run(
        make_resource(model_dir, tmp_path / "solo", options=EngineOptions(batch_samples=False)),
        False,
    )
    batched = make_resource(  # a generous window: both samples arrive inside it
        model_dir, tmp_path / "batched", options=EngineOptions(merge_window_ms=500.0)
    )
    got = run(batched, True)
    for g, w in zip(got, want, strict=True):
        for gr, wr in zip(g["results"], w["results"], strict=True):
            for gs, ws in zip(gr["sequences"], wr["sequences"], strict=True):
                assert gs["tokens"] == ws["tokens"], family
                torch.testing.assert_close(
                    torch.tensor(gs["logprobs"]), torch.tensor(ws["logprobs"]), atol=1e-5, rtol=0
                )
    if batched.sessions["s0"].policy.segmentable:
        assert batched.sample_batcher is not None and batched.sample_batcher.batches >= 1
