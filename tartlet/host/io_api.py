"""Host calls for I/O beyond the client session: messaging between
inferlets, the key-value store, HTTP, and child inferlets.

Mixed into :class:`tartlet.host.api.HostApi`.
"""

from __future__ import annotations


class IoHostMixin:
    """I/O host calls (see the server issue)."""
