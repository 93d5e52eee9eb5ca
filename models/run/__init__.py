"""A run from its spec: the job spec and its fields (jobspec, fields), the run's plan made once from the spec
(plan) and the refusal rules the plan, the stages and the API's submit check share (rules), the stage list
(stage_names, stages), the stage bodies (pipeline), the runner the CLI and the worker share (runner), the files
a run writes (files) and its progress reports (progress).
"""
