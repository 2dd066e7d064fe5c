"""The LoRA adapters of one served model, per user: the served ones (the
server config's ``[[models]] adapters``, every user's), each user's saved
and uploaded ones (namespaced like named snapshots: another user neither
lists nor uses them), the per-user byte quota, and their folders on disk.

Names. A user sees the served adapters and its own; its own shadow a
served one of the same name (which can only happen when the config gains
that name later: a new adapter may not take a name the user sees). Names are
1 to 64 characters of ``A-Z a-z 0-9 . _ -``, starting with a letter or a
digit (no ``:``, so ``BASE:ADAPTER`` over the OpenAI routes is unambiguous).

Quota (``[limits] max_adapter_mb_per_user``): the float32 bytes of the
``A`` and ``B`` matrices (:attr:`~tartlet.engine.models.lora.LoraAdapter.weight_bytes`,
the size of their PEFT safetensors file) of a user's saved adapters and of
the adapters its running instances forked (:mod:`.adapter_api`), per model.
Served adapters are the operator's and count for nobody. Resident memory is
about twice the counted bytes (the fused copy the model multiplies, and the
fused C decode step's float16 copy, made once an adapter runs there).

Persistence: with a folder (:meth:`AdapterManager.enable_persistence`) each
saved adapter is written there (:mod:`.adapter_store`) before the save
returns, and registered again at start *on disk only*: its matrices are
read on first use.
"""

from __future__ import annotations

import re
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.core.engine import Engine
from ..engine.models.lora import LoraAdapter
from ..sdk.errors import AdapterError, LimitError
from .adapter_store import AdapterStore

_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
#: file names an upload may hold: a PEFT folder's two files, or one GGUF LoRA file
PEFT_FILES = frozenset({"adapter_config.json", "adapter_model.safetensors"})
_GGUF_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,120}\.gguf")


def check_name(name: object) -> str:
    """``name`` if it is a valid adapter name (see the module docstring).

    Raises:
        AdapterError: not a str of that form, naming the rule.
    """
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise AdapterError(f"adapter name {name!r:.80} is not 1 to 64 characters of A-Z a-z 0-9 . _ - "
                           "starting with a letter or digit")
    return name


@dataclass
class UserAdapter:
    """A user's saved adapter.

    Attributes:
        owner, name: whose and what.
        weight_bytes: what it counts against the owner's quota.
        adapter: the loaded adapter, or None while it lies on disk only.
        path: its folder (None: not persisted).
    """

    owner: str
    name: str
    weight_bytes: int
    adapter: LoraAdapter | None = None
    path: Path | None = None
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class AdapterManager:
    """Adapters of ``engine`` per user (module docstring). Thread-safe.

    Args:
        engine: the served model; its :attr:`~tartlet.engine.core.engine.Engine.adapters`
            are the served adapters.
        max_bytes_per_user: the quota in bytes (None: unlimited).
    """

    def __init__(self, engine: Engine, max_bytes_per_user: int | None = None) -> None:
        self.engine = engine
        self.max_bytes_per_user = max_bytes_per_user
        self.store: AdapterStore | None = None
        self._lock = threading.Lock()
        self._saved: dict[tuple[str, str], UserAdapter] = {}
        self._used: dict[str, int] = {}

    def enable_persistence(self, root: Path) -> int:
        """Keep saved adapters under ``root`` and register those found there
        (on disk only, not counted against the quota as they are restored);
        returns how many.

        Raises:
            OSError: the folder cannot be created.
        """
        self.store = AdapterStore(root, self.engine)
        n = 0
        for found in self.store.scan():
            with self._lock:
                if (found.owner, found.name) in self._saved:
                    continue
                self._saved[(found.owner, found.name)] = UserAdapter(found.owner, found.name, found.weight_bytes, None, found.path)
                self._used[found.owner] = self._used.get(found.owner, 0) + found.weight_bytes
            n += 1
        return n

    # -- names ----------------------------------------------------------------------------
    def names(self, owner: str) -> list[str]:
        """Names ``owner`` may use: the served adapters and its own, sorted."""
        with self._lock:
            own = {n for (o, n) in self._saved if o == owner}
        return sorted(own | set(self.engine.adapters))

    def saved_names(self, owner: str) -> list[str]:
        """``owner``'s own saved and uploaded adapters, sorted."""
        with self._lock:
            return sorted(n for (o, n) in self._saved if o == owner)

    def find(self, owner: str, name: str) -> LoraAdapter | None:
        """The adapter ``owner`` sees as ``name`` (its own first, then the
        served one), loading a saved one from disk on first use; None when
        there is none.

        Raises:
            AdapterError: its folder is gone or damaged.
        """
        with self._lock:
            ua = self._saved.get((owner, name))
        if ua is None:
            return self.engine.adapters.get(name)
        with ua.lock:
            if ua.adapter is None:
                assert ua.path is not None  # only restored adapters lie on disk only
                ua.adapter = self.engine.read_adapter(ua.path, name)
            return ua.adapter

    def resolve(self, owner: str, name: str) -> LoraAdapter:
        """:meth:`find`, or an error.

        Raises:
            AdapterError: no adapter ``owner`` sees as ``name`` (the message
                lists those it sees).
        """
        a = self.find(owner, name)
        if a is None:
            raise AdapterError(f"model {self.engine.name!r} serves no adapter named {name!r} "
                               f"(adapters: {', '.join(self.names(owner)) or 'none'})")
        return a

    # -- the quota ---------------------------------------------------------------------------
    def used(self, owner: str) -> int:
        """Bytes counted against ``owner``'s quota now."""
        with self._lock:
            return self._used.get(owner, 0)

    def charge(self, owner: str, nbytes: int) -> None:
        """Count ``nbytes`` more for ``owner``.

        Raises:
            LimitError: past ``[limits] max_adapter_mb_per_user`` (nothing counted).
        """
        with self._lock:
            self._charge(owner, nbytes)

    def _charge(self, owner: str, nbytes: int) -> None:
        have = self._used.get(owner, 0)
        cap = self.max_bytes_per_user
        if cap is not None and have + nbytes > cap:
            raise LimitError(f"user {owner or '(local)'!r}'s adapters would take {(have + nbytes) / 2**20:.1f} MiB, more than "
                             f"the limit of {cap / 2**20:.1f} MiB (limits.max_adapter_mb_per_user): drop or delete some first")
        self._used[owner] = have + nbytes

    def release(self, owner: str, nbytes: int) -> None:
        """Count ``nbytes`` less for ``owner``."""
        with self._lock:
            self._used[owner] = max(0, self._used.get(owner, 0) - nbytes)

    # -- saved adapters -----------------------------------------------------------------------
    def save(self, owner: str, name: str, adapter: LoraAdapter) -> None:
        """Register ``adapter`` as ``owner``'s ``name`` and, with a folder,
        write it there (in PEFT's format) before returning.

        Raises:
            AdapterError: an invalid name, or one ``owner`` sees already.
            LimitError: past the owner's quota.
            OSError: the write failed (nothing is saved then).
        """
        check_name(name)
        nbytes = adapter.weight_bytes
        with self._lock:
            if (owner, name) in self._saved or name in self.engine.adapters:
                raise AdapterError(f"an adapter named {name!r} exists already (delete it first, or choose another name)")
            self._charge(owner, nbytes)
            ua = UserAdapter(owner, name, nbytes, adapter)
            self._saved[(owner, name)] = ua  # the name is taken while the folder is written
        try:
            if self.store is not None:
                ua.path = self.store.write(owner, name, adapter.parts)
        except BaseException:
            with self._lock:
                self._saved.pop((owner, name), None)
            self.release(owner, nbytes)
            raise

    def delete(self, owner: str, name: str) -> None:
        """Remove ``owner``'s adapter ``name`` and its folder. Passes that
        were queued with it still run with it.

        Raises:
            AdapterError: ``owner`` has no adapter of that name (a served
                one cannot be deleted by an inferlet or a user).
        """
        with self._lock:
            ua = self._saved.pop((owner, name), None)
            if ua is None:
                what = "is served by the server's config" if name in self.engine.adapters else "does not exist"
                raise AdapterError(f"no adapter of yours named {name!r} to delete (it {what})")
            self._used[owner] = max(0, self._used.get(owner, 0) - ua.weight_bytes)
        if ua.path is not None and self.store is not None:
            self.store.delete(ua.path)

    def listing(self, owner: str) -> list[dict[str, object]]:
        """What ``owner`` sees, for ``tartlet adapter list``: per adapter its
        ``name``, ``owner`` (``"served"`` or ``"user"``), ``weight_bytes``
        (None for a served adapter's), and ``modules`` / ``rank`` when loaded."""
        with self._lock:
            own = {n: ua for (o, n), ua in self._saved.items() if o == owner}
        out: list[dict[str, object]] = []
        for name in sorted(set(own) | set(self.engine.adapters)):
            ua = own.get(name)
            a = ua.adapter if ua is not None else self.engine.adapters[name]
            out.append({"name": name, "owner": "user" if ua is not None else "served",
                        "weight_bytes": ua.weight_bytes if ua is not None else (a.weight_bytes if a else None),
                        "modules": a.modules if a is not None else None, "rank": a.rank if a is not None else None})
        return out

    def add_upload(self, owner: str, name: str, files: dict[str, bytes]) -> dict[str, object]:
        """Check an uploaded adapter by loading it, then save it as
        ``owner``'s ``name`` (:meth:`save`: a GGUF LoRA is stored as PEFT).

        Args:
            files: a PEFT folder's ``adapter_config.json`` and
                ``adapter_model.safetensors``, or one ``*.gguf`` file, by
                file name -> bytes.

        Returns:
            ``{"name", "modules", "rank", "weight_bytes"}``.

        Raises:
            AdapterError: a bad name, another set of files, or an adapter
                that does not load or does not fit the model (the message
                names the uploaded file and the module).
            LimitError: past the owner's quota.
        """
        check_name(name)
        names = set(files)
        gguf = len(names) == 1 and _GGUF_NAME_RE.fullmatch(next(iter(names))) is not None
        if names != PEFT_FILES and not gguf:
            raise AdapterError(f"an adapter upload is a PEFT folder ({', '.join(sorted(PEFT_FILES))}) or one .gguf file, "
                               f"got {', '.join(sorted(names))[:200]}")
        if name in self.names(owner):
            raise AdapterError(f"an adapter named {name!r} exists already (delete it first, or choose another name)")
        tmp = Path(tempfile.mkdtemp(prefix="tartlet-adapter-"))
        try:
            for fname, data in files.items():
                (tmp / fname).write_bytes(data)
            path = tmp / next(iter(names)) if gguf else tmp
            try:
                adapter = self.engine.read_adapter(path, name)
            except AdapterError as e:
                raise AdapterError(str(e).replace(f"{tmp}/", "").replace(str(tmp), f"upload {name!r}")) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        self.save(owner, name, adapter)
        return {"name": name, "modules": adapter.modules, "rank": adapter.rank, "weight_bytes": adapter.weight_bytes}
