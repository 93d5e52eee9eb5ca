"""A run from its spec: the job spec (jobspec; its fields' rules are models.base.fields), the run's plan made
once from the spec (plan) and the refusal rules the plan, the stages and the API's submit check share (rules),
the stage list (stage_names, stages), the stage bodies (pipeline), the runner the CLI and the worker share
(runner) and the files a run writes (files); progress reports and the stop signal are models.base.progress.
"""
