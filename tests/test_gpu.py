"""Stages on a CUDA device (``round.device``): the same rules as on the CPU, within the tolerance of the GPU's
kernels, and checkpoints that load on any device. Every test here is marked ``gpu`` and skips, saying why,
where torch sees no CUDA device (tests/conftest.py). One section per stage."""

from __future__ import annotations

import os

import pytest
import torch

from models.builtin.base_policy import build_base_policy
from models.builtin.recipe import BaseRecipe
from models.checkpoint import load_policy, load_state_dict, save_policy
from models.engines.embedded import EmbeddedEngine
from models.engines.greedy import greedy_completions
from models.engines.types import GroupRequest, SamplingParams
from models.logprobs import TokenBatch, pack_sequences, token_logprobs
from models.prompt import Prompt
from tasks.serving import engines

pytestmark = pytest.mark.gpu

PROMPTS = ["1+2=", "34+56=", "7+89=", "99+99=", "5+5="]


# -- the device's memory


def test_cached_memory_is_returned_to_the_gpu_before_an_engine_starts():
    """vLLM sizes itself from the GPU's free memory: what torch's allocator keeps cached must go back first."""
    from models.device import release_cached_memory

    block = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
    del block
    assert torch.cuda.memory_reserved() >= 64 << 20  # freed to torch's cache, not to the GPU
    release_cached_memory()
    assert torch.cuda.memory_reserved() < 64 << 20


# -- vLLM weights from memory


@pytest.fixture(scope="module")
def vllm_base(request, tmp_path_factory):
    """The built-in base checkpoint, and a small KV cache per engine (two engines share the GPU). Skips before
    building the base (which needs the whole project's packages) where vLLM is missing, as in the torch tier."""
    pytest.importorskip("vllm", reason="vLLM is not installed (on a GPU machine: benchmarks/gpu_check.sh)")
    seed_builtin_base = request.getfixturevalue("seed_builtin_base")
    saved = os.environ.get("RLROUNDS_VLLM_ARGS")
    os.environ["RLROUNDS_VLLM_ARGS"] = '{"kv_cache_memory_bytes": 268435456}'
    yield seed_builtin_base(str(tmp_path_factory.mktemp("gpu") / "data"))
    if saved is None:
        os.environ.pop("RLROUNDS_VLLM_ARGS", None)
    else:
        os.environ["RLROUNDS_VLLM_ARGS"] = saved


def _perturbed(base_dir: str, directory: str, device: str) -> dict[str, torch.Tensor]:
    """The base policy moved a little, saved to ``directory`` (its checkpoint) and returned as the
    trainer would hold it: parameter name -> tensor on ``device``."""
    from models.checkpoint import load_policy, save_policy

    model, tokenizer = load_policy(base_dir)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn_like(p))
    save_policy(model, tokenizer, directory)
    return {name: t.detach().to(device) for name, t in model.state_dict().items()}


def _greedy(engine, tokenizer) -> dict[str, tuple[list[int], list[float]]]:
    from models.engines.types import GroupRequest, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=6)
    groups = [GroupRequest(f"g{i}", tuple(tokenizer(p)["input_ids"]), 1, params) for i, p in enumerate(PROMPTS)]
    return {s.group_id: (s.token_ids, s.logprobs) for s in engine.generate(groups)}


def _assert_same(pushed, reloaded):
    assert {g: t for g, (t, _) in pushed.items()} == {g: t for g, (t, _) in reloaded.items()}
    for g, (_, logprobs) in pushed.items():
        assert torch.allclose(torch.tensor(logprobs), torch.tensor(reloaded[g][1]), atol=1e-5), g


@pytest.mark.vllm
def test_weights_pushed_by_cuda_ipc_serve_as_a_reload_of_their_checkpoint(vllm_base, tmp_path):
    """The in-process engine on the trainer's GPU: the state dict shared by CUDA IPC gives the same greedy
    tokens and logprobs as reloading the checkpoint it was saved to, and the engine was never restarted."""
    from tasks.serving.engines import make_engine
    from tasks.serving.live import takes_weights_from_memory

    engine, tokenizer = make_engine("vllm", vllm_base, dtype="float32", policy_version=0, max_batch=64)
    try:
        assert takes_weights_from_memory(engine)
        before = _greedy(engine, tokenizer)
        weights = _perturbed(vllm_base, str(tmp_path), "cuda:0")
        core = engine.llm.llm_engine.engine_core
        pause = engine.push_weights(weights, 1)
        pushed = _greedy(engine, tokenizer)
        assert 0.0 < pause < 60.0 and engine.llm.llm_engine.engine_core is core
        assert {g: t for g, (t, _) in pushed.items()} != {g: t for g, (t, _) in before.items()}

        engine.load_weights(vllm_base, 0)  # back to the base, then the perturbed checkpoint from disk
        engine.load_weights(str(tmp_path), 2)
        _assert_same(pushed, _greedy(engine, tokenizer))
    finally:
        engine.close()


@pytest.mark.vllm
def test_publish_serves_offered_weights_from_memory_and_reports_both_costs(vllm_base, tmp_path):
    """A live engine given weights offered for a checkpoint pushes them (no reload); without, it reloads."""
    from tasks.serving.live import LiveEngines

    with LiveEngines() as live:
        engine, tokenizer, _ = live.serve("vllm", vllm_base, dtype="float32", policy_version=0, max_batch=64)
        weights = _perturbed(vllm_base, str(tmp_path), "cuda:0")
        _, _, pause = live.serve("vllm", str(tmp_path), dtype="float32", policy_version=1, weights=weights)
        pushed = _greedy(engine, tokenizer)
        live.serve("vllm", vllm_base, dtype="float32", policy_version=0)
        _, _, reload_pause = live.serve("vllm", str(tmp_path), dtype="float32", policy_version=2)
        _assert_same(pushed, _greedy(engine, tokenizer))
        assert pause > 0.0 and reload_pause > 0.0


@pytest.mark.vllm
@pytest.mark.ray
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL from the trainer to a replica needs 2 CUDA devices")
def test_weights_broadcast_over_nccl_to_a_replica_serve_as_a_reload(vllm_base, tmp_path):
    """A vLLM replica (a Ray actor on GPU 0) takes the trainer's tensors (on the last GPU) over NCCL."""
    pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[ray]')")
    from tasks.serving.engines import Placement, make_engine
    from tasks.serving.live import takes_weights_from_memory

    last = f"cuda:{torch.cuda.device_count() - 1}"  # Ray hands out GPU 0 first: the trainer keeps its own
    engine, tokenizer = make_engine(
        "vllm",
        vllm_base,
        dtype="float32",
        policy_version=0,
        max_batch=64,
        placement=Placement(replicas=1, ray_address="local"),
    )
    try:
        assert takes_weights_from_memory(engine)
        weights = _perturbed(vllm_base, str(tmp_path), last)
        assert engine.push_weights(weights, 1) > 0.0
        pushed = _greedy(engine, tokenizer)
        engine.load_weights(str(tmp_path), 2)
        _assert_same(pushed, _greedy(engine, tokenizer))
    finally:
        engine.close()


def _requests(tokenizer, n: int, params: SamplingParams) -> list[GroupRequest]:
    return [GroupRequest(f"g{i}", tuple(tokenizer(p)["input_ids"]), n, params) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def on_cuda(tiny_policy_dir):
    return load_policy(tiny_policy_dir, device="cuda")


# -- the embedded engine ----------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["slots", "padded"])
def test_the_engine_on_cuda_reports_the_logprobs_the_trainer_computes(on_cuda, kv):
    """Behaviour logprobs under temperature and top-p equal a from-scratch trainer pass on the same device.
    The decode step and the full forward sum in different orders on a GPU, hence a tolerance above the CPU's."""
    model, tok = on_cuda
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=8, kv_cache=kv)  # forces refills
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8, seed=1)
    samples = list(engine.generate(_requests(tok, 3, params)))
    assert engine.device.type == "cuda" and len(samples) == 3 * len(PROMPTS)
    for s in samples:  # what callers get is plain Python, wherever the engine computes
        assert all(type(t) is int for t in s.token_ids) and all(type(x) is float for x in s.logprobs)
    packed = pack_sequences(
        [list(s.prompt_token_ids) for s in samples], [s.token_ids for s in samples], tok.pad_token_id
    )
    batch = TokenBatch(packed.input_ids.cuda(), packed.attention_mask.cuda(), packed.completion_mask.cuda())
    top_p = torch.full((len(samples),), 0.9, device="cuda")
    with torch.no_grad():
        trainer = token_logprobs(model, batch, temperature=0.7, top_p=top_p).cpu()  # [B, T-1]
    width = batch.input_ids.shape[1] - max(len(s.token_ids) for s in samples)
    for row, s in enumerate(samples):
        got = trainer[row, width - 1 : width - 1 + len(s.token_ids)]
        assert torch.allclose(got, torch.tensor(s.logprobs), atol=1e-3), (got, s.logprobs)


@pytest.mark.parametrize("kv", ["slots", "padded"])
def test_seeded_samples_on_cuda_are_reproducible(on_cuda, kv):
    model, tok = on_cuda
    params = SamplingParams(temperature=1.0, max_tokens=10, seed=7)
    runs = [
        [
            (s.group_id, s.sample_index, s.token_ids, s.logprobs)
            for s in EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, kv_cache=kv).generate(
                _requests(tok, 4, params)
            )
        ]
        for _ in range(2)
    ]
    assert sorted(runs[0]) == sorted(runs[1])


def test_speculative_samples_on_cuda_are_the_plain_ones(on_cuda):
    """Verification on the GPU (models/engines/speculative.py): the samples plain sampling gives, drafts accepted."""
    from models.engines.speculative import DraftIndex, Speculation

    model, tok = on_cuda
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, seed=4)
    plain = {
        (s.group_id, s.sample_index): s
        for s in EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=8).generate(
            _requests(tok, 4, params)
        )
    }
    index = DraftIndex(match=1)
    for s in plain.values():
        index.add(s.prompt_token_ids, s.token_ids, s.logprobs)
    engine = EmbeddedEngine(model, tok.eos_token_id, tok.pad_token_id, max_batch=8)
    assert engine.speculate(Speculation(index, k=4)) is None
    spec = {(s.group_id, s.sample_index): s for s in engine.generate(_requests(tok, 4, params))}
    assert engine.speculation_stats.accepted > 0 and engine.decode_steps > 0
    assert {k: s.token_ids for k, s in spec.items()} == {k: s.token_ids for k, s in plain.items()}
    for key, s in spec.items():
        assert s.logprobs == pytest.approx(plain[key].logprobs, abs=1e-3)


def test_new_weights_land_on_the_engines_device(tiny_policy_dir, tmp_path):
    engine = engines.build_engine("embedded", tiny_policy_dir, dtype="float32", policy_version=0, device="cuda")
    other, tok = load_policy(tiny_policy_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1)
    save_policy(other, tok, str(tmp_path))
    engine.load_weights(str(tmp_path), policy_version=1)
    state = engine.model.state_dict()
    assert all(t.device.type == "cuda" for t in state.values())
    assert all(torch.equal(state[k].cpu(), v) for k, v in load_state_dict(str(tmp_path)).items())


def test_greedy_answers_at_serving_precision_on_cuda(tiny_policy_dir):
    """Evaluation's path: the embedded engine at bfloat16 on the device, greedy, decoded to text."""
    engine, tok = engines.make_engine("embedded", tiny_policy_dir, dtype="bfloat16", policy_version=0, device="cuda")
    assert engine.info.dtype == "bfloat16" and engine.device.type == "cuda"
    prompts = [Prompt(f"p{i}", "addition", text, "0") for i, text in enumerate(PROMPTS)]
    answers = list(greedy_completions(engine, tok, prompts, max_tokens=6))
    assert len(answers) == len(PROMPTS) and all(isinstance(text, str) for _, text, _ in answers)


# -- checkpoints ------------------------------------------------------------------------------------


def test_a_checkpoint_saved_from_cuda_loads_on_the_cpu(on_cuda, tmp_path):
    model, tok = on_cuda
    save_policy(model, tok, str(tmp_path))
    assert all(p.device.type == "cuda" for p in model.parameters())  # saving did not move the model
    loaded, _ = load_policy(str(tmp_path))
    assert all(p.device.type == "cpu" for p in loaded.parameters())
    expected = {k: v.cpu() for k, v in model.state_dict().items()}
    assert all(torch.equal(expected[k], v) for k, v in loaded.state_dict().items())


# -- the base build ---------------------------------------------------------------------------------


def test_a_base_built_on_cuda_says_so_and_loads_on_the_cpu(tmp_path):
    recipe = BaseRecipe(max_steps=4, check_every=2, stop_at_accuracy=1.0)
    meta = build_base_policy(str(tmp_path), recipe, device="cuda")
    assert meta["trained_on"] == {"device": "cuda"} and meta["steps"] == 4
    model, _ = load_policy(str(tmp_path))
    assert all(p.device.type == "cpu" for p in model.parameters())


# -- the trainer ------------------------------------------------------------------------------------


def test_the_trainer_on_cuda_makes_the_cpu_update(tiny_policy_dir, tmp_path):
    """Three fp32 steps on the GPU land within GPU rounding of the CPU's three steps."""
    from tests.test_sharded_training import one_process, step_config, synthetic_rows, weight_gap

    _, tokenizer = load_policy(tiny_policy_dir)
    rows, config = synthetic_rows(tokenizer), step_config(precision="fp32")
    one_process(tiny_policy_dir, rows, config, str(tmp_path / "cpu"))
    one_process(tiny_policy_dir, rows, config, str(tmp_path / "cuda"), device="cuda")
    worst, mean = weight_gap(str(tmp_path / "cpu"), str(tmp_path / "cuda"))
    assert worst < 1e-4 and mean < 1e-6, (worst, mean)


def test_bf16_mixed_precision_learns(tiny_policy_dir, tmp_path):
    """bf16 autocast over fp32 weights raises the likelihood of the rewarded completions as fp32 does, and
    leaves fp32 weights behind."""
    from models.device import resolve_device
    from tests.test_sharded_training import one_process, step_config, synthetic_rows

    _, tokenizer = load_policy(tiny_policy_dir)
    rows = synthetic_rows(tokenizer)
    rewarded = [r for r in rows if r["advantage"] > 0]

    def mean_logprob(path: str) -> float:
        model = load_policy(path, device=resolve_device("cuda"))[0]
        batch = pack_sequences(
            [r["prompt_token_ids"] for r in rewarded], [r["completion_token_ids"] for r in rewarded], 0
        )
        batch = TokenBatch(*(t.to("cuda") for t in (batch.input_ids, batch.attention_mask, batch.completion_mask)))
        with torch.no_grad():
            logp = token_logprobs(model, batch)
        return float((logp * batch.completion_mask).sum() / batch.completion_mask.sum())

    out = str(tmp_path / "bf16")
    stats, _ = one_process(tiny_policy_dir, rows, step_config(precision="bf16", epochs=4), out, device="cuda")
    assert all(t.dtype == torch.float32 for t in load_state_dict(out).values())
    assert mean_logprob(out) > mean_logprob(tiny_policy_dir) + 0.05, stats


def test_two_gpu_workers_make_the_one_gpu_update(tiny_policy_dir, tmp_path):
    """FSDP2 over NCCL on 2 GPUs against one GPU, fp32: within GPU rounding after three steps."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 CUDA devices ({torch.cuda.device_count()} here)")
    from tests.test_sharded_training import one_process, step_config, synthetic_rows, two_workers, weight_gap

    _, tokenizer = load_policy(tiny_policy_dir)
    rows, config = synthetic_rows(tokenizer), step_config(precision="fp32")
    one_process(tiny_policy_dir, rows, config, str(tmp_path / "one"), device="cuda")
    two_workers(tiny_policy_dir, rows, config, str(tmp_path / "two"), device="cuda")
    worst, mean = weight_gap(str(tmp_path / "one"), str(tmp_path / "two"))
    assert worst < 1e-4 and mean < 1e-6, (worst, mean)
