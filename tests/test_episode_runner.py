"""Episodes end to end on a chat model (random weights, byte-level BPE, a chat template): the runner keeps the
policy's ids as sampled and appends observations as encoded, the budgets and the step timeout end episodes with the
outcome the rules give, and the schedules (overlapped, turn after turn) produce the same episodes."""

import os
from functools import partial

import pytest
import torch

from models.builtin.chat_example import random_chat_policy
from models.engines.embedded import EmbeddedEngine
from models.engines.embedded_episodes import EmbeddedEpisodes
from models.engines.types import SamplingParams
from models.prompt import Prompt
from tasks.config.environment import EpisodeBudget, ToolPoolConfig
from tasks.environments.calculator import CalculatorEnvironment, calculator_prompts
from tasks.environments.runner import EpisodeRunner
from tasks.environments.tool_pool import ToolPool
from tasks.environments.types import Observation, StepResult, ToolEnvironment, load_environment
from tasks.verifiers.outcome import Outcome

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the tool sandbox needs root")


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


def nap(seconds: float) -> str:
    """Sleep, then answer."""
    import time

    time.sleep(seconds)
    return "awake"


def crash() -> str:
    """Die without answering."""
    import os

    os._exit(3)


class ScriptedEnvironment(ToolEnvironment):
    """Makes the tool calls of ``script`` whatever the policy wrote (a random policy writes no calls), then scores the
    last turn: 1 if its text is of even length. Stands for an environment whose tools the policy always calls."""

    tool_functions = (add, nap, crash)

    def __init__(self, pool, script):
        super().__init__(pool)
        self.script = list(script)

    def score(self, answer_text: str) -> float:
        return float(len(answer_text) % 2 == 0)

    def step(self, action_text: str, *, timeout_s: float) -> StepResult:
        if not self.script:
            return StepResult(Observation(""), done=True, reward=self.score(action_text))
        name, arguments = self.script.pop(0)
        reply = self.pool.call(name, arguments, timeout_s=timeout_s)
        if reply.infra is not None:
            return StepResult(Observation(""), done=True, infra_error=reply.infra, tool_seconds=reply.seconds)
        return StepResult(Observation(reply.text), done=False, tool_seconds=reply.seconds)


PROMPTS = [Prompt(prompt_id=f"p{i}", task="t", text=f"What is {i} + {i * 7}?", reference="") for i in range(3)]
TWO_CALLS = [("add", {"a": 2, "b": 40}), ("add", {"a": 10**20, "b": 1})]


@pytest.fixture(scope="module")
def chat():
    texts = [p.text for p in PROMPTS] + ["The answer is 42.", "<tool_call>", '{"name": "add"}', "[tool]"]
    model, tok = random_chat_policy(texts, seed=1)
    stops = [tok.eos_token_id, tok.pad_token_id]
    return model, tok, stops


@pytest.fixture(scope="module")
def pool():
    with ToolPool([t for t in ScriptedEnvironment(None, []).tools], ToolPoolConfig(sandboxes=2)) as p:
        yield p


def _run(chat, pool, script, *, budget=None, schedule="overlap", keep_kv=True, n=2):
    model, tok, stops = chat
    engine = EmbeddedEngine(
        model, stops, tok.pad_token_id, max_batch=8, decode=partial(tok.decode, skip_special_tokens=False)
    )
    session = EmbeddedEpisodes(engine, max_live=4, keep_kv=keep_kv)
    runner = EpisodeRunner(
        session,
        tok,
        partial(ScriptedEnvironment, script=script),
        pool,
        budget=budget or EpisodeBudget(max_turns=4, max_tokens=64, step_timeout_s=5),
        sampling=SamplingParams(temperature=1.0, max_tokens=10, seed=5),
        schedule=schedule,
    )
    records, stats = runner.run(PROMPTS, n=n)
    return records, stats, session


def test_policy_ids_are_kept_as_sampled_and_observations_are_appended_and_masked(chat, pool):
    _, tok, _ = chat
    records, stats, session = _run(chat, pool, TWO_CALLS)
    assert len(records) == 6 and stats.outcomes.keys() <= {"success", "model_failure"}
    round_trips = []
    for r in records:
        assert [t.turn for t in r.turns] == [0, 1, 2]
        assert r.token_ids == session.sequence(r.episode_id)  # exactly the engine's sequence, nothing re-encoded
        mask, logprobs, versions = r.policy_mask, r.logprobs, r.policy_versions
        assert len(mask) == len(logprobs) == len(versions) == len(r.token_ids)
        at = 0
        for turn in r.turns:
            n, m = len(turn.token_ids), len(turn.observation_ids)
            assert mask[at : at + n] == [True] * n and mask[at + n : at + n + m] == [False] * m
            assert logprobs[at : at + n] == turn.logprobs and logprobs[at + n : at + n + m] == [0.0] * m
            assert versions[at + n : at + n + m] == [-1] * m
            assert turn.observation_ids == tok(turn.observation_text, add_special_tokens=False)["input_ids"]
            round_trips.append(tok(tok.decode(turn.token_ids), add_special_tokens=False)["input_ids"] == turn.token_ids)
            at += n + m
        # the tool's answers reached the policy as a chat tool turn, and the policy speaks next
        assert "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n" in r.turns[0].observation_text
        assert "100000000000000000001" in r.turns[1].observation_text
    # byte-level BPE does not give a random policy's ids back from their text: the case that must not matter here
    assert not all(round_trips)
    assert stats.reused_tokens > 0  # turns after the first appended onto their kept cache


def test_every_schedule_and_both_caches_give_the_same_episodes(chat, pool):
    a, _, _ = _run(chat, pool, TWO_CALLS)
    b, stats, _ = _run(chat, pool, TWO_CALLS, schedule="sequential", keep_kv=False)
    again, _, _ = _run(chat, pool, TWO_CALLS, schedule="lockstep")
    assert stats.reused_tokens == 0
    for x, y, z in zip(a, b, again):
        assert x.token_ids == y.token_ids == z.token_ids and x.outcome == y.outcome and x.reward == y.reward
        # the rows a batch shares with differ with tool timing, and with them the last bits of a logprob: the same
        # tokens, logprobs to float rounding (replay reads the stored ones, so it stays bitwise)
        for other in (y, z):
            assert torch.allclose(torch.tensor(x.logprobs), torch.tensor(other.logprobs), atol=1e-5)


@pytest.mark.parametrize(
    "script, budget, outcome, error",
    [
        # more tool calls than turns: the model never answered within its turns
        (TWO_CALLS * 3, EpisodeBudget(max_turns=2, step_timeout_s=5), Outcome.MODEL_FAILURE, "max_turns=2"),
        # a token budget smaller than the turns it needs: the model's own spending
        (TWO_CALLS * 3, EpisodeBudget(max_tokens=12, step_timeout_s=5), Outcome.MODEL_FAILURE, "max_tokens=12"),
        # a tool that hangs past the step timeout: the environment's failure, never a zero reward
        ([("nap", {"seconds": 30})], EpisodeBudget(step_timeout_s=0.5), Outcome.INFRA_FAILURE, "hung past 0.5s"),
        # a tool whose process dies: the environment's failure
        ([("crash", {})], EpisodeBudget(step_timeout_s=5), Outcome.INFRA_FAILURE, "exited with 3"),
    ],
)
def test_budgets_and_tool_failures_end_episodes_with_the_rules_outcome(chat, pool, script, budget, outcome, error):
    records, stats, _ = _run(chat, pool, script, budget=budget, n=1)
    for r in records:
        assert r.outcome == outcome and error in r.error
        assert r.reward == (0.0 if outcome == Outcome.MODEL_FAILURE else None)
    assert stats.outcomes == {outcome.value: len(PROMPTS)}


def test_environments_are_named_in_config_as_module_and_class():
    assert load_environment("tasks.environments.calculator:CalculatorEnvironment") is CalculatorEnvironment
    with pytest.raises(ValueError, match="'package.module:Name'"):
        load_environment("tasks.environments.calculator.CalculatorEnvironment")
    with pytest.raises(ValueError, match="cannot be loaded"):
        load_environment("tasks.environments.calculator:Nope")


def test_the_calculator_scores_the_last_answer(pool):
    prompt = calculator_prompts(1, digits=15, seed=3)[0]
    env = CalculatorEnvironment(pool)
    assert "add tool" in env.reset(prompt).system
    call = f'<tool_call>{{"name": "add", "arguments": {{"a": {prompt.text.split()[2]}, "b": 1}}}}</tool_call>'
    assert not env.step(call, timeout_s=5).done
    assert env.step(f"The answer is {prompt.reference}.", timeout_s=5).reward == 1.0
    assert env.step("The answer is 12.", timeout_s=5).reward == 0.0


MY_ENV = '''
from tasks.environments.types import Observation, ToolEnvironment


def lookup(word: str) -> str:
    """Look a word up in the dictionary.

    Args:
        word: the word to look up
    """
    import json  # a tool imports inside itself: it runs as its own source in the sandbox

    return json.dumps({"word": word, "length": len(word)})


class MyEnv(ToolEnvironment):
    tool_functions = (lookup,)

    def reset(self, prompt):
        self.prompt = prompt
        return Observation(prompt.text, system="Use the lookup tool, then answer: The answer is N.")

    def score(self, answer_text):
        return 1.0 if answer_text.strip().endswith(f"{self.prompt.reference}.") else 0.0
'''


def test_a_users_environment_module_named_in_config_runs_on_a_chat_model(chat, tmp_path, monkeypatch):
    """docs/environments.md's example, as a package of the user's own: loaded by name, its tool in the sandbox, its
    episodes on a chat-template model, each printed turn by turn."""
    from tasks.environments.runner import describe_episode

    package = tmp_path / "my_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "my_env.py").write_text(MY_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    factory = load_environment("my_pkg.my_env:MyEnv")
    model, tok, stops = chat
    engine = EmbeddedEngine(
        model, stops, tok.pad_token_id, max_batch=8, decode=partial(tok.decode, skip_special_tokens=False)
    )
    with ToolPool(factory(None).tools, ToolPoolConfig(sandboxes=2)) as pool:
        runner = EpisodeRunner(
            EmbeddedEpisodes(engine, max_live=4),
            tok,
            factory,
            pool,
            budget=EpisodeBudget(max_turns=2, max_tokens=40, step_timeout_s=5),
            sampling=SamplingParams(temperature=1.0, max_tokens=12, seed=2),
        )
        prompt = Prompt(prompt_id="w", task="words", text="How long is the word tool?", reference="4")
        records, stats = runner.run([prompt], n=2)
        # the tool is shown through the template (this one lists it in the system turn) and runs when called
        assert "- lookup(word: string): Look a word up in the dictionary." in records[0].prompt_text
        call = '<tool_call>{"name": "lookup", "arguments": {"word": "tool"}}</tool_call>'
        assert factory(pool).step(call, timeout_s=5).observation.text == '{"word": "tool", "length": 4}'
    assert stats.outcomes.keys() <= {"success", "model_failure"} and sum(stats.outcomes.values()) == 2
    shown = describe_episode(records[0])
    assert shown.startswith("episode w/0 (group w): ") and "  turn 0  policy " in shown


class StuckEnvironment(ScriptedEnvironment):
    """An environment whose own code ignores its step timeout and never comes back in time."""

    def step(self, action_text: str, *, timeout_s: float) -> StepResult:
        import time

        time.sleep(3)
        return StepResult(Observation("late"), done=False)


def test_an_environment_that_ignores_its_timeout_is_abandoned_as_an_infra_failure(chat, pool, monkeypatch):
    """The runner's own guard: past the step timeout plus the grace, the step is abandoned (its thread may run on)
    and the batch does not wait for it."""
    import time

    from tasks.environments import runner as runner_module

    monkeypatch.setattr(runner_module, "STEP_GRACE_S", 0.2)
    model, tok, stops = chat
    engine = EmbeddedEngine(
        model, stops, tok.pad_token_id, max_batch=8, decode=partial(tok.decode, skip_special_tokens=False)
    )
    runner = EpisodeRunner(
        EmbeddedEpisodes(engine, max_live=4),
        tok,
        partial(StuckEnvironment, script=[]),
        pool,
        budget=EpisodeBudget(step_timeout_s=0.3),
        sampling=SamplingParams(temperature=1.0, max_tokens=6, seed=5),
    )
    began = time.perf_counter()
    records, stats = runner.run(PROMPTS[:1], n=2)
    assert time.perf_counter() - began < 2.5  # not the 3 s the stuck steps take
    assert [r.outcome for r in records] == [Outcome.INFRA_FAILURE] * 2
    assert records[0].error == "the environment step did not return in time"
