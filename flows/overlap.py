"""How a round's mode changes its recipe: ``sync`` runs nothing beside the round; ``overlap`` runs the next
round's rollout while this round trains (tasks/rollout/overlap.py).

``round.mode: overlap``: once this round's trajectories are committed, the next round's rollout is submitted as
its own task run and generates while this round trains, publishes and evaluates; train hands it the new
checkpoint. The round ends when that rollout is recorded (under the next round, which then finds its rollout
committed and goes straight to filter). The round flow (flows/round.py) asks its mode at each of those points, so
it reads as one recipe for both.
"""

from __future__ import annotations

from flows.config import RoundConfig
from flows.progress import StageProgress, artifact_key
from flows.stages import PendingStage, Stages
from flows.tasks import rollout_task
from storage.checkpoints import read_lineage
from storage.paths import StorageRoot
from tasks.rollout.overlap import NextPolicy, Overlapped, RolloutCancelled
from tasks.rollout.stage import carry_source
from tasks.round.context import RoundContext
from tasks.round.results import Staged
from tasks.serving.live import LiveEngines

OVERLAPPED_PARENT = "(registered while this rollout ran)"
"""An overlapped rollout's context holds this as its parent's registered version: the rollout starts
before the parent is registered, and never reads it (it is not part of what it generates)."""


class SyncMode:
    """``round.mode: sync``: the round's rollout runs first, nothing runs beside the round."""

    publish_loads_engine = True
    """Publish loads the new weights into the live rollout engine (overlap: the running rollout takes them)."""
    evaluation_role = "rollout"
    """The live engine evaluation scores on (overlap: its own, since the next rollout holds the rollout engine)."""

    def __init__(self, stage: Stages, config: RoundConfig, ctx: RoundContext, engines: LiveEngines) -> None:
        self.stage, self.config, self.ctx, self.engines = stage, config, ctx, engines

    def rollout(self, progress: StageProgress) -> Staged:
        """This round's rollout: generated now (or answered from its record on resume)."""
        return self.stage.run("rollout", rollout_task, **self.rollout_inputs(self.ctx), progress=progress)

    def rollout_inputs(self, ctx: RoundContext) -> dict:
        """What round ``ctx.round``'s rollout is asked to do, and the engines it generates with."""
        config = self.config
        return {
            "ctx": ctx,
            "prompts": config.prompts,
            "rollout": config.rollout,
            "verify": config.verify_resolved,
            "filtering": config.filter,
            "target_groups": config.target_groups,
            "carry_from": carry_source(ctx.storage, ctx.run_id, ctx.round),
            **config.agent,
            "engines": self.engines,
            "device": config.device,
        }

    def start_next_rollout(self) -> None:
        """Before training: start what runs beside it (nothing)."""

    def trained(self) -> None:
        """Train has committed this round's checkpoint."""

    def abandon(self, reason: str) -> None:
        """The round failed: stop what runs beside it."""

    def finish(self, stop: bool) -> bool:
        """The round is evaluated: wait for what runs beside it (``stop``: the campaign ends here, so cancel it).
        Returns whether there was anything to wait for."""
        return False


class OverlapMode(SyncMode):
    """``round.mode: overlap``: the next round's rollout generates while this round trains."""

    publish_loads_engine = False
    evaluation_role = "evaluate"

    def __init__(self, stage: Stages, config: RoundConfig, ctx: RoundContext, engines: LiveEngines) -> None:
        super().__init__(stage, config, ctx, engines)
        self.upcoming: PendingStage | None = None
        self.next_policy: NextPolicy | None = None

    def rollout(self, progress: StageProgress) -> Staged:
        if self.ctx.round < 2:  # round 1 has no previous round to have run it
            return super().rollout(progress)
        # normally recorded already by the previous round, which ran it
        pending, _ = self._submit(self.stage, overlapped_context(self.ctx), progress, start=None)
        rollout = pending.result()
        if "rollout" in self.stage.skipped:  # the previous round ran it: that is overlap, not a resume
            self.stage.skipped.remove("rollout")
        return rollout

    def start_next_rollout(self) -> None:
        ctx = next_context(self.ctx)
        progress = StageProgress(
            "rollout",
            artifact_key(ctx.run_id, "round", ctx.round, "rollout"),
            f"round {ctx.round}: trainable groups collected",
        )
        self.upcoming, self.next_policy = self._submit(Stages(ctx), ctx, progress, start=self.ctx.parent_checkpoint)

    def trained(self) -> None:
        if self.next_policy is not None:
            self.next_policy.committed()

    def abandon(self, reason: str) -> None:
        if self.upcoming is not None:  # a rollout waiting for weights that will not come must not wait forever
            self.next_policy.cancel(reason)
            self.upcoming.abandon()

    def finish(self, stop: bool) -> bool:
        if self.upcoming is None:
            return False
        if stop:
            self.next_policy.cancel(f"the campaign stops after round {self.ctx.round}")
            if not isinstance(error := self.upcoming.abandon(), (RolloutCancelled, type(None))):
                raise error
        else:
            self.upcoming.result()  # recorded under the next round
        return True

    def _submit(
        self, stage: Stages, ctx: RoundContext, progress: StageProgress, start: str | None
    ) -> tuple[PendingStage, NextPolicy]:
        """Round ``ctx.round``'s overlapped rollout, submitted: it starts from ``start``, the parent's parent
        (the newest checkpoint committed while the parent trains), and switches to the parent after
        ``config.update_after_samples`` finished samples. ``start`` None: the parent is committed already,
        and its parent is read from its lineage (a resumed campaign runs the rollout with the same start and
        switch point, and so to the same rows)."""
        next_policy = NextPolicy(
            ctx.storage, ctx.parent_checkpoint, ctx.parent_policy_version, self.config.update_after_samples
        )
        if start is None:
            next_policy.committed()
            start = read_lineage(StorageRoot.of(ctx.storage), ctx.parent_checkpoint)["parent_checkpoint"]
        pending = stage.submit(
            "rollout",
            rollout_task,
            **self.rollout_inputs(ctx),
            progress=progress,
            overlap=Overlapped(start, ctx.parent_policy_version - 1, next_policy),
        )
        return pending, next_policy


def overlapped_context(ctx: RoundContext) -> RoundContext:
    """The context an overlapped rollout of round ``ctx.round`` runs under (its stage record's key)."""
    return ctx.model_copy(update={"parent_model_version": OVERLAPPED_PARENT})


def next_context(ctx: RoundContext) -> RoundContext:
    """The next round's rollout context, as that round will build it, from this round's."""
    checkpoint = StorageRoot.of(ctx.storage).checkpoint(ctx.run_id, ctx.round)  # where train commits
    return overlapped_context(ctx).model_copy(
        update={
            "round": ctx.round + 1,
            "parent_checkpoint": checkpoint,
            "parent_policy_version": ctx.round,
            "mlflow_run_id": "(opened when its round starts)",
        }
    )
