"""The inferlet's session with its client.

``send`` streams text (or bytes) to the client that launched the inferlet
(the CLI prints it; a server client receives it); ``receive`` waits for the
client's next message.
"""

from __future__ import annotations

from . import _binding


def send(text: str) -> None:
    """Send text to the client.

    Raises:
        LimitError: the text is larger than the server's
            ``max_session_message_bytes`` (4 MiB by default, as UTF-8), or
            the server already keeps ``max_backlog_bytes`` of this user's
            output for clients that are not reading (detached or slow).
    """
    if not isinstance(text, str):
        raise TypeError(f"session.send takes a str, got {type(text).__name__}; use send_bytes for bytes")
    _binding.host().session_send(text)


def send_bytes(data: bytes) -> None:
    """Send bytes to the client.

    Raises:
        LimitError: as :func:`send`.
    """
    if not isinstance(data, (bytes, bytearray)):
        raise TypeError(f"session.send_bytes takes bytes, got {type(data).__name__}")
    _binding.host().session_send(bytes(data))


async def receive() -> str:
    """The client's next text message.

    Raises:
        EOFError: the client closed the session.
        TypeError: the next message is bytes (use receive_bytes).
    """
    msg = await _binding.wait(_binding.host().session_receive())
    if not isinstance(msg, str):
        raise TypeError("the next session message is bytes; use receive_bytes()")
    return msg


async def receive_bytes() -> bytes:
    """The client's next message as bytes (text is UTF-8 encoded)."""
    msg = await _binding.wait(_binding.host().session_receive())
    return msg.encode() if isinstance(msg, str) else msg
