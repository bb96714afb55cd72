"""The config of every stage, one module each, importing nothing heavier than pydantic.

    base.py      Config (unknown fields are errors; each field's docstring is its help), Dtype, field_help
    prompts.py   PromptsConfig        rollout.py   RolloutConfig      verify.py    VerifyConfig and its parts
    filter.py    FilterConfig         train.py     TrainConfig        publish.py   PublishConfig, promotion_line
    evaluate.py  EvaluateConfig       refilter.py  RefilterRequest, ReverifyRequest

flows/config.py composes them into RoundConfig and CampaignConfig. Keeping them apart from the stages
lets a config be validated, printed and rendered as a form without importing torch, pyarrow or a stage.
"""
