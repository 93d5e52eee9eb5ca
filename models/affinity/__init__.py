"""The affinity pass: head↔neuron (and, per schedule, every edge's) scores measured on calibration text
(scoring: one pass, fed its layers by a layer source, resident or streamed),
the edge scores (edges: resident only), the affinity file written and read (file), the score names (names).
"""
