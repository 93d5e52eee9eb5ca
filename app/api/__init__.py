"""The HTTP API (FastAPI): the app factory, routers, dependencies, middleware and error answers. Never imports
torch or worker/.
"""
