"""Pre-rollout selection: how well a prompt's history predicts that its next group has zero advantage.

    python benchmarks/selection.py --storage DIR --run-id RUN [--from-round 3] [--history 16]
                                   [--decay 0.5] [--prior 2] [--floor 0.05] [--json PATH]

Reads a finished campaign's committed trajectory versions (every generated group is stored, kept or
not) and, for each round from ``--from-round`` on, predicts each generated group's chance of having zero
reward variance (every sample right, or every sample wrong: filter drops it after its generation was
paid for) from the rounds before it only, as a round's rollout would have to. Two predictors:

- **last group** (the campaign's curriculum, tasks/rollout/curriculum.py): a prompt whose most recent
  group, within ``--history`` rounds, was solved by every sample is admitted at ``--solved-weight``;
- **posterior**: a Beta posterior of the prompt's success rate over its samples in the last
  ``--history`` rounds, a round ``k`` back weighted ``decay**(k-1)``, under a prior of strength
  ``--prior`` samples centred on the previous round's success rate; the chance that ``n`` samples all
  agree is ``E[p**n] + E[(1-p)**n]`` under it, and a prompt is admitted with the rest of the probability
  (at least ``--floor``, so no prompt is shut out).

It prints the posterior's calibration (predicted zero-variance probability, by tenths, against the
fraction of those groups that had zero variance) and, for admitting every prompt, the last-group rule
and the posterior, the groups generated per kept group that admission would cost. A group stored with
``prompt_weight`` w stands for 1/w groups of the prompt stream, so the figures estimate each rule on
the same stream, whatever rule the campaign itself drew with. Groups with an infrastructure failure or
an unknown verdict are left out (they never train). Generated per kept group is the whole of what
selection can save: rollout seconds scale with it.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class GroupOutcome:
    prompt_id: str
    successes: int
    samples: int
    prompt_weight: float  # the probability the campaign drew the prompt with

    @property
    def informative(self) -> bool:
        return 0 < self.successes < self.samples


def _log_beta(a: float, b: float) -> float:
    return math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b)


def zero_variance_probability(alpha: float, beta: float, samples: int) -> float:
    """The chance that ``samples`` Bernoulli draws of a success rate p ~ Beta(alpha, beta) all agree:
    E[p**n] + E[(1-p)**n]."""
    base = _log_beta(alpha, beta)
    return math.exp(_log_beta(alpha + samples, beta) - base) + math.exp(_log_beta(alpha, beta + samples) - base)


def read_rounds(storage: str, run_id: str) -> dict[int, list[GroupOutcome]]:
    """Every committed round of the campaign (round 1 on): its groups' model outcomes, in stored order."""
    from storage.paths import StorageRoot
    from storage.trajectories import committed_round_version, read_table
    from tasks.verifiers.outcome import Outcome

    root = StorageRoot.of(storage)
    rounds: dict[int, list[GroupOutcome]] = {}
    index = 1
    while (version := committed_round_version(root, run_id, index)) is not None:
        table = read_table(root, version, columns=["prompt_id", "group_id", "outcome", "prompt_weight"])
        groups: dict[str, list] = {}  # group id -> [prompt id, successes, samples, weight, model outcomes only]
        for prompt_id, group_id, outcome, weight in zip(
            *(table.column(c).to_pylist() for c in ("prompt_id", "group_id", "outcome", "prompt_weight"))
        ):
            entry = groups.setdefault(group_id, [prompt_id, 0, 0, weight, True])
            entry[1] += outcome == Outcome.SUCCESS.value
            entry[2] += 1
            entry[4] &= outcome in (Outcome.SUCCESS.value, Outcome.MODEL_FAILURE.value)
        rounds[index] = [GroupOutcome(p, s, n, w) for p, s, n, w, model in groups.values() if model]
        index += 1
    if not rounds:
        raise SystemExit(f"no committed round of run {run_id!r} under {storage}")
    return rounds


def success_rate(groups: list[GroupOutcome]) -> float:
    samples = sum(g.samples for g in groups)
    return sum(g.successes for g in groups) / samples if samples else 0.5


def posterior_counts(
    rounds: dict[int, list[GroupOutcome]], round_index: int, history: int, decay: float
) -> dict[str, tuple[float, float]]:
    """Per prompt, decayed (successes, failures) over the ``history`` rounds before ``round_index``."""
    counts: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for past in range(max(1, round_index - history), round_index):
        weight = decay ** (round_index - 1 - past)
        for group in rounds.get(past, []):
            entry = counts[group.prompt_id]
            entry[0] += weight * group.successes
            entry[1] += weight * (group.samples - group.successes)
    return {prompt: (s, f) for prompt, (s, f) in counts.items()}


def last_group_solved(rounds: dict[int, list[GroupOutcome]], round_index: int, history: int) -> set[str]:
    """The curriculum's rule: prompts whose most recent group in the window was solved by every sample."""
    latest: dict[str, bool] = {}
    for past in range(max(1, round_index - history), round_index):
        for group in rounds.get(past, []):
            latest[group.prompt_id] = group.successes == group.samples
    return {prompt for prompt, solved in latest.items() if solved}


def evaluate(rounds: dict[int, list[GroupOutcome]], args) -> dict:
    """Calibration of the posterior, and generated per kept group under each admission rule."""
    generated = collections.Counter()  # rule -> expected groups generated (stream-weighted)
    kept = collections.Counter()
    bins = collections.defaultdict(lambda: [0, 0])  # tenth -> [groups, zero-variance groups]
    for index in range(args.from_round, max(rounds) + 1):
        prior_mean = success_rate(rounds.get(index - 1, []))
        counts = posterior_counts(rounds, index, args.history, args.decay)
        solved = last_group_solved(rounds, index, args.history)
        for group in rounds[index]:
            s, f = counts.get(group.prompt_id, (0.0, 0.0))
            alpha, beta = args.prior * prior_mean + s, args.prior * (1 - prior_mean) + f
            predicted = zero_variance_probability(max(alpha, 1e-6), max(beta, 1e-6), group.samples)
            tenth = min(int(predicted * 10), 9)
            bins[tenth][0] += 1
            bins[tenth][1] += not group.informative
            stream = 1.0 / group.prompt_weight  # the stream's groups this stored one stands for
            admit = {
                "every prompt": 1.0,
                "last group": args.solved_weight if group.prompt_id in solved else 1.0,
                "posterior": max(args.floor, 1.0 - predicted),
            }
            for rule, weight in admit.items():
                generated[rule] += stream * weight
                kept[rule] += stream * weight * group.informative
    per_kept = {rule: generated[rule] / kept[rule] for rule in generated if kept[rule]}
    calibration = [
        {"predicted": f"{t / 10:.1f}-{(t + 1) / 10:.1f}", "groups": n, "zero_variance": z / n}
        for t, (n, z) in sorted(bins.items())
    ]
    return {"generated_per_kept": per_kept, "calibration": calibration}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--storage", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--from-round", type=int, default=3, help="first round predicted (earlier ones: history)")
    parser.add_argument("--history", type=int, default=16, help="rounds looked back over")
    parser.add_argument("--decay", type=float, default=0.5, help="a round k back counts decay**(k-1)")
    parser.add_argument("--prior", type=float, default=2.0, help="the prior's strength, in samples")
    parser.add_argument("--floor", type=float, default=0.05, help="the posterior rule's least admission probability")
    parser.add_argument("--solved-weight", type=float, default=0.2, help="the last-group rule's admission probability")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if not 0 < args.decay <= 1 or args.prior <= 0 or not 0 < args.floor <= 1 or not 0 < args.solved_weight <= 1:
        parser.error("--decay, --floor and --solved-weight lie in (0, 1]; --prior is positive")
    rounds = read_rounds(args.storage, args.run_id)
    if args.from_round < 2 or args.from_round > max(rounds):
        parser.error(f"--from-round must lie in 2..{max(rounds)} (the run has {max(rounds)} rounds)")
    figures = evaluate(rounds, args)
    print(f"[selection] rounds {args.from_round}-{max(rounds)} of {args.run_id}, predicted from the rounds before each")
    print("[selection] posterior's calibration: predicted zero-variance probability -> observed (groups)")
    for row in figures["calibration"]:
        print(f"  {row['predicted']}: {row['zero_variance']:.2f} ({row['groups']})")
    every = figures["generated_per_kept"]["every prompt"]
    for rule, value in figures["generated_per_kept"].items():
        print(f"[selection] {rule}: {value:.2f} generated per kept group ({value / every:.2f}x admitting every prompt)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), **figures}, f, indent=2)


if __name__ == "__main__":
    main()
