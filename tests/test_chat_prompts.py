"""Users' own data and models: column mapping, chat prompts rendered by the base tokenizer's template, and
the stop conditions a model brings (several end-of-sequence ids, stop strings, a pad that is not EOS)."""

import json

import pytest
import torch

from flows.config import CampaignConfig
from models.builtin.tokenizer import build_char_tokenizer
from models.checkpoint import load_policy, stop_token_ids
from models.engines.embedded import EmbeddedEngine
from models.engines.types import GroupRequest, SamplingParams
from models.logprobs import pack_sequences, token_logprobs
from models.prompt import ChatTemplateError, Prompt, PromptEncodings, encode_prompt, prompt_encodings
from tasks.config.prompts import PromptsConfig
from tasks.prompts.sources import PromptError, load_prompt_file
from tasks.serving.engines import build_engine, load_tokenizer


def _jsonl(tmp_path, records, name="p.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_columns_are_mapped_and_a_dotted_path_reaches_a_nested_reference(tmp_path):
    path = _jsonl(tmp_path, [{"question": "2+2?", "answer": {"value": 4, "steps": "2+2"}}])
    config = PromptsConfig(source=path, task="math", prompt_column="question", reference_column="answer.value")
    [prompt] = load_prompt_file(path, "math", config)
    assert (prompt.text, prompt.reference, prompt.messages) == ("2+2?", "4", None)


@pytest.mark.parametrize(
    "columns, fragment",
    [
        # the prompt column is not there: the record's columns are listed
        ({"prompt_column": "problem"}, "has no 'problem' \\(the record holds 'question', 'answer'\\)"),
        # the nested path stops at a field that lacks the key: that field's keys are listed
        ({"prompt_column": "question", "reference_column": "answer.final"}, "answer holds 'value'"),
        # the default reference column in a file that names it otherwise: the setting to change
        ({"prompt_column": "question"}, "set prompts.reference_column"),
    ],
)
def test_a_missing_column_names_the_files_columns_and_the_setting(tmp_path, columns, fragment):
    path = _jsonl(tmp_path, [{"question": "2+2?", "answer": {"value": 4}}])
    with pytest.raises(PromptError, match=fragment):
        load_prompt_file(path, "math", PromptsConfig(source=path, task="math", **columns))


def test_messages_and_chat_template_prompts_become_turns(tmp_path):
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    path = _jsonl(tmp_path, [{"messages": chat, "reference": "4"}, {"messages": chat[1:], "reference": "4"}])
    config = PromptsConfig(source=path, task="math", chat_template=True, system_prompt="Answer.")
    own, added = load_prompt_file(path, "math", config)  # 'messages' is the default column without 'prompt'
    assert own.messages == (("system", "Be brief."), ("user", "2+2?"))  # its own system turn stays
    assert added.messages == (("system", "Answer."), ("user", "2+2?"))
    assert own.prompt_id != added.prompt_id and own.text == "2+2?"
    plain = _jsonl(tmp_path, [{"prompt": "2+2?", "reference": "4"}], "plain.jsonl")
    [as_chat] = load_prompt_file(plain, "math", PromptsConfig(source=plain, task="math", chat_template=True))
    assert as_chat.messages == (("user", "2+2?"),)
    [as_text] = load_prompt_file(plain, "math", PromptsConfig(source=plain, task="math"))
    assert as_text.messages is None and as_text.prompt_id == as_chat.prompt_id  # ids name data, not rendering


@pytest.mark.parametrize(
    "messages, fragment",
    [
        ([], "non-empty list of chat turns"),  # no turns
        ([{"role": "user"}], "not a \\{role, content\\} object"),  # a turn without content
        ("", "empty prompt"),  # an empty string prompt
    ],
)
def test_bad_chat_turns(tmp_path, messages, fragment):
    path = _jsonl(tmp_path, [{"prompt": messages, "reference": "4"}])
    with pytest.raises(PromptError, match=fragment):
        load_prompt_file(path, "math")


def test_chat_settings_are_checked_and_left_out_of_identity_at_their_defaults(tmp_path):
    with pytest.raises(ValueError, match="set prompts.chat_template: true"):
        PromptsConfig(source=str(tmp_path / "p.jsonl"), system_prompt="Be brief.")
    with pytest.raises(ValueError, match="chat_template: false, or prompts.source"):
        PromptsConfig(chat_template=True)
    identity = CampaignConfig().identity()["round"]
    assert "chat_template" not in identity["prompts"] and "stop" not in identity["rollout"]
    chat = CampaignConfig.model_validate({"round": {"rollout": {"stop": ["\n"]}}}).identity()["round"]
    assert chat["rollout"]["stop"] == ["\n"]


def test_rendered_chat_ids_decode_to_the_rendered_text(chat_policy_dir):
    tokenizer = load_tokenizer(chat_policy_dir)
    prompt = Prompt("p", "math", "2+2?", "4", (("system", "Answer."), ("user", "2+2?")))
    text, ids = encode_prompt(tokenizer, prompt)
    assert text == "<|im_start|>system\nAnswer.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.decode(ids) == text and len(ids) < len(text)  # subword tokens
    plain = Prompt("p", "math", "2+2?", "4")
    assert encode_prompt(tokenizer, plain) == ("2+2?", tuple(tokenizer("2+2?")["input_ids"]))
    with pytest.raises(ChatTemplateError, match="has no chat template; give its tokenizer_config.json"):
        encode_prompt(build_char_tokenizer(), prompt)


def test_encodings_are_remembered_per_tokenizer_and_bounded(chat_policy_dir):
    tokenizer = load_tokenizer(chat_policy_dir)
    chat = Prompt("c", "math", "2+2?", "4", (("system", "Answer."), ("user", "2+2?")))
    plain = [Prompt(f"p{i}", "math", f"{i}+{i}?", str(2 * i)) for i in range(4)]
    remembered = prompt_encodings(tokenizer)
    assert prompt_encodings(tokenizer) is remembered  # the next round finds this round's encodings
    assert prompt_encodings(load_tokenizer(chat_policy_dir)) is not remembered  # another tokenizer: its own
    for prompt in [chat, *plain, chat]:
        assert remembered(prompt) == encode_prompt(tokenizer, prompt)
    assert len(remembered) == 5

    calls = []

    class Counting:  # the tokenizer, counting its calls
        chat_template = None

        def __call__(self, text, **kwargs):
            calls.append(text)
            return tokenizer(text, **kwargs)

    lengths = [len(encode_prompt(tokenizer, p)[1]) for p in plain]
    bounded = PromptEncodings(Counting(), max_tokens=sum(lengths[:3]))
    for prompt in plain[:3]:
        bounded(prompt)
    bounded(plain[0])  # a hit: the most recent now, so the next eviction takes plain[1]
    bounded(plain[3])
    assert calls == [p.text for p in plain]
    bounded(plain[0]), bounded(plain[1])
    assert calls[4:] == [plain[1].text]  # plain[0] stayed, plain[1] was dropped and encoded again
    assert bounded._tokens <= bounded.max_tokens or len(bounded) == 1


def test_stop_ids_are_the_tokenizers_and_the_generation_configs(chat_policy_dir, tiny_policy_dir):
    tokenizer = load_tokenizer(chat_policy_dir)
    assert tokenizer.pad_token_id != tokenizer.eos_token_id
    assert stop_token_ids(chat_policy_dir, tokenizer) == tuple(sorted({tokenizer.eos_token_id, tokenizer.pad_token_id}))
    builtin = load_tokenizer(tiny_policy_dir)
    assert stop_token_ids(tiny_policy_dir, builtin) == (builtin.eos_token_id,)  # the built-in: one, as before


def test_the_engine_stops_at_any_stop_id_and_at_stop_strings(chat_policy_dir):
    tokenizer = load_tokenizer(chat_policy_dir)
    engine = build_engine("embedded", chat_policy_dir, dtype="float32", policy_version=0, device="cpu")
    prompt = Prompt("p", "math", "x", "4", (("user", "Tom has 3 apples and buys 4 more. How many apples?"),))
    ids = encode_prompt(tokenizer, prompt)[1]
    samples = list(engine.generate([GroupRequest("g", ids, 8, SamplingParams(1.0, 1.0, 16, 3))]))
    stops = set(stop_token_ids(chat_policy_dir, tokenizer))
    for s in samples:
        assert (s.finish_reason == "stop") == (s.token_ids[-1] in stops)
        assert not stops & set(s.token_ids[:-1])
    assert any(s.finish_reason == "stop" for s in samples)
    cut = list(engine.generate([GroupRequest("g", ids, 8, SamplingParams(1.0, 1.0, 16, 3, stop=(" answer",)))]))
    for s in cut:
        text = tokenizer.decode(s.token_ids)
        assert s.finish_reason == "length" or text.endswith(" answer") or s.token_ids[-1] in stops
        assert " answer" not in tokenizer.decode(s.token_ids[:-1])
    assert any(tokenizer.decode(s.token_ids).endswith(" answer") for s in cut)
    with pytest.raises(ValueError, match="no decode"):
        bare = EmbeddedEngine(engine.model, tokenizer.eos_token_id, tokenizer.pad_token_id)
        list(bare.generate([GroupRequest("g", ids, 1, SamplingParams(stop=("x",)))]))


def test_pad_is_never_scored_whatever_its_id(chat_policy_dir):
    """Training and logprobs mask by lengths, so a pad distinct from end-of-sequence changes nothing scored."""
    model, tokenizer = load_policy(chat_policy_dir)
    prompts, completions = [[5, 6, 7], [8]], [[9, tokenizer.eos_token_id], [10, 11, 12]]
    scored = []
    for pad in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        batch = pack_sequences(prompts, completions, pad)
        with torch.inference_mode():
            scored.append(token_logprobs(model, batch)[batch.completion_mask.bool()])
    assert torch.equal(*scored)
