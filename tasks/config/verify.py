"""The verify section: the verifier, its pool, the limits each verifier runs under, and the optional
simulated environment in front of it."""

from __future__ import annotations

import math
import statistics

from pydantic import ConfigDict, Field, ValidationInfo, field_validator

from tasks.config.base import Config

KNOWN_VERIFIERS: dict[str, str] = {
    "addition": "the built-in addition task: exact integer match",
    "longtail": "the built-in count-down task: exact list match",
    "math": "free-form final answers, compared by math-verify",
    "python": "Python code run against the reference's asserts in a sandbox",
}
"""The verifiers a round can name, and what each checks. tasks/verifiers/registry.py builds them; a test
that registers a verifier of its own adds its name here too."""

_Z99 = statistics.NormalDist().inv_cdf(0.99)  # p99 of a lognormal is median * exp(sigma * z99)


class SandboxLimits(Config):
    """Resource limits for one sandboxed run. Worst-case memory of one sample is
    ``max_processes * memory_mib`` plus ``disk_mib``: size the verifier pool with that in mind."""

    model_config = ConfigDict(frozen=True)

    wall_timeout_s: float = 5.0
    """Seconds from launch until the whole sandbox is killed; the model's failure (it hung or slept)."""
    cpu_time_s: int = 5
    """RLIMIT_CPU of each process, whole seconds; a busy loop is killed (SIGKILL) when it runs out."""
    memory_mib: int = 256
    """RLIMIT_AS of each process, MiB of address space; allocations beyond it raise MemoryError."""
    max_processes: int = 8
    """RLIMIT_NPROC of the run's private uid: processes plus threads, so a fork bomb stops here."""
    max_open_files: int = 64
    """RLIMIT_NOFILE of each process."""
    max_output_bytes: int = 1 << 20
    """Bytes the program may write (stdout, stderr) before it is killed; only tails are kept."""
    disk_mib: int = 16
    """Size of the private tmpfs working directory, the only writable place."""
    python: str | None = None
    """Interpreter run inside the sandbox; None means this process's own base interpreter."""

    @field_validator(
        "wall_timeout_s",
        "cpu_time_s",
        "memory_mib",
        "max_processes",
        "max_open_files",
        "max_output_bytes",
        "disk_mib",
    )
    @classmethod
    def _in_range(cls, value: float, info: ValidationInfo) -> float:
        low, high, why = _RANGES[info.field_name or ""]
        if not low <= value <= high:
            raise ValueError(f"{info.field_name}={value} is out of range: {why}; set it between {low} and {high}")
        return value


_RANGES: dict[str, tuple[float, float, str]] = {
    "wall_timeout_s": (0.5, 600, "below 0.5 s the interpreter may not even start"),
    "cpu_time_s": (1, 600, "RLIMIT_CPU counts whole seconds"),
    "memory_mib": (64, 65536, "the Python interpreter alone maps about 30 MiB"),
    "max_processes": (1, 4096, "the program itself is one process"),
    "max_open_files": (16, 65536, "the interpreter opens a few files to start"),
    "max_output_bytes": (1024, 1 << 30, "error messages need a few KiB of output"),
    "disk_mib": (1, 65536, "the task file is written there first"),
}


class SimulatedEnvironmentConfig(Config):
    """SIMULATION of a remote environment's latency and outages around the verifier (no remote service is
    called)."""

    median_latency_s: float = Field(0.05, ge=0.0, le=60.0)
    """SIMULATION: median seconds a verifier call waits before scoring, standing for a remote round trip
    (lognormal). 0 disables the delay."""
    p99_over_median: float = Field(10.0, ge=1.0, le=1000.0)
    """SIMULATION: the latency tail, p99 / p50 of the lognormal (10: one call in a hundred waits at least
    ten times the median). 1 makes every call wait exactly the median."""
    infra_failure_rate: float = Field(0.0, ge=0.0, le=1.0)
    """SIMULATION: share of samples whose environment fails after its delay (outcome infra_failure, dropped
    from the loss, counted against verify.max_infra_failure_rate). 0: the simulated environment never fails."""
    seed: int = 0
    """SIMULATION: seeds the draws, together with the round's seed and the sample itself."""

    @property
    def sigma(self) -> float:
        """Standard deviation of log-latency that gives ``p99_over_median``."""
        return math.log(self.p99_over_median) / _Z99


class VerifyConfig(Config):
    """How finished samples are scored."""

    verifier: str | None = None
    """Verifier name; default: the prompts' task name (e.g. 'addition')."""
    workers: int = Field(2, ge=1, le=256)
    """Verifier threads, sized independently of the engine: scoring overlaps generation."""
    on_ray: bool = False
    """Run rollout's verifier calls as Ray tasks on the engines' cluster (rollout.ray_address, or a local Ray), for
    verifiers that need more machines than the flow's. Each of the workers threads waits on one task; every node
    must import this code."""
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
