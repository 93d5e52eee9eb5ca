"""Comparing layouts by distillation: every (layout, seed) run of a spec (compare), the curves' summary and
table (report) and the figure (plot)."""
