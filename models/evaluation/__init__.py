"""Evaluating a layout under DTP: the model resident (resident) or streamed layer by layer (streamed).
"""
