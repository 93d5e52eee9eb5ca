"""Text for a run: calibration token blocks (calibration) and held-out evaluation text (heldout).
"""
