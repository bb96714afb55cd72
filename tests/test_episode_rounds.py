"""Agentic rounds end to end: a user's environment module named in config (docs/environments.md's guess_env.py,
written out exactly as the page shows it) on a user's chat-template model (the chat example), through a real
campaign: its rows are episodes (the policy's ids as sampled, observations appended as ids and masked out of the
loss, every turn's span), it trains and evaluates as an agent, `trajectories show` prints an episode turn by turn, the
health report shows the engine's wait on environments, and a round replays bit for bit."""

import json
import os
import random
import re
import sys

import pytest
import torch

from flows.config import CampaignConfig
from storage.paths import StorageRoot
from storage.trajectories import NOT_SAMPLED, find_version, policy_mask, read_table, rows_of
from tasks.serving.engines import load_tokenizer

pytestmark = pytest.mark.slow

DOCS = os.path.join(os.path.dirname(__file__), "..", "docs", "environments.md")


def docs_module(name: str) -> str:
    """The python block of docs/environments.md whose first line is ``# <name>``."""
    with open(DOCS) as f:
        text = f.read()
    for block in re.findall(r"```python\n(.*?)```", text, flags=re.S):
        if block.startswith(f"# {name}\n"):
            return block
    raise AssertionError(f"docs/environments.md has no python block starting '# {name}'")


def guesses(path, count: int, seed: int) -> str:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            f.write(json.dumps({"prompt": "Guess my number.", "reference": str(rng.randint(1, 100))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def agent_campaign(prefect_harness, chat_policy_dir, tmp_path_factory) -> dict:
    from flows.campaign import rl_campaign

    home = tmp_path_factory.mktemp("agent-campaign")
    (home / "guess_env.py").write_text(docs_module("guess_env.py"))
    sys.path.insert(0, str(home))
    config = {
        "rounds": 2,
        "run_id": "agent",
        "round": {
            "policy": {"base_model": chat_policy_dir},
            "prompts": {"source": guesses(home / "guesses.jsonl", 64, 0), "task": "guess"},
            "environment": "guess_env:GuessEnvironment",
            "episode": {"budget": {"max_turns": 3, "max_tokens": 48}, "tools": {"sandboxes": 1}},
            "rollout": {"max_tokens": 16, "samples_per_prompt": 4},
            "train": {"groups_per_step": 2, "steps_per_round": 1, "learning_rate": 1e-3},
            "evaluate": {"source": guesses(home / "held_out.jsonl", 8, 1), "max_tokens": 16},
            "publish": {"model_name": "guess-agent"},
        },
    }
    storage = str(home / "data")
    try:
        result = rl_campaign(CampaignConfig.model_validate(config), storage=storage)
    finally:
        sys.path.remove(str(home))
    return {"storage": storage, "result": result, "config": config, "home": str(home)}


def _rows(campaign, index: int):
    root = StorageRoot.of(campaign["storage"])
    return rows_of(read_table(root, find_version(root, campaign["result"]["rounds"][index]["trajectory_version"])))


def _metrics(campaign, index: int) -> dict[str, float]:
    """What round ``index`` logged on its MLflow run."""
    from storage.model_versions import parse_model_version
    from storage.settings import settings
    from storage.tracking import Tracker

    tracker = Tracker.connect(settings(), StorageRoot.of(campaign["storage"]))
    version = tracker.model_version(*parse_model_version(campaign["result"]["rounds"][index]["model_version"]))
    return tracker.client.get_run(version.run_id).data.metrics


def test_rows_are_episodes_token_in_token_out(agent_campaign, chat_policy_dir):
    tokenizer = load_tokenizer(chat_policy_dir)
    rows = _rows(agent_campaign, 1) + _rows(agent_campaign, 2)
    assert rows and all(r.turns for r in rows)
    assert any(len(r.turns) > 1 for r in rows)  # the environment answered and the policy spoke again
    for row in rows:
        assert row.verifier["name"] == "guess_env:GuessEnvironment" and row.verifier["version"] == "1"
        assert row.prompt_text.startswith("<|im_start|>system\nGuess the number.")
        assert tokenizer.decode(row.prompt_token_ids) == row.prompt_text  # what the engine was fed
        ids, versions, logprobs = row.completion_token_ids, row.token_policy_versions, row.rollout_logprobs
        assert len(ids) == len(versions) == len(logprobs)
        at = 0
        for turn in row.turns:  # the spans tile the completion: policy tokens, then the observation's
            assert turn["start"] == at <= turn["policy_end"] <= turn["end"]
            policy = range(turn["start"], turn["policy_end"])
            observation = range(turn["policy_end"], turn["end"])
            assert all(versions[i] == row.round - 1 for i in policy)  # sampled by the round's parent
            assert all(versions[i] == NOT_SAMPLED and logprobs[i] == 0.0 for i in observation)
            if turn["end"] > turn["policy_end"]:  # appended as the ids its text encodes to, never re-tokenized
                appended = tokenizer(turn["observation_text"], add_special_tokens=False)["input_ids"]
                assert ids[turn["policy_end"] : turn["end"]] == appended
            at = turn["end"]
        assert at == len(ids)
        mask = policy_mask({"completion_token_ids": ids, "turns": row.turns})
        assert mask == [v != NOT_SAMPLED for v in versions]
        assert row.outcome in {"success", "model_failure"} and row.reward is not None
    assert any(r.kept for r in rows)


def test_the_campaign_trains_and_evaluates_as_an_agent(agent_campaign):
    rounds = agent_campaign["result"]["rounds"]
    for index in (1, 2):
        stats = _metrics(agent_campaign, index)
        assert stats["train/steps"] >= 1
        assert stats["rollout/groups_trainable"] >= 1
        assert stats["episodes/turns_mean"] > 1
        assert "episodes/engine_wait_s" in stats
        assert 0.0 <= rounds[index]["accuracy"] <= 1.0
        assert stats["eval/prompts"] == 8


def test_trajectories_show_prints_an_episode_turn_by_turn(agent_campaign, capsys):
    from flows.cli import main

    version = agent_campaign["result"]["rounds"][1]["trajectory_version"]
    assert main(["trajectories", "show", version, "--storage", agent_campaign["storage"], "--episodes", "2"]) == 0
    out = capsys.readouterr().out
    assert "rows are episodes" in out
    assert len(re.findall(r"^episode r1-g\d+/\d+", out, flags=re.M)) == 2
    assert re.search(r"^  turn 0  policy \d+ tokens", out, flags=re.M)
    assert re.search(r"observation \d+ tokens \(masked\)", out)


def test_the_health_report_shows_the_engine_wait_on_environments(agent_campaign):
    from tasks.round.report import health_report

    report = health_report("agent", 1, _metrics(agent_campaign, 1), None, None)
    assert "engine waiting on environments" in report


def test_observation_tokens_leave_the_loss(chat_policy_dir):
    """The update with observation tokens masked equals the update on the same rows whose observation tokens carry
    any other behaviour logprobs and advantages-irrelevant values: they are context, never a term of the loss."""
    from models.checkpoint import load_policy
    from tasks.config.train import TrainConfig
    from tasks.train.minibatches import TrainBatch
    from tasks.train.policy_update import train_policy

    def batch(observation_logprob: float) -> TrainBatch:
        return TrainBatch(
            prompt_ids=[[5, 6, 7], [5, 6, 8]],
            completion_ids=[[9, 10, 11, 12, 13], [9, 14, 15, 16, 17]],
            behaviour=[[-1.0, -1.2, observation_logprob, observation_logprob, -0.9], [-1.1, -2.0, -1.5, -0.7, -1.3]],
            advantages=[1.0, -1.0],
            policy_versions=[[0, 0, NOT_SAMPLED, NOT_SAMPLED, 0], [0, 0, 0, 0, 0]],
            top_p=[1.0, 1.0],
            policy_mask=[[True, True, False, False, True], [True] * 5],
        )

    grads = []
    for observation_logprob in (0.0, -7.5):
        model, tokenizer = load_policy(chat_policy_dir)
        torch.manual_seed(0)
        train_policy(
            model,
            tokenizer.pad_token_id,
            [batch(observation_logprob)],
            config=TrainConfig(learning_rate=1e-2, epochs=1),
            temperature=1.0,
            optimizer=None,
            current_version=0,
            recompute=False,
        )
        grads.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert torch.equal(grads[0], grads[1])


def test_a_round_of_the_agent_campaign_replays_bitwise(agent_campaign):
    from flows.config import ReplayRequest
    from flows.replay import rl_replay

    rounds = agent_campaign["result"]["rounds"]
    request = ReplayRequest(
        trajectories=rounds[2]["trajectory_version"],
        from_model=rounds[1]["model_version"],
        config=CampaignConfig.model_validate(agent_campaign["config"]).round,
        evaluate=False,
    )
    replay = rl_replay(request, storage=agent_campaign["storage"])
    original = StorageRoot.of(agent_campaign["storage"]).checkpoint("agent", 2)
    weights = "model.safetensors"
    with open(os.path.join(original, weights), "rb") as a, open(os.path.join(replay["checkpoint"], weights), "rb") as b:
        assert a.read() == b.read()


def test_an_agentic_round_killed_mid_round_resumes_without_playing_again(prefect_harness, chat_policy_dir, tmp_path):
    """`rlrounds run` killed (SIGKILL) right after round 1's filter committed its episodes, before its record: the
    resumed campaign keeps that trajectory version (the episodes are not played again) and finishes the round."""
    import yaml
    from test_resume import Campaign

    from storage.trajectories import committed_round_version

    (tmp_path / "guess_env.py").write_text(docs_module("guess_env.py"))
    config = {
        "rounds": 1,
        "run_id": "agent-crash",
        "round": {
            "policy": {"base_model": chat_policy_dir},
            "prompts": {"source": guesses(tmp_path / "guesses.jsonl", 32, 2), "task": "guess"},
            "environment": "guess_env:GuessEnvironment",
            "episode": {"budget": {"max_turns": 2, "max_tokens": 32}, "tools": {"sandboxes": 1}},
            "rollout": {"max_tokens": 12, "samples_per_prompt": 4},
            "train": {"groups_per_step": 2, "steps_per_round": 1},
            "evaluate": {"source": guesses(tmp_path / "held_out.jsonl", 4, 3), "max_tokens": 12},
            "publish": {"model_name": "guess-crash"},
        },
    }
    path = tmp_path / "agent.yaml"
    path.write_text(yaml.safe_dump(config))
    storage = str(tmp_path / "data")
    campaign = Campaign(storage)
    pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(tmp_path), pythonpath]))
    try:
        campaign.run("--config", str(path), crash_after="filter:1", expect_crash=True)
        root = StorageRoot.of(storage)
        before = committed_round_version(root, "agent-crash", 1)
        assert before is not None
        out, _ = campaign.run("--resume", "agent-crash", "--config", str(path))
    finally:
        if pythonpath is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = pythonpath
    assert "round 1:" in out and "resumed:" in out
    after = committed_round_version(root, "agent-crash", 1)
    assert after.version == before.version
    committed = read_table(root, after).to_pylist()
    assert all(r["turns"] for r in committed)
