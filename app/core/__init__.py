"""What the API and the worker share: settings, database, storage, queue, keys, budgets, model and data sources,
and the job domain. Imports neither app.api, app.ui nor app.cli.
"""
