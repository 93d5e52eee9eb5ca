"""`python -m models.runtime SHARDS_DIR (--prompt TEXT | --ids FILE.npy) ...` (see models.runtime.cli)."""

import sys

from models.runtime.cli import main

if __name__ == "__main__":  # the ranks' forkserver (or spawn) imports this module too: only the launcher runs
    sys.exit(main())
