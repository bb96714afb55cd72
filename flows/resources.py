"""What a campaign holds while it runs, in one object: the live engines and the trainer's worker group.

The flow that owns them opens them and passes them down; nothing else reaches them, since they are passed, never
looked up. A campaign opens one for all its rounds (the rollout engine and the worker group then live as long as
the campaign, not one round); a round, replay or evaluation started on its own opens its own. Leaving the block
that opened them releases both, however the flow ends (an error, or SIGTERM unwinding the command), so a
long-lived Prefect worker keeps no engine's memory and no trainer process after a flow:

    with CampaignResources() as resources:   # a campaign: released when it ends
        run_round(config, resources=resources, ...)

    with held(resources) as resources:       # a round: its campaign's, left open; or its own, closed on leaving
        stage.run("rollout", rollout_task, ..., engines=resources.engines)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from tasks.serving.live import LiveEngines
from tasks.train.worker_group import TrainerWorkers


class CampaignResources:
    """The live engines (``engines``: rollout, evaluation, offered weights) and the trainer's worker group
    (``trainers``) of one campaign. ``__slots__``: a Prefect flow or task records it as a placeholder, never walks
    into it (its engines hold models)."""

    __slots__ = ("engines", "trainers")

    def __init__(self) -> None:
        self.engines = LiveEngines()
        self.trainers = TrainerWorkers()

    def __enter__(self) -> CampaignResources:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop the worker group, then release the engines; each is released even if the other fails to."""
        try:
            self.trainers.close()
        finally:
            self.engines.close()


@contextlib.contextmanager
def held(resources: CampaignResources | None) -> Iterator[CampaignResources]:
    """``resources`` when a calling flow passed its own (they stay open: the caller releases them), else new
    ones, released when the block ends."""
    if resources is not None:
        yield resources
        return
    opened = CampaignResources()
    try:
        yield opened
    finally:
        opened.close()
