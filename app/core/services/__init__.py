"""The job domain's operations, as functions the routes (and the worker, for its own part) call: jobs,
uploads and their checks, usage and quotas, work budgets, sources of models and data, the spec the server
accepts, timelines and job statistics."""
