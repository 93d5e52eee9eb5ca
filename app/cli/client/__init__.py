"""`dtp-layout client …`: the HTTP client's commands (commands), how they print a job, a list or a wait
(output), and scores for CI gates (scores)."""
