"""Bookkeeping around a round: its MLflow run, its metrics, and the round health report.

The report answers, with numbers: is the batch ready fast (time to a trainable batch, straggler
tail), is the policy fresh (staleness), do engine and trainer agree (logprob mismatch), is the
environment reliable (outcomes), what did publication cost (latency vs engine pause), and how does
the checkpoint evaluate (serving vs training precision).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any

from storage.paths import StorageRoot
from storage.settings import settings
from storage.tracking import KIND_TAG, ROUND_TAG, RUN_ID_TAG, Tracker
from tasks.config.base import NotInput
from tasks.round.context import RoundContext
from tasks.round.results import RoundRecord, RoundRuns, Stats

log = logging.getLogger("rlrounds")
progress_log = logging.getLogger("rlrounds.progress")


def report_progress(message: str) -> None:
    progress_log.info(message)


def run_open_round(
    *, storage: str, experiment: str, run_id: str, round_index: int, params: dict[str, Any]
) -> RoundRuns:
    """The campaign's MLflow run and this round's child run (both reused when a round is resumed)."""
    tracker = Tracker.connect(settings(), StorageRoot.of(storage))
    exp = tracker.experiment_id(experiment)
    campaign = tracker.ensure_run(exp, f"campaign-{run_id}", {RUN_ID_TAG: run_id, KIND_TAG: "campaign"})
    round_run = tracker.ensure_run(
        exp,
        f"{run_id}-round-{round_index}",
        {RUN_ID_TAG: run_id, KIND_TAG: "round", ROUND_TAG: str(round_index)},
        parent=campaign,
    )
    if params:
        existing = tracker.client.get_run(round_run).data.params
        fresh = {k: v for k, v in params.items() if k not in existing}
        tracker.log(round_run, params=fresh)
    return RoundRuns(campaign_run=campaign, round_run=round_run, experiment_id=exp)


def _fmt(stats: dict, key: str, spec: str = ".3f", unit: str = "") -> str:
    value = stats.get(key)
    return "n/a" if value is None else f"{value:{spec}}{unit}"


def _generated_per_kept(s: dict) -> str:
    """Generated groups per trainable one: the rollout's waste (all-right or all-wrong groups teach nothing)."""
    generated, kept = s.get("rollout/groups"), s.get("filter/kept_groups")
    if generated is None or not kept:
        return "n/a"
    return f"{generated / kept:.2f} ({_fmt(s, 'rollout/curriculum_skipped_prompts', '.0f')})"


def straggler_wait(stats: dict[str, Any]) -> dict[str, float]:
    """The wait the round paid between holding its trainable batch and starting to train (stopping or
    finishing stragglers, verdicts, staging, filter and store, loading the trainer). Absent when the
    round resumed past either moment (the other process's clock is not this one's), and in overlap mode,
    where the batch is collected while the previous round trains (its rollout/weight_update_* figures
    say what overlapping cost instead)."""
    ready, started = stats.get("rollout/batch_ready_at"), stats.get("train/started_at")
    overlapped = "rollout/weight_update_after_samples" in stats
    if ready is None or started is None or stats.get("resume/stages_skipped") or overlapped:
        return {}
    return {"rollout/straggler_wait_s": max(0.0, started - ready)}


def _tail(s: dict, what: str, prefix: str) -> list[tuple[str, str]]:
    """Two short rows (p50 / p90, p99 / max) rather than one wide one."""
    return [
        (f"{what} p50 / p90", f"{_fmt(s, prefix + '_p50_s', '.3f')} / {_fmt(s, prefix + '_p90_s', '.3f', ' s')}"),
        (f"{what} p99 / max", f"{_fmt(s, prefix + '_p99_s', '.3f')} / {_fmt(s, prefix + '_max_s', '.3f', ' s')}"),
    ]


def _length_bias(s: dict) -> list[tuple[str, str]]:
    rows = [
        (
            f"completions <= {_fmt(s, f'filter/length_q{q}_max_tokens', '.0f')} tokens, kept vs generated share",
            f"{_fmt(s, f'filter/length_q{q}_kept_share', '.0%')} vs "
            f"{_fmt(s, f'filter/length_q{q}_generated_share', '.0%')}",
        )
        for q in range(1, 5)
        if f"filter/length_q{q}_max_tokens" in s
    ]
    return rows + [("mean kept length / generated (1: no bias)", _fmt(s, "filter/length_bias", ".3f"))]


def _speculation(s: dict) -> list[tuple[str, str]]:
    rows = [("decode steps", _fmt(s, "rollout/decode_steps", ".0f"))]
    if not s.get("rollout/speculative"):
        off = "on in the config, but the engine cannot (the round's log says why)"
        return rows + [("speculative rollout", off if s.get("rollout/speculative_unavailable") else "off")]
    return rows + [
        ("draft acceptance", _fmt(s, "rollout/spec_acceptance", ".1%")),
        ("tokens per verification step (a sample)", _fmt(s, "rollout/spec_tokens_per_verify_step", ".2f")),
        (
            "drafting / indexing seconds",
            f"{_fmt(s, 'rollout/spec_draft_s', '.3f')} / {_fmt(s, 'rollout/spec_index_s', '.3f', ' s')}",
        ),
    ]


def _episodes(s: dict) -> list[tuple[str, str]]:
    """An agentic round's engine wait on environments ("your most expensive GPU waits for your cheapest
    container") beside its time to a trainable batch; nothing for a single-turn round."""
    if "episodes/engine_wait_s" not in s:
        return []
    return [
        (
            "engine waiting on environments",
            f"{_fmt(s, 'episodes/engine_wait_s', '.2f', ' s')} ({_fmt(s, 'episodes/engine_wait_fraction', '.0%')})",
        ),
        (
            "tool seconds / sandbox wait",
            f"{_fmt(s, 'episodes/tool_seconds', '.2f')} / {_fmt(s, 'episodes/sandbox_wait_s', '.2f', ' s')}",
        ),
        (
            "turns per episode (mean / max)",
            f"{_fmt(s, 'episodes/turns_mean', '.2f')} / {_fmt(s, 'episodes/turns_max', '.0f')}",
        ),
    ]


def report_sections(s: dict) -> list[tuple[str, list[tuple[str, str]]]]:
    """(question, [(measure, value), ...]) in the order the report answers them: one short figure per
    row, so the table fits a page however many figures a question has."""
    return [
        (
            "batch readiness",
            [
                ("time to a trainable batch", _fmt(s, "rollout/time_to_trainable_batch_s", ".2f", " s")),
                ("straggler wait (batch ready to training start)", _fmt(s, "rollout/straggler_wait_s", ".2f", " s")),
                (
                    "groups complete / trainable target",
                    f"{_fmt(s, 'rollout/groups', '.0f')} / {_fmt(s, 'rollout/target_groups', '.0f')}",
                ),
                ("groups generated per kept (curriculum skipped prompts)", _generated_per_kept(s)),
                *_episodes(s),
            ],
        ),
        ("speculative rollout", _speculation(s)),
        (
            "long tail",
            [
                *_tail(s, "generation latency", "rollout/gen_latency"),
                *_tail(s, "environment latency", "verify/env_latency"),
                *_tail(s, "wait for a free verifier (verify.workers)", "verify/queue_wait"),
                ("slow environment (stop point timing-dependent)", _fmt(s, "rollout/slow_environment", ".0f")),
            ],
        ),
        (
            "carry-over",
            [
                ("groups carried out", _fmt(s, "rollout/carried_out_groups", ".0f")),
                (
                    "partial samples carried out (tokens)",
                    f"{_fmt(s, 'rollout/carried_out_partial_samples', '.0f')} "
                    f"({_fmt(s, 'rollout/carried_out_tokens', '.0f')})",
                ),
                (
                    "samples carried out awaiting the environment",
                    _fmt(s, "rollout/carried_out_unverified_samples", ".0f"),
                ),
                (
                    "groups carried in, finished here",
                    f"{_fmt(s, 'rollout/carried_in_groups', '.0f')}, "
                    f"{_fmt(s, 'rollout/carried_in_finished_groups', '.0f')}",
                ),
                (
                    "samples spanning policy versions (kept)",
                    f"{_fmt(s, 'rollout/samples_spanning_versions', '.0f')} "
                    f"({_fmt(s, 'filter/kept_rows_spanning_versions', '.0f')})",
                ),
            ],
        ),
        ("length bias", _length_bias(s)),
        (
            "policy freshness",
            [
                (
                    "token lag in policy versions mean / p99 / max",
                    f"{_fmt(s, 'train/lag_versions_mean', '.2f')} / {_fmt(s, 'train/lag_versions_p99', '.0f')} / "
                    f"{_fmt(s, 'train/lag_versions_max', '.0f')}",
                ),
                ("trained samples spanning versions", _fmt(s, "train/samples_spanning_versions_share", ".1%")),
                ("behaviour vs trained policy KL (k3)", _fmt(s, "train/behaviour_kl_k3", ".2e")),
                (
                    "behaviour weight mean / p99",
                    f"{_fmt(s, 'train/behaviour_weight_mean', '.3f')} / {_fmt(s, 'train/behaviour_weight_p99', '.3f')}",
                ),
                ("behaviour weight over tis_cap", _fmt(s, "train/behaviour_weight_over_cap", ".2%")),
                (
                    "staleness mean / max (optimizer steps)",
                    f"{_fmt(s, 'train/staleness_mean_steps', '.1f')} / {_fmt(s, 'train/staleness_max_steps', '.0f')}",
                ),
                ("ratio mean", _fmt(s, "train/ratio_mean", ".4f")),
                ("clip fraction", _fmt(s, "train/clip_fraction", ".3f")),
            ],
        ),
        (
            "numeric alignment",
            [
                (
                    "engine vs trainer at sampling weights, mean / max abs Δ",
                    f"{_fmt(s, 'train/mismatch_mean_abs', '.2e')} / {_fmt(s, 'train/mismatch_max_abs', '.2e')}",
                ),
                ("KL estimate", _fmt(s, "train/mismatch_kl", ".2e")),
                (
                    "trainer drift from sampling weights, mean / max abs Δ",
                    f"{_fmt(s, 'train/drift_mean_abs', '.2e')} / {_fmt(s, 'train/drift_max_abs', '.2e')}",
                ),
                ("TIS weight mean", _fmt(s, "train/tis_mean", ".4f")),
            ],
        ),
        (
            "environment reliability",
            [
                (
                    "success / model failure / infra failure / unknown",
                    f"{_fmt(s, 'verify/success', '.0f')} / {_fmt(s, 'verify/model_failure', '.0f')} / "
                    f"{_fmt(s, 'verify/infra_failure', '.0f')} / {_fmt(s, 'verify/unknown', '.0f')}",
                ),
                ("infra failure rate", _fmt(s, "verify/infra_failure_rate", ".2%")),
                (
                    "retries (recovered)",
                    f"{_fmt(s, 'verify/infra_retries', '.0f')} ({_fmt(s, 'verify/infra_recovered', '.0f')})",
                ),
                (
                    "workers replaced, verifier timeouts",
                    f"{_fmt(s, 'verify/workers_replaced', '.0f')}, {_fmt(s, 'verify/verifier_timeouts', '.0f')}",
                ),
            ],
        ),
        (
            "weight publication",
            [
                ("publish latency", _fmt(s, "publish/latency_s", ".3f", " s")),
                ("engine pause", _fmt(s, "publish/engine_pause_s", ".4f", " s")),
                (
                    "overlap: parent loaded after samples (applied)",
                    f"{_fmt(s, 'rollout/weight_update_after_samples', '.0f')} "
                    f"({_fmt(s, 'rollout/weight_update_applied', '.0f')})",
                ),
                (
                    "overlap: engine wait for the trainer / pause",
                    f"{_fmt(s, 'rollout/weight_update_wait_s', '.3f', ' s')} / "
                    f"{_fmt(s, 'rollout/weight_update_pause_s', '.4f', ' s')}",
                ),
            ],
        ),
        (
            "evaluation",
            [
                (
                    f"accuracy at serving precision ({s.get('eval/engine', '?')}, {s.get('eval/dtype', '?')})",
                    _fmt(s, "eval/accuracy", ".1%"),
                ),
                ("accuracy at training precision", _fmt(s, "eval/accuracy_train_precision", ".1%")),
                ("gap", _fmt(s, "eval/serving_gap", "+.1%")),
            ],
        ),
    ]


def health_report(
    run_id: str, round_index: int, stats: dict[str, float], model_version: str | None, trajectory_version: str | None
) -> str:
    s = {**stats, **straggler_wait(stats)}
    lines = [
        f"# Round {round_index} of campaign `{run_id}`",
        "",
        f"Model version **{model_version or 'n/a'}**, trajectory version `{trajectory_version or 'n/a'}`.",
        "",
        "| question | measure | value |",
        "| --- | --- | --- |",
    ]
    for question, rows in report_sections(s):
        for i, (measure, value) in enumerate(rows):
            lines.append(f"| {question if i == 0 else ''} | {measure} | {value} |")
    lines += ["", "| stage | seconds |", "| --- | --- |"]
    for key in sorted(k for k in s if k.startswith("time/")):
        lines.append(f"| {key.removeprefix('time/')} | {s[key]:.2f} |")
    lines.append("")
    lines.append(
        f"Mean reward {_fmt(s, 'verify/mean_reward', '.3f')}; kept {_fmt(s, 'filter/kept_groups', '.0f')} groups "
        f"({_fmt(s, 'filter/kept_rows', '.0f')} samples); loss {_fmt(s, 'train/loss', '.4f')}; grad norm "
        f"{_fmt(s, 'train/grad_norm', '.3f')}."
    )
    return "\n".join(lines) + "\n"


def run_record_round(
    *,
    ctx: RoundContext,
    stats: Annotated[Stats, NotInput("measurements")],
    model_version: str | None,
    trajectory_version: str | None,
) -> RoundRecord:
    """Log the round's metrics and its health report (an MLflow artifact); close the round's run.

    Closing the run is the commit: a run already FINISHED is not logged to again."""
    tracker = Tracker.connect(settings(), StorageRoot.of(ctx.storage))
    report = health_report(ctx.run_id, ctx.round, stats, model_version, trajectory_version)
    if tracker.client.get_run(ctx.mlflow_run_id).info.status == "FINISHED":  # recorded before a crash: never log twice
        return RoundRecord(report=report)
    numeric = {k: float(v) for k, v in {**stats, **straggler_wait(stats)}.items() if isinstance(v, (int, float))}
    tracker.log(ctx.mlflow_run_id, metrics=numeric, step=ctx.round)
    tracker.log_text(ctx.mlflow_run_id, report, "round_health_report.md")
    tracker.finish(ctx.mlflow_run_id)
    return RoundRecord(report=report)
