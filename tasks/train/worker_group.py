"""Sharded data-parallel training: ``train.workers`` trainer processes as Ray actors, one FSDP2 process group.

    with TrainerWorkers() as trainers:                       # a campaign's, passed to its train stages
        group = trainers.group(2, device="auto", ray_address=None)   # started once, reused by later rounds
        files, stats, memory = group.train(parent_dir, job, shares, reference_dir)   # every worker its share
    # leaving the block (the campaign's end, failure or kill) stops the group

The workers sit in a placement group (a GPU each on GPUs, a CPU each otherwise), join one
``torch.distributed`` process group (NCCL on CUDA, gloo on CPU) and shard the policy with FSDP2
(models/sharded.py). Each round they load the parent checkpoint, which the driver ships through Ray's
object store (no filesystem is shared between nodes), and run ``tasks.train.policy_update.train_policy`` on their
shares of every minibatch (``tasks.train.policy_update.sharded_minibatches``): whole groups, with the minibatch's totals
as the loss's denominators, so N workers make the update one would. Rank 0 gathers the weights into the
Hugging Face directory; every rank writes its shard of the optimizer state with DCP.

A worker that dies fails the round at once: the driver waits on every worker's call, and the first
that raises (a dead actor, or a collective that timed out after ``COLLECTIVE_TIMEOUT_S``) stops the
group and names the worker. Nothing was committed, so ``--resume`` trains the round again on a new group.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pickle
import socket
import tempfile
import threading
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from models.checkpoint import load_policy, load_tokenizer, save_policy, set_threads
from models.device import deterministic_kernels, distributed_backend, indexed, resolve_device, resolve_precision
from models.memory import ADAPTER_DIR, add_adapters, merged_policy, save_adapters, trainable_parameters
from models.sharded import (
    OPTIMIZER_DIR,
    OPTIMIZER_FILE,
    adapters_on_meta,
    empty_policy,
    full_weights,
    load_optimizer_shards,
    load_plain_optimizer,
    load_shards,
    resident_bytes,
    save_optimizer_shards,
    shard_policy,
)
from tasks.config.train import TrainConfig
from tasks.serving.engines import Placement, connect_ray
from tasks.train.policy_update import Collective, TrainBatch, schedule, train_policy

COLLECTIVE_TIMEOUT_S = 300
"""A collective that waits longer than this on a peer fails (a hung worker, not a dead one: Ray reports a
dead actor at once). A round's longest wait between collectives is one minibatch's forward pass."""
PLACEMENT_TIMEOUT_S = 120
"""How long the group's placement group may wait for its GPUs or CPUs before the round fails."""


class TrainWorkerError(RuntimeError):
    pass


@dataclass(kw_only=True)
class TrainJob:
    """One round's training, as every worker receives it (its own ``shares``)."""

    shares: list[TrainBatch]  # this worker's share of every minibatch
    config: TrainConfig
    temperature: float
    current_version: int
    recompute: list[bool]


@dataclass
class WorkerResult:
    rank: int
    stats: dict  # the round's figures (the same on every rank)
    memory: dict[str, int]  # this rank's resident parameter / gradient / optimizer-state bytes
    files: dict[str, bytes] = field(default_factory=dict)  # what this rank wrote of the checkpoint
    largest_read_bytes: int = 0  # the largest whole tensor it read while loading (its peak beyond its shards)
    reference_bytes: int | None = None  # its shards of the KL reference model; None: no reference was built


class GroupCollective(Collective):
    """Sums, maxima and gathers over the process group (on the device for NCCL, the CPU for gloo)."""

    def __init__(self, device: torch.device):
        self.world, self.rank, self.device = dist.get_world_size(), dist.get_rank(), device

    def _reduced(self, values: list[float], op) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=op)
        return tensor.tolist()

    def sum(self, values: list[float]) -> list[float]:
        return self._reduced(values, dist.ReduceOp.SUM)

    def max(self, values: list[float]) -> list[float]:
        return self._reduced(values, dist.ReduceOp.MAX)

    def gather(self, value: object) -> list:
        out: list = [None] * self.world
        dist.all_gather_object(out, value)
        return out


class TrainWorker:
    """One trainer process of a group: the actor body (wrapped with ``ray.remote`` by ``WorkerGroup``), or a
    plain object in a process of its own (the tests)."""

    def __init__(self, device: str = "cpu"):
        self.device = indexed(resolve_device(device))  # a Ray GPU actor is given plain 'cuda': its cuda:0
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        deterministic_kernels()
        self.collective: GroupCollective | None = None

    def where(self) -> dict:
        return {"host": socket.gethostname(), "pid": os.getpid(), "device": str(self.device)}

    def rendezvous(self) -> str:
        """host:port where rank 0 listens for the group (called on rank 0's worker)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"{node_address()}:{port}"

    def join(self, rank: int, world: int, address: str, timeout_s: float = COLLECTIVE_TIMEOUT_S) -> dict:
        dist.init_process_group(
            distributed_backend(self.device),
            init_method=f"tcp://{address}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=timeout_s),
        )
        self.collective = GroupCollective(self.device)
        return self.where()

    def train(self, parent: dict[str, bytes], job: TrainJob, reference: dict[str, bytes] | None = None) -> WorkerResult:
        """Train this rank's shares from the parent checkpoint's files; return what this rank wrote of the new
        checkpoint (rank 0: the Hugging Face directory and the optimizer metadata; every rank: its shard)."""
        assert self.collective is not None, "join the group first"
        rank, device = self.collective.rank, self.device
        precision = resolve_precision(job.config.precision, device)
        with tempfile.TemporaryDirectory(prefix="rlrounds-worker-") as tmp:
            parent_dir = write_files(os.path.join(tmp, "parent"), parent)
            tokenizer = load_tokenizer(parent_dir)
            # built on the meta device, sharded, then filled a tensor at a time: no rank holds the whole model
            model, lora, adapted, start = empty_policy(parent_dir), job.config.lora, None, None
            if lora is not None:  # fresh adapters each round (the same draw on every rank), as in one process
                adapted, start = adapters_on_meta(
                    model, rank=lora.rank, alpha=lora.alpha, target_modules=lora.target_modules, seed=job.config.seed
                )
                model = adapted.get_base_model()
            shard_policy(model, precision)
            largest = load_shards(model, parent_dir, device, start)
            optimizer = torch.optim.AdamW(trainable_parameters(model), lr=job.config.learning_rate)
            if adapted is not None:
                pass  # the parent's optimizer state is not the new adapters'
            elif os.path.isdir(os.path.join(parent_dir, OPTIMIZER_DIR)):
                load_optimizer_shards(model, optimizer, os.path.join(parent_dir, OPTIMIZER_DIR))
            elif os.path.exists(os.path.join(parent_dir, OPTIMIZER_FILE)):
                plain = torch.load(os.path.join(parent_dir, OPTIMIZER_FILE), weights_only=True, map_location="cpu")
                load_plain_optimizer(model, optimizer, plain)
            schedule(optimizer, job.config)
            ref_model = None
            if reference is not None and job.config.kl_coef > 0:  # the KL anchor, sharded as the policy is
                reference_dir = write_files(os.path.join(tmp, "reference"), reference)
                ref_model = shard_policy(empty_policy(reference_dir), precision)
                largest = max(largest, load_shards(ref_model, reference_dir, device))
            optimizer, stats = train_policy(
                model,
                tokenizer.pad_token_id,
                job.shares,
                config=job.config,
                temperature=job.temperature,
                optimizer=optimizer,
                current_version=job.current_version,
                recompute=job.recompute,
                ref_model=ref_model,
                device=device,
                precision=precision,
                collective=self.collective,
            )
            memory = resident_bytes(model, optimizer)
            out = os.path.join(tmp, "out")
            weights = full_weights(model)
            kept = os.path.join(out, ADAPTER_DIR) if adapted is not None else out  # LoRA: beside the adapters
            save_optimizer_shards(model, optimizer, os.path.join(kept, OPTIMIZER_DIR))
            if rank == 0:  # the whole policy, saved from the CPU like a one-process round's
                whole, _ = load_policy(parent_dir)
                if adapted is None:
                    whole.load_state_dict(weights)
                else:
                    whole = add_adapters(
                        whole, rank=lora.rank, alpha=lora.alpha, target_modules=lora.target_modules, seed=0
                    )
                    whole.get_base_model().load_state_dict(weights)
                    save_adapters(whole, kept)
                    whole = merged_policy(whole)
                save_policy(whole, tokenizer, out)
            reference_bytes = None if ref_model is None else resident_bytes(ref_model)["parameters"]
            return WorkerResult(rank, stats, memory, read_files(out), largest, reference_bytes)

    def leave(self, wait_for_peers: bool = True) -> None:
        """Leave the process group, by default once every rank has finished (a barrier): rank 0 works on after
        the last collective (it saves the whole policy), and a rank that tore its gloo connections down
        meanwhile was seen to abort ("terminate called without an active exception", SIGABRT)."""
        if dist.is_initialized():
            if wait_for_peers:
                dist.barrier()
            dist.destroy_process_group()


def train_in_processes(
    world: int,
    parent_dir: str,
    shares: list[list[TrainBatch]],
    job: TrainJob,
    device: str = "cpu",
    reference_dir: str | None = None,
) -> list[WorkerResult]:
    """A group of ``world`` workers as processes of this machine, without Ray: on its CPUs (gloo), or with
    ``device`` 'cuda' on its first ``world`` GPUs (NCCL). Each rank's ``WorkerResult`` after training its
    ``shares`` from ``parent_dir`` (with ``reference_dir`` as the KL reference). For tests and benchmarks;
    campaigns use ``WorkerGroup``."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    with tempfile.TemporaryDirectory(prefix="rlrounds-group-") as out:
        parent, reference = read_files(parent_dir), read_files(reference_dir) if reference_dir else None
        return spawn_ranks(_process_worker, (world, address, parent, shares, job, out, device, reference), world, out)


def spawn_ranks(fn, args: tuple, world: int, out: str) -> list:
    """``fn(rank, *args)`` in ``world`` processes, each writing what it returns to ``out/{rank}.pkl`` before it
    leaves its process group; the ranks' results in rank order. gloo's teardown after the last barrier was seen to
    abort a rank ("terminate called without an active exception", SIGABRT) once its work was done: with every
    rank's result written, that abort is not a failure."""
    try:
        mp.spawn(fn, args=args, nprocs=world, join=True)
    except mp.ProcessExitedException as e:
        if e.signal_name != "SIGABRT" or not all(os.path.exists(os.path.join(out, f"{r}.pkl")) for r in range(world)):
            raise
    results = []
    for rank in range(world):
        with open(os.path.join(out, f"{rank}.pkl"), "rb") as f:
            results.append(pickle.load(f))
    return results


def _process_worker(
    rank: int,
    world: int,
    address: str,
    parent: dict,
    shares: list,
    job: TrainJob,
    out: str,
    device: str,
    reference: dict | None,
) -> None:
    set_threads(max(1, (os.cpu_count() or 1) // world))  # the machine's cores shared out, as Ray shares them
    worker = TrainWorker(f"cuda:{rank}" if device == "cuda" else "cpu")
    worker.join(rank, world, address, timeout_s=COLLECTIVE_TIMEOUT_S)
    try:
        result = worker.train(parent, dataclasses.replace(job, shares=shares[rank]), reference)
    except BaseException:
        worker.leave(wait_for_peers=False)  # a peer may be gone: no barrier
        raise
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:  # before the teardown (spawn_ranks)
        pickle.dump(result, f)
    worker.leave()


def node_address() -> str:
    """This node's address as the cluster reaches it (Ray's view when in a Ray worker)."""
    try:
        import ray  # Ray only where the worker group runs on it: importing it takes seconds

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def read_files(directory: str) -> dict[str, bytes]:
    """Every file under ``directory``, by relative path."""
    out = {}
    for folder, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(folder, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, directory)] = f.read()
    return out


def write_files(directory: str, files: dict[str, bytes]) -> str:
    for name, data in files.items():
        path = os.path.join(directory, name)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
    return directory


class WorkerGroup:
    """``workers`` ``TrainWorker`` actors in one placement group, joined into one process group."""

    def __init__(self, workers: int, device: str, ray_address: str | None):
        import ray  # Ray only where the worker group runs on it: importing it takes seconds

        connect_ray(Placement(workers, ray_address))
        gpus = ray.cluster_resources().get("GPU", 0)
        self.on_gpu = device.startswith("cuda") or (device == "auto" and gpus >= workers)
        bundle = {"GPU": 1.0, "CPU": 1.0} if self.on_gpu else {"CPU": 1.0}
        self.group = ray.util.placement_group([bundle] * workers, strategy="PACK")
        try:
            ray.get(self.group.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self.group)
            raise TrainWorkerError(
                f"train.workers {workers}: Ray could not place {workers} workers of {bundle} within "
                f"{PLACEMENT_TIMEOUT_S} s (free: {ray.available_resources()}); lower train.workers or "
                "rollout.replicas, or add nodes to the cluster"
            ) from None
        actor = ray.remote(TrainWorker)
        self.actors = [
            actor.options(
                num_cpus=bundle["CPU"],
                num_gpus=bundle.get("GPU", 0),
                scheduling_strategy=ray.util.scheduling_strategies.PlacementGroupSchedulingStrategy(
                    self.group, placement_group_bundle_index=i
                ),
            ).remote("cuda" if self.on_gpu else "cpu")  # Ray shows a GPU actor its GPU alone, as cuda:0
            for i in range(workers)
        ]
        self.places: list[dict] = [{"rank": i} for i in range(workers)]
        address = self._wait([self.actors[0].rendezvous.remote()], "start")[0]
        self.places = self._wait([a.join.remote(i, workers, address) for i, a in enumerate(self.actors)], "join")
        self.key = (workers, device, ray_address)
        self.rounds = 0  # rounds this group has trained

    @property
    def workers(self) -> int:
        return len(self.actors)

    def train(self, parent_dir: str, job: TrainJob, shares: list[list[TrainBatch]], reference_dir: str | None):
        """Train a round on every worker; returns (the checkpoint's files, stats, each rank's resident bytes)."""
        import ray  # Ray only where the worker group runs on it: importing it takes seconds

        parent = ray.put(read_files(parent_dir))  # fetched once per node, not once per worker
        reference = ray.put(read_files(reference_dir)) if reference_dir else None
        calls = [
            a.train.remote(parent, dataclasses.replace(job, shares=s), reference) for a, s in zip(self.actors, shares)
        ]
        results: list[WorkerResult] = self._wait(calls, "train")
        files = {name: data for r in results for name, data in r.files.items()}
        self.rounds += 1
        stats = {**results[0].stats, "train/group_rounds": self.rounds}  # 1 when this round started the group
        return files, stats, [r.memory for r in results]

    def _wait(self, calls: list, what: str) -> list:
        """Every call's result, in call order; the first to fail stops the group and names its worker."""
        import ray  # Ray only where the worker group runs on it: importing it takes seconds

        rank_of = {call: i for i, call in enumerate(calls)}
        pending = list(calls)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except ray.exceptions.RayError as exc:  # a dead actor, a collective that timed out, an error in training
                rank = rank_of[done[0]]
                place = self.places[rank] if rank < len(self.places) else {}
                where = f" on {place['host']} (pid {place['pid']})" if "host" in place else ""
                workers = len(self.actors)
                self.close()
                reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise TrainWorkerError(
                    f"trainer worker {rank} of {workers}{where} failed during {what}: {reason[:300]}. "
                    "The group was stopped and nothing was committed; `rlrounds run --resume RUN_ID` trains the "
                    "round again on a new group"
                ) from None
        return ray.get(calls)

    def close(self) -> None:
        import ray  # Ray only where the worker group runs on it: importing it takes seconds

        for actor in getattr(self, "actors", []):
            with contextlib.suppress(Exception):
                ray.kill(actor)
        self.actors = []
        with contextlib.suppress(Exception):
            ray.util.remove_placement_group(self.group)


class TrainerWorkers:
    """The trainer's worker group a campaign keeps across its rounds: opened by the flow that owns it, passed to the
    train stage, closed (its actors and placement group stopped) when that flow ends, however it ends.

    It holds at most one group: a group of another shape is stopped before a new one starts, since its workers hold
    the devices the new one needs. ``__slots__``: a Prefect task records it as a placeholder, never walks into it."""

    __slots__ = ("_lock", "_group")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._group: WorkerGroup | None = None

    def __enter__(self) -> TrainerWorkers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def group(self, workers: int, device: str, ray_address: str | None) -> WorkerGroup:
        """The live group of this shape (one whose workers all still run), or a new one."""
        with self._lock:
            live = self._group
            if live is not None and live.key == (workers, device, ray_address) and live.actors:
                return live
            self._group = None
        if live is not None:
            live.close()
        group = WorkerGroup(workers, device, ray_address)
        with self._lock:
            self._group = group
        return group

    def close(self) -> None:
        with self._lock:
            group, self._group = self._group, None
        if group is not None:
            group.close()
