"""One optimizer step's forward and backward on the built-in base: scoring full sequences against
scoring completions over shared prompts (what training does), measured in one run.

    python benchmarks/train_step.py --storage DIR [--groups 128] [--samples 4] [--repeats 5] [--json PATH]

DIR is a storage root; the built-in base is built there on first use and reused after. A minibatch
is sampled by the embedded engine from the base (``--groups`` prompts x ``--samples`` samples, by
default the default round's step), then each scoring runs forward and backward ``--repeats`` times in turn; the medians
and their ratio are printed. Both scorings give the same logprobs to float rounding
(tests/test_shared_prompts.py), so the ratio is the whole difference.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    from tasks.rollout import RolloutConfig
    from tasks.train import TrainConfig

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", required=True)
    parser.add_argument("--groups", type=int, default=TrainConfig().groups_per_step, help="groups per step")
    parser.add_argument("--samples", type=int, default=RolloutConfig().samples_per_prompt, help="samples per group")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()

    from models.engine import EmbeddedEngine, GroupRequest, SamplingParams
    from models.policy import (
        completion_logprobs,
        load_policy,
        pack_sequences,
        pack_shared,
        token_logprobs,
    )
    from storage import checkpoints
    from storage.paths import StorageRoot
    from tasks.base import run_prepare_base
    from tasks.prompts import PromptsConfig, prompt_stream

    base = run_prepare_base(storage=args.storage, base_model="builtin")
    model, tokenizer = load_policy(checkpoints.local_copy(StorageRoot.of(args.storage), base.checkpoint))
    stream = prompt_stream(PromptsConfig(), seed=0)
    params = SamplingParams(temperature=1.0, max_tokens=8, seed=0)
    requests = [
        GroupRequest(f"g{i}", tuple(tokenizer(next(stream).text)["input_ids"]), args.samples, params)
        for i in range(args.groups)
    ]
    samples = list(EmbeddedEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id).generate(requests))
    prompts = [list(s.prompt_token_ids) for s in samples]
    completions = [s.token_ids for s in samples]
    full = pack_sequences(prompts, completions, tokenizer.pad_token_id)
    shared = pack_shared(prompts, completions, tokenizer.pad_token_id)
    ways = {
        "full_sequences": lambda: token_logprobs(model, full).mul(full.completion_mask).sum(),
        "shared_prompts": lambda: completion_logprobs(model, shared).mul(shared.completion_mask).sum(),
    }
    seconds: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(args.repeats + 1):  # the first pass of each warms up and is not counted
        for name, score in ways.items():
            start = time.perf_counter()
            score().backward()
            seconds[name].append(time.perf_counter() - start)
            model.zero_grad(set_to_none=True)
    median = {name: statistics.median(times[1:]) for name, times in seconds.items()}
    tokens = {
        "full_sequences": int(full.input_ids.numel()),
        "shared_prompts": int(shared.prompt_ids.numel() + shared.completion_ids.numel()),
    }
    ratio = median["full_sequences"] / median["shared_prompts"]
    groups = shared.prompt_ids.shape[0]
    print(f"{len(samples)} samples in {groups} groups, forward + backward, median of {args.repeats}:")
    for name in ways:
        print(f"  {name:15s} {median[name]:.3f} s over {tokens[name]} token positions")
    print(f"shared prompts are {ratio:.2f}x faster")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"median_s": median, "token_positions": tokens, "speedup": ratio}, f, indent=2)


if __name__ == "__main__":
    main()
