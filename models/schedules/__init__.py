"""Communication schedules: the grammar and the per-module (b_n, s_n, a_n) table (grammar) and
spd:auto:K's sensitivity rule (spd_auto).
"""
