"""/docs and /redoc: the vendored Swagger UI and Redoc pages, served from static files (VENDORED.md)."""
