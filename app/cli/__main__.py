"""`python -m app.cli.main`."""

from app.cli.main import main

raise SystemExit(main())
