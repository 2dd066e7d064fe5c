"""Host calls for grammar-constrained decoding (matchers that turn a grammar
state into a logit mask). Mixed into :class:`tartlet.host.api.HostApi`.
"""

from __future__ import annotations


class GrammarHostMixin:
    """Grammar matcher host calls."""
