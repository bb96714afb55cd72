"""A SIMULATED remote environment: the latency and outages of a sandbox or remote verifier, without one.

Nothing here calls a remote service. When ``verify.simulated_environment`` is set, every verifier call
of rollout (``registry.rollout_verifier``) first waits a delay drawn from a lognormal distribution
(``time.sleep``; the verifier thread is idle, as it would be waiting on a remote call) and, with
probability ``infra_failure_rate``, then fails as the environment would (``VerifierInfraError``: outcome
``infra_failure``, never a zero reward). The real verifier scores everything else. It exists to give
benchmarks and the long-tail preset an environment whose latency has a tail (p99 / p50 about 10 by
default) and to exercise the failure taxonomy on demand.

Reproducible: a sample's delay and failure are a pure function of the environment seed, the round's
seed and the sample (its prompt's reference and its completion), so a rerun of a round meets the same
environment whatever the thread schedule. For the same reason a simulated failure is permanent for
that sample: it is raised as not retryable (another attempt would meet the same draw).

Held-out evaluation scores with the bare verifier: the simulation stands for the cost of the training
environment, and accuracy must not depend on simulated outages.

While it is on, rollout records ``<verifier version>+simulated-env-<VERSION>`` beside every reward, so
trajectories scored behind the simulation are told apart from those scored without it.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from tasks.config.verify import SimulatedEnvironmentConfig
from tasks.verifiers.outcome import Verdict, Verifier, VerifierInfraError

VERSION = "1"  # bump when the draws or their meaning change; recorded with every reward it stood in front of


@dataclass(frozen=True)
class EnvironmentDraw:
    latency_s: float
    fails: bool


def _uniforms(key: str) -> tuple[float, float]:
    """Two independent uniforms in (0, 1) from a hash of ``key``: no state, so no thread-order effects."""
    digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
    a, b = int.from_bytes(digest[:8], "little") >> 11, int.from_bytes(digest[8:], "little") >> 11
    return (a + 0.5) / 2**53, (b + 0.5) / 2**53


def draw(config: SimulatedEnvironmentConfig, key: str) -> EnvironmentDraw:
    """The environment one sample meets: its delay and whether it fails. ``key`` names the sample;
    callers that know a sample's identity (group, index) may pass it directly."""
    u_latency, u_failure = _uniforms(f"{config.seed}/{key}")
    z = statistics.NormalDist().inv_cdf(u_latency)
    return EnvironmentDraw(config.median_latency_s * math.exp(config.sigma * z), u_failure < config.infra_failure_rate)


def sample_key(round_seed: int, reference: str, completion_text: str) -> str:
    return f"{round_seed}/{reference}\x00{completion_text}"


class SimulatedEnvironment:
    """A verifier behind the simulated environment: wait, maybe fail, else score with ``verifier``."""

    def __init__(
        self,
        verifier: Verifier,
        config: SimulatedEnvironmentConfig,
        round_seed: int,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.verifier = verifier
        self.config = config
        self.round_seed = round_seed
        self._sleep = sleep

    def __call__(self, completion_text: str, reference: str) -> Verdict:
        env = draw(self.config, sample_key(self.round_seed, reference, completion_text))
        self._sleep(env.latency_s)
        if env.fails:
            raise VerifierInfraError(
                f"simulated environment failure after {env.latency_s:.3f}s "
                f"(verify.simulated_environment.infra_failure_rate={self.config.infra_failure_rate:g})",
                retryable=False,
            )
        return self.verifier(completion_text, reference)


def with_simulated_environment(
    verifier: Verifier, config: SimulatedEnvironmentConfig | None, round_seed: int
) -> Verifier:
    """``verifier`` itself when no simulation is configured, else the verifier behind it."""
    return verifier if config is None else SimulatedEnvironment(verifier, config, round_seed)
