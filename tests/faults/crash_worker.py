"""A worker that trains and writes checkpoints in a loop until it is killed (for crash tests).

python tests/faults/crash_worker.py MODEL_DIR STORAGE {lora,full}
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.engine.helpers import make_resource, random_batch
from trainer.specs import AdamParams, LossConfig, SessionSpec


def main() -> None:
    model_dir, storage, kind = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
    resource = make_resource(model_dir, storage, lora=kind == "lora")
    session = resource.create_session("crash", SessionSpec())
    print("ready", flush=True)
    step = 0
    while True:
        session.forward_backward(
            LossConfig(type="cross_entropy"), random_batch(step, weights="ones")
        )
        session.optim_step(AdamParams(learning_rate=1e-2))
        session.save_training_checkpoint()
        session.save_inference_checkpoint()
        print("saved", flush=True)
        step += 1


if __name__ == "__main__":
    main()
