"""Exporting a layout: the permuted checkpoint and per-rank shards with their manifest, written once tensor by
tensor from a layer source, resident or streamed (writer); the shards format, export dtype and reading shards
back (files); the permuted copy of a model in memory and its export (resident); what the export records
for a server, the serving manifest and shards/config.json (serving_manifest).
"""
