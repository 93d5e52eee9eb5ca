"""The layouts an optimise run builds and compares (its variants): optimised, the paper's ablations and the
baselines, each scored in both affinity units (set); saved layouts rescored on a saved affinity (score); and
calibration stability, each half's layout scored on the other half (stability). Above affinity and optimise,
which it drives; below run. Pure numpy.
"""
