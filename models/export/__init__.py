"""Exporting a layout: the permuted checkpoint and per-rank shards with their manifest, written once tensor by
tensor from a layer source, resident or streamed (writer); the shards format, export dtype and reading shards
back (files); the names callers import for a permuted model (resident) and a checkpoint directory (streamed).
"""
