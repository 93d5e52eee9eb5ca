"""Serving the exported shards in other engines.

`models.export.serving_manifest` (torch-free) says what the export records for a server: the full per-module
schedule table, the family, L, the layout's provenance, and the `config.json` of `shards/` that names the
DTP architecture. `models.serving.commands` (torch-free) words how to serve a job's shards, for its summary:
the client's download, then `dtp-layout vllm-serve` at TP = L. `models.serving.vllm` is the vLLM plugin: it
imports vLLM and is loaded only by vLLM (the `vllm.general_plugins` entry point); nothing else in the project
imports it.
`models.serving.exchange_ops` (torch alone) registers the overlapped exchange as custom ops that torch.compile
keeps opaque and CUDA graphs capture (torch.ops.dtp_layout.exchange_start / exchange_wait), for the plugin.
"""
