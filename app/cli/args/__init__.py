"""The CLI's arguments: flags generated from the job spec (spec_flags), model and schedule arguments,
the checks made before any model loads (prechecks) and argparse's errors naming the closest flag (errors)."""
