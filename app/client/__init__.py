"""The HTTP client of the layout service (`dtp-layout client`, and scripts): `from app.client.http import
LayoutClient`.
"""

from app.client.http import ClientError, LayoutClient

__all__ = ["ClientError", "LayoutClient"]
