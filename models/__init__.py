"""dtp-layout's math core: model families, layouts, permutation, the DTP simulator and export.

Pure PyTorch + transformers; imports nothing from `app` or `worker`.
"""
