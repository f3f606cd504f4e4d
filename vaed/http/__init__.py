"""HTTP for the vaed server: one aiohttp stack in the server's asyncio loop (``server``)."""

from .server import HttpLimits, HttpServer

__all__ = ["HttpLimits", "HttpServer"]
