"""Engine replicas as Ray actors, seen as one ``RolloutEngine`` (models/engines/types.py).

    router = ReplicaRouter.start(build, replicas=2, cpus_per_replica=1)
    for sample in router.generate(groups): ...       # finish order, across replicas
    router.load_weights(checkpoint_dir, version)     # every replica, in place

``build`` is a picklable zero-argument callable that makes one engine (embedded or vLLM) inside the
actor. The router keeps each group on one replica, chosen by a hash of its prompt tokens, so the
samples of a group (and any later group with the same prompt) share that replica's prefix cache.
Groups are pulled from the caller lazily, as replicas have room, so a rollout that stops feeding
stops starting work here too. Samples stream back from each replica as they finish (a Ray streaming
generator per call), so verification overlaps generation exactly as with a local engine.

Partial rollouts: ``generate(groups, should_stop)`` polls ``should_stop`` while it waits on the
replicas; once it is True, groups not yet sent come back as unstarted partial samples, and every
replica is told to stop that call's samples (a ``stop`` call in the actor's own "control"
concurrency group, so it runs while ``stream`` is busy), which then stream back partial.

Multi-turn episodes run on the replicas too: each replica actor holds one local episode session
(``open_episodes``, ``episode_step``, ``episode_end``), driven by ``ReplicaEpisodes`` (models/engines/sessions.py),
which keeps every turn of an episode on the replica that ran its first.

Checkpoint directories passed to ``load_weights`` must be readable by every replica's node: local
paths on a one-machine cluster, a shared filesystem otherwise. New weights load between calls only:
a replica set takes no ``update`` in flight (overlap mode runs one engine in the rollout's process).

vLLM replicas on GPUs also take weights from memory (``push_weights``): this process, holding the
trainer's tensors on its GPU, is rank 0 of one NCCL group with every replica's workers (replica ``i``'s
tensor-parallel workers after those of replicas before it), set up at the first push by vLLM's trainer
engine (``NCCLTrainerWeightTransferEngine``: a ``StatelessProcessGroup`` rendezvous on a free port of this
node, then a ``PyNcclCommunicator``), and each update is one broadcast per tensor, received by all
replicas at once. NCCL refuses two ranks on one GPU: when a replica sees the trainer's GPU (compared by UUID),
the replicas read the checkpoint instead.
"""

from __future__ import annotations

import hashlib
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from models.checkpoint import set_threads
from models.engines.episodes import EpisodeSession, EpisodeStart, PolicyTurn, SessionStats
from models.engines.types import (
    EngineInfo,
    GeneratedSample,
    GroupRequest,
    RolloutEngine,
    UpdateKV,
    WeightUpdate,
    unstarted,
)
from models.engines.vllm_engine import VLLMEngine

FLUSH_SAMPLES = 64  # a replica sends finished samples back in batches of at most this many ...
FLUSH_SECONDS = 0.05  # ... or after this long, whichever comes first
START_TIMEOUT_S = 900  # a vLLM replica on a busy CPU takes minutes to start; pending forever is an error
STOP_POLL_S = 0.02  # how often the router asks should_stop while it waits on the replicas
CONTROL = "control"  # the actor concurrency group of stop(): it must not queue behind stream()


class EngineReplica:
    """The actor body: one engine, driven by the router. Wrapped with ``ray.remote`` at start."""

    def __init__(self, build: Callable[[], RolloutEngine], threads: int):
        set_threads(threads)  # Ray's OMP_NUM_THREADS already gives an actor its CPUs: usually nothing to do
        self.engine = build()
        self._stopped: set[str] = set()  # generation ids whose samples must stop
        self._lock = threading.Lock()
        self.episodes: EpisodeSession | None = None  # open_episodes
        self.replica = 0

    def describe(self) -> tuple[EngineInfo, int]:
        return self.engine.info, self.engine.policy_version

    def decode_steps(self) -> int:
        """Called in the control group, so it answers while stream() is busy."""
        return self.engine.decode_steps

    def stop(self, generation: str) -> None:
        """Stop the samples of every call of ``generation``; runs in the control group, beside stream()."""
        with self._lock:
            self._stopped.add(generation)

    def stream(self, groups: list[GroupRequest], generation: str = "") -> Iterator[list[GeneratedSample]]:
        """Generate ``groups``; yield finished samples in small batches as they finish (partial ones
        once ``stop(generation)`` was called)."""
        batch: list[GeneratedSample] = []
        last = time.monotonic()

        def should_stop() -> bool:
            with self._lock:
                return generation in self._stopped

        pulled = 0

        def feed() -> Iterator[GroupRequest]:
            nonlocal pulled
            for group in groups:
                pulled += 1
                yield group

        for sample in self.engine.generate(feed(), should_stop):
            batch.append(sample)
            if len(batch) >= FLUSH_SAMPLES or time.monotonic() - last >= FLUSH_SECONDS:
                yield batch
                batch, last = [], time.monotonic()
        now = time.time()  # groups the engine never pulled (stopped first) are handed back, not dropped
        batch.extend(unstarted(g, i, now) for g in groups[pulled:] for i in g.sample_indices())
        if batch:
            yield batch

    def load_weights(self, checkpoint_dir: str, policy_version: int) -> float:
        return self.engine.load_weights(checkpoint_dir, policy_version)

    def nccl_workers(self) -> int:
        """Workers this replica puts in an NCCL weight-transfer group: its tensor-parallel workers when
        it is a vLLM engine on GPUs, else 0 (it takes checkpoints only)."""
        engine = self.engine
        return engine.tensor_parallel_size if isinstance(engine, VLLMEngine) and engine.transfer == "nccl" else 0

    def gpu_uuids(self) -> list[str]:
        """The GPUs this replica sees (``gpu_uuids``)."""
        return gpu_uuids()

    def weight_sync(self, call: str, payload: dict | None = None) -> None:
        assert isinstance(self.engine, VLLMEngine), "weight_sync is asked only of replicas with nccl_workers"
        self.engine.weight_sync(call, payload)

    # -- an episode session on this replica (models/engines/sessions.py drives it) --------------------

    def open_episodes(self, open_session: OpenSession, replica: int, max_live: int, keep_kv: bool) -> bool:
        """Open this replica's episode session with ``open_session`` (the router's: it picks the session for this
        replica's engine); its turns are labelled ``replica``. Returns whether it keeps KV between turns."""
        self.episodes = open_session(self.engine, max_live=max_live, keep_kv=keep_kv)
        self.replica = replica
        return self.episodes.keeps_kv

    def episode_step(self, commands: list[EpisodeStart | EpisodeExtend]) -> tuple[list[PolicyTurn], bool, SessionStats]:
        """Queue ``commands`` in order, run one step of the session; the turns that ended, whether it is still
        busy, and its stats so far."""
        session = self._session()
        for command in commands:
            if isinstance(command, EpisodeStart):
                session.start(command)
            else:
                session.extend(command.episode_id, command.observation_token_ids, max_tokens=command.max_tokens)
        turns = session.step() if session.busy else []
        for turn in turns:
            turn.replica = self.replica
        return turns, session.busy, session.stats

    def episode_end(self, episode_id: str) -> None:
        self._session().end(episode_id)

    def _session(self) -> EpisodeSession:
        if self.episodes is None:
            raise RuntimeError("this replica has no episode session: the router calls open_episodes first")
        return self.episodes

    def close(self) -> None:
        self.engine.close()


@dataclass(frozen=True)
class EpisodeExtend:
    """An episode's next turn, sent to its replica: ``EpisodeSession.extend``'s arguments."""

    episode_id: str
    observation_token_ids: tuple[int, ...]
    max_tokens: int | None = None


OpenSession = Callable[..., EpisodeSession]
"""What opens a replica's local session: ``open_session(engine, *, max_live, keep_kv)`` of models/engines/sessions.py,
passed in by the router (that module imports this one, so this one does not import it back)."""


class ReplicaSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` over a replica set: each call fans out to every replica and waits
    for all. At init each replica is told its own rank offset in the NCCL group (vLLM's trainer engine
    assumes one engine, whose workers start at rank 1); at finish, the version being served."""

    def __init__(self, actors: list[Any], workers: list[int]):
        self.actors = actors
        self.offsets = rank_offsets(workers)
        self.version: str | None = None  # set before each send: the policy version the update serves

    def _all(self, call: str, payloads: list[dict | None]) -> None:
        import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

        ray.get([a.weight_sync.remote(call, p) for a, p in zip(self.actors, payloads)])

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        base = init_info["rank_offset"]
        self._all("init_weight_transfer_engine", [{**init_info, "rank_offset": base + o} for o in self.offsets])

    def start_weight_update(self) -> None:
        self._all("start_weight_update", [None] * len(self.actors))

    def update_weights(self, update_info: Any) -> None:
        self._all("update_weights", [update_info] * len(self.actors))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish_weight_update", [{"weight_version": weight_version or self.version}] * len(self.actors))


def rank_offsets(workers: list[int]) -> list[int]:
    """Each replica's first rank after the trainer's, in an NCCL group of the trainer and every replica's
    ``workers`` (tensor-parallel workers, in replica order): [2, 2] -> [0, 2]."""
    offsets, total = [], 0
    for n in workers:
        offsets.append(total)
        total += n
    return offsets


def gpu_uuids() -> list[str]:
    """The UUIDs of the GPUs this process sees (none without CUDA): the same GPU has the same UUID in every
    process, whatever index ``CUDA_VISIBLE_DEVICES`` gives it there."""
    if not torch.cuda.is_available():
        return []
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(torch.cuda.device_count())]


def shares_a_gpu(trainer: list[str], replicas: list[list[str]]) -> bool:
    """Whether the trainer's GPU is one a replica sees. Ray hands its GPUs out from the first, and from Ray 2.60 an
    actor without GPUs keeps the ``CUDA_VISIBLE_DEVICES`` of its node, so a replica can hold the GPU this process
    trains on; NCCL refuses two ranks of one group on one GPU, so the weights then go through the checkpoint."""
    return bool(set(trainer) & {uuid for seen in replicas for uuid in seen})


def replica_for(prompt_token_ids: tuple[int, ...], replicas: int) -> int:
    """Stable prompt -> replica assignment (Python's hash() is salted per process; this is not)."""
    digest = hashlib.blake2b(repr(tuple(prompt_token_ids)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % replicas


class ReplicaRouter(RolloutEngine):
    """N engine actors seen as one engine: prompt-affinity routing, finish-order results.

    ``generate`` keeps up to ``calls_per_replica`` calls of ``groups_per_call`` groups on each
    replica, and pulls more groups only when a replica has room for another call."""

    def __init__(self, actors: list[Any], groups_per_call: int, calls_per_replica: int = 2):
        import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

        self.actors = actors
        self.groups_per_call = max(1, groups_per_call)
        self.calls_per_replica = max(1, calls_per_replica)
        try:
            described = ray.get([a.describe.remote() for a in actors], timeout=START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise RuntimeError(
                f"{len(actors)} engine replicas did not start within {START_TIMEOUT_S} s; the Ray cluster "
                f"has {ray.available_resources()} free: lower rollout.replicas or add nodes"
            ) from None
        self.info: EngineInfo = described[0][0]
        self.policy_version: int = described[0][1]
        self.routed = [0] * len(actors)  # groups sent to each replica (over this router's life)
        self._nccl_workers: list[int] | None = None  # per replica, asked once (weights_from_memory)
        self._replica_gpus: list[list[str]] | None = None  # the GPUs each replica sees, asked once
        self._source = StateSource()  # what push_weights sends: the latest weights handed to it
        self._sender: Any = None  # vLLM's NCCL trainer engine, made at the first push
        self._client: ReplicaSyncClient | None = None

    @classmethod
    def start(
        cls,
        build: Callable[[], RolloutEngine],
        replicas: int,
        cpus_per_replica: float = 1.0,
        gpus_per_replica: float = 0.0,
        groups_per_call: int = 64,
    ) -> ReplicaRouter:
        """Start ``replicas`` actors on the connected Ray cluster (``ray.init`` must have run)."""
        import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

        # The default group stays one thread (one call drives the engine at a time); stop() has its own.
        actor_class = ray.remote(num_cpus=cpus_per_replica, num_gpus=gpus_per_replica, concurrency_groups={CONTROL: 1})(
            EngineReplica
        )
        threads = max(1, int(cpus_per_replica))
        return cls([actor_class.remote(build, threads) for _ in range(replicas)], groups_per_call)

    @property
    def replicas(self) -> int:
        return len(self.actors)

    @property
    def decode_steps(self) -> int:
        """Every replica's decode steps, summed: each replica steps on its own."""
        import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

        return sum(ray.get([a.decode_steps.options(concurrency_group=CONTROL).remote() for a in self.actors]))

    def generate(
        self,
        groups: Iterable[GroupRequest],
        should_stop: Callable[[], bool] | None = None,
        update: WeightUpdate | None = None,
    ) -> Iterator[GeneratedSample]:
        if update is not None:
            raise ValueError(
                "a replica set loads new weights between calls only; weight updates in flight (mode "
                "'overlap') need one engine in this process: set rollout.replicas 1 and no ray_address"
            )
        import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

        feed = iter(groups)
        queues: list[deque[GroupRequest]] = [deque() for _ in self.actors]
        calls = [0] * len(self.actors)
        streams: dict[Any, int] = {}  # Ray streaming generator -> replica
        exhausted = False
        generation = uuid.uuid4().hex
        stopping = False

        def wants_more(r: int) -> bool:
            return calls[r] < self.calls_per_replica and len(queues[r]) < self.groups_per_call

        try:
            while True:
                # Groups are routed by prompt, so filling one idle replica may queue groups for others;
                # the buffer cap bounds how far ahead of the engines the caller's feed is read.
                cap = self.groups_per_call * len(self.actors)
                while (
                    not exhausted
                    and sum(map(len, queues)) < cap
                    and any(wants_more(r) for r in range(len(self.actors)))
                ):
                    group = next(feed, None)
                    if group is None:
                        exhausted = True
                        break
                    queues[replica_for(group.prompt_token_ids, len(self.actors))].append(group)
                for r, queue in enumerate(queues):
                    while queue and calls[r] < self.calls_per_replica:
                        chunk = [queue.popleft() for _ in range(min(self.groups_per_call, len(queue)))]
                        streams[self.actors[r].stream.remote(chunk, generation)] = r
                        calls[r] += 1
                        self.routed[r] += len(chunk)
                if not streams:
                    return
                if not stopping and should_stop is not None and should_stop():
                    stopping = exhausted = True
                    now = time.time()
                    for queue in queues:  # pulled but never sent: back as unstarted partial samples
                        while queue:
                            group = queue.popleft()
                            yield from (unstarted(group, i, now) for i in group.sample_indices())
                    ray.get([a.stop.options(concurrency_group=CONTROL).remote(generation) for a in self.actors])
                ready, _ = ray.wait(
                    list(streams), num_returns=1, timeout=None if should_stop is None or stopping else STOP_POLL_S
                )
                for stream in ready:
                    try:
                        batch = ray.get(next(stream))
                    except StopIteration:
                        calls[streams.pop(stream)] -= 1
                        continue
                    yield from batch
        finally:  # the caller stopped early: stop the calls still running rather than finish them unread
            for stream in streams:
                try:
                    ray.cancel(stream)
                except Exception:  # noqa: BLE001 -- already finished, or not cancellable: it just runs out
                    pass

    def load_weights(self, checkpoint_dir: str, policy_version: int) -> float:
        """Every replica loads the weights in place, concurrently; the pause is the longest one."""
        import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

        pauses = ray.get([a.load_weights.remote(checkpoint_dir, policy_version) for a in self.actors])
        self.policy_version = policy_version
        return max(pauses)

    @property
    def weights_from_memory(self) -> bool:
        """True when every replica is a vLLM engine on GPUs and this process has a GPU to send from that no replica
        holds (``shares_a_gpu``); else new weights are read from the checkpoint."""
        import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

        if self._nccl_workers is None:
            self._nccl_workers = ray.get([a.nccl_workers.remote() for a in self.actors])
        if not all(self._nccl_workers) or not torch.cuda.is_available():
            return False
        if self._replica_gpus is None:
            self._replica_gpus = ray.get([a.gpu_uuids.remote() for a in self.actors])
        trainer = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        return not shares_a_gpu([trainer], self._replica_gpus)

    def push_weights(self, weights: Mapping[str, torch.Tensor], policy_version: int) -> float:
        """Broadcast ``weights`` (names -> this process's CUDA tensors, all on one GPU, unchanged until
        this returns) to every replica over NCCL and serve them as ``policy_version``. The group is set
        up at the first push (module doc); returns the seconds the replicas were paused."""
        if not self.weights_from_memory:
            raise RuntimeError("these replicas take checkpoints only (not vLLM on GPUs); use load_weights")
        self._source.weights = weights
        if self._sender is None:
            import ray  # Ray and vLLM only where vLLM replicas take weights from memory
            from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
            from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo
            from vllm.utils.network_utils import get_open_port

            torch.cuda.set_device(next(iter(weights.values())).device)  # rank 0's communicator lives there
            assert self._nccl_workers is not None  # set by weights_from_memory
            self._client = ReplicaSyncClient(self.actors, self._nccl_workers)
            init = NCCLTrainerInitInfo(
                master_address=ray.util.get_node_ip_address(),
                master_port=get_open_port(),
                world_size=1 + sum(self._nccl_workers),
                rank=0,
            )
            self._sender = WeightTransferTrainerFactory.trainer_init(init, client=self._client, source=self._source)
        assert self._client is not None
        paused = time.perf_counter()
        self._client.version = str(policy_version)
        self._sender.send_weights()
        self.policy_version = policy_version
        return time.perf_counter() - paused

    def configure(self, max_batch: int, update_kv: UpdateKV) -> None:
        """Nothing changes: the replicas keep the batch they were started with (each call is sized
        from it at start), and ``update_kv`` matters only to weight updates in flight, which a
        replica set does not take."""

    def close(self) -> None:
        import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

        try:
            if self._sender is not None:
                self._sender.shutdown()
            ray.get([a.close.remote() for a in self.actors], timeout=60)
        finally:
            for actor in self.actors:
                ray.kill(actor)


class StateSource:
    """The weights vLLM's NCCL trainer engine sends (a ``WeightSource`` in its terms, which it reads
    through ``metadata()`` and iteration only): it keeps the source it was made with and reads it afresh
    at each send, so ``push_weights`` replaces ``weights`` before every send."""

    def __init__(self) -> None:
        self.weights: Mapping[str, torch.Tensor] = {}

    def metadata(self) -> list:
        from vllm.distributed.weight_transfer import ParamMeta  # vLLM only where its replicas take weights

        return [ParamMeta(name, t.dtype, tuple(t.shape)) for name, t in self.weights.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self.weights.items()
