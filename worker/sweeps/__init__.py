"""The sweeper thread's sweeps (worker.tasks starts them): the object store's (store: stale multipart
uploads, objects no artifact row lists) and the owned bytes' (owned: expired uploads, local copies and
derived data nothing owns any more)."""
