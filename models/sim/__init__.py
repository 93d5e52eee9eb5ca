"""The DTP simulator: the model run with each device's own residual stream and the others' partials
folded in per the schedule (dtp), the partial sums (partials) and the layout's permutation of weights
(permute).
"""
