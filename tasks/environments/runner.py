"""The episode runner: N episodes at once against an episode session (models/engines/episodes.py) and their
environments, whose tools run in the shared warm sandbox pool. Pure orchestration: no tensors here.

Three schedules, the same episodes:

    overlap      a turn that ends goes to its environment on a worker thread and the engine keeps decoding the
                 other episodes; an answer that comes back is appended and the episode rejoins the batch. The
                 engine waits only when every unfinished episode is waiting on its environment.
    lockstep     turn after turn (the common synchronous batched loop): every episode's turn is decoded, then the
                 environment steps of that turn run together while the engine waits for the slowest; then the
                 next turn.
    sequential   turn after turn, and the environment steps one after another (the engine waits on every one).

Budgets (``EpisodeBudget``) are enforced here: turns, policy tokens (a turn also stops at what is left), tool
seconds, and the step timeout (the environment gets it; a step that does not return within it plus
``STEP_GRACE_S`` is abandoned as an infrastructure failure). The outcome follows ``types.episode_outcome``.

Each episode's record keeps every turn's sampled ids, logprobs and policy versions as the engine returned them, and
each observation's ids as they were appended: ``EpisodeRecord.token_ids`` / ``policy_mask`` give the sequence the
trainer scores and which of its tokens are the policy's (observations are masked out of the loss).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from typing import Literal

from models.engines.episodes import EpisodeSession, EpisodeStart, PolicyTurn
from models.engines.types import SamplingParams
from models.prompt import Prompt
from tasks.config.environment import EpisodeBudget
from tasks.environments.rendering import EpisodeFormat
from tasks.environments.tool_pool import ToolPool
from tasks.environments.types import (
    Environment,
    EnvironmentFactory,
    Observation,
    PlainFormat,
    StepResult,
    episode_outcome,
)
from tasks.verifiers.outcome import Outcome

Schedule = Literal["overlap", "lockstep", "sequential"]

STEP_GRACE_S = 2.0
"""Seconds past the step timeout the runner waits for an environment that should have stopped its own tool call."""


@dataclass(kw_only=True)
class TurnRecord:
    turn: int
    token_ids: list[int]
    """The policy's ids, as sampled."""
    logprobs: list[float]
    """Behaviour logprobs of ``token_ids``."""
    policy_versions: list[int]
    finish_reason: str
    action_text: str
    """``token_ids`` decoded, as the environment read them (not re-encoded: the ids above are the record)."""
    observation_text: str = ""
    observation_ids: list[int] = field(default_factory=list)
    """The ids appended after this turn (empty after the last)."""
    step_seconds: float = 0.0
    prefill_tokens: int = 0


@dataclass(kw_only=True)
class EpisodeRecord:
    episode_id: str
    group_id: str
    prompt_id: str
    prompt_text: str
    prompt_token_ids: tuple[int, ...]
    turns: list[TurnRecord] = field(default_factory=list)
    outcome: Outcome = Outcome.UNKNOWN
    reward: float | None = None
    error: str | None = None
    tool_seconds: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0

    @property
    def token_ids(self) -> list[int]:
        """Everything after the prompt: each turn's ids, then the observation's, in order."""
        return [t for turn in self.turns for t in (*turn.token_ids, *turn.observation_ids)]

    @property
    def policy_mask(self) -> list[bool]:
        """Per token of ``token_ids``: the policy's (True, in the loss) or the environment's (False)."""
        return [m for turn in self.turns for m in [True] * len(turn.token_ids) + [False] * len(turn.observation_ids)]

    @property
    def logprobs(self) -> list[float]:
        """Behaviour logprobs per token of ``token_ids``; 0.0 at observation tokens (masked)."""
        return [x for turn in self.turns for x in (*turn.logprobs, *[0.0] * len(turn.observation_ids))]

    @property
    def policy_versions(self) -> list[int]:
        """Policy version per token of ``token_ids``; -1 at observation tokens (no policy sampled them)."""
        return [v for turn in self.turns for v in (*turn.policy_versions, *[-1] * len(turn.observation_ids))]


def describe_episode(record: EpisodeRecord, *, width: int = 100) -> str:
    """An episode turn by turn, as a person reads it: each policy turn (its tokens, how it ended, its mean behaviour
    logprob and versions) and the text it decoded to, then the observation appended after it (masked)."""

    def clip(text: str) -> str:
        text = text.replace("\n", "\\n")
        return text if len(text) <= width else text[: width - 3] + "..."

    reward = "none" if record.reward is None else f"{record.reward:g}"
    lines = [
        f"episode {record.episode_id} (group {record.group_id}): {record.outcome.value}, reward {reward}, "
        f"{len(record.turns)} turns, {record.tool_seconds:.2f} s in tools"
        + (f" ({record.error})" if record.error else ""),
        f"  prompt  {len(record.prompt_token_ids)} tokens: {clip(record.prompt_text)}",
    ]
    for turn in record.turns:
        mean = sum(turn.logprobs) / len(turn.logprobs) if turn.logprobs else 0.0
        versions = ",".join(str(v) for v in sorted(set(turn.policy_versions)))
        lines.append(
            f"  turn {turn.turn}  policy {len(turn.token_ids)} tokens ({turn.finish_reason}), mean logprob {mean:.3f}, "
            f"version {versions}, prefilled {turn.prefill_tokens}: {clip(turn.action_text)}"
        )
        if turn.observation_ids:
            lines.append(
                f"          observation {len(turn.observation_ids)} tokens (masked), step {turn.step_seconds:.2f} s: "
                f"{clip(turn.observation_text)}"
            )
    return "\n".join(lines)


@dataclass
class RunnerStats:
    wall_s: float = 0.0
    engine_wait_s: float = 0.0
    """Seconds the engine had nothing to decode because every unfinished episode waited on its environment."""
    env_steps: int = 0
    step_seconds: float = 0.0
    """Environment step seconds, summed over episodes (they overlap each other and the engine when overlapped)."""
    sandbox_wait_s: float = 0.0
    decode_steps: int = 0
    prefill_tokens: int = 0
    reused_tokens: int = 0
    outcomes: dict[str, int] = field(default_factory=dict)


@dataclass
class _Live:
    record: EpisodeRecord
    env: Environment
    policy_tokens: int = 0
    deadline: float = 0.0  # of the step in flight
    step_due: bool = False  # its turn ended and its environment step is not submitted yet


class EpisodeRunner:
    """Runs episodes of ``make_environment`` on ``session`` (one call of ``run`` per batch)."""

    def __init__(
        self,
        session: EpisodeSession,
        tokenizer,
        make_environment: EnvironmentFactory,
        pool: ToolPool,
        *,
        budget: EpisodeBudget,
        sampling: SamplingParams,
        schedule: Schedule = "overlap",
        env_workers: int = 16,
        max_context: int | None = None,
    ) -> None:
        self.session = session
        self.tokenizer = tokenizer
        self.make_environment = make_environment
        self.pool = pool
        self.budget = budget
        self.sampling = replace(sampling, max_tokens=min(sampling.max_tokens, budget.max_tokens))
        self.schedule = schedule
        self.env_workers = env_workers
        self.max_context = max_context
        """The model's positions: a turn stops where they run out, and an episode with no room left for a turn
        after its observation is a model failure (it spent its context without answering)."""
        self._format: EpisodeFormat | None = None

    def run(
        self,
        prompts: Iterable[Prompt],
        *,
        n: int = 1,
        max_live_groups: int | None = None,
        enough: Callable[[list[EpisodeRecord]], bool] | None = None,
        progress: Callable[[RunnerStats, int], None] | None = None,
        group_id: Callable[[int, Prompt], str] | None = None,
    ) -> tuple[list[EpisodeRecord], RunnerStats]:
        """``n`` episodes of each prompt (a group per prompt); their records in the order their groups were started,
        and the batch's stats.

        ``prompts`` is read lazily: at most ``max_live_groups`` groups are in flight (all of them when None), and a
        new one starts as one finishes. ``enough(group)`` is asked as each group finishes; once it says True no
        further group starts, and the groups in flight finish (their episodes are recorded, never dropped).
        ``progress(stats, groups_finished)`` is called as each group finishes. ``group_id(index, prompt)`` names the
        index-th group (default: its prompt's id); episode ``i`` of a group is ``<group id>/<i>``, which seeds its
        sampling, so a prompt drawn twice needs two group ids."""
        began = time.perf_counter()
        stats = RunnerStats()
        pool_wait, before = self.pool.stats.wait_s, replace(self.session.stats)
        live: dict[str, _Live] = {}
        records: list[EpisodeRecord] = []
        pending: dict[str, list[EpisodeRecord]] = {}  # groups in flight -> their records
        self._unfinished: dict[str, int] = {}  # groups in flight -> their episodes not finished yet
        source = enumerate(prompts)
        started: set[str] = set()
        feeding, satisfied = True, False  # prompts left to start; enough() said the batch is full
        finished_groups = 0

        def feed() -> None:
            nonlocal feeding
            while feeding and (max_live_groups is None or len(pending) < max_live_groups):
                index, prompt = next(source, (0, None))
                if prompt is None:
                    feeding = False
                    return
                gid = prompt.prompt_id if group_id is None else group_id(index, prompt)
                if gid in started:
                    raise ValueError(f"group id {gid!r} is used twice; pass group_id to name each group")
                started.add(gid)
                self._unfinished[gid] = n
                group = [self._start(prompt, f"{gid}/{i}", gid, live) for i in range(n)]
                records.extend(group)
                pending[gid] = group

        def settle() -> None:
            """Groups whose every episode finished: tell ``enough`` and ``progress``; start new ones in their place."""
            nonlocal feeding, finished_groups, satisfied
            for done in [g for g, left in self._unfinished.items() if left == 0]:
                del self._unfinished[done]
                group = pending.pop(done)
                finished_groups += 1
                if enough is not None and not satisfied and enough(group):
                    satisfied, feeding = True, False
                if progress is not None:
                    progress(stats, finished_groups)
            feed()

        steps: dict[Future, str] = {}  # environment steps in flight -> their episode
        workers_count = 1 if self.schedule == "sequential" else self.env_workers  # sequential: one step at a time
        workers = ThreadPoolExecutor(workers_count, thread_name_prefix="episode-env")
        try:
            feed()
            while live:
                for future in [f for f in steps if f.done()]:
                    episode_id = steps.pop(future)
                    if episode_id in live:
                        self._answered(live, episode_id, *future.result(), stats)
                now = time.perf_counter()
                for future, episode_id in list(steps.items()):
                    if episode_id in live and now > live[episode_id].deadline:  # abandoned: its thread may linger
                        steps.pop(future)
                        self._finish(live, episode_id, infra_error="the environment step did not return in time")
                if 0 in self._unfinished.values():
                    settle()
                if steps and (self.schedule != "overlap" or not self.session.busy):
                    # turn after turn, the engine waits for every step of the turn; overlapped, only when it has
                    # nothing left to decode
                    waited = time.perf_counter()
                    wait(list(steps), timeout=0.05, return_when=FIRST_COMPLETED)
                    stats.engine_wait_s += time.perf_counter() - waited
                    if self.schedule != "overlap":
                        continue
                if self.session.busy:
                    for turn in self.session.step():
                        self._turn_ended(live, turn)
                    if self.schedule != "overlap" and self.session.busy:
                        continue  # turn after turn: every episode's turn ends before any environment runs
                for episode_id in [eid for eid, state in live.items() if state.step_due]:
                    state = live[episode_id]
                    state.step_due = False
                    state.deadline = math.inf  # set when the step starts: a step queued for a worker is not late
                    steps[workers.submit(self._step, state)] = episode_id
                if not live:
                    settle()  # the last groups finished: tell enough/progress, and feed more if wanted
        finally:
            workers.shutdown(wait=False, cancel_futures=True)  # an abandoned step must not hold the batch
            for episode_id in list(live):  # an error left episodes in flight: release what they hold
                self._finish(live, episode_id, infra_error="the batch stopped before the episode finished")
        stats.wall_s = time.perf_counter() - began
        after = self.session.stats
        stats.decode_steps = after.decode_steps - before.decode_steps
        stats.prefill_tokens = after.prefill_tokens - before.prefill_tokens
        stats.reused_tokens = after.reused_tokens - before.reused_tokens
        stats.sandbox_wait_s = self.pool.stats.wait_s - pool_wait
        for r in records:
            stats.outcomes[r.outcome.value] = stats.outcomes.get(r.outcome.value, 0) + 1
        return records, stats

    # -- one episode's life ------------------------------------------------------------------------

    def _start(self, prompt: Prompt, episode_id: str, group_id: str, live: dict[str, _Live]) -> EpisodeRecord:
        env = self.make_environment(self.pool)
        first = env.reset(prompt)
        if self._format is None:
            plain = getattr(env, "plain_format", None) or PlainFormat()  # an environment may leave it out
            self._format = EpisodeFormat(self.tokenizer, env.tools, plain)
            if not self._format.chat:  # the environment's own turn ends (a tool call's closing), once each
                stop = tuple(dict.fromkeys((*self.sampling.stop, *plain.stop)))
                self.sampling = replace(self.sampling, stop=stop)
        text, ids = self._format.prompt(first)
        record = EpisodeRecord(
            episode_id=episode_id,
            group_id=group_id,
            prompt_id=prompt.prompt_id,
            prompt_text=text,
            prompt_token_ids=ids,
            started_at=time.time(),
        )
        live[episode_id] = _Live(record, env)
        sampling = self.sampling
        if self.max_context is not None:
            room = self.max_context - len(ids)
            if room < 1:
                raise ValueError(
                    f"prompt {prompt.prompt_id} renders to {len(ids)} tokens with its tools; the model has "
                    f"{self.max_context} positions"
                )
            sampling = replace(sampling, max_tokens=min(sampling.max_tokens, room))
        self.session.start(EpisodeStart(episode_id=episode_id, prompt_token_ids=ids, sampling=sampling))
        return record

    def _turn_ended(self, live: dict[str, _Live], turn: PolicyTurn) -> None:
        state = live[turn.episode_id]
        state.policy_tokens += len(turn.token_ids)
        action = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        state.record.turns.append(
            TurnRecord(
                turn=turn.turn,
                token_ids=list(turn.token_ids),
                logprobs=list(turn.logprobs),
                policy_versions=list(turn.policy_versions),
                finish_reason=turn.finish_reason,
                action_text=action,
                prefill_tokens=turn.prefill_tokens,
            )
        )
        if turn.finish_reason == "length" and state.policy_tokens >= self.budget.max_tokens:
            self._finish(live, turn.episode_id, exhausted=f"no answer within max_tokens={self.budget.max_tokens}")
            return  # cut off by its token budget: no answer to score
        state.step_due = True

    def _step(self, state: _Live) -> tuple[StepResult, float]:
        """On a worker thread: the environment's answer to the turn just recorded, and the seconds it took."""
        began = time.perf_counter()
        budget = self.budget
        timeout = max(min(budget.step_timeout_s, budget.max_tool_seconds - state.record.tool_seconds), 0.0)
        state.deadline = began + timeout + STEP_GRACE_S
        try:
            result = state.env.step(state.record.turns[-1].action_text, timeout_s=timeout)
        except Exception as exc:  # noqa: BLE001 -- the environment's own bug: its failure, not the model's
            result = StepResult(Observation(""), done=True, infra_error=f"{type(exc).__name__}: {exc}")
        return result, time.perf_counter() - began

    def _answered(self, live: dict[str, _Live], episode_id: str, result: StepResult, seconds: float, stats) -> None:
        state = live[episode_id]
        record, budget = state.record, self.budget
        stats.env_steps += 1
        stats.step_seconds += seconds
        record.tool_seconds += seconds
        last = record.turns[-1]
        last.step_seconds = seconds
        if result.infra_error is not None or result.done:
            self._finish(live, episode_id, done=result.done, reward=result.reward, infra_error=result.infra_error)
            return
        exhausted = None
        if len(record.turns) >= budget.max_turns:
            exhausted = f"no answer within max_turns={budget.max_turns}"
        elif state.policy_tokens >= budget.max_tokens:
            exhausted = f"no answer within max_tokens={budget.max_tokens}"
        elif record.tool_seconds >= budget.max_tool_seconds:
            exhausted = f"no answer within max_tool_seconds={budget.max_tool_seconds:g}"
        if exhausted is not None:
            self._finish(live, episode_id, exhausted=exhausted)
            return
        last.observation_text, last.observation_ids = self._format.observation(
            result.observation.text, turn_ids=last.token_ids, finish_reason=last.finish_reason
        )
        left = budget.max_tokens - state.policy_tokens
        if self.max_context is not None:
            used = len(record.prompt_token_ids) + sum(len(t.token_ids) + len(t.observation_ids) for t in record.turns)
            left = min(left, self.max_context - used)
            if left < 1:
                last.observation_text, last.observation_ids = "", []
                self._finish(live, episode_id, exhausted=f"no answer within the model's {self.max_context} positions")
                return
        self.session.extend(episode_id, last.observation_ids, max_tokens=left)

    def _finish(
        self,
        live: dict[str, _Live],
        episode_id: str,
        *,
        done: bool = False,
        reward: float | None = None,
        infra_error: str | None = None,
        exhausted: str | None = None,
    ) -> None:
        state = live.pop(episode_id)
        self._unfinished[state.record.group_id] -= 1
        verdict = episode_outcome(done=done, reward=reward, infra_error=infra_error, exhausted=exhausted)
        record = state.record
        record.outcome, record.reward, record.error = verdict.outcome, verdict.reward, verdict.error
        record.finished_at = time.time()
        self.session.end(episode_id)
        state.env.close()
