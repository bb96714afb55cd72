"""Verification as Ray tasks: the rollout's verifier calls run on the Ray cluster its engines use.

The verifier pool keeps its threads, retries, deadlines and failure taxonomy; each thread's call runs as
a Ray task and waits for it. Errors come back as what the verifier raised (Ray re-raises a task's
exception as a subclass of its type), so a ``VerifierInfraError`` stays infrastructure, with its
retryable flag. The simulated environment (tasks/verifiers/simulated_env.py) stays on the driver: it
stands for the remote call's latency, and its seeded draws must come from one sequence.
"""

from __future__ import annotations

from tasks.verifiers.outcome import Verdict, Verifier

TASK_CPUS = 0
"""Logical CPUs a verification task reserves: none. Verifiers mostly wait (a sandbox, a remote
environment), and the engine replicas hold the cluster's logical CPUs: tasks that reserved a share
would queue behind them for as long as the replicas live (a 2-CPU cluster with 2 replicas never ran
one). The pool's ``workers`` bounds how many run at once."""

_remote_call = None


def _remote():
    global _remote_call
    if _remote_call is None:
        import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

        @ray.remote(num_cpus=TASK_CPUS, max_retries=0)  # retries are the pool's, counted against its budget
        def call(verifier: Verifier, completion_text: str, reference: str) -> Verdict:
            return verifier(completion_text, reference)

        _remote_call = call
    return _remote_call


class RayVerifier:
    """A verifier whose calls run as Ray tasks (``ray.init`` must have run: tasks.serving.engines.connect_ray)."""

    def __init__(self, inner: Verifier) -> None:
        self.inner = inner

    def __call__(self, completion_text: str, reference: str) -> Verdict:
        import ray  # Ray only where engines or verifiers run on it: importing it takes seconds

        return ray.get(_remote().remote(self.inner, completion_text, reference))
