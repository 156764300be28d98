"""`python -m services.trainer`: the trainer (prompts, master weights, optimizer, RL loop)."""

from __future__ import annotations

import os

from services.trainer.app import TrainerApp
from services.trainer.config import TrainerSettings
from services.trainer.ranks import run_follower
from services.trainer.servicer import TrainerServicer
from trace_common.protos_gen.trace.trainer.v1 import trainer_pb2_grpc
from trace_common.service import ServiceRuntime, load_settings


def main() -> None:
    settings = load_settings(TrainerSettings)
    if int(os.environ.get("RANK", "0")) > 0:  # torchrun ranks 1..N-1 hold learner shards
        run_follower(settings)
        return
    rt = ServiceRuntime("trainer", settings)
    app = TrainerApp(settings, rt.metrics)
    rt.grpc.add(
        trainer_pb2_grpc.add_TrainerServicer_to_server,
        TrainerServicer(app),
        "trace.trainer.v1.Trainer",
    )
    rt.before_drain.append(app.stop)
    app.start()
    rt.run(
        ready=lambda: app.core.version >= 0 and app.state != "failed",
        status=app.status,
        live=lambda: app.state != "failed",  # a dead loop: the liveness probe restarts it
    )


if __name__ == "__main__":
    main()
