"""The GPU tier (``pytest -m gpu tests/test_gpu.py`` and benchmarks/gpu_tier.py) runs where only the project's
torch level is installed: torch, transformers, peft, safetensors, pyarrow, pytest, and pydantic's carried wheels,
as on a GPU machine that reaches no package registry (docs/testing.md, "The GPU tier").

Each test runs a fresh interpreter in which Prefect, MLflow, Ray, vLLM, s3fs, DuckDB, math-verify and boto3 cannot
be imported, so a module of the tier that starts to need one of them fails here, on the CPU, instead of on the
lent machine."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABSENT = ("prefect", "mlflow", "ray", "vllm", "s3fs", "duckdb", "math_verify", "boto3", "botocore", "moto")

PRELUDE = f"""
import sys

for name in {ABSENT!r}:  # None in sys.modules: importing fails, and probes for optional packages find nothing
    sys.modules[name] = None
sys.path.insert(0, {ROOT!r})
"""


def _run(code: str, timeout: int = 600) -> subprocess.CompletedProcess:
    script = PRELUDE + textwrap.dedent(code)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=os.environ
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_the_absent_packages_are_absent_in_the_check():
    """The check itself: an import of a package the tier lacks fails in its interpreter."""
    done = subprocess.run(
        [sys.executable, "-c", PRELUDE + "import mlflow"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode != 0 and "ModuleNotFoundError: import of mlflow halted" in done.stderr, done.stderr


def test_the_gpu_tests_collect_and_skip_without_the_whole_project():
    done = _run(
        """
        import pytest
        sys.exit(pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_gpu.py"]))
        """
    )
    assert "error" not in done.stdout.lower(), done.stdout
    assert "skipped" in done.stdout, done.stdout


def test_the_trainer_the_gpu_tests_drive_runs_without_the_whole_project(tmp_path):
    """tests/test_gpu.py's trainer tests call tests/test_sharded_training.one_process: on the CPU here."""
    _run(
        f"""
        import torch
        from models.builtin.base_policy import BaseRecipe, build_model
        from models.builtin.tokenizer import build_char_tokenizer
        from models.checkpoint import save_policy
        from tests.test_sharded_training import one_process, step_config, synthetic_rows

        torch.manual_seed(0)
        tokenizer = build_char_tokenizer()
        recipe = BaseRecipe(hidden_size=32, num_layers=2, intermediate_size=64, num_heads=2)
        save_policy(build_model(recipe, len(tokenizer), tokenizer), tokenizer, {str(tmp_path / "parent")!r})
        stats, _ = one_process(
            {str(tmp_path / "parent")!r}, synthetic_rows(tokenizer), step_config(), {str(tmp_path / "out")!r}
        )
        assert stats["train/steps"] == 3, stats
        """
    )
    assert os.path.exists(tmp_path / "out" / "optimizer.pt")


def test_the_gpu_benchmark_prints_its_table_without_the_whole_project(tmp_path):
    out = tmp_path / "figures.json"
    done = _run(
        f"""
        import runpy
        sys.argv = ["gpu_tier.py", "--shape", "tiny", "--device", "cpu", "--prompts", "3", "--samples", "2",
                    "--tokens", "12", "--json", {str(out)!r}]
        runpy.run_path("benchmarks/gpu_tier.py", run_name="__main__")
        """
    )
    figures = json.loads(out.read_text())
    assert figures["rows"] == 6 and figures["engine_tokens"] == 6 * 12
    assert figures["engine_tokens_per_s"] > 0
    for name in ("full", "lora"):
        train = figures["train"][name]
        assert train["tokens_per_s"] > 0 and train["peak_gib"] > 0
        # the engine serves at bfloat16, the trainer scores in float32: close, not equal
        assert 0.0 < train["mismatch_mean_abs"] < 0.05, train
    assert "| engine vs trainer logprob, mean abs gap |" in done.stdout
