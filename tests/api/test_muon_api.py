"""Muon through the wire (docs/semantics.md §10): the official SDK, unchanged, creates a Muon
resource
and trains with `muon_params`; mismatched or malformed params are 400s that name the field and
change nothing; the resource returns its optimizer_config."""

from __future__ import annotations

import pytest
import together
from api_helpers import SEQUENCES, ce_sample
from conftest import TOKEN, LiveServer
from together.post_training import ModelResourcesClient

CE = {"type": "LOSS_TYPE_CROSS_ENTROPY"}
MUON = {"muon": {"scaling_strategy": "MUON_SCALING_STRATEGY_MATCH_ADAM"}}


def _resource(server: LiveServer, optimizer_config: dict, lora: bool) -> ModelResourcesClient:
    return ModelResourcesClient.create(
        api_key=TOKEN,
        base_url=server.api,
        base_model="tiny-llama",
        lora_enabled=lora,
        optimizer_config=optimizer_config,
        inactive_timeout=600,
        interval=0.05,
    )


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_sdk_muon_loop_learns(server: LiveServer, lora: bool) -> None:
    with _resource(server, MUON, lora) as resource:
        view = resource.retrieve()
        assert view.optimizer_config.muon is not None
        assert view.optimizer_config.muon.scaling_strategy == "MUON_SCALING_STRATEGY_MATCH_ADAM"
        lora_config = {"lora_config": {"rank": 8, "seed": 0}} if lora else {}
        session = resource.create_session(**lora_config, interval=0.05)
        trainer = session.trainer
        samples = [ce_sample(s) for s in SEQUENCES]
        params = {"learning_rate": 5e-3, "adam": {"learning_rate": 5e-3}}
        losses = []
        for step in range(1, 7):
            losses.append(trainer.forward_backward(samples=samples, loss=CE).loss)
            out = trainer.optim_step(muon_params=params)
            assert int(out.step) == step
        losses.append(trainer.forward(samples=samples, loss=CE).loss)
        assert losses[-1] < 0.5 * losses[0], losses

        # mismatched or malformed params: a 400 naming the field, and no step taken
        trainer.forward_backward(samples=samples, loss=CE)
        for bad, field in [
            ({"adam_params": {"learning_rate": 1e-2}}, "adam_params"),
            ({"muon_params": {"momentum": 1.5}}, "muon_params.momentum"),
            ({"muon_params": {"newton_schulz_steps": 0}}, "muon_params.newton_schulz_steps"),
            ({"muon_params": {"adam": {"grad_clip_norm": 1.0}}}, "adam.grad_clip_norm"),
            ({"muon_params": {}, "adam_params": {}}, "muon_params"),
        ]:
            with pytest.raises(together.BadRequestError) as info:
                trainer.optim_step(**bad)
            assert field in str(info.value), (bad, info.value)
        assert int(session.retrieve().step) == 6
        before = trainer.forward(samples=samples, loss=CE).loss
        assert before == pytest.approx(losses[-1], rel=1e-6)
        assert int(trainer.optim_step().step) == 7  # no params: §10's defaults
        resource.stop(force=True)


def test_adam_resource_refuses_muon_params(server: LiveServer) -> None:
    with _resource(server, {"adam": {}}, lora=True) as resource:
        assert resource.retrieve().optimizer_config.adam is not None
        session = resource.create_session(lora_config={"rank": 4}, interval=0.05)
        session.trainer.forward_backward(samples=[ce_sample(SEQUENCES[0])], loss=CE)
        with pytest.raises(together.BadRequestError, match="muon_params"):
            session.trainer.optim_step(muon_params={"learning_rate": 1e-2})
        assert int(session.retrieve().step) == 0
        assert int(session.trainer.optim_step(adam_params={"learning_rate": 1e-2}).step) == 1
        resource.stop(force=True)
