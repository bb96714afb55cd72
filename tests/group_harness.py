"""Trainer workers in processes of their own, joined by gloo on this machine: the worker group's training
(tasks/train_workers.py) without Ray, so the README's test command checks the sharded update."""

from __future__ import annotations

import os
import pickle
import socket
import tempfile

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, address: str, parent: dict, shares: list, job, out: str) -> None:
    import dataclasses

    from tasks.train_workers import TrainWorker

    worker = TrainWorker("cpu")
    worker.join(rank, world, address, timeout_s=120)
    try:
        result = worker.train(parent, dataclasses.replace(job, shares=shares[rank]))
    finally:
        worker.leave()
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)


def train_in_group(world: int, parent_dir: str, shares: list, job) -> list:
    """Each rank's ``WorkerResult`` after training ``shares`` (one list per rank) from ``parent_dir``."""
    from tasks.train_workers import read_files

    with tempfile.TemporaryDirectory() as out:
        address = f"127.0.0.1:{free_port()}"
        mp.spawn(_worker, args=(world, address, read_files(parent_dir), shares, job, out), nprocs=world, join=True)
        results = []
        for rank in range(world):
            with open(os.path.join(out, f"{rank}.pkl"), "rb") as f:
                results.append(pickle.load(f))
    return results
