"""The verifiers a round can name, each with the version recorded beside every reward it gives.

A verifier's module declares its ``VERSION`` (bumped when its rules change); a ``VerifierSpec`` ties
a name to that version and to how the verifier is built from ``VerifyConfig`` (the sandbox limits,
the math deadline). Importing this module is cheap: math-verify and the sandbox start on first use.

Rollout scores through ``rollout_verifier``: the same verifier, behind the simulated environment
(``simulated_env``, a simulation) when ``verify.simulated_environment`` is set; ``rollout_verifier_version``
then names both versions. Held-out evaluation uses ``get_verifier``, never the simulation.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from tasks.config.verify import VerifyConfig
from tasks.verifiers import addition, longtail, math, sandbox, simulated_env
from tasks.verifiers.on_ray import RayVerifier
from tasks.verifiers.outcome import Verifier


@dataclass(frozen=True)
class VerifierSpec:
    version: str
    build: Callable[[VerifyConfig], Verifier]
    """The verifier a round uses, configured by its ``verify`` section."""
    inline: bool = False
    """A pure function of the text that takes microseconds and cannot hang: rollout calls it on its own
    thread rather than through the pool's workers (``VerifierPool``'s ``inline``)."""


VERIFIERS: dict[str, VerifierSpec] = {
    "addition": VerifierSpec(addition.VERSION, lambda config: addition.verify_addition, inline=True),
    "math": VerifierSpec(math.VERSION, lambda config: math.shared_verifier(config.math_timeout_s)),
    "python": VerifierSpec(
        sandbox.VERSION, lambda config: functools.partial(sandbox.verify_python, limits=config.sandbox)
    ),
    "longtail": VerifierSpec(longtail.VERSION, lambda config: longtail.verify_longtail, inline=True),
}


def _spec(name: str) -> VerifierSpec:
    try:
        return VERIFIERS[name]
    except KeyError:
        known = ", ".join(sorted(VERIFIERS))
        raise ValueError(f"unknown verifier {name!r}; set verify.verifier to one of: {known}") from None


def get_verifier(name: str, config: VerifyConfig | None = None) -> Verifier:
    """The verifier called ``name``, configured by ``config`` (default: VerifyConfig's defaults)."""
    return _spec(name).build(config or VerifyConfig())


def verifier_version(name: str) -> str:
    return _spec(name).version


def rollout_verifier(name: str, config: VerifyConfig, round_seed: int) -> Verifier:
    """The verifier rollout scores with: ``get_verifier``'s (as Ray tasks with ``config.on_ray``), behind
    the simulated environment when ``config.simulated_environment`` is set (its draws depend on
    ``round_seed``)."""
    verifier = get_verifier(name, config)
    if config.on_ray:
        verifier = RayVerifier(verifier)
    return simulated_env.with_simulated_environment(verifier, config.simulated_environment, round_seed)


def scores_inline(name: str, config: VerifyConfig) -> bool:
    """Whether rollout calls the verifier on its own thread: only a verifier declared ``inline``, and
    never behind the simulated environment or on Ray, whose calls wait."""
    return _spec(name).inline and not config.on_ray and config.simulated_environment is None


def rollout_verifier_version(name: str, config: VerifyConfig) -> str:
    """The version recorded beside rollout's rewards: the verifier's, plus the simulation's when it is on."""
    version = verifier_version(name)
    if config.simulated_environment is None:
        return version
    return f"{version}+simulated-env-{simulated_env.VERSION}"
