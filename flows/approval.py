"""The pause of a round whose promotion needs a person (``evaluate.approval: required``).

The flow run shows the decision as a markdown artifact and pauses with a small form (approve, a
note); the Prefect UI's Resume button opens it. The run goes on when someone answers; no answer
within ``evaluate.approval_timeout_s`` is a rejection.
"""

from __future__ import annotations

from typing import Annotated

from prefect.artifacts import create_markdown_artifact
from prefect.exceptions import FlowPauseTimeout
from prefect.flow_runs import pause_flow_run
from prefect.input import RunInput

from flows.progress import artifact_key, stage_logger
from flows.tasks import decide_promotion_task
from tasks.config.base import NotInput
from tasks.config.evaluate import EvaluateConfig
from tasks.evaluate.approval import approval_markdown
from tasks.round.context import RoundContext
from tasks.round.results import Evaluation, Promotion


class Approval(RunInput):
    """Promote this checkpoint to champion?"""

    approve: bool = False
    """Tick to move the champion alias to this checkpoint; leave unticked to reject it."""
    note: str = ""
    """Why (kept in the flow run's log)."""


def ask_for_approval(
    run_id: str,
    round_index: int,
    model_version: str,
    champion: str | None,
    evaluation: Evaluation,
    config: EvaluateConfig,
) -> str:
    """Pause until a person answers: 'approved', 'rejected' or 'timed_out'."""
    logger = stage_logger()
    markdown = approval_markdown(model_version, champion, evaluation, config.approval_timeout_s)
    create_markdown_artifact(
        markdown=markdown,
        key=artifact_key(run_id, "round", round_index, "approval"),
        description=f"round {round_index}: promote {model_version}?",
    )
    logger.info(
        "round %d: waiting up to %d s for approval to promote %s", round_index, config.approval_timeout_s, model_version
    )
    try:
        answer = pause_flow_run(
            wait_for_input=Approval.with_initial_data(description=markdown, approve=False),
            timeout=config.approval_timeout_s,
            poll_interval=min(10, config.approval_timeout_s),
            key=f"approve-round-{round_index}",
        )
    except FlowPauseTimeout:
        logger.warning(
            "round %d: no answer within %d s; %s is not promoted", round_index, config.approval_timeout_s, model_version
        )
        return "timed_out"
    decision = "approved" if answer.approve else "rejected"
    logger.info("round %d: %s %s%s", round_index, decision, model_version, f" ({answer.note})" if answer.note else "")
    return decision


def approve_and_promote(
    *,
    ctx: RoundContext,
    config: EvaluateConfig,
    model_version: str,
    evaluation: Annotated[Evaluation, NotInput("the evaluation the approver reads")],
    champion_name: Annotated[str, NotInput("the registered model name, for the approver")],
) -> Promotion:
    """The round's promote stage: ask, then apply the answer (tasks/approval.run_decide_promotion)."""
    champion = f"{champion_name}@{config.champion_alias}" if evaluation.champion_accuracy is not None else None
    decision = ask_for_approval(ctx.run_id, ctx.round, model_version, champion, evaluation, config)
    return decide_promotion_task(ctx=ctx, config=config, model_version=model_version, decision=decision)
