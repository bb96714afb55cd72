"""The tooladd base policy as an agent: how often it succeeds on the held-out prompts, and how much room RL has.

Builds the ``builtin-tooladd`` base into ``--base`` (or loads it when it is there already), then runs every
held-out prompt as episodes through the real parts: the episode runner, the embedded engine's episode session and
the warm tool sandbox pool, with the task's environment (tasks/environments/tooladd.py). Once sampled as a rollout
samples (``--temperature``, ``--samples`` episodes a prompt) and once greedy. For each it prints

    success          episodes whose final answer is the sum (the reward)
    calls            episodes whose first turn called the tool
    success | call   success among those: what a policy that always called the tool would get, about
    success | none   success among the episodes that answered in their head (near 0: the headroom is in calling)
    wrong call       episodes whose call had other operands than the prompt's (a copy error)
    wrong copy       episodes that called right but did not copy the tool's answer

    python benchmarks/agentic_base.py [--base DIR] [--samples 4] [--temperature 1.0] [--json PATH]

Needs root (the tool sandbox). The build runs on the CPU, at the recipe's thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings


def figures(records, prompts_by_id) -> dict:
    from models.builtin import tooladd

    called = [r for r in records if tooladd.read_call(r.turns[0].action_text) is not None]
    direct = [r for r in records if r not in called]
    success = [r for r in records if r.outcome.value == "success"]
    wrong_call = 0
    wrong_copy = 0
    for r in called:
        a, b = tooladd.read_call(r.turns[0].action_text)
        prompt = prompts_by_id[r.prompt_id]
        if f"{a}+{b}=" != prompt.text:
            wrong_call += 1
        elif r.outcome.value != "success":
            wrong_copy += 1
    n = len(records)

    def share(part: list, whole: list) -> float:
        return round(len(part) / len(whole), 4) if whole else 0.0

    return {
        "episodes": n,
        "success": share(success, records),
        "calls": share(called, records),
        "success_given_call": share([r for r in called if r in success], called),
        "success_given_no_call": share([r for r in direct if r in success], direct),
        "wrong_call": round(wrong_call / n, 4),
        "wrong_copy": round(wrong_copy / n, 4),
        "outcomes": {k: sum(r.outcome.value == k for r in records) for k in sorted({r.outcome.value for r in records})},
        "mean_policy_tokens": round(sum(sum(len(t.token_ids) for t in r.turns) for r in records) / n, 2),
    }


def ensure_base(base: str | None, *, progress=print) -> tuple[str, dict]:
    """The ``builtin-tooladd`` base's directory and its lineage: built there by its recipe when the directory holds
    no base yet (None: a new temporary directory). Prints what it loaded."""
    from models.builtin import BUILTINS
    from models.builtin.base_policy import build_base_policy

    base = base or tempfile.mkdtemp(prefix="tooladd-base-")
    lineage_path = os.path.join(base, "lineage.json")
    if not os.path.exists(lineage_path):
        os.makedirs(base, exist_ok=True)
        build_base_policy(base, task=BUILTINS["builtin-tooladd"], progress=progress)
    with open(lineage_path) as f:
        lineage = json.load(f)
    if not str(lineage.get("name", "")).startswith("builtin-tooladd"):
        raise SystemExit(f"{base} holds {lineage.get('name')!r}, not the builtin-tooladd base; pass another --base")
    progress(
        f"base: {base}, {lineage['steps']} steps, built in {lineage['build_seconds']} s, "
        f"validation accuracy {lineage['validation_accuracy']:.1%} (teacher-forced, on the recipe's examples)"
    )
    return base, lineage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", help="the base policy's directory (built there when missing; default: a temp dir)")
    parser.add_argument("--samples", type=int, default=4, help="sampled episodes per held-out prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48, help="policy tokens an episode may sample")
    parser.add_argument("--show", type=int, default=4, help="sampled episodes printed turn by turn")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    from models.builtin import BUILTINS
    from models.checkpoint import load_policy, set_threads
    from models.engines.embedded import EmbeddedEngine
    from models.engines.embedded_episodes import EmbeddedEpisodes
    from models.engines.types import SamplingParams
    from tasks.config.environment import EpisodeBudget, ToolPoolConfig
    from tasks.environments.runner import EpisodeRunner, describe_episode
    from tasks.environments.tool_pool import ToolPool
    from tasks.environments.tooladd import TooladdEnvironment

    task = BUILTINS["builtin-tooladd"]
    base, lineage = ensure_base(args.base)

    set_threads(task.recipe.threads)
    model, tok = load_policy(base)
    prompts = task.data.held_out_prompts()
    by_id = {p.prompt_id: p for p in prompts}
    budget = EpisodeBudget(max_turns=args.max_turns, max_tokens=args.max_tokens, step_timeout_s=10)
    results = {"base": base, "lineage": lineage, "held_out_prompts": len(prompts)}
    with ToolPool(TooladdEnvironment(None).tools, ToolPoolConfig(sandboxes=2)) as pool:
        for name, temperature, samples in (("sampled", args.temperature, args.samples), ("greedy", 0.0, 1)):
            engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, decode=tok.decode)
            session = EmbeddedEpisodes(engine, max_live=256)
            runner = EpisodeRunner(
                session,
                tok,
                TooladdEnvironment,
                pool,
                budget=budget,
                sampling=SamplingParams(temperature=temperature, max_tokens=args.max_tokens, seed=args.seed),
            )
            began = time.perf_counter()
            records, _ = runner.run(prompts, n=samples)
            seconds = time.perf_counter() - began
            measured = {"temperature": temperature, "samples_per_prompt": samples, **figures(records, by_id)}
            measured["seconds"] = round(seconds, 1)
            results[name] = measured
            print(
                f"{name:8s} T={temperature:g} x{samples}: success {measured['success']:.1%}, calls "
                f"{measured['calls']:.1%}, success | call {measured['success_given_call']:.1%}, success | none "
                f"{measured['success_given_no_call']:.1%}, wrong call {measured['wrong_call']:.1%}, wrong copy "
                f"{measured['wrong_copy']:.1%}, {measured['outcomes']} ({seconds:.1f} s)"
            )
            if name == "sampled":
                for record in records[: args.show]:
                    print(describe_episode(record))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
