"""Verification: turn a finished sample into a reward and an outcome.

    outcome.py    Outcome, Verdict, VerifierInfraError: what every verifier says (shared by all below)
    config.py     VerifyConfig: the verifier, its pool, the sandbox limits and the math deadline
    registry.py   the verifiers a round can name, each with its version; get_verifier
    pool.py       VerifierPool: verification beside generation, retries, timeouts, the failure-rate gate
    addition.py   the built-in addition task (exact integer match)
    math.py       free-form final answers via math-verify, in killable worker processes
    sandbox.py    Python code against the reference's asserts, in a contained process

Nothing is imported here, so importing one module does not start the others.
"""
