"""The tooladd task (models/builtin/tooladd.py) and its environment (tasks/environments/tooladd.py): the data, the
compact call format read back safely, the base recipe's examples and their masked observations, and a real episode
through the runner, the embedded engine's episode session and the sandboxed tool pool."""

import itertools
import os

import pytest
import torch

from models.builtin import BUILTINS, tooladd
from models.builtin.base_policy import _answer_batch, _logits, build_model
from models.builtin.recipe import BaseRecipe
from models.builtin.tokenizer import build_char_tokenizer
from models.engines.embedded import EmbeddedEngine
from models.engines.embedded_episodes import EmbeddedEpisodes
from models.engines.types import SamplingParams
from tasks.config.environment import EpisodeBudget, ToolPoolConfig
from tasks.environments.rendering import EpisodeFormat
from tasks.environments.tool_pool import ToolPool
from tasks.environments.tooladd import TooladdEnvironment
from tasks.environments.tools import ToolCall
from tasks.environments.types import Observation
from tasks.verifiers.outcome import Outcome

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the tool sandbox needs root")
TASK = BUILTINS["builtin-tooladd"]


def _first(stream, count: int) -> list:
    return list(itertools.islice(stream, count))


# -- the data ---------------------------------------------------------------------------------------


def test_held_out_set_is_fixed_distinct_and_never_trained_on():
    held = tooladd.held_out_prompts()
    assert len(held) == len({p.prompt_id for p in held}) == tooladd.HELD_OUT_SIZE
    assert held == tooladd.held_out_prompts()
    held_ids = {p.prompt_id for p in held}
    assert not held_ids & {p.prompt_id for p in tooladd.training_prompts(seed=3, count=20_000)}
    assert not held_ids & {p.prompt_id for p in _first(tooladd.base_prompt_stream(seed=0), 20_000)}


def test_prompts_are_long_additions_and_streams_are_seeded():
    prompts = tooladd.training_prompts(seed=0, count=2_000)
    assert prompts == tooladd.training_prompts(seed=0, count=2_000) != tooladd.training_prompts(seed=1, count=2_000)
    for p in prompts:
        a, b = p.text.removesuffix("=").split("+")
        assert tooladd.MIN_DIGITS <= len(a) <= tooladd.MAX_DIGITS and tooladd.MIN_DIGITS <= len(b) <= tooladd.MAX_DIGITS
        assert p.reference == str(int(a) + int(b)) and p.task == "tooladd"
    longest = len(tooladd.longest_prompt().text)
    assert max(len(p.text) for p in prompts) == longest
    assert _first(tooladd.base_prompt_stream(seed=0), 50) == _first(tooladd.base_prompt_stream(seed=0), 50)


def test_base_examples_are_whole_episodes_that_call_more_often_on_longer_numbers():
    examples = _first(tooladd.base_prompt_stream(seed=0), 10_000)
    calls = [p for p in examples if p.reference.startswith("[")]
    assert 0.45 < len(calls) / len(examples) < 0.55
    for p in examples[:500]:
        a, b = (int(x) for x in p.text.removesuffix("=").split("+"))
        total = str(a + b)
        # a call, the tool's answer, then the sum; or the sum at once
        assert p.reference in (f"[{a}+{b}]{total};{total}", total)

    def call_share(length: int) -> float:
        chosen = [p for p in examples if len(p.text) - 2 == length]
        return sum(p.reference.startswith("[") for p in chosen) / len(chosen)

    shortest, longest = 2 * tooladd.MIN_DIGITS, 2 * tooladd.MAX_DIGITS
    assert call_share(shortest) < 0.3 and call_share(longest) > 0.7


def test_every_character_the_format_writes_is_in_the_alphabet():
    tok = build_char_tokenizer(TASK.characters)
    largest = tooladd.longest_prompt()
    a, b = (int(x) for x in largest.text.removesuffix("=").split("+"))
    written = [
        largest.text,
        tooladd.episode_text(a, b, calls=True),
        tooladd.tool_call(a, b),
        tooladd.OBSERVATION.format(text=str(a + b)),
        tooladd.CALL_END,
    ]
    written += [p.reference for p in _first(tooladd.base_prompt_stream(seed=0), 200)]
    for text in written:
        assert set(text) <= set(TASK.characters), text
        assert tok.unk_token_id not in tok(text, add_special_tokens=False)["input_ids"]


def test_the_recipe_leaves_the_tools_answer_out_of_its_loss():
    """The observation's tokens (the tool's answer and its ``;``) are the environment's: masked as in RL; the
    call, the final answer and end-of-sequence are the policy's."""
    tok = build_char_tokenizer(TASK.characters)
    called = tooladd.make_prompt(1234567, 7654321)
    called = type(called)(
        called.prompt_id, called.task, called.text, tooladd.episode_text(1234567, 7654321, calls=True)
    )
    direct = tooladd.make_prompt(123456, 654321)
    batch = _answer_batch(tok, [called, direct], torch.device("cpu"), tooladd.observation_spans)
    unmasked = _answer_batch(tok, [called, direct], torch.device("cpu"))
    targets = batch.input_ids[:, 1:]

    def judged(row: int, mask) -> str:
        return tok.decode(targets[row][mask[row].bool()].tolist())

    assert judged(0, batch.completion_mask) == "[1234567+7654321]8888888</s>"
    assert judged(0, unmasked.completion_mask) == "[1234567+7654321]8888888;8888888</s>"
    assert judged(1, batch.completion_mask) == judged(1, unmasked.completion_mask) == "777777</s>"


# -- the environment's format and parsing ------------------------------------------------------------


@pytest.mark.parametrize(
    "action, call",
    [
        ("[1234567+7654321]", ToolCall("add", {"a": 1234567, "b": 7654321})),  # a call
        ("[007+1]", ToolCall("add", {"a": 7, "b": 1})),  # leading zeros are still digits
        ("8888888", None),  # a direct answer
        ("", None),  # an empty turn: an answer, and a wrong one
        ("[12+30", None),  # a call cut off by end-of-sequence: not a call
        ("[12+x]", None),  # a non-integer argument
        ("[1.5+2]", None),  # not an integer either
        ("[-1+2]", None),  # no sign in the format
        ("[12+30+4]", None),  # three operands
        ("[12+30]99", None),  # more than the call in one turn
        ("[" + "9" * 5000 + "+1]", None),  # a huge argument never reaches int() nor the tool
        ("[١٢+3]", None),  # digits of another script
        ('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', None),  # the JSON form is not this
    ],
)
def test_a_turn_is_a_call_only_when_it_is_exactly_one(action, call):
    assert TooladdEnvironment(None).parse_call(action) == call


def test_the_prompt_is_the_tasks_text_and_the_observation_is_compact():
    tok = build_char_tokenizer(TASK.characters)
    env = TooladdEnvironment(None)
    prompt = tooladd.make_prompt(1234567, 7654321)
    episode = EpisodeFormat(tok, env.tools, env.plain_format)
    text, ids = episode.prompt(env.reset(prompt))
    assert text == "1234567+7654321=" and ids == (tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"])
    body, obs_ids = episode.observation("8888888", turn_ids=[1, 2], finish_reason="stop")
    assert body == "8888888;" and tok.decode(obs_ids) == "8888888;"
    # another environment's default is unchanged: the tools listed, the answer in OBSERVATION_PLAIN
    plain = EpisodeFormat(tok, env.tools)
    assert plain.prompt(Observation("1+2="))[0].startswith("You can call these tools:\n- add(a: integer, b: integer)")
    assert plain.observation("3", turn_ids=[1], finish_reason="stop")[0] == "\n[tool] 3\n"


# -- with the sandbox pool -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pool():
    with ToolPool(TooladdEnvironment(None).tools, ToolPoolConfig(sandboxes=1)) as p:
        yield p


@needs_root
@pytest.mark.parametrize(
    "turns, done, reward, observation",
    [
        (["[1234567+7654321]"], False, None, "8888888"),  # the call runs in the sandbox; its answer comes back
        (["[1234567+7654321]", "8888888"], True, 1.0, ""),  # the answer copied: success
        (["[1234567+7654321]", "8888889"], True, 0.0, ""),  # copied wrong: a model failure
        (["8888888"], True, 1.0, ""),  # the sum in its head, right: as good as a call
        (["8888"], True, 0.0, ""),  # in its head, wrong
        (["[1234567+x]"], True, 0.0, ""),  # a malformed call is a wrong answer, never an exception
        (["[" + "9" * 5000 + "+1]"], True, 0.0, ""),  # a hostile one too
        (["[99999999999999999999+99999999999999999999]"], False, None, "199999999999999999998"),  # large, exact
    ],
)
def test_steps_run_calls_and_score_the_final_answer(pool, turns, done, reward, observation):
    env = TooladdEnvironment(pool)
    env.reset(tooladd.make_prompt(1234567, 7654321))
    for turn in turns:
        result = env.step(turn, timeout_s=10)
    assert (result.done, result.reward, result.observation.text, result.infra_error) == (
        done,
        reward,
        observation,
        None,
    )


def _memorised_policy(tok, example, steps: int = 150):
    """A tiny Llama that has learnt one episode by heart, on the recipe's masked loss: it writes the call, and the
    final answer after the tool's (masked) answer."""
    torch.manual_seed(0)
    recipe = BaseRecipe(hidden_size=32, num_layers=1, intermediate_size=64, num_heads=2, max_position_embeddings=64)
    model = build_model(recipe, len(tok), tok)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = _answer_batch(tok, [example], torch.device("cpu"), tooladd.observation_spans)
    for _ in range(steps):
        nll = torch.nn.functional.cross_entropy(
            _logits(model, batch)[:, :-1].transpose(1, 2), batch.input_ids[:, 1:], reduction="none"
        )
        loss = (nll * batch.completion_mask).sum() / batch.completion_mask.sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@needs_root
def test_a_real_episode_calls_the_tool_and_its_answer_is_appended_and_masked(pool):
    from tasks.environments.runner import EpisodeRunner

    tok = build_char_tokenizer(TASK.characters)
    prompt = tooladd.make_prompt(1234567, 7654321)
    example = type(prompt)(
        prompt.prompt_id, prompt.task, prompt.text, tooladd.episode_text(1234567, 7654321, calls=True)
    )
    model = _memorised_policy(tok, example)
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, decode=tok.decode)
    runner = EpisodeRunner(
        EmbeddedEpisodes(engine, max_live=4),
        tok,
        TooladdEnvironment,
        pool,
        budget=EpisodeBudget(max_turns=3, max_tokens=40, step_timeout_s=10),
        sampling=SamplingParams(temperature=0.0, max_tokens=40),  # the runner adds the environment's stop string
    )
    (record,), stats = runner.run([prompt])
    assert runner.sampling.stop == ("]",)
    assert record.outcome == Outcome.SUCCESS and record.reward == 1.0
    call, answer = record.turns
    assert (call.action_text, call.finish_reason) == ("[1234567+7654321]", "stop")
    assert call.observation_text == "8888888;"
    assert call.observation_ids == tok("8888888;", add_special_tokens=False)["input_ids"]
    assert (answer.action_text, answer.finish_reason, answer.observation_ids) == ("8888888", "stop", [])
    assert record.token_ids == [*call.token_ids, *call.observation_ids, *answer.token_ids]
    assert answer.token_ids[-1] == tok.eos_token_id
    assert record.policy_mask == [True] * 17 + [False] * 8 + [True] * 8  # the call, the tool's answer, the sum + eos
    assert record.prompt_token_ids == tuple(tok(prompt.text)["input_ids"])
    assert stats.outcomes == {"success": 1}
