"""The Prefect tasks: each stage function of tasks/ wrapped once, here at the edge.

tasks/, storage/ and models/ never import Prefect, so validating a config or running the pure unit
tests does not pay for its import. No task caches its result (``NO_CACHE``): a stage is skipped on
resume by its own commit marker and its stage record (flows/stages.py), never by Prefect's cache.
"""

from __future__ import annotations

import functools
import logging

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE

from tasks.campaign.base_policy import run_prepare_base, run_register_base
from tasks.campaign.preflight import run_preflight
from tasks.campaign.replay import run_plan_replay, run_publish_replay
from tasks.campaign.start import run_resolve_start
from tasks.evaluate.approval import run_decide_promotion
from tasks.evaluate.stage import run_evaluate, run_evaluate_version
from tasks.filter.refilter import run_refilter, run_reverify
from tasks.filter.stage import run_filter
from tasks.publish.stage import run_publish
from tasks.rollout.stage import run_rollout
from tasks.round.report import run_open_round, run_record_round
from tasks.round.results import RoundRecord
from tasks.train.stage import run_train

log = logging.getLogger("rlrounds")


def _task(name: str, fn):
    return task(name=name, cache_policy=NO_CACHE)(fn)


@functools.wraps(run_record_round)  # its signature and declared inputs are run_record_round's
def _record_round(**kwargs) -> RoundRecord:
    """run_record_round, then the health report as a Prefect markdown artifact (a bonus beside MLflow's)."""
    record = run_record_round(**kwargs)
    ctx = kwargs["ctx"]
    slug = "".join(c if c.isalnum() else "-" for c in ctx.run_id.lower()).strip("-")
    try:
        create_markdown_artifact(
            markdown=record.report, key=f"round-{slug}-{ctx.round}", description=f"round {ctx.round} health report"
        )
    except Exception as exc:  # noqa: BLE001 -- the report is already in MLflow; a UI artifact is a bonus
        log.warning("could not create the Prefect report artifact: %s", exc)
    return record


preflight_task = _task("preflight", run_preflight)
prepare_base_task = _task("prepare-base", run_prepare_base)
register_base_task = _task("register-base", run_register_base)
open_round_task = _task("open-round", run_open_round)
rollout_task = _task("rollout", run_rollout)
filter_task = _task("filter+store", run_filter)
train_task = _task("train", run_train)
publish_task = _task("publish", run_publish)
evaluate_task = _task("evaluate", run_evaluate)
record_round_task = _task("record-round", _record_round)
evaluate_version_task = _task("evaluate-version", run_evaluate_version)
plan_replay_task = _task("plan-replay", run_plan_replay)
publish_replay_task = _task("publish-replay", run_publish_replay)
refilter_task = _task("refilter", run_refilter)
reverify_task = _task("reverify", run_reverify)
resolve_start_task = _task("resolve-start", run_resolve_start)
decide_promotion_task = _task("decide-promotion", run_decide_promotion)
