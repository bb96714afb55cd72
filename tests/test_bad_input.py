"""Bad input everywhere: each problem a user can fix ends `rlrounds run` in one line that names the input
and the fix (exit 2), before Prefect starts, with nothing written under the storage root."""

import json
import os
import socket

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from flows.cli import main


@pytest.fixture(autouse=True)
def _isolated(monkeypatch, tmp_path):
    monkeypatch.setenv("RLROUNDS_STORAGE", str(tmp_path / "unused"))  # the CLI exports it; restored afterwards
    monkeypatch.delenv("RLROUNDS_MLFLOW_URI", raising=False)


def run(capsys, tmp_path, config: dict | None, *args: str) -> tuple[int, str, str]:
    """Run `rlrounds run` in-process; returns (exit code, the error line, the storage root)."""
    storage = str(tmp_path / "data")
    argv = ["run", "--storage", storage, *args]
    if config is not None:
        path = tmp_path / "campaign.yaml"
        path.write_text(yaml.safe_dump(config))
        argv += ["--config", str(path)]
    code = main(argv)
    err = capsys.readouterr().err.strip()
    return code, err, storage


def assert_one_line(code: int, err: str, *fragments: str) -> None:
    assert code == 2, err
    assert err.startswith("error: ") and "\n" not in err and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def written(storage: str) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), storage) for d, _, files in os.walk(storage) for f in files)


def prompts_config(source: str, **round_fields) -> dict:
    return {"rounds": 1, "run_id": "bad", "round": {"prompts": {"source": source}, **round_fields}}


@pytest.mark.parametrize(
    "name, content, fragments",
    [
        (
            "broken.jsonl",
            '{"prompt": "1+1=", "reference": "2"}\n{"prompt": "2+2="\n',
            ["broken.jsonl:2: not valid JSON", "each line must be"],
        ),
        (
            "noref.jsonl",
            '{"prompt": "1+1="}\n',
            ["record 1 has no 'reference' (the record holds 'prompt')", "set prompts.reference_column"],
        ),
        (
            "blank.jsonl",
            '{"prompt": "  ", "reference": "2"}\n',
            ["record 1 has an empty prompt", "remove it or give it text"],
        ),
        ("empty.jsonl", "\n", ["holds no prompts", "add at least one record"]),
        (
            "latin1.jsonl",
            b'{"prompt": "\xe9", "reference": "1"}\n',
            ["cannot be read as UTF-8 JSON lines", "rewrite it"],
        ),
        ("garbage.parquet", b"PAR1 this is not parquet", ["cannot be read as a Parquet file", "rewrite it"]),
    ],
)
def test_malformed_or_empty_prompt_files(capsys, tmp_path, name, content, fragments):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, err, storage = run(capsys, tmp_path, prompts_config(str(path)))
    assert_one_line(code, err, str(path), *fragments)
    assert written(storage) == []


def test_empty_parquet_prompt_set(capsys, tmp_path):
    path = tmp_path / "none.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "reference": pa.array([], pa.string())}), path)
    code, err, storage = run(capsys, tmp_path, prompts_config(str(path)))
    assert_one_line(code, err, f"prompt file {path} holds no prompts")
    assert written(storage) == []


def test_missing_prompt_file(capsys, tmp_path):
    code, err, storage = run(capsys, tmp_path, prompts_config(str(tmp_path / "nowhere.jsonl")))
    assert_one_line(code, err, "nowhere.jsonl does not exist", "set prompts.source")
    assert written(storage) == []


def test_prompts_longer_than_the_model_context(capsys, tmp_path, tiny_policy_dir):
    path = tmp_path / "long.jsonl"
    path.write_text(
        json.dumps({"prompt": "1+1=", "reference": "2"})
        + "\n"
        + json.dumps({"id": "too-long", "prompt": "1" * 60 + "+1=", "reference": "2"})
        + "\n"
    )
    config = prompts_config(str(path), policy={"base_model": tiny_policy_dir}, evaluate={"source": str(path)})
    code, err, storage = run(capsys, tmp_path, config)
    assert_one_line(
        code,
        err,
        "prompt too-long",
        "64 tokens",
        "rollout.max_tokens=8 it needs 72 positions but the model has 64",
        "lower rollout.max_tokens",
    )
    assert written(storage) == []


def test_generation_budget_beyond_the_builtin_context(capsys, tmp_path):
    code, err, storage = run(capsys, tmp_path, {"rounds": 1, "round": {"rollout": {"max_tokens": 100}}})
    assert_one_line(code, err, "prompt add-99-99 of builtin:addition", "the model has 64")
    assert written(storage) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has the CUDA device the config asks for")
def test_a_cuda_device_on_a_machine_without_one(capsys, tmp_path):
    code, err, storage = run(capsys, tmp_path, {"rounds": 1, "round": {"device": "cuda"}})
    assert_one_line(code, err, "device 'cuda' asked for CUDA", "set device to 'auto' or 'cpu'")
    assert written(storage) == []


def test_checkpoint_directory_missing_files(capsys, tmp_path):
    base = tmp_path / "half-copied"
    base.mkdir()
    (base / "config.json").write_text('{"model_type": "llama"}')
    code, err, storage = run(capsys, tmp_path, {"rounds": 1, "round": {"policy": {"base_model": str(base)}}})
    assert_one_line(
        code,
        err,
        f"policy directory {base} is missing tokenizer_config.json, model weights",
        "point to a complete Hugging Face checkpoint",
    )
    assert written(storage) == []


def test_a_committed_checkpoint_that_lost_its_weights(tiny_policy_dir, tmp_path):
    """Mid-campaign (a resumed round loading its parent): the same one-line error type."""
    import shutil

    from flows.cli import _known_input_error
    from models.checkpoint import PolicyLoadError, load_policy

    broken = tmp_path / "checkpoint"
    shutil.copytree(tiny_policy_dir, broken)
    os.remove(broken / "model.safetensors")
    with pytest.raises(PolicyLoadError) as info:
        load_policy(str(broken))
    assert _known_input_error(info.value) == str(info.value)
    assert "missing model weights" in str(info.value)


def test_unreachable_mlflow(capsys, tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("RLROUNDS_MLFLOW_URI", f"http://127.0.0.1:{port}")
    code, err, storage = run(capsys, tmp_path, {"rounds": 1, "run_id": "bad"})
    assert_one_line(code, err, f"cannot reach MLflow at http://127.0.0.1:{port}", "set RLROUNDS_MLFLOW_URI")
    assert written(storage) == []


def test_resume_of_an_unknown_campaign(capsys, tmp_path):
    code, err, storage = run(capsys, tmp_path, None, "--resume", "ghost")
    assert_one_line(code, err, "no campaign 'ghost'", "rlrounds run --run-id ghost")
    assert written(storage) == []


def _started(storage: str, config: dict, pid: int | None = None) -> None:
    """A campaign started earlier (its owner: ``pid`` on this host, or a process that has exited)."""
    from flows.config import CampaignConfig
    from storage.campaigns import claim, process_started, release
    from storage.paths import StorageRoot

    c = CampaignConfig.model_validate(config)
    owner = claim(StorageRoot.of(storage), c.run_id, c.model_dump(mode="json"), c.identity(), "new")
    release(owner)
    record = json.load(open(StorageRoot.of(storage).campaign_file(c.run_id)))
    pid = pid or 2**22 + 17  # above the kernel's pid_max default: never a live process
    record["owner"].update(token="earlier", pid=pid, pid_started=process_started(pid))
    json.dump(record, open(StorageRoot.of(storage).campaign_file(c.run_id), "w"))


def test_starting_an_existing_run_id(capsys, tmp_path):
    config = {"rounds": 1, "run_id": "taken"}
    _started(str(tmp_path / "data"), config)
    code, err, storage = run(capsys, tmp_path, config)
    assert_one_line(code, err, "run id 'taken' already holds a campaign", "rlrounds run --resume taken")
    assert written(storage) == ["runs/taken/campaign.json"]


def test_resume_with_another_config(capsys, tmp_path):
    _started(str(tmp_path / "data"), {"rounds": 1, "run_id": "c1"})
    path = tmp_path / "other.yaml"
    path.write_text(yaml.safe_dump({"rounds": 3, "round": {"train": {"learning_rate": 0.001}}}))
    code, err, storage = run(capsys, tmp_path, None, "--resume", "c1", "--config", str(path))
    assert_one_line(code, err, "round.train.learning_rate: 0.0001 (stored) vs 0.001 (given)", "resume without --config")
    assert written(storage) == ["runs/c1/campaign.json"]


def test_resume_while_the_campaign_still_runs(capsys, tmp_path):
    _started(str(tmp_path / "data"), {"rounds": 1, "run_id": "live"}, pid=os.getppid())
    code, err, storage = run(capsys, tmp_path, None, "--resume", "live")
    assert_one_line(code, err, "campaign 'live' is still running as pid", "stop it before resuming")
    assert written(storage) == ["runs/live/campaign.json"]


def test_run_id_and_resume_together(capsys, tmp_path):
    code, err, storage = run(capsys, tmp_path, None, "--run-id", "a", "--resume", "b")
    assert_one_line(code, err, "pass only one of them")


def test_bad_config_value_names_the_field(capsys, tmp_path):
    code, err, storage = run(capsys, tmp_path, {"round": {"verify": {"infra_retries": -1}}})
    assert_one_line(code, err, "round.verify.infra_retries")


def test_keeping_fewer_samples_than_a_group_needs_is_refused(capsys, tmp_path):
    code, err, storage = run(capsys, tmp_path, {"round": {"filter": {"keep_samples": 2, "min_scored_per_group": 3}}})
    assert_one_line(code, err, "filter.keep_samples (2) is below filter.min_scored_per_group (3)")


def test_the_errors_the_cli_reports_in_one_line_are_classes_that_exist():
    """The CLI names them rather than importing them (flows/cli.py, KNOWN_INPUT_ERRORS): a rename must show."""
    import importlib

    from flows.cli import KNOWN_INPUT_ERRORS

    for name in KNOWN_INPUT_ERRORS:
        module, _, cls = name.rpartition(".")
        kind = getattr(importlib.import_module(module), cls)
        assert isinstance(kind, type) and issubclass(kind, Exception), name
        assert f"{kind.__module__}.{kind.__qualname__}" == name
