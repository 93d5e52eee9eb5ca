"""Bounded-memory runs: layers read one at a time from safetensors (layer_source, safetensors_reader),
hidden states spilled between layers (hidden_states), and the memory plan that chooses resident or
streamed (memory_plan).
"""
