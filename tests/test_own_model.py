"""The worked example of docs/own-model-and-data.md, end to end: a user's own model (a tiny Qwen2 with a
byte-level BPE tokenizer and a chat template, models/builtin/chat_example.py) and a JSONL of chat messages
with its reference in a nested field, through a real campaign on the embedded engine with the math verifier;
its rows hold what the engine saw, and a round replays bit for bit."""

import json
import os

import pytest

from flows.config import CampaignConfig
from models.builtin.chat_example import GSM_MINI, SYSTEM_PROMPT
from storage.paths import StorageRoot
from storage.trajectories import find_version, read_table, rows_of
from tasks.serving.engines import load_tokenizer

pytestmark = pytest.mark.slow


def chat_file(path) -> str:
    """gsm_mini as a user's chat set has it: a messages column, the answer nested under answer.value."""
    with open(GSM_MINI) as f:
        records = [json.loads(line) for line in f if line.strip()]
    path.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "system", "content": SYSTEM_PROMPT},
                        {"role": "user", "content": r["prompt"]},
                    ],
                    "answer": {"value": r["reference"]},
                }
            )
            + "\n"
            for r in records
        )
    )
    return str(path)


@pytest.fixture(scope="module")
def chat_campaign(prefect_harness, chat_policy_dir, tmp_path_factory) -> dict:
    from flows.campaign import rl_campaign

    home = tmp_path_factory.mktemp("chat-campaign")
    prompts = chat_file(home / "gsm_chat.jsonl")
    config = {
        "rounds": 2,
        "run_id": "chat",
        "round": {
            "policy": {"base_model": chat_policy_dir},
            "prompts": {"source": prompts, "task": "math", "reference_column": "answer.value"},
            "rollout": {"max_tokens": 12, "samples_per_prompt": 4},
            "train": {"groups_per_step": 2, "steps_per_round": 1, "learning_rate": 1e-3},
            "evaluate": {"source": prompts, "max_tokens": 12},
            "publish": {"model_name": "chat-policy"},
        },
    }
    storage = str(home / "data")
    result = rl_campaign(CampaignConfig.model_validate(config), storage=storage)
    return {"storage": storage, "result": result, "config": config}


def test_rows_hold_the_rendered_chat_and_its_ids(chat_campaign, chat_policy_dir):
    tokenizer = load_tokenizer(chat_policy_dir)
    root = StorageRoot.of(chat_campaign["storage"])
    rows = []
    for index in (1, 2):
        version = chat_campaign["result"]["rounds"][index]["trajectory_version"]
        rows += rows_of(read_table(root, find_version(root, version)))
    assert rows
    for row in rows:
        assert row.prompt_text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n")
        assert row.prompt_text.endswith("<|im_end|>\n<|im_start|>assistant\n")
        assert tokenizer.decode(row.prompt_token_ids) == row.prompt_text  # exactly what the engine was fed
        assert row.verifier["name"] == "math" and row.engine["name"] == "embedded"
        assert row.completion_text == tokenizer.decode(row.completion_token_ids, skip_special_tokens=True)
    assert {r.outcome for r in rows} <= {"success", "model_failure"}
    assert any(r.reward == 1.0 for r in rows)  # the model answers sometimes: RL has signal
    assert any(r.finish_reason == "stop" and r.completion_token_ids[-1] == tokenizer.eos_token_id for r in rows)


def test_a_round_of_the_chat_campaign_replays_bitwise(chat_campaign):
    from flows.config import ReplayRequest
    from flows.replay import rl_replay

    rounds = chat_campaign["result"]["rounds"]
    request = ReplayRequest(
        trajectories=rounds[2]["trajectory_version"],
        from_model=rounds[1]["model_version"],
        config=CampaignConfig.model_validate(chat_campaign["config"]).round,
        evaluate=False,
    )
    replay = rl_replay(request, storage=chat_campaign["storage"])
    original = StorageRoot.of(chat_campaign["storage"]).checkpoint("chat", 2)
    weights = "model.safetensors"
    with open(os.path.join(original, weights), "rb") as a, open(os.path.join(replay["checkpoint"], weights), "rb") as b:
        assert a.read() == b.read()
