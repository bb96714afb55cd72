"""Agentic batch collection with a SIMULATED slow tool, two ways in one run, the same episodes:

    naive   turn after turn: every episode's turn is decoded, then every tool call runs, one after another, while
            the engine waits; each call starts a cold sandbox; each turn prefills the whole history again
    design  the engine keeps decoding the other episodes while tools run (tasks/environments/runner.py 'overlap'),
            tool calls go to a warm pool of sandboxes (tool_pool.py), and each episode's KV cache is kept between
            its turns (models/engines/embedded_episodes.py): a turn prefills only its observation

    python benchmarks/episodes.py [--episodes N] [--turns T] [--tool-median-s S] [--json PATH]

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
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from functools import partial

from models.builtin.chat_example import random_chat_policy
from models.checkpoint import set_threads
from models.engines.embedded import EmbeddedEngine
from models.engines.embedded_episodes import EmbeddedEpisodes
from models.engines.types import SamplingParams
from models.prompt import Prompt
from tasks.config.environment import EpisodeBudget, ToolPoolConfig
from tasks.environments.runner import EpisodeRunner
from tasks.environments.tool_pool import ToolPool
from tasks.environments.types import Observation, StepResult, ToolEnvironment


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


WAYS = {  # name -> (the runner's schedule, warm pool, KV kept)
    "naive": ("sequential", False, False),
    "design": ("overlap", True, True),
    # ablations: the design with one part taken away
    "design_cold_sandboxes": ("overlap", False, True),
    "design_reprefill": ("overlap", True, False),
    "design_lockstep": ("lockstep", True, True),  # turn after turn, a turn's tool calls together
    "design_sequential": ("sequential", True, True),  # turn after turn, tool calls one after another
}


def collect(args, model, tok, prompts, *, schedule: str, warm: bool, keep_kv: bool) -> dict:
    environment = partial(
        LookupEnvironment, turns=args.turns, median_s=args.tool_median_s, sigma=math.log(args.p99_over_median) / 2.3263
    )
    tools = LookupEnvironment(None, turns=1, median_s=0, sigma=0).tools
    pool_config = ToolPoolConfig(sandboxes=args.sandboxes, warm=warm)
    with ToolPool(tools, pool_config) as pool:
        engine = EmbeddedEngine(
            model,
            [tok.eos_token_id, tok.pad_token_id],
            tok.pad_token_id,
            max_batch=args.episodes,
            decode=partial(tok.decode, skip_special_tokens=False),
        )
        session = EmbeddedEpisodes(engine, max_live=args.episodes, keep_kv=keep_kv)
        runner = EpisodeRunner(
            session,
            tok,
            environment,
            pool,
            budget=EpisodeBudget(max_turns=args.turns, max_tokens=args.turns * args.turn_tokens + 1, step_timeout_s=60),
            sampling=SamplingParams(temperature=1.0, max_tokens=args.turn_tokens, seed=args.seed, ignore_eos=True),
            schedule=schedule,
            env_workers=args.episodes,
        )
        began = time.perf_counter()
        records, stats = runner.run(prompts)
        elapsed = time.perf_counter() - began
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
        "tokens": [r.token_ids for r in records],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=16, help="episodes in the batch (one each of as many prompts)")
    parser.add_argument("--turns", type=int, default=4, help="policy turns per episode (a tool call between each)")
    parser.add_argument("--turn-tokens", type=int, default=24, help="tokens the policy samples per turn")
    parser.add_argument("--tool-median-s", type=float, default=0.5, help="SIMULATED tool latency, median seconds")
    parser.add_argument("--p99-over-median", type=float, default=10.0, help="SIMULATED tool latency tail")
    parser.add_argument("--sandboxes", type=int, default=16, help="tool sandboxes (warm pool; cold: at most at once)")
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
    set_threads(args.threads)
    prompts = [
        Prompt(prompt_id=f"q{i}", task="lookup", text=f"Find records q{i} and summarise them.", reference="")
        for i in range(args.episodes)
    ]
    model, tok = random_chat_policy([p.text for p in prompts] + ["record status ok fields"], seed=args.seed)
    figures: dict = {"config": vars(args), "cpu": _cpu(), "python": platform.python_version()}
    ways = ["naive", "design"] if args.no_ablations else list(WAYS)
    for name in ways:
        schedule, warm, keep_kv = WAYS[name]
        figures[name] = collect(args, model, tok, prompts, schedule=schedule, warm=warm, keep_kv=keep_kv)
        shown = {k: round(v, 3) if isinstance(v, float) else v for k, v in figures[name].items() if k != "tokens"}
        print(f"{name:22s} {shown}", flush=True)
    tokens = [figures[name].pop("tokens") for name in ways]
    same = all(t == tokens[0] for t in tokens)
    naive, design = figures["naive"], figures["design"]
    figures["ratios"] = {
        "time_to_trainable_batch": naive["time_to_trainable_batch_s"] / design["time_to_trainable_batch_s"],
        "prefill_tokens_per_episode": naive["prefill_tokens_per_episode"] / design["prefill_tokens_per_episode"],
        "engine_wait": naive["engine_wait_s"] / max(design["engine_wait_s"], 1e-9),
    }
    figures["same_tokens"] = same
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
    print(f"engine waiting on tools: naive {naive['engine_wait_s']:.2f}s, design {design['engine_wait_s']:.2f}s")
    for name in ways[2:]:
        print(
            f"  {name}: {figures[name]['time_to_trainable_batch_s']:.2f}s, "
            f"{figures[name]['time_to_trainable_batch_s'] / design['time_to_trainable_batch_s']:.2f}x the design's"
        )
    print(f"same tokens every way: {same}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)


def _cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, StopIteration):
        return platform.processor()


if __name__ == "__main__":
    main()
