"""The long-tail task, its verifier, and the simulated remote environment (a simulation: no remote calls)."""

import itertools
import statistics

import pytest

from models.builtin import addition, longtail
from tasks.config.verify import SimulatedEnvironmentConfig, VerifyConfig
from tasks.verifiers.outcome import Outcome, Verdict, VerifierInfraError
from tasks.verifiers.pool import VerifierPool, run_verifier
from tasks.verifiers.registry import get_verifier, rollout_verifier, rollout_verifier_version, verifier_version
from tasks.verifiers.simulated_env import SimulatedEnvironment, draw, with_simulated_environment

# -- the task -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "start, span, text, reference",
    [
        (1, 1, "1>0=", "1,0"),  # the shortest answer
        (10, 2, "10>8=", "10,9,8"),  # a borrow: the numbers get shorter
        (500, 1, "500>499=", "500,499"),  # a borrow through two digits
        (999, 14, "999>985=", ",".join(str(n) for n in range(999, 984, -1))),  # the longest prompt and answer
    ],
)
def test_prompts_count_down_from_start_to_stop(start, span, text, reference):
    prompt = longtail.make_prompt(start, span)
    assert (prompt.text, prompt.reference, prompt.task) == (text, reference, "longtail")


def test_held_out_set_is_fixed_distinct_and_never_trained_on():
    held = longtail.held_out_prompts()
    assert len(held) == len({p.prompt_id for p in held}) == longtail.HELD_OUT_SIZE
    assert held == longtail.held_out_prompts()
    held_ids = {p.prompt_id for p in held}
    assert not held_ids & {p.prompt_id for p in longtail.training_prompts(seed=3, count=20_000)}


def test_answer_lengths_have_a_tail():
    """Most answers are short and a few are ten times longer: the tail comes from the task itself."""
    lengths = sorted(len(p.reference) + 1 for p in longtail.training_prompts(seed=0, count=5_000))  # + end-of-sequence
    p50, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert p50 <= 10 and p99 >= 7 * p50, (p50, p99)
    assert max(lengths) <= len(longtail.longest_prompt().reference) + 1


def test_base_examples_count_down_further_than_the_task_and_are_never_held_out():
    """The base recipe's examples are the task's prompts with longer spans more often (models/builtin/longtail.py)."""

    def counted(prompts):  # share that count past the first number: span 2 and up
        return sum(p.reference.count(",") > 1 for p in prompts) / len(prompts)

    base = _first(longtail.base_prompt_stream(seed=0), 5_000)
    assert counted(base) > counted(longtail.training_prompts(seed=0, count=5_000)) + 0.2
    assert not {p.prompt_id for p in base} & {p.prompt_id for p in longtail.held_out_prompts()}
    stream = longtail.base_prompt_stream
    assert base[:50] == _first(stream(seed=0), 50) != _first(stream(seed=1), 50)


def test_base_examples_count_past_the_tasks_longest_answer():
    """A run-on ends about where the base's longest example does: the recipe's examples take every span up to
    ``BASE_MAX_SPAN``, past the task's longest answer, so the base's wrong samples can run on to
    ``rollout.max_tokens`` rather than stop where the task's answers end."""
    base = _first(longtail.base_prompt_stream(seed=0), 20_000)
    assert {p.reference.count(",") for p in base} == set(range(1, longtail.BASE_MAX_SPAN + 1))
    task_longest = len(longtail.longest_prompt().reference)
    assert max(len(p.reference) for p in base) >= task_longest + 3 * 4  # three numbers further at least
    assert max(len(p.reference) for p in longtail.training_prompts(seed=0, count=20_000)) <= task_longest


def test_the_addition_base_trains_on_the_training_prompts_draws_in_order():
    """The recipe takes each step's examples from ``base_prompt_stream`` as it goes; for addition they are
    the draws of ``training_prompts``, in order, seeded by the recipe's seed."""
    assert _first(addition.base_prompt_stream(seed=0), 300) == addition.training_prompts(seed=0, count=300)
    assert _first(addition.base_prompt_stream(seed=1), 20) != addition.training_prompts(seed=0, count=20)


def _first(stream, count: int) -> list:
    return list(itertools.islice(stream, count))


def test_stream_is_seeded():
    assert longtail.training_prompts(seed=7, count=50) == longtail.training_prompts(seed=7, count=50)
    assert longtail.training_prompts(seed=7, count=50) != longtail.training_prompts(seed=8, count=50)


# -- the verifier ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "completion, outcome",
    [
        ("12,11,10", Outcome.SUCCESS),  # exactly the count-down
        (" 12,11,10\n", Outcome.SUCCESS),  # surrounding whitespace is not the model's answer
        ("12,11", Outcome.MODEL_FAILURE),  # stopped early
        ("12,11,10,9,8", Outcome.MODEL_FAILURE),  # ran on past the last number
        ("12,11,9,8,7", Outcome.MODEL_FAILURE),  # skipped a number
        ("12,11,10,", Outcome.MODEL_FAILURE),  # a trailing separator is part of the answer
        ("", Outcome.MODEL_FAILURE),  # said nothing
    ],
)
def test_longtail_verifier(completion, outcome):
    verdict = run_verifier(get_verifier("longtail"), completion, "12,11,10")
    assert verdict.outcome == outcome
    assert verdict.reward == (1.0 if outcome == Outcome.SUCCESS else 0.0)


def test_a_broken_reference_is_the_datasets_fault():
    with pytest.raises(VerifierInfraError) as info:
        get_verifier("longtail")("12,11", "twelve")
    assert info.value.retryable is False


def test_registered_version_matches_the_module():
    from tasks.verifiers import longtail as verify_longtail

    assert verifier_version("longtail") == verify_longtail.VERSION


# -- the simulated environment ----------------------------------------------------------------------


def _quantiles(config, n=20_000):
    latencies = sorted(draw(config, f"sample-{i}").latency_s for i in range(n))
    return latencies[n // 2], latencies[int(0.99 * n)]


@pytest.mark.parametrize(
    "median, ratio",
    [
        (0.05, 10.0),  # the default: one call in a hundred waits ten times the median
        (0.2, 3.0),  # a milder tail
        (0.01, 30.0),  # a heavier one
    ],
)
def test_latency_quantiles_follow_the_config(median, ratio):
    p50, p99 = _quantiles(SimulatedEnvironmentConfig(median_latency_s=median, p99_over_median=ratio))
    assert p50 == pytest.approx(median, rel=0.05)
    assert p99 / p50 == pytest.approx(ratio, rel=0.15)


def test_ratio_one_is_a_constant_delay():
    config = SimulatedEnvironmentConfig(median_latency_s=0.03, p99_over_median=1.0)
    assert {round(draw(config, f"s{i}").latency_s, 12) for i in range(100)} == {0.03}


def test_draws_are_seeded_per_sample():
    config = SimulatedEnvironmentConfig()
    assert draw(config, "r1/a") == draw(config, "r1/a")  # the same sample meets the same environment
    assert draw(config, "r1/a") != draw(config, "r1/b")  # another sample, another draw
    assert draw(config, "r1/a") != draw(config.model_copy(update={"seed": 1}), "r1/a")  # another environment seed


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.5])
def test_failure_rate_follows_the_config(rate):
    config = SimulatedEnvironmentConfig(infra_failure_rate=rate)
    failures = statistics.fmean(draw(config, f"s{i}").fails for i in range(10_000))
    assert failures == pytest.approx(rate, abs=0.015)


def test_environment_waits_then_scores_or_fails():
    slept: list[float] = []
    rule = get_verifier("longtail")
    calm = SimulatedEnvironment(rule, SimulatedEnvironmentConfig(), round_seed=1, sleep=slept.append)
    assert calm("3,2", "3,2").outcome == Outcome.SUCCESS
    assert calm("3,1", "3,2").outcome == Outcome.MODEL_FAILURE
    assert len(slept) == 2 and all(s > 0 for s in slept)
    broken = SimulatedEnvironment(
        rule, SimulatedEnvironmentConfig(infra_failure_rate=1.0), round_seed=1, sleep=slept.append
    )
    verdict = run_verifier(broken, "3,2", "3,2")  # a correct answer, but the environment failed: never a zero reward
    assert (verdict.outcome, verdict.reward) == (Outcome.INFRA_FAILURE, None)
    assert "simulated environment failure" in verdict.error


def test_no_simulation_leaves_the_verifier_alone():
    rule = get_verifier("longtail")
    assert with_simulated_environment(rule, None, round_seed=0) is rule


def test_rollout_scores_behind_the_simulation_only_when_it_is_configured():
    from tasks.verifiers import simulated_env

    bare = VerifyConfig()
    assert rollout_verifier("longtail", bare, round_seed=0) is get_verifier("longtail", bare)
    assert rollout_verifier_version("longtail", bare) == verifier_version("longtail")
    simulated = VerifyConfig(simulated_environment={"median_latency_s": 0.0, "infra_failure_rate": 1.0})
    verifier = rollout_verifier("longtail", simulated, round_seed=3)
    assert isinstance(verifier, SimulatedEnvironment) and verifier.round_seed == 3
    assert run_verifier(verifier, "3,2", "3,2").outcome == Outcome.INFRA_FAILURE
    version = rollout_verifier_version("longtail", simulated)  # rewards scored behind a simulation say so
    assert version == f"{verifier_version('longtail')}+simulated-env-{simulated_env.VERSION}"


def test_simulation_fields_are_labelled_and_checked():
    from tasks.config.base import field_help

    fields = SimulatedEnvironmentConfig.model_fields
    assert all(fields[name].description.startswith("SIMULATION") for name in fields)
    assert field_help(VerifyConfig, ("simulated_environment",)).startswith("SIMULATION")
    with pytest.raises(ValueError, match="p99_over_median"):
        VerifyConfig(simulated_environment={"p99_over_median": 0.5})
    with pytest.raises(ValueError, match="Extra inputs"):
        VerifyConfig(simulated_environment={"median_latency": 0.1})


def test_pool_meets_the_same_environment_whatever_the_schedule():
    """Real threads, real sleeps: outcomes per sample do not depend on which worker ran it."""
    config = SimulatedEnvironmentConfig(median_latency_s=0.002, infra_failure_rate=0.3)
    samples = [(f"{n},{n - 1}", f"{n},{n - 1}") for n in range(1, 41)]

    def outcomes(workers: int) -> list[Outcome]:
        env = with_simulated_environment(get_verifier("longtail"), config, round_seed=5)
        with VerifierPool(env, workers=workers, retries=2, retry_budget=100) as pool:
            futures = [pool.submit(text, ref) for text, ref in samples]
            verdicts: list[Verdict] = [f.result() for f in futures]
        assert all(v.attempts == 1 for v in verdicts)  # simulated failures are permanent: no retry is spent
        return [v.outcome for v in verdicts]

    one, many = outcomes(1), outcomes(8)
    assert one == many
    assert set(one) == {Outcome.SUCCESS, Outcome.INFRA_FAILURE}


# -- the base recipe's shortcut -----------------------------------------------------------------------


def test_teacher_forced_accuracy_is_greedy_exact_match():
    """One forward pass gives greedy decoding's verdict: references set to what greedy decoding wrote
    all pass, and a one-character change (or a missing end) fails each of them."""
    import torch

    from models.builtin.base_policy import BaseRecipe, build_model, teacher_forced_accuracy
    from models.builtin.tokenizer import build_char_tokenizer
    from models.engines.embedded import EmbeddedEngine
    from models.engines.types import GroupRequest, SamplingParams

    torch.manual_seed(0)
    tokenizer = build_char_tokenizer(longtail.CHARACTERS)
    model = build_model(
        BaseRecipe(hidden_size=32, num_layers=1, intermediate_size=64, num_heads=2), len(tokenizer), tokenizer
    ).eval()
    with torch.no_grad():  # make end-of-sequence likely, so greedy answers stop within the limit
        model.lm_head.weight[tokenizer.eos_token_id] += 0.5 * model.lm_head.weight.abs().mean()
    prompts = longtail.training_prompts(seed=0, count=256)
    engine = EmbeddedEngine(model, tokenizer.eos_token_id, tokenizer.pad_token_id)
    requests = [
        GroupRequest(p.prompt_id, tuple(tokenizer(p.text)["input_ids"]), 1, SamplingParams(0.0, 1.0, 12, 0))
        for p in prompts
    ]
    written = {s.group_id: s.token_ids for s in engine.generate(requests)}
    special = set(tokenizer.all_special_ids)
    stopped = [
        p
        for p in prompts
        if written[p.prompt_id][-1] == tokenizer.eos_token_id
        and len(written[p.prompt_id]) > 1
        and not special & set(written[p.prompt_id][:-1])
    ]
    assert len(stopped) >= 8, "the test needs greedy answers that end"
    as_written = [
        p.__class__(p.prompt_id, p.task, p.text, tokenizer.decode(written[p.prompt_id][:-1])) for p in stopped
    ]
    assert teacher_forced_accuracy(model, tokenizer, as_written, buckets=3) == 1.0
    changed = [
        p.__class__(p.prompt_id, p.task, p.text, p.reference[:-1] + ("1" if p.reference[-1] != "1" else "2"))
        for p in as_written
    ]
    assert teacher_forced_accuracy(model, tokenizer, changed) == 0.0
    longer = [
        p.__class__(p.prompt_id, p.task, p.text, p.reference + ",0") for p in as_written
    ]  # greedy stops before this
    assert teacher_forced_accuracy(model, tokenizer, longer) == 0.0
