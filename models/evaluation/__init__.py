"""Evaluating a layout under DTP: dense and DTP perplexity and KL(dense ‖ DTP), one pass (evaluate) for a
model in memory or streamed layer by layer (the layer source feeds it: models.streaming.source); and
spd:auto:K's sensitivity rule, which evaluates the damage of dropped syncs to choose its layers (spd_auto).
"""
