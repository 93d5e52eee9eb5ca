"""The affinity pass: head↔neuron (and, per schedule, every edge's) scores measured on calibration text
(scoring; streamed feeds it one layer at a time), the edge scores (edges), the affinity file written
and read (file), the score names (names).
"""
