"""Environments for multi-turn (agentic) episodes: the policy calls tools, the environment answers, the reward
comes at the end (docs/environments.md).

    types.py       Environment, Observation, StepResult, ToolEnvironment, episode_outcome, load_environment
    tools.py       Tool from a plain function (JSON schema), rendering the tools, parsing a tool call
    tool_pool.py   ToolPool: warm sandboxes sized apart from the engine; what a call can end in
    tool_child.py  the template that runs inside each sandbox (sent as source)
    rendering.py   EpisodeFormat: the first prompt and each observation as tokens (the policy's stay as sampled)
    runner.py      EpisodeRunner: N episodes against an episode session, budgets, outcomes, engine wait
    calculator.py  the built-in calculator environment
    tooladd.py     the built-in tooladd environment: a compact call format a character-level policy can learn

Not wired into the rollout stage yet. Nothing is imported here, so importing one module does not start the others.
"""
