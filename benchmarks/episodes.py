"""Agentic batch collection with a SIMULATED slow tool, two ways in one run, the same episodes:

    naive   turn after turn: every episode's turn is decoded, then every tool call runs, one after another, while
            the engine waits; each call starts a cold sandbox; each turn prefills the whole history again
    design  the engine keeps decoding the other episodes while tools run (tasks/environments/runner.py 'overlap'),
            tool calls go to a warm pool of sandboxes (tool_pool.py), and each episode's KV cache is kept between
            its turns (models/engines/embedded_episodes.py): a turn prefills only its observation

    python benchmarks/episodes.py [--episodes N] [--turns T] [--tool-median-s S] [--json PATH]
    python benchmarks/episodes.py --preset agentic [--base DIR] [--prompts 32] [--json PATH]

Figures (both measured here, ratios naive / design):
- time_to_trainable_batch_s: from the first prompt fed until every episode of the batch is finished (scored or
  failed), i.e. until the trainer could start;
- engine_wait_s: seconds the engine had nothing to decode because every unfinished episode waited on its tool;
- prefill_tokens_per_episode: tokens prefilled per episode, the prompt and every later turn's (re-prefilling the
  history, as re-rendering the conversation each turn does, against appending the observation onto kept KV).

Ablations (``--no-ablations`` skips them): the design with one part taken away at a time (cold sandboxes, the
history re-prefilled each turn, turn after turn with a turn's tool calls together ('lockstep', the usual
synchronous batched loop), turn after turn with every call in sequence), each as a ratio to the design's time.

The policy is the chat example's shape (Qwen2, byte-level BPE, chat template) at random weights: learning is not
needed for these figures. Every turn samples exactly ``--turn-tokens`` tokens (end-of-sequence ignored) so both
ways do the same decoding work. The tool sleeps a delay drawn from a lognormal (median ``--tool-median-s``,
p99 / median ``--p99-over-median``) seeded by the episode and the call, in its sandbox: both ways meet the same
delays. The sanity check: both ways sample the same tokens.

``--preset agentic`` measures the agentic preset's batch instead (flows/presets/agentic.yaml, read as a campaign
reads it): the ``builtin-tooladd`` base (built by its recipe into ``--base`` when missing, as
benchmarks/agentic_base.py does), ``--prompts`` prompts of its prompt stream x its ``samples_per_prompt``, its
sampling, episode budget, tool pool size and environment workers, and its environment with the add tool SIMULATED
slow (``SlowTooladdEnvironment``: the same reading and scoring; the tool sleeps a lognormal delay seeded by its
addends, so every way meets the same delays). The policy's own choices decide the turns (an episode calls the tool
or answers in its head), so episodes differ in length, and the end-of-sequence ends a turn as in a round. Added
figures: outcomes, turns and calls per episode, and the prefill each episode's own turns asked for (the engine
prefills a prompt, or a whole re-rendered sequence, once for the episodes of a group that share it:
``prefill_tokens_per_episode`` counts what it computed), over all episodes and over those that called the tool.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from models.builtin.chat_example import random_chat_policy
from models.checkpoint import set_threads
from models.engines.embedded import EmbeddedEngine
from models.engines.embedded_episodes import EmbeddedEpisodes
from models.engines.types import SamplingParams
from models.prompt import Prompt
from tasks.config.environment import EpisodeBudget, ToolPoolConfig
from tasks.environments.runner import EpisodeRecord, EpisodeRunner
from tasks.environments.tool_pool import ToolPool
from tasks.environments.tooladd import TooladdEnvironment
from tasks.environments.tools import Tool, ToolCall
from tasks.environments.types import EnvironmentFactory, Observation, StepResult, ToolEnvironment

P99_Z = 2.3263
"""The standard normal's 99th percentile: a lognormal's p99 / median is exp(sigma * P99_Z)."""


def slow_lookup(key: str, median_s: float, sigma: float) -> str:
    """Look a record up in a slow remote service (SIMULATED: sleeps a seeded lognormal delay, answers a digest).

    Args:
        key: what to look up
        median_s: the median delay
        sigma: the delay's log standard deviation
    """
    import hashlib
    import math
    import statistics
    import time

    digest = hashlib.blake2b(key.encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "little") >> 11) / 2**53 + 2**-54
    time.sleep(median_s * math.exp(sigma * statistics.NormalDist().inv_cdf(u)))
    return f"record {key}: {digest.hex()} status ok; fields a={digest[0]} b={digest[1]} c={digest[2]}"


class LookupEnvironment(ToolEnvironment):
    """Calls the slow tool after each of the first ``turns - 1`` turns, then scores the last turn (1.0)."""

    tool_functions = (slow_lookup,)

    def __init__(self, pool, *, turns: int, median_s: float, sigma: float) -> None:
        super().__init__(pool)
        self.turns, self.median_s, self.sigma = turns, median_s, sigma
        self.calls = 0

    def reset(self, prompt: Prompt) -> Observation:
        self.prompt = prompt
        return Observation(prompt.text, system="Look the records up with the tool, then summarise them.")

    def score(self, answer_text: str) -> float:
        return 1.0  # what the batch collects is timed, not learned from

    def step(self, action_text: str, *, timeout_s: float) -> StepResult:
        self.calls += 1
        if self.calls >= self.turns:
            return StepResult(Observation(""), done=True, reward=self.score(action_text))
        key = f"{self.prompt.prompt_id}/{self.calls}"
        reply = self.pool.call(
            "slow_lookup", {"key": key, "median_s": self.median_s, "sigma": self.sigma}, timeout_s=timeout_s
        )
        if reply.infra is not None:
            return StepResult(Observation(""), done=True, infra_error=reply.infra, tool_seconds=reply.seconds)
        return StepResult(Observation(reply.text), done=False, tool_seconds=reply.seconds)


def slow_add(a: int, b: int, median_s: float, sigma: float) -> int:
    """Add two integers exactly (SIMULATED slow service: first sleeps a lognormal delay seeded by the addends).

    Args:
        a: the first addend
        b: the second addend
        median_s: the median delay
        sigma: the delay's log standard deviation
    """
    import hashlib
    import math
    import statistics
    import time

    digest = hashlib.blake2b(f"{a}+{b}".encode(), digest_size=8).digest()
    u = (int.from_bytes(digest, "little") >> 11) / 2**53 + 2**-54
    time.sleep(median_s * math.exp(sigma * statistics.NormalDist().inv_cdf(u)))
    return a + b


class SlowTooladdEnvironment(TooladdEnvironment):
    """The agentic preset's environment, its add tool SIMULATED slow (``slow_add``); it reads calls and scores
    answers as ``TooladdEnvironment`` does."""

    tool_functions = (slow_add,)

    def __init__(self, pool, *, median_s: float, sigma: float) -> None:
        super().__init__(pool)
        self.median_s, self.sigma = median_s, sigma

    def parse_call(self, action_text: str) -> ToolCall | None:
        call = super().parse_call(action_text)
        if call is None:
            return None
        return ToolCall("slow_add", {**call.arguments, "median_s": self.median_s, "sigma": self.sigma})


WAYS = {  # name -> (the runner's schedule, warm pool, KV kept)
    "naive": ("sequential", False, False),
    "design": ("overlap", True, True),
    # ablations: the design with one part taken away
    "design_cold_sandboxes": ("overlap", False, True),
    "design_reprefill": ("overlap", True, False),
    "design_lockstep": ("lockstep", True, True),  # turn after turn, a turn's tool calls together
    "design_sequential": ("sequential", True, True),  # turn after turn, tool calls one after another
}


@dataclass(frozen=True, kw_only=True)
class Batch:
    """The batch every way collects: the same policy, prompts, environment and settings; only the way differs."""

    make_engine: Callable[[], EmbeddedEngine]
    """A fresh engine over the policy (one per way: nothing carries from one way to the next)."""
    tokenizer: object
    environment: EnvironmentFactory
    tools: Sequence[Tool]
    prompts: list[Prompt]
    samples_per_prompt: int
    budget: EpisodeBudget
    sampling: SamplingParams
    pool: ToolPoolConfig
    """The sandboxes; ``warm`` is the way's."""
    env_workers: int
    max_live: int
    """Episodes decoding at once (the session's rows)."""
    max_context: int | None = None
    all_succeed: bool = False
    """Every episode must succeed (the lookup batch scores 1.0 whatever the policy wrote)."""
    describe: Callable[[list[EpisodeRecord]], dict] | None = None
    """Figures of the records beside the timing (the agentic batch's outcomes, turns, calls)."""


def collect(batch: Batch, *, schedule: str, warm: bool, keep_kv: bool) -> dict:
    with ToolPool(batch.tools, batch.pool.model_copy(update={"warm": warm})) as pool:
        session = EmbeddedEpisodes(batch.make_engine(), max_live=batch.max_live, keep_kv=keep_kv)
        runner = EpisodeRunner(
            session,
            batch.tokenizer,
            batch.environment,
            pool,
            budget=batch.budget,
            sampling=batch.sampling,
            schedule=schedule,
            env_workers=batch.env_workers,
            max_context=batch.max_context,
        )
        groups = max(1, batch.max_live // batch.samples_per_prompt)  # as a round feeds them (tasks/rollout/episodes.py)
        began = time.perf_counter()
        records, stats = runner.run(batch.prompts, n=batch.samples_per_prompt, max_live_groups=groups)
        elapsed = time.perf_counter() - began
    if batch.all_succeed:
        assert all(r.outcome.value == "success" for r in records), stats.outcomes
    return {
        "time_to_trainable_batch_s": elapsed,
        "engine_wait_s": stats.engine_wait_s,
        "tool_step_s_summed": stats.step_seconds,
        "sandbox_wait_s": stats.sandbox_wait_s,
        "cold_starts": pool.stats.cold_starts,
        "decode_steps": stats.decode_steps,
        "prefill_tokens_per_episode": stats.prefill_tokens / len(records),
        "reused_tokens_per_episode": stats.reused_tokens / len(records),
        **(batch.describe(records) if batch.describe else {}),
        "tokens": [r.token_ids for r in records],
        "cut_short": [r.outcome.value == "infra_failure" for r in records],
    }


def lookup_batch(args) -> Batch:
    """The default batch: a random-weight chat policy, ``--turns`` turns of ``--turn-tokens`` tokens each."""
    prompts = [
        Prompt(prompt_id=f"q{i}", task="lookup", text=f"Find records q{i} and summarise them.", reference="")
        for i in range(args.episodes)
    ]
    model, tok = random_chat_policy([p.text for p in prompts] + ["record status ok fields"], seed=args.seed)
    make_engine = partial(
        EmbeddedEngine,
        model,
        [tok.eos_token_id, tok.pad_token_id],
        tok.pad_token_id,
        max_batch=args.episodes,
        decode=partial(tok.decode, skip_special_tokens=False),
    )
    environment = partial(
        LookupEnvironment, turns=args.turns, median_s=args.tool_median_s, sigma=math.log(args.p99_over_median) / P99_Z
    )
    return Batch(
        make_engine=make_engine,
        tokenizer=tok,
        environment=environment,
        tools=LookupEnvironment(None, turns=1, median_s=0, sigma=0).tools,
        prompts=prompts,
        samples_per_prompt=1,
        budget=EpisodeBudget(max_turns=args.turns, max_tokens=args.turns * args.turn_tokens + 1, step_timeout_s=60),
        sampling=SamplingParams(temperature=1.0, max_tokens=args.turn_tokens, seed=args.seed, ignore_eos=True),
        pool=ToolPoolConfig(sandboxes=args.sandboxes),
        env_workers=args.episodes,
        max_live=args.episodes,
        all_succeed=True,
    )


def agentic_batch(args, figures: dict) -> Batch:
    """The agentic preset's batch (module doc); what it read goes into ``figures``."""
    import warnings

    from benchmarks.agentic_base import ensure_base
    from flows.config import load_campaign_config
    from models.checkpoint import context_length
    from tasks.prompts.sources import prompt_stream
    from tasks.serving.engines import make_engine

    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    config = load_campaign_config(None, args.preset).round
    if config.environment != "tasks.environments.tooladd:TooladdEnvironment":
        sys.exit(f"preset {args.preset} runs {config.environment}; the slow variant here is of TooladdEnvironment")
    base, lineage = ensure_base(args.base)
    rollout, episode = config.rollout, config.episode
    sandboxes = args.sandboxes or episode.tools.sandboxes
    n = args.samples or rollout.samples_per_prompt
    engine_for = partial(
        make_engine,
        "embedded",
        base,
        dtype=rollout.dtype,
        policy_version=0,
        max_batch=rollout.max_batch,
        update_kv=rollout.update_kv,
        device="cpu",
    )
    tokenizer = engine_for()[1]
    figures["preset"] = {
        "name": args.preset,
        "base": base,
        "base_steps": lineage["steps"],
        "base_validation_accuracy": lineage["validation_accuracy"],
        "samples_per_prompt": n,
        "temperature": rollout.temperature,
        "top_p": rollout.top_p,
        "turn_max_tokens": rollout.max_tokens,
        "budget": episode.budget.model_dump(),
        "sandboxes": sandboxes,
        "env_workers": episode.env_workers,
        "max_batch": rollout.max_batch,
    }
    return Batch(
        make_engine=lambda: engine_for()[0],
        tokenizer=tokenizer,
        environment=partial(
            SlowTooladdEnvironment, median_s=args.tool_median_s, sigma=math.log(args.p99_over_median) / P99_Z
        ),
        tools=SlowTooladdEnvironment(None, median_s=0, sigma=0).tools,
        prompts=list(itertools.islice(prompt_stream(config.prompts, args.seed), args.prompts)),
        samples_per_prompt=n,
        budget=episode.budget,
        sampling=SamplingParams(
            rollout.temperature, rollout.top_p, rollout.max_tokens, args.seed, stop=tuple(rollout.stop)
        ),
        pool=episode.tools.model_copy(update={"sandboxes": sandboxes}),
        env_workers=episode.env_workers,
        max_live=rollout.max_batch,
        max_context=context_length(base),
        describe=episode_figures,
    )


def episode_figures(records: list[EpisodeRecord]) -> dict:
    """Outcomes, turns and tool calls per episode, and the prefill each episode's own turns asked for."""
    calling = [r for r in records if any(t.observation_ids for t in r.turns)]

    def own_prefill(some: list[EpisodeRecord]) -> float:
        return sum(t.prefill_tokens for r in some for t in r.turns) / max(len(some), 1)

    return {
        "episodes": len(records),
        "outcomes": dict(sorted(Counter(r.outcome.value for r in records).items())),
        "infra_errors": dict(Counter(r.error for r in records if r.outcome.value == "infra_failure")),
        "success": sum(r.outcome.value == "success" for r in records) / len(records),
        "turns_per_episode": sum(len(r.turns) for r in records) / len(records),
        "calling_episodes": len(calling) / len(records),
        "tool_calls": sum(1 for r in records for t in r.turns if t.observation_ids),
        "own_prefill_tokens_per_episode": own_prefill(records),
        "own_prefill_tokens_per_calling_episode": own_prefill(calling),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--preset", choices=["agentic"], help="measure this preset's batch instead (its base, task and settings)"
    )
    parser.add_argument("--episodes", type=int, default=16, help="episodes in the batch (one each of as many prompts)")
    parser.add_argument("--turns", type=int, default=4, help="policy turns per episode (a tool call between each)")
    parser.add_argument("--turn-tokens", type=int, default=24, help="tokens the policy samples per turn")
    parser.add_argument("--base", help="--preset agentic: the base's directory (built there when missing)")
    parser.add_argument("--prompts", type=int, default=32, help="--preset agentic: prompts in the batch")
    parser.add_argument("--samples", type=int, help="--preset agentic: episodes per prompt (default: the preset's)")
    parser.add_argument(
        "--tool-median-s", type=float, help="SIMULATED tool latency, median seconds (default 0.5; 0.2 with --preset)"
    )
    parser.add_argument("--p99-over-median", type=float, default=10.0, help="SIMULATED tool latency tail")
    parser.add_argument(
        "--sandboxes", type=int, help="tool sandboxes (warm pool; cold: at most at once); default 16, or the preset's"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (2 on a busy 2-core machine made every step pay for OpenMP)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-ablations", action="store_true", help="only naive and design (not each part removed)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("the tool sandbox needs Linux and root")
    if args.tool_median_s is None:
        args.tool_median_s = 0.2 if args.preset else 0.5
    if args.sandboxes is None and not args.preset:
        args.sandboxes = 16
    set_threads(args.threads)
    figures: dict = {"config": vars(args), "cpu": _cpu(), "python": platform.python_version()}
    batch = agentic_batch(args, figures) if args.preset else lookup_batch(args)
    if args.preset:
        print(
            f"batch: {len(batch.prompts)} prompts x {batch.samples_per_prompt} episodes, "
            f"{figures['preset']['sandboxes']} sandboxes, tool median {args.tool_median_s:g} s, "
            f"p99/median {args.p99_over_median:g}",
            flush=True,
        )
    ways = ["naive", "design"] if args.no_ablations else list(WAYS)
    for name in ways:
        schedule, warm, keep_kv = WAYS[name]
        figures[name] = collect(batch, schedule=schedule, warm=warm, keep_kv=keep_kv)
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures[name].items()}
        shown = {k: v for k, v in shown.items() if k not in ("tokens", "cut_short")}
        print(f"{name:22s} {shown}", flush=True)
    sampled = {name: (figures[name].pop("tokens"), figures[name].pop("cut_short")) for name in ways}
    same = all(tokens == sampled["naive"][0] for tokens, _ in sampled.values())
    naive, design = figures["naive"], figures["design"]
    figures["ratios"] = {
        "time_to_trainable_batch": naive["time_to_trainable_batch_s"] / design["time_to_trainable_batch_s"],
        "prefill_tokens_per_episode": naive["prefill_tokens_per_episode"] / design["prefill_tokens_per_episode"],
        "engine_wait": naive["engine_wait_s"] / max(design["engine_wait_s"], 1e-9),
    }
    if args.preset:
        for key in ("own_prefill_tokens_per_episode", "own_prefill_tokens_per_calling_episode"):
            figures["ratios"][key] = naive[key] / max(design[key], 1e-9)
        if "design_reprefill" in figures:  # the same schedule: re-rendered sequences rarely meet in one admission
            figures["ratios"]["prefill_tokens_per_episode_overlapped"] = (
                figures["design_reprefill"]["prefill_tokens_per_episode"] / design["prefill_tokens_per_episode"]
            )
    figures["same_tokens"] = same
    if not same:
        figures["same_tokens_by_way"] = {name: compare_tokens(*sampled[name], *sampled["naive"]) for name in ways}
    ratios = figures["ratios"]
    print(
        f"time to a trainable batch: naive {naive['time_to_trainable_batch_s']:.2f}s, design "
        f"{design['time_to_trainable_batch_s']:.2f}s: {ratios['time_to_trainable_batch']:.2f}x less (goal 3x)"
    )
    print(
        f"prefill tokens per episode: re-prefilled each turn {naive['prefill_tokens_per_episode']:.1f}, KV kept "
        f"{design['prefill_tokens_per_episode']:.1f}: {figures['ratios']['prefill_tokens_per_episode']:.2f}x fewer "
        "(goal 2x)"
    )
    if args.preset:
        for key, what in (("own_prefill_tokens_per_episode", "every episode"),
                          ("own_prefill_tokens_per_calling_episode", "episodes that called the tool")):  # fmt: skip
            print(
                f"  each episode's own turns, {what}: re-prefilled {naive[key]:.1f}, KV kept {design[key]:.1f}: "
                f"{ratios[key]:.2f}x fewer"
            )
        if "prefill_tokens_per_episode_overlapped" in ratios:
            print(
                "  the engine's prefill, both overlapped (design_reprefill against design): "
                f"{figures['design_reprefill']['prefill_tokens_per_episode']:.1f} against "
                f"{design['prefill_tokens_per_episode']:.1f}: "
                f"{ratios['prefill_tokens_per_episode_overlapped']:.2f}x fewer"
            )
        print(
            f"episodes: {design['outcomes']}, {design['calling_episodes']:.1%} called the tool, "
            f"{design['turns_per_episode']:.2f} turns each"
        )
    print(f"engine waiting on tools: naive {naive['engine_wait_s']:.2f}s, design {design['engine_wait_s']:.2f}s")
    for name in ways[2:]:
        print(
            f"  {name}: {figures[name]['time_to_trainable_batch_s']:.2f}s, "
            f"{figures[name]['time_to_trainable_batch_s'] / design['time_to_trainable_batch_s']:.2f}x the design's"
        )
    print(f"same tokens every way: {same}")
    for name, seen in figures.get("same_tokens_by_way", {}).items():
        if seen["differ"] or seen["cut_short"]:
            print(
                f"  {name}: {seen['differ']} episodes differ from naive's; {seen['cut_short']} cut short by an "
                "infrastructure failure whose tokens are a prefix of the other's"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


def compare_tokens(tokens, cut_short, naive_tokens, naive_cut_short) -> dict:
    """How one way's episodes' tokens compare with naive's: the same, or an episode cut short by an infrastructure
    failure in either way (its tokens a prefix of the other's: the same sampling, stopped early), or different."""
    counts = {"same": 0, "cut_short": 0, "differ": 0}
    for mine, short, theirs, their_short in zip(tokens, cut_short, naive_tokens, naive_cut_short, strict=True):
        if mine == theirs:
            counts["same"] += 1
        elif (short and theirs[: len(mine)] == mine) or (their_short and mine[: len(theirs)] == theirs):
            counts["cut_short"] += 1
        else:
            counts["differ"] += 1
    return counts


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
