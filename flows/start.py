"""One round from a model the user knows: the ``round`` deployment's flow.

``start`` is ``NAME@ALIAS`` (``rlrounds-addition@champion``), ``NAME/VERSION`` or ``base``; the registry
supplies the parent's checkpoint, policy version and base model (tasks/campaign/start.py). The round is the
one round of its own run id, claimed like a campaign (one writer per run id), so re-running the flow
with the same run id resumes it, and always from the version ``start`` resolved to the first time.
"""

from __future__ import annotations

from prefect import flow

from flows.campaign import campaign_rounds, code_version, new_run_id, run_rounds
from flows.config import CampaignConfig, RoundConfig
from flows.resources import CampaignResources
from flows.tasks import preflight_task, resolve_start_task
from storage.campaigns import claim, read_campaign, release
from storage.paths import StorageRoot
from storage.settings import settings
from tasks.campaign.start import BASE


@flow(name="rl-round-from", validate_parameters=True)
def rl_round_from(
    start: str = "rlrounds-addition@champion",
    config: RoundConfig = RoundConfig(),  # noqa: B008 -- a frozen default the UI shows filled in
    run_id: str | None = None,
    experiment: str = "rlrounds",
    storage: str | None = None,
    rounds: int = 1,
) -> dict:
    """Run RL rounds starting from a registered model version: one round (the nightly schedule's
    default), or a campaign of ``rounds`` rounds, each from the previous one's checkpoint.

    Args:
        start: The model to start from: NAME@ALIAS (e.g. rlrounds-addition@champion), NAME/VERSION
            (e.g. rlrounds-addition/3), or 'base' for the config's policy.base_model (registered as round 0).
        config: Everything the round does, stage by stage.
        run_id: Run id of this round (directory and MLflow tag). Default: a fresh one. Re-running with
            the same run id resumes the round from its last committed stage.
        experiment: MLflow experiment holding the round's run.
        storage: Storage root (a directory or s3://bucket/prefix). Default: $RLROUNDS_STORAGE.
        rounds: Rounds to run, each starting from the previous one's checkpoint (numbered on from the
            starting version's round).
    """
    root = StorageRoot.of(storage or settings().storage)
    campaign = CampaignConfig(rounds=rounds, run_id=run_id or new_run_id(), experiment=experiment, round=config)
    run_id = campaign.run_id
    record = read_campaign(root, run_id)
    # the parent is fixed when the run starts: a resume never follows an alias that has moved since
    resolved = (record or {}).get("identity", {}).get("start")
    if resolved is None:
        resolved = BASE if start.strip() == BASE else resolve_start_task(storage=root.uri, start=start).model_version
    identity = {**campaign.identity(), "start": resolved}
    preflight_task(config=config, storage=root.uri)
    owner = claim(root, run_id, campaign.model_dump(mode="json"), identity, "auto")
    try:
        with CampaignResources() as resources:
            where = {"storage": root.uri, "run_id": run_id, "version": code_version(), "owner": owner}
            if resolved == BASE:  # the base registered as round 0, then rounds 1..N: a campaign from the base
                return campaign_rounds(campaign, **where, resources=resources)
            parent = resolve_start_task(storage=root.uri, start=resolved)
            history: list[dict] = []
            final_version = run_rounds(campaign, **where, start=parent, history=history, resources=resources)
    finally:
        release(owner)
    return {
        "run_id": run_id,
        "storage": root.uri,
        "start": parent.model_version,
        "rounds": history,
        "final_model_version": final_version,
    }
