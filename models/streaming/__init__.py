"""Where a pass's weights come from: the layer source (source: a model resident in memory, or one read layer
by layer from safetensors, layer_source) and the two orders in which it feeds a pass (pipelines), chosen once
from the memory plan (memory_plan); hidden states spilled between layers (hidden_states) and safetensors
written tensor by tensor (safetensors_reader).
"""
