"""Communication schedules: the grammar (a string → `ScheduleSpec`), the presets as a registry (one class
each: parse, format, table), the per-module (b_n, s_n, a_n) table (`table.Schedule`) and spd:auto:K's
sensitivity rule (spd_auto).
"""
