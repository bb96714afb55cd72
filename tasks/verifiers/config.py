"""How finished samples are scored: the verifier, its pool, the limits each verifier runs under, and the
optional simulated environment in front of it."""

from __future__ import annotations

from pydantic import Field

from tasks.config_base import Config
from tasks.verifiers.sandbox import SandboxLimits
from tasks.verifiers.simulated_env import SimulatedEnvironmentConfig


class VerifyConfig(Config):
    """How finished samples are scored."""

    verifier: str | None = None
    """Verifier name; default: the prompts' task name (e.g. 'addition')."""
    workers: int = Field(2, ge=1, le=256)
    """Verifier threads, sized independently of the engine: scoring overlaps generation."""
    on_ray: bool = False
    """Run rollout's verifier calls as Ray tasks on the cluster the engines use (rollout.ray_address, or
    a local Ray): for verifiers that need more machines than the flow's. Each of the ``workers`` threads
    waits on one task at a time. Every node must be able to import this code."""
    max_infra_failure_rate: float = Field(0.2, ge=0.0, le=1.0)
    """A round whose share of infrastructure failures exceeds this fails loudly instead of training."""
    infra_retries: int = Field(2, ge=0, le=10)
    """Extra attempts for one sample after an infrastructure failure (sandbox did not start, worker
    died, verifier bug). Failures a verifier marks permanent (a bad reference) are not retried."""
    infra_retry_budget: int = Field(256, ge=0)
    """Recovery actions one round may spend: retries plus replacements of dead or stuck workers. When it
    is spent, further infrastructure failures are recorded at once, so a broken environment fails the
    round quickly instead of retrying every sample."""
    timeout_s: float = Field(60.0, gt=0.0, le=3600.0)
    """Seconds one verifier call may run before the pool records infra_failure and replaces its worker.
    Keep it above the verifier's own deadline (math_timeout_s; sandbox.wall_timeout_s), which decides
    whether slowness is the model's; this one only catches a verifier that never returns."""
    math_timeout_s: float = Field(5.0, gt=0.0, le=600.0)
    """The 'math' verifier's deadline for parsing and comparing one answer; past it the sample is an
    infra_failure (the verifier's slowness, not the model's)."""
    sandbox: SandboxLimits = SandboxLimits()
    """Resource limits of the 'python' verifier's sandbox, per sample."""
    simulated_environment: SimulatedEnvironmentConfig | None = None
    """SIMULATION (tasks/verifiers/simulated_env.py): rollout's verifier calls wait a seeded long-tailed
    delay and may fail, standing for a remote environment; no remote service is called. Held-out
    evaluation never goes through it. None: no simulated delay or failure."""
