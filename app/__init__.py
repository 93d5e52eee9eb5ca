"""dtp-layout's service and tools by role: core (settings, db, storage, the job domain), api (the HTTP
routes), ui (the dashboard), cli (the `dtp-layout` command) and client (the torch-free HTTP client)."""
