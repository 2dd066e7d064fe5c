"""Python client of ``tartlet serve``: :class:`Client` (async)."""

from .client import Client, ExitInfo, RemoteInstance, TartletError

__all__ = ["Client", "ExitInfo", "RemoteInstance", "TartletError"]
