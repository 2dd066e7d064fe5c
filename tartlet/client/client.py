"""Async Python client of ``tartlet serve`` (the WebSocket protocol of
:mod:`tartlet.protocol`).

::

    async with await Client.connect("http://127.0.0.1:8080", key=KEY) as c:
        inst = await c.launch("text-completion", {"prompt": "Hi"})
        async for text in inst.output():
            print(text, end="")
        exit = await inst.wait()          # ExitInfo(status, result, error)

``launch`` takes an installed/bundled name or a local path (a ``.py`` file
or an inferlet folder): a path is uploaded once, content-hashed, and later
launches send only the hash.
"""

from __future__ import annotations

import asyncio
import base64
import builtins
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from ..protocol import program_hash

#: Bytes of one piece of an adapter upload (base64: 4/3 of it in one frame).
ADAPTER_CHUNK_BYTES = 4 * 2**20
#: File suffixes uploaded from an inferlet folder.
UPLOAD_SUFFIXES = {".py", ".toml", ".json", ".txt", ".md"}


class TartletError(Exception):
    """An error reply from the server: ``code`` (protocol code) and message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


@dataclass
class ExitInfo:
    """How an instance ended: ``status`` (finished, failed, aborted),
    ``result`` (main's return value), ``error``."""

    status: str
    result: Any = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == "finished"


def ws_url(url: str) -> str:
    """``http://h:p`` / ``ws://h:p`` / ``h:p`` -> ``ws://h:p/ws``."""
    if "://" not in url:
        url = "ws://" + url
    scheme, rest = url.split("://", 1)
    scheme = {"http": "ws", "https": "wss"}.get(scheme, scheme)
    rest = rest.rstrip("/")
    if not rest.endswith("/ws"):
        rest += "/ws"
    return f"{scheme}://{rest}"


def collect_files(path: Path) -> dict[str, str]:
    """The files to upload for a program: a ``.py`` file becomes
    ``main.py``; a folder gives its text files (``__pycache__`` and dot
    files skipped).

    Raises:
        FileNotFoundError / ValueError: nothing to upload.
    """
    path = Path(path)
    if path.is_file():
        if path.suffix != ".py":
            raise ValueError(f"{path} is not a Python inferlet (.py file or folder)")
        return {"main.py": path.read_text()}
    if not path.is_dir():
        raise FileNotFoundError(f"no inferlet at {path}")
    files = {}
    for f in sorted(path.rglob("*")):
        rel = f.relative_to(path)
        if f.is_file() and f.suffix in UPLOAD_SUFFIXES and not any(p.startswith(".") or p == "__pycache__" for p in rel.parts):
            files[rel.as_posix()] = f.read_text()
    return files


def _is_local_folder(path: Path) -> bool:
    """Whether ``path`` is a folder here (False for a name the file system
    refuses, such as one longer than a file name may be: then it is sent
    as a name, and the server answers for it)."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


class RemoteInstance:
    """An instance on the server, seen from this connection."""

    def __init__(self, client: "Client", iid: str, program: str = "") -> None:
        self.client = client
        self.id = iid
        self.program = program
        self.exit: ExitInfo | None = None
        #: ``(stream, line)`` of what the inferlet printed (launched with ``logs=True``), as read by :meth:`output`
        self.logs: list[tuple[str, str]] = []
        #: called with ``(stream, line)`` for each log line as :meth:`output` reads it
        self.on_log: Callable[[str, str], None] | None = None

    async def send(self, data: str | bytes) -> None:
        """Send a message to the inferlet (its ``session.receive``)."""
        if isinstance(data, (bytes, bytearray)):
            await self.client._send({"type": "send", "instance": self.id, "data_b64": base64.b64encode(bytes(data)).decode()})
        else:
            await self.client._send({"type": "send", "instance": self.id, "data": data})

    async def close_input(self) -> None:
        """No more messages: the inferlet's next ``receive`` raises EOFError."""
        await self.client._send({"type": "close_input", "instance": self.id})

    async def output(self) -> AsyncIterator[str | bytes]:
        """The inferlet's sends until it ends (then ``self.exit`` is set)."""
        q = self.client._inbox(self.id)
        while self.exit is None:
            ev = await q.get()
            if ev["type"] == "exit":
                self.exit = ExitInfo(ev["status"], ev.get("result"), ev.get("error"))
                return
            if ev["type"] == "log":
                self.logs.append((ev.get("stream", "stdout"), ev.get("data", "")))
                if self.on_log is not None:
                    self.on_log(*self.logs[-1])
                continue
            yield base64.b64decode(ev["data_b64"]) if "data_b64" in ev else ev["data"]

    async def recv(self) -> str | bytes:
        """The next output message.

        Raises:
            EOFError: the instance ended.
        """
        async for msg in self.output():
            return msg
        raise EOFError(f"instance {self.id} ended: {self.exit}")

    async def wait(self) -> ExitInfo:
        """Wait for the end (output not yet read is discarded)."""
        async for _ in self.output():
            pass
        assert self.exit is not None
        return self.exit

    async def abort(self) -> None:
        await self.client.abort(self.id)


class Client:
    """One WebSocket connection to a server. Create with :meth:`connect`."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[dict[str, Any]]] = {}  # request id -> its reply
        self._inboxes: dict[str, asyncio.Queue[dict[str, Any]]] = {}  # instance id -> its output and exit events
        self._hashes: dict[str, str] = {}
        self.errors: list[TartletError] = []  # errors not tied to a request
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def connect(cls, url: str = "http://127.0.0.1:8080", key: str | None = None, max_size: int = 64 * 2**20) -> "Client":
        """Open a connection; checks the key with a ping.

        Raises:
            TartletError: ``unauthorized`` (missing or invalid key).
            OSError: the server cannot be reached.
        """
        import websockets

        headers = {"Authorization": f"Bearer {key}"} if key else {}
        ws = await websockets.connect(ws_url(url), additional_headers=headers, max_size=max_size, open_timeout=30)
        client = cls(ws)
        try:
            await client.ping()
        except BaseException:
            await client.close()
            raise
        return client

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        import websockets

        try:
            await self.ws.close()
        except websockets.ConnectionClosed:
            pass
        self._reader.cancel()

    # -- plumbing ------------------------------------------------------------------
    def _inbox(self, iid: str) -> asyncio.Queue[dict[str, Any]]:
        return self._inboxes.setdefault(iid, asyncio.Queue())

    async def _send(self, msg: dict[str, Any]) -> None:
        await self.ws.send(json.dumps(msg))

    async def _request(self, msg: dict[str, Any]) -> dict[str, Any]:
        rid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        import websockets

        try:
            try:
                await self._send({**msg, "id": rid})
            except websockets.ConnectionClosed:
                pass  # the reader fails the future with the reason
            return await fut
        finally:
            self._pending.pop(rid, None)

    async def _read(self) -> None:
        import websockets

        reason: BaseException = ConnectionError("the connection closed")
        try:
            async for raw in self.ws:
                ev = json.loads(raw)
                t = ev.get("type")
                if t in ("output", "exit", "log"):
                    self._inbox(ev["instance"]).put_nowait(ev)
                    continue
                fut = self._pending.get(ev.get("id"))
                if t == "error":
                    err = TartletError(ev.get("code", "error"), ev.get("message", ""))
                    if fut is not None and not fut.done():
                        fut.set_exception(err)
                    else:
                        self.errors.append(err)
                        if err.code == "unauthorized":
                            reason = err
                elif fut is not None and not fut.done():
                    fut.set_result(ev)
        except websockets.ConnectionClosed as e:
            reason = reason if isinstance(reason, TartletError) else ConnectionError(f"the connection closed: {e}")
        finally:
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(reason)
            for iid, q in self._inboxes.items():
                q.put_nowait({"type": "exit", "instance": iid, "status": "disconnected", "error": str(reason)})

    # -- requests ------------------------------------------------------------------
    async def ping(self) -> dict[str, Any]:
        """``{"type": "pong", "user": ...}``."""
        return await self._request({"type": "ping"})

    async def upload(self, path: str | Path) -> str:
        """Upload a program (file or folder); returns its hash."""
        r = await self._request({"type": "upload", "files": collect_files(Path(path))})
        program: str = r["program"]
        return program

    async def launch(
        self, inferlet: str | Path, args: dict[str, Any] | None = None, *, attach: bool = True, abort_on_disconnect: bool = False,
        time_limit_s: float | None = None, logs: bool = False,
    ) -> RemoteInstance:
        """Launch by name, or a local path (uploaded when the server lacks it).
        ``logs``: what the inferlet prints comes too, one line per ``log``
        event (:attr:`RemoteInstance.logs`, :attr:`RemoteInstance.on_log`).

        Raises:
            TartletError: ``not_found``, ``bad_request``, ``limit``, ``forbidden``.
        """
        msg: dict[str, Any] = {"type": "launch", "args": args or {}, "attach": attach, "abort_on_disconnect": abort_on_disconnect}
        if time_limit_s is not None:
            msg["time_limit_s"] = time_limit_s
        if logs:
            msg["logs"] = True
        p = Path(inferlet)
        if isinstance(inferlet, Path) or p.suffix == ".py" or _is_local_folder(p):
            files = collect_files(p)
            h = program_hash(files)
            try:
                r = await self._request({**msg, "program": h})
            except TartletError as e:
                if e.code != "unknown_program":
                    raise
                await self._request({"type": "upload", "files": files})
                r = await self._request({**msg, "program": h})
        else:
            r = await self._request({**msg, "inferlet": inferlet})
        return RemoteInstance(self, r["instance"], r.get("program", ""))

    async def attach(self, iid: str) -> RemoteInstance:
        """Stream an existing instance's output (buffered output first)."""
        await self._request({"type": "attach", "instance": iid})
        return RemoteInstance(self, iid)

    async def list(self) -> list[dict[str, Any]]:
        """This user's instances: ``id``, ``program``, ``status``, ..."""
        instances: list[dict[str, Any]] = (await self._request({"type": "list"}))["instances"]
        return instances

    async def abort(self, iid: str) -> None:
        await self._request({"type": "abort", "instance": iid})

    # -- LoRA adapters (tartlet adapter add/list/remove) ----------------------------------
    async def add_adapter(self, name: str, path: str | Path, model: str | None = None) -> dict[str, Any]:
        """Upload the LoRA adapter at ``path`` (a PEFT folder, or a llama.cpp
        GGUF LoRA file) as ``name`` in this user's namespace; returns
        ``{"name", "modules", "rank", "weight_bytes"}``. The server loads and
        checks it against the model first.

        Raises:
            TartletError: ``bad_request`` (a bad adapter: the message names the
                file and the module), ``limit`` (the adapter quota),
                ``too_large`` (past ``[limits] max_message_bytes``).
            ValueError: ``path`` is neither.
        """
        files = adapter_files(Path(path))
        where: dict[str, Any] = {"name": name} if model is None else {"name": name, "model": model}
        for fname, data in files.items():  # in pieces: each one frame, whatever the adapter's size
            for i in range(0, len(data), ADAPTER_CHUNK_BYTES):
                piece = base64.b64encode(data[i : i + ADAPTER_CHUNK_BYTES]).decode()
                await self._request({"type": "adapter_chunk", **where, "file": fname, "data_b64": piece})
        info: dict[str, Any] = (await self._request({"type": "adapter_add", **where}))["adapter"]
        return info

    async def list_adapters(self, model: str | None = None) -> builtins.list[dict[str, Any]]:
        """The adapters this user may use on ``model``: ``name``, ``owner``
        (``"served"`` or ``"user"``), ``weight_bytes``, ``modules``, ``rank``."""
        msg: dict[str, Any] = {"type": "adapter_list"} if model is None else {"type": "adapter_list", "model": model}
        adapters: builtins.list[dict[str, Any]] = (await self._request(msg))["adapters"]
        return adapters

    async def remove_adapter(self, name: str, model: str | None = None) -> None:
        """Delete this user's adapter ``name``.

        Raises:
            TartletError: ``not_found``.
        """
        msg: dict[str, Any] = {"type": "adapter_remove", "name": name}
        if model is not None:
            msg["model"] = model
        await self._request(msg)


def adapter_files(path: Path) -> dict[str, bytes]:
    """The files of an adapter upload: a PEFT folder's ``adapter_config.json``
    and ``adapter_model.safetensors``, or one ``.gguf`` file.

    Raises:
        ValueError: neither.
    """
    if path.is_file() and path.suffix == ".gguf":
        return {"adapter.gguf": path.read_bytes()}
    if path.is_dir() and (path / "adapter_config.json").is_file() and (path / "adapter_model.safetensors").is_file():
        return {n: (path / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}
    raise ValueError(f"{path} is not a LoRA adapter: a PEFT folder (adapter_config.json + adapter_model.safetensors) "
                     "or a .gguf file")
