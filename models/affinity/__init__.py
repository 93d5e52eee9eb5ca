"""The affinity pass: head↔neuron (and, per schedule, every edge's) scores measured on calibration text
(scoring: one pass, fed its layers by a layer source, resident or streamed),
the edge scores (edges: resident only) and what their pass holds (edge_memory: torch-free, from the shape),
the affinity file written and read (file), the score names (names).
"""
