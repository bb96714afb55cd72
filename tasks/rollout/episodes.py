"""An agentic round's collection: groups of multi-turn episodes, run until the batch holds enough trainable groups.

With ``round.environment`` set a sample is an episode (docs/environments.md): the policy's turns interleaved with
the environment's observations, scored by the environment when it ends. The rollout stage hands the round to
``EpisodeCollection`` instead of ``RolloutCollection``; what it returns is the same (``RolloutResult``): rows in the
order their groups finished, the figures under the same names, so filter, train and the health report read an
agentic round as they read any other.

    collection = EpisodeCollection(engine, tokenizer, environment="pkg.mod:Env", episode=..., prompts=...,
                                   rollout=..., filtering=..., target_groups=64, seed=seed, run_id=..., round_index=k)
    result = collection.collect(progress=print)

Prompts are fed lazily, as in a single-turn round: at most ``rollout.max_batch`` episodes are live, a group starts
as one finishes, and no group starts once enough trainable ones have finished (time to a trainable batch); the
groups in flight then finish and are stored (filter marks those past the batch ``batch_full``).

A row's ``completion_token_ids`` is the whole sequence after the prompt, the policy's tokens as sampled and the
observations as appended; ``turns`` says which spans are the policy's (observations leave the loss), and
``token_policy_versions`` is -1 (``NOT_SAMPLED``) at observation tokens. An episode that ends in an environment
failure is an infrastructure failure: filter drops it, and its group is scored over the others.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime

from models.engines.sessions import open_session
from models.engines.types import RolloutEngine, SamplingParams
from models.prompt import Prompt
from storage.trajectories import TrajectoryRow, policy_token_count
from tasks.config.environment import EpisodeConfig
from tasks.config.filter import FilterConfig
from tasks.config.prompts import PromptsConfig
from tasks.config.rollout import RolloutConfig
from tasks.environments.runner import EpisodeRecord, EpisodeRunner, RunnerStats
from tasks.environments.tool_pool import ToolPool
from tasks.environments.tools import Tool
from tasks.environments.types import load_environment
from tasks.filter.stage import group_is_trainable
from tasks.prompts.sources import prompt_stream
from tasks.rollout.collection import RolloutResult, quantiles
from tasks.rollout.curriculum import admitted
from tasks.verifiers.outcome import Outcome


def environment_version(spec: str) -> str:
    """What a row records as its scorer's version: the environment class's ``version`` attribute, else "1"."""
    return str(getattr(load_environment(spec), "version", "1"))


class EpisodeCollection:
    """One agentic round's collection on ``engine`` (module doc). ``policy_version``: the policy being trained on
    these rows (filter.max_staleness is judged against it). ``solved``: prompt ids the curriculum draws with
    probability ``prompts.solved_weight``. ``max_context``: the model's positions; turns stop where they run out."""

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        *,
        environment: str,
        episode: EpisodeConfig,
        prompts: PromptsConfig,
        rollout: RolloutConfig,
        filtering: FilterConfig,
        target_groups: int,
        seed: int,
        run_id: str,
        round_index: int,
        max_context: int | None = None,
        policy_version: int | None = None,
        solved: frozenset[str] = frozenset(),
        baselines: Mapping[str, float] | None = None,
    ) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self.environment, self.episode = environment, episode
        self.baselines = baselines  # filter.history_baseline_rounds (tasks/filter/history.py)
        self.prompts, self.rollout, self.filtering = prompts, rollout, filtering
        self.target_groups, self.seed, self.run_id, self.round_index = target_groups, seed, run_id, round_index
        self.max_context, self.policy_version, self.solved = max_context, policy_version, solved
        self.factory = load_environment(environment)
        self.sampling = SamplingParams(
            rollout.temperature, rollout.top_p, rollout.max_tokens, seed, stop=tuple(rollout.stop)
        )
        self.skipped = 0
        self.drawn: dict[str, tuple[Prompt, float]] = {}  # group id -> its prompt and the curriculum's weight

    @property
    def max_groups(self) -> int:
        return int(self.target_groups * self.rollout.max_prompts_factor)

    def fresh_prompts(self) -> Iterator[Prompt]:
        """Prompts in stream order up to the cap, drawn by the curriculum as a single-turn round draws them."""
        stream = prompt_stream(self.prompts, self.seed)
        position = 0
        for _ in range(self.max_groups):
            while True:
                prompt, position = next(stream), position + 1
                weight = self.prompts.solved_weight if prompt.prompt_id in self.solved else 1.0
                if admitted(self.seed, position, weight):
                    break
                self.skipped += 1
            self._weights.append(weight)
            yield prompt

    def group_id(self, index: int, prompt: Prompt) -> str:
        group_id = f"r{self.round_index}-g{index:06d}"
        self.drawn[group_id] = (prompt, self._weights[index])
        return group_id

    def collect(self, *, progress: Callable[[str], None] | None = None) -> RolloutResult:
        n = self.rollout.samples_per_prompt
        self._weights: list[float] = []
        trainable = 0
        batch_ready_at: float | None = None

        def enough(group: list[EpisodeRecord]) -> bool:
            nonlocal trainable, batch_ready_at
            if group_is_trainable([self._decision_row(r, i) for i, r in enumerate(group)], self.filtering,
                                  self.policy_version, self.baselines):  # fmt: skip
                trainable += 1
            if trainable >= self.target_groups and batch_ready_at is None:
                batch_ready_at = time.time()
            return trainable >= self.target_groups

        def report(stats: RunnerStats, finished: int) -> None:
            if progress and finished % 8 == 0:
                progress(
                    f"rollout: {finished} episode groups, {trainable}/{self.target_groups} trainable, "
                    f"engine waited {stats.engine_wait_s:.1f} s on environments"
                )

        start = time.time()
        tools = [Tool.from_function(f) for f in getattr(self.factory, "tool_functions", ())]
        with ToolPool(tools, self.episode.tools) as pool:
            session = open_session(self.engine, max_live=self.rollout.max_batch)
            runner = EpisodeRunner(
                session,
                self.tokenizer,
                self.factory,
                pool,
                budget=self.episode.budget,
                sampling=self.sampling,
                env_workers=self.episode.env_workers,
                max_context=self.max_context,
            )
            records, stats = runner.run(
                self.fresh_prompts(),
                n=n,
                max_live_groups=max(1, self.rollout.max_batch // n),
                enough=enough,
                progress=report,
                group_id=self.group_id,
            )
            pool_stats = pool.stats
        end = time.time()
        info = self.engine.info
        context = {
            "engine": {"name": info.name, "version": info.version, "dtype": info.dtype},
            "verifier": {"name": self.environment, "version": environment_version(self.environment)},
        }
        finished: dict[str, float] = {}
        for record in records:
            finished[record.group_id] = max(finished.get(record.group_id, 0.0), record.finished_at)
        order = sorted(range(len(records)), key=lambda i: (finished[records[i].group_id], i))  # as groups finished
        rows = [self.row(records[i], i % n, context, start) for i in order]
        figures = episode_stats(rows, stats, target_groups=self.target_groups, trainable=trainable, start=start,
                                end=end, batch_ready_at=batch_ready_at)  # fmt: skip
        figures["episodes/sandbox_cold_starts"] = pool_stats.cold_starts
        figures["rollout/curriculum_solved_prompts"] = len(self.solved)
        figures["rollout/curriculum_skipped_prompts"] = self.skipped
        return RolloutResult(rows=rows, carry_rows=[], stats=figures)

    def _decision_row(self, record: EpisodeRecord, index: int) -> dict:
        """The fields filter's decision reads, for the ready test of a finished group."""
        return {
            "group_id": record.group_id,
            "prompt_id": self.drawn[record.group_id][0].prompt_id,
            "sample_index": index,
            "reward": record.reward,
            "outcome": record.outcome.value,
            "token_policy_versions": record.policy_versions,
            "finish_reason": record.turns[-1].finish_reason if record.turns else "stop",
            "completion_token_ids": record.token_ids,
            "turns": turn_spans(record),
            "sampling": self.sampling.as_dict(),
        }

    def row(self, record: EpisodeRecord, index: int, context: dict, start: float) -> TrajectoryRow:
        prompt, weight = self.drawn[record.group_id]
        finished = datetime.fromtimestamp(record.finished_at, tz=UTC)
        return TrajectoryRow(
            run_id=self.run_id,
            round=self.round_index,
            prompt_id=prompt.prompt_id,
            group_id=record.group_id,
            sample_index=index,
            task=prompt.task,
            prompt_text=record.prompt_text,
            prompt_token_ids=list(record.prompt_token_ids),
            reference=prompt.reference,
            prompt_weight=weight,
            completion_text="".join(t.action_text + t.observation_text for t in record.turns),
            completion_token_ids=record.token_ids,
            rollout_logprobs=record.logprobs,
            token_policy_versions=record.policy_versions,
            finish_reason=record.turns[-1].finish_reason if record.turns else "stop",
            engine=context["engine"],
            sampling=self.sampling.as_dict(),
            verifier=context["verifier"],
            reward=record.reward,
            outcome=record.outcome.value,
            verify_error=record.error,
            enqueued_at=datetime.fromtimestamp(start, tz=UTC),
            started_at=datetime.fromtimestamp(record.started_at, tz=UTC),
            finished_at=finished,
            verified_at=finished,
            gen_latency_s=record.finished_at - record.started_at,
            verify_latency_s=record.tool_seconds,
            turns=turn_spans(record),
        )


def turn_spans(record: EpisodeRecord) -> list[dict]:
    """The row's ``turns``: per turn, where its policy tokens start and end in the completion, where its observation
    ends (the next turn's start), how it ended, the tokens prefilled to begin it, its environment step's seconds,
    and the two texts (the action as the environment read it, the observation as appended) for people to read: the
    ids are the record."""
    spans, at = [], 0
    for turn in record.turns:
        policy_end = at + len(turn.token_ids)
        end = policy_end + len(turn.observation_ids)
        spans.append(
            {
                "start": at,
                "policy_end": policy_end,
                "end": end,
                "finish_reason": turn.finish_reason,
                "prefill_tokens": turn.prefill_tokens,
                "step_s": turn.step_seconds,
                "action_text": turn.action_text,
                "observation_text": turn.observation_text,
            }
        )
        at = end
    return spans


def episode_stats(
    rows: list[TrajectoryRow],
    runner: RunnerStats,
    *,
    target_groups: int,
    trainable: int,
    start: float,
    end: float,
    batch_ready_at: float | None,
) -> dict[str, float]:
    """The round's figures under the single-turn names (rollout/*, verify/*) and the episodes' own (episodes/*)."""
    outcomes = Counter(r.outcome for r in rows)
    tokens = sum(policy_token_count({"completion_token_ids": r.completion_token_ids, "turns": r.turns}) for r in rows)
    rewards = [r.reward for r in rows if r.reward is not None]
    wall = max(end - start, 1e-9)
    turns = [len(r.turns or ()) for r in rows]
    groups = len({r.group_id for r in rows})
    return {
        "rollout/groups": groups,
        "rollout/groups_trainable": trainable,
        "rollout/target_groups": target_groups,
        "rollout/batch_full": float(trainable >= target_groups),
        "rollout/samples": len(rows),
        "rollout/tokens": tokens,
        "rollout/tokens_per_s": tokens / wall,
        "rollout/wall_s": wall,
        "rollout/time_to_trainable_batch_s": (batch_ready_at or end) - start,
        "rollout/batch_ready_at": batch_ready_at or end,
        **quantiles([r.gen_latency_s for r in rows], "rollout/gen_latency"),
        **quantiles([r.verify_latency_s for r in rows if r.verify_latency_s is not None], "verify/env_latency"),
        "rollout/mean_completion_tokens": tokens / max(len(rows), 1),
        "rollout/truncated_fraction": sum(r.finish_reason == "length" for r in rows) / max(len(rows), 1),
        "rollout/carried_out_groups": 0,
        "verify/mean_reward": statistics.fmean(rewards) if rewards else 0.0,
        "verify/success": outcomes.get(Outcome.SUCCESS.value, 0),
        "verify/model_failure": outcomes.get(Outcome.MODEL_FAILURE.value, 0),
        "verify/infra_failure": outcomes.get(Outcome.INFRA_FAILURE.value, 0),
        "verify/unknown": outcomes.get(Outcome.UNKNOWN.value, 0),
        "verify/infra_failure_rate": outcomes.get(Outcome.INFRA_FAILURE.value, 0) / max(len(rows), 1),
        "episodes/turns_mean": statistics.fmean(turns) if turns else 0.0,
        "episodes/turns_max": max(turns, default=0),
        "episodes/engine_wait_s": runner.engine_wait_s,
        "episodes/engine_wait_fraction": runner.engine_wait_s / max(runner.wall_s, 1e-9),
        "episodes/env_steps": runner.env_steps,
        "episodes/tool_seconds": runner.step_seconds,
        "episodes/sandbox_wait_s": runner.sandbox_wait_s,
        "episodes/prefill_tokens": runner.prefill_tokens,
        "episodes/reused_tokens": runner.reused_tokens,
        "episodes/decode_steps": runner.decode_steps,
    }


def describe_episode_row(row: dict, *, width: int = 100) -> str:
    """A stored episode turn by turn, as ``rlrounds trajectories show`` prints it: each policy turn (its tokens, how
    it ended, its mean behaviour logprob and policy versions) and its text, then the observation appended after it
    (masked out of the loss), then the episode's outcome."""

    def clip(text: str) -> str:
        text = (text or "").replace("\n", "\\n")
        return text if len(text) <= width else text[: width - 3] + "..."

    reward = "none" if row.get("reward") is None else f"{row['reward']:g}"
    error = f" ({row['verify_error']})" if row.get("verify_error") else ""
    lines = [
        f"episode {row['group_id']}/{row['sample_index']} (prompt {row['prompt_id']}): {row.get('outcome')}, "
        f"reward {reward}, {len(row['turns'])} turns, kept {row.get('kept')}{error}",
        f"  prompt  {len(row['prompt_token_ids'])} tokens: {clip(row['prompt_text'])}",
    ]
    logprobs, versions = row["rollout_logprobs"], row["token_policy_versions"]
    for index, turn in enumerate(row["turns"]):
        start, policy_end, end = turn["start"], turn["policy_end"], turn["end"]
        count = policy_end - start
        mean = sum(logprobs[start:policy_end]) / count if count else 0.0
        seen = ",".join(str(v) for v in sorted(set(versions[start:policy_end])))
        lines.append(
            f"  turn {index}  policy {count} tokens ({turn['finish_reason']}), mean logprob {mean:.3f}, version "
            f"{seen or '-'}: {clip(turn['action_text'])}"
        )
        if end > policy_end:
            lines.append(
                f"          observation {end - policy_end} tokens (masked), step {turn['step_s']:.2f} s: "
                f"{clip(turn['observation_text'])}"
            )
    return "\n".join(lines)
