"""Verification: turn a finished sample into a reward and an outcome.

    outcome.py        Outcome, Verdict, VerifierInfraError: what every verifier says (shared by all below)
    config.py         VerifyConfig: the verifier, its pool, the sandbox limits, the math deadline, the simulation
    registry.py       the verifiers a round can name, each with its version; get_verifier, rollout_verifier
    pool.py           VerifierPool: verification beside generation, retries, timeouts, the failure-rate gate
    addition.py       the built-in addition task (exact integer match)
    math.py           free-form final answers via math-verify, in killable worker processes
    sandbox.py        Python code against the reference's asserts, in a contained process
    longtail.py       the built-in long-tail (count-down) task (exact list match)
    simulated_env.py  SIMULATED remote-environment latency and outages in front of rollout's verifier

Nothing is imported here, so importing one module does not start the others.
"""
