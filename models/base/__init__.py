"""The ground floor of models/: small shared helpers that import nothing of models/ (docs/architecture.md),
so any package may use them. How long work reports progress and is asked to stop (progress), what one
declared field accepts and how a command line spells it (fields), a model's shape as a layout sees it
(shapes), and the layout file format's name and its error (layout_format).
"""
