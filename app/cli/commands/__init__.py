"""The CLI's commands, one module per concern: optimise, eval and export, layout and score (affinity),
distill, generate, keys, serve and worker (service)."""
