"""Communication schedules: the grammar (a string → `ScheduleSpec`), the presets as a registry (one class
each: parse, format, table) and the per-module (b_n, s_n, a_n) table (`table.Schedule`). spd:auto:K's
sensitivity rule, which evaluates a model, stands on a higher floor (models.evaluation.spd_auto).
"""
