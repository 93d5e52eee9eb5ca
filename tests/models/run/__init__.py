"""Tests of models/run: the run's plan from its spec and the refusal rules."""
