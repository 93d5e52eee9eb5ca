"""The training probe (issue 45): choose a job's layout among K candidates by a short distillation of each.

At δ ≥ 2 the schedule objective J_σ does not rank layouts as they train (docs/schedules.md), so a job may
ask for a probe: K candidate layouts (candidates: the schedule's J_σ-optimised layout, the dtp:1-optimised
one, mixtures of the two objectives, optimiser restarts with other seeds), each distilled for S steps on the
calibration text by `models.distill.run.distill_run` (the one training loop), the lowest held-out KL winning
(probe). What it costs, in token passes and in seconds from a measured step, is said before it trains and
held under the job's budget (cost). Above distill and variants, which it drives; below run.
"""
