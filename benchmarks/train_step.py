"""One optimizer step's forward and backward on the built-in base: scoring full sequences against
scoring completions over shared prompts (what training does), with the completions in one chunk or in
chunks of similar length, measured in one run.

    python benchmarks/train_step.py --storage DIR [--groups 128] [--samples 4] [--repeats 5] [--json PATH]
    python benchmarks/train_step.py --storage DIR --run-id RUN --round K [--repeats 5] [--json PATH]
    python benchmarks/train_step.py --storage DIR --run-id RUN --round K --policy-update [--profile] [--repeats 3]
                                  [--compile mlp-norms|layers] [--precision fp32|bf16|bf16-weights]
                                  [--attention default|math]

DIR is a storage root; the built-in base is built there on first use and reused after. A minibatch
is sampled by the embedded engine from the base (``--groups`` prompts x ``--samples`` samples, by
default the default round's step), or, with ``--run-id`` and ``--round``, the scored work is every
minibatch of that committed round's kept rows under its parent checkpoint: completions sampled by a
trained policy, whose lengths spread wider than the base's. Each scoring then runs forward and backward
``--repeats`` times in turn; the medians and their ratios are printed. All scorings give the same
logprobs to float rounding (tests/test_shared_prompts.py), so a ratio is the whole difference.

Last, the training scoring runs ``--repeats`` times more after ``torch.set_num_threads`` is called with
the count already in use, and its wall and system seconds are compared with the same scoring's before
(``torch.set_num_threads`` cannot be undone in a process, so this comes last).

``--policy-update`` times the whole update of round K instead, as the train stage runs it
(``train_policy`` on its minibatches from the parent checkpoint and its optimizer state, the default
``TrainConfig``; ``--precision bf16``: under bf16 autocast): the median seconds of ``--repeats``, then
one profiled repeat's operator time and the share of it in matrix products, attention's softmax,
autograd's backward nodes and the optimizer's step (the rest: elementwise ops, copies, gathers).
``--profile`` prints torch.profiler's table of the operators taking the most time. ``--compile PARTS`` first
times the eager update against one with each decoder layer's MLP and norms (``mlp-norms``) or each whole layer
(``layers``) under ``torch.compile(dynamic=True)``, interleaved, after one compiling update; the compiled update's
numbers differ from the eager one's in the last bits, so a gain there is a learning-speed question, not a bitwise one.
``--precision bf16-weights`` first times, interleaved, the update on the float32 weights against the same update on a
bfloat16 copy (forward, backward and the optimizer's step all in bfloat16, no casts around the products), without and
with the proximal logprobs recomputed: the ceiling of a bfloat16 working copy of the weights on this CPU, which
leaves out the copies to and from float32 master weights and what bfloat16's rounding does to learning.
``--attention math`` runs every timed update's attention on torch's math backend (products and a softmax) instead of
the kernel ``scaled_dot_product_attention`` picks (flash attention on a CPU), whose bfloat16 path can be slower than
its float32 one; the two backends agree to float rounding. With ``--precision bf16-weights`` the float32 update on
torch's own kernel is then timed in the same interleaving, as the base the others are read against.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    from tasks.config.rollout import RolloutConfig
    from tasks.config.train import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", required=True)
    parser.add_argument("--groups", type=int, default=TrainConfig().groups_per_step, help="groups per step")
    parser.add_argument("--samples", type=int, default=RolloutConfig().samples_per_prompt, help="samples per group")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--run-id", help="score the kept rows of this campaign's round --round")
    parser.add_argument("--round", type=int, help="with --run-id: the round whose rows are scored")
    parser.add_argument("--policy-update", action="store_true", help="time round --round's whole update")
    parser.add_argument("--profile", action="store_true", help="with --policy-update: torch.profiler's table")
    parser.add_argument(
        "--precision",
        choices=["fp32", "bf16", "bf16-weights"],
        default="fp32",
        help="with --policy-update: fp32, bf16 autocast, or also the same update on a bfloat16 copy of the weights "
        "against the fp32 one, interleaved (bf16-weights)",
    )
    parser.add_argument(
        "--attention",
        choices=["default", "math"],
        default="default",
        help="with --policy-update: the attention backend of every timed update: torch's choice or the math one",
    )
    parser.add_argument(
        "--compile",
        choices=["none", "mlp-norms", "layers"],
        default="none",
        help="with --policy-update: also time the update with torch.compile on each decoder layer's MLP and norms, or "
        "on whole decoder layers, against the eager update in the same run (the numbers differ in the last bits)",
    )
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if (args.run_id is None) != (args.round is None):
        parser.error("--run-id and --round go together")
    if args.policy_update:
        if args.run_id is None:
            parser.error("--policy-update needs --run-id and --round")
        return policy_update(args)

    from models.checkpoint import load_policy
    from models.engines.embedded import EmbeddedEngine
    from models.engines.types import GroupRequest, SamplingParams
    from models.logprobs import (
        COMPLETION_PADDING_BUDGET,
        completion_logprobs,
        length_chunks,
        pack_sequences,
        pack_shared,
        token_logprobs,
    )
    from storage import checkpoints
    from storage.paths import StorageRoot
    from tasks.campaign.base_policy import run_prepare_base
    from tasks.config.prompts import PromptsConfig
    from tasks.prompts.sources import prompt_stream

    root = StorageRoot.of(args.storage)
    if args.run_id is None:
        base = run_prepare_base(storage=args.storage, base_model="builtin")
        model, tokenizer = load_policy(checkpoints.local_copy(root, base.checkpoint))
        stream = prompt_stream(PromptsConfig(), seed=0)
        params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
        requests = [
            GroupRequest(f"g{i}", tuple(tokenizer(next(stream).text)["input_ids"]), args.samples, params)
            for i in range(args.groups)
        ]
        samples = list(EmbeddedEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id).generate(requests))
        work = [([list(s.prompt_token_ids) for s in samples], [s.token_ids for s in samples])]
    else:
        from storage.trajectories import committed_round_version, read_table
        from tasks.train.policy_update import minibatches
        from tasks.train.stage import TRAIN_COLUMNS, kept_rows

        model, tokenizer = load_policy(checkpoints.local_copy(root, root.checkpoint(args.run_id, args.round - 1)))
        version = committed_round_version(root, args.run_id, args.round)
        if version is None:
            parser.error(f"round {args.round} of {args.run_id} has no committed trajectories under {args.storage}")
        rows = kept_rows(read_table(root, version, columns=TRAIN_COLUMNS))
        config = TrainConfig()
        work = [
            (b.prompt_ids, b.completion_ids) for b in minibatches(rows, config.groups_per_step, config.steps_per_round)
        ]
    pad = tokenizer.pad_token_id
    fulls = [pack_sequences(prompts, completions, pad) for prompts, completions in work]
    shareds = [pack_shared(prompts, completions, pad) for prompts, completions in work]
    one_chunk = max(s.completion_ids.numel() for s in shareds)  # a padding budget no split can exceed

    def full_sequences(full):
        return token_logprobs(model, full).mul(full.completion_mask).sum()

    def shared_prompts(shared, budget=COMPLETION_PADDING_BUDGET):
        return completion_logprobs(model, shared, padding_budget=budget).mul(shared.completion_mask).sum()

    ways = {
        "full_sequences": lambda: [full_sequences(full).backward() for full in fulls],
        "shared_one_chunk": lambda: [shared_prompts(shared, one_chunk).backward() for shared in shareds],
        "shared_prompts": lambda: [shared_prompts(shared).backward() for shared in shareds],
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats + 1):  # the first pass of each warms up and is not counted
        for name, score in ways.items():
            start = time.perf_counter()
            score()
            seconds[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    median = {name: statistics.median(times[1:]) for name, times in seconds.items()}
    threads = thread_setting_cost(ways["shared_prompts"], model, args.repeats)
    tokens = {
        "full_sequences": sum(int(full.input_ids.numel()) for full in fulls),
        "shared_one_chunk": sum(int(s.prompt_ids.numel() + s.completion_ids.numel()) for s in shareds),
        "shared_prompts": sum(
            int(s.prompt_ids.numel())
            + sum(len(c) * int(s.completion_mask[c].sum(-1).max()) for c in length_chunks(s.completion_mask.sum(-1)))
            for s in shareds
        ),
    }
    ratio = median["full_sequences"] / median["shared_prompts"]
    chunk_ratio = median["shared_one_chunk"] / median["shared_prompts"]
    samples = sum(s.completion_ids.shape[0] for s in shareds)
    groups = sum(s.prompt_ids.shape[0] for s in shareds)
    print(f"{len(shareds)} minibatch(es), {samples} samples in {groups} groups, forward + backward,", end=" ")
    print(f"median of {args.repeats}:")
    for name in ways:
        print(f"  {name:16s} {median[name]:.3f} s over {tokens[name]} token positions")
    print(f"shared prompts are {ratio:.2f}x faster than full sequences")
    print(f"completions in chunks of similar length are {chunk_ratio:.2f}x faster than in one chunk")
    print(
        f"after torch.set_num_threads({threads['threads']}): {threads['slowdown']:.2f}x the time "
        f"({threads['after_s']:.3f} s against {threads['before_s']:.3f} s), system time "
        f"{threads['after_system_s']:.3f} s against {threads['before_system_s']:.3f} s"
    )
    if args.json:
        with open(args.json, "w") as f:
            figures = {"median_s": median, "token_positions": tokens, "speedup": ratio, "chunk_speedup": chunk_ratio}
            json.dump({**figures, "set_num_threads": threads}, f, indent=2)


def attention_backend(name: str):
    """The context every timed update runs in: torch's own choice of attention kernel, or its math backend."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    return contextlib.nullcontext() if name == "default" else sdpa_kernel(SDPBackend.MATH)


def policy_update(args) -> None:
    """Time (and with ``--profile``, profile) round ``args.round``'s whole update, as the train stage runs it."""
    import torch

    from models.checkpoint import load_policy
    from models.sharded import load_optimizer
    from storage import checkpoints
    from storage.paths import StorageRoot
    from storage.trajectories import committed_round_version, read_table
    from tasks.config.train import TrainConfig
    from tasks.train.policy_update import minibatches, proximal_plan, train_policy
    from tasks.train.stage import TRAIN_COLUMNS, kept_rows

    root = StorageRoot.of(args.storage)
    parent = checkpoints.local_copy(root, root.checkpoint(args.run_id, args.round - 1))
    version = committed_round_version(root, args.run_id, args.round)
    if version is None:
        raise SystemExit(f"round {args.round} of {args.run_id} has no committed trajectories under {args.storage}")
    rows = kept_rows(read_table(root, version, columns=TRAIN_COLUMNS))
    config = TrainConfig()
    batches = minibatches(rows, config.groups_per_step, config.steps_per_round, config.seed)
    plan = proximal_plan(config.recompute_proximal, "float32", [r["engine"] for r in rows], batches, args.round - 1)

    precision = "fp32" if args.precision == "bf16-weights" else args.precision

    def update(
        parts: str = "none", dtype: str = "float32", recompute: list[bool] = plan, attention: str = args.attention
    ) -> dict:
        model, tokenizer = load_policy(parent, dtype=dtype)
        compile_parts(model, parts)
        state = load_optimizer(parent, model)  # its moments take the parameters' dtype
        with attention_backend(attention):
            start = time.perf_counter()
            _, stats = train_policy(
                model, tokenizer.pad_token_id, batches, config=config, temperature=1.0, optimizer=state,
                current_version=args.round - 1, recompute=recompute, precision=precision,
            )  # fmt: skip
            return {"seconds": time.perf_counter() - start, "steps": stats["train/steps"]}

    update()  # warm-up
    if args.precision == "bf16-weights":
        # Rows sampled at float32 scored on bfloat16 weights differ from their behaviour logprobs by the weights'
        # rounding, so such an update would recompute its proximal logprobs (needs_proximal): timed both ways.
        recomputed = [True] * len(batches)
        update(dtype="bfloat16")  # warm-up
        # on another backend, today's update (float32, torch's own kernel) is timed beside them as the base
        today = args.attention != "default"
        runs = [(update(), update(dtype="bfloat16"), update(dtype="bfloat16", recompute=recomputed),
                 update(attention="default") if today else None)
                for _ in range(args.repeats)]  # fmt: skip
        # per optimizer step: the drift limit may stop them after different numbers of steps
        fp32, bf16, bf16_proximal = (
            statistics.median(run[i]["seconds"] / run[i]["steps"] for run in runs) for i in range(3)
        )
        print(
            f"round {args.round}, ms a step, medians of {args.repeats} interleaved: fp32 weights {fp32 * 1e3:.1f} "
            f"({runs[0][0]['steps']} steps); bfloat16 weights {bf16 * 1e3:.1f} ({runs[0][1]['steps']} steps), "
            f"{bf16 / fp32:.2f}x the time; with the proximal logprobs recomputed {bf16_proximal * 1e3:.1f} "
            f"({runs[0][2]['steps']} steps), {bf16_proximal / fp32:.2f}x (as the round ran, {sum(plan)} of "
            f"{len(plan)} minibatches recompute them)"
        )
        if today:
            base = statistics.median(run[3]["seconds"] / run[3]["steps"] for run in runs)
            print(
                f"against today's update (float32 weights, torch's own attention kernel) at {base * 1e3:.1f} ms a "
                f"step, interleaved with them: float32 weights on the {args.attention} backend {fp32 / base:.2f}x the "
                f"time, bfloat16 weights {bf16 / base:.2f}x, with the proximal logprobs recomputed "
                f"{bf16_proximal / base:.2f}x"
            )
    if args.compile != "none":
        first = update(args.compile)  # compiles
        print(f"compiled ({args.compile}): first update {first['seconds']:.3f} s, compilation included")
        pairs = [(update(), update(args.compile)) for _ in range(args.repeats)]
        eager = statistics.median(a["seconds"] for a, _ in pairs)
        compiled = statistics.median(b["seconds"] for _, b in pairs)
        print(
            f"round {args.round}: eager {eager:.3f} s, compiled ({args.compile}) {compiled:.3f} s, medians of "
            f"{args.repeats} interleaved: compiled / eager {compiled / eager:.2f}x the time"
        )
    runs = [update() for _ in range(args.repeats)]
    median = statistics.median(r["seconds"] for r in runs)
    print(f"round {args.round}: {len(batches)} minibatches, {runs[0]['steps']} optimizer steps,", end=" ")
    print(f"{median:.3f} s median of {args.repeats} ({median / max(runs[0]['steps'], 1) * 1e3:.1f} ms a step)")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        update()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    model_math = sum(
        e.self_cpu_time_total
        for e in events
        if e.key.startswith(("aten::mm", "aten::addmm", "aten::bmm", "aten::_scaled_dot", "aten::_softmax"))
        or "Backward" in e.key
        or e.key.startswith(("Optimizer.step", "aten::_foreach", "aten::_fused_adam"))
    )
    print(
        f"profiled: {total / 1e6:.3f} s of operator self time, {model_math / total:.0%} in matrix products, "
        "softmax, autograd's backward nodes and the optimizer's step"
    )
    if args.profile:
        print(events.table(sort_by="self_cpu_time_total", row_limit=30))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_s": median, "steps": runs[0]["steps"], "operator_s": total / 1e6}, f, indent=2)


def compile_parts(model, parts: str) -> None:
    """torch.compile, in place, each decoder layer's MLP and norms (``mlp-norms``) or each whole layer (``layers``)."""
    if parts == "none":
        return
    for layer in model.model.layers:
        if parts == "layers":
            layer.compile(dynamic=True)
        else:
            for module in (layer.mlp, layer.input_layernorm, layer.post_attention_layernorm):
                module.compile(dynamic=True)


def thread_setting_cost(score, model, repeats: int) -> dict:
    """Medians of ``score()`` (wall and system seconds) before and after ``torch.set_num_threads`` is called
    with the thread count already in use: a call that changes nothing, yet leaves the process's OpenMP
    threads waking each other by system call at every parallel op (why rlrounds never makes it in a
    campaign's process, models/builtin/base_policy.py)."""
    import resource

    import torch

    def measure() -> tuple[float, float]:
        walls, systems = [], []
        for _ in range(repeats):
            before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            score()
            walls.append(time.perf_counter() - start)
            systems.append(resource.getrusage(resource.RUSAGE_SELF).ru_stime - before.ru_stime)
            model.zero_grad(set_to_none=True)
        return statistics.median(walls), statistics.median(systems)

    before_s, before_system_s = measure()
    threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    after_s, after_system_s = measure()
    return {
        "threads": threads,
        "before_s": before_s,
        "after_s": after_s,
        "before_system_s": before_system_s,
        "after_system_s": after_system_s,
        "slowdown": after_s / before_s,
    }


if __name__ == "__main__":
    main()
