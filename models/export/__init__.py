"""Exporting a layout: the permuted checkpoint and per-rank shards with their manifest, the model
resident (resident) or streamed layer by layer (streamed).
"""
