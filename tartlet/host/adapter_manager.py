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

Replicas sharing one folder (``enable_persistence(..., shared=True)``, what
``tartlet serve --replicas`` turns on, as for snapshots): the folder, not
any one manager, says which adapters a user has.

- Every call about a user's adapters (use, names, listing, save, delete,
  the quota) first brings this manager's view of the user's folder up to
  date: one ``stat`` of the folder while its mtime is unchanged (and older
  than two seconds: a change in the same clock tick would not show), else
  a listing of it with each adapter's ``tartlet_adapter.json``. An adapter
  saved or uploaded through another replica is registered on disk only and
  read on first use; one deleted there is dropped here; one saved again
  there (another ``version``) is dropped here and the new folder read on
  next use. A folder replaced while it is read is read again.
- An instance names an adapter at each host call (:mod:`.adapter_api`): a
  pass already queued, or a ``generate`` / token stream in flight, finishes
  with the version it found; the instance's next call finds the adapter
  gone (``AdapterError`` naming it) or runs the new version. Its forks are
  its own copies and stay usable. KV computed with the old version stays
  in its contexts (the prefix cache keys pages by version).
- The quota counts the user's adapters in the folder (whoever saved them)
  plus the forks of this replica's instances (other replicas' forks count
  there). Two replicas saving one name at the same moment: one save wins,
  the other fails with ``AdapterError`` (the rename into place never
  replaces a folder). A delete and a save of one name at the same moment
  on two replicas are not serialized.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.core.engine import Engine
from ..engine.models.lora import LoraAdapter
from ..sdk.errors import AdapterError, LimitError
from .adapter_store import AdapterStore, StoredAdapter
from .snapshot_store import RACY_MTIME_NS, SHARED_TMP_AGE_S

log = logging.getLogger(__name__)

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
        path: its folder (None: not persisted, or being written).
        version: the version of its folder (:class:`~.adapter_store.StoredAdapter`).
    """

    owner: str
    name: str
    weight_bytes: int
    adapter: LoraAdapter | None = None
    path: Path | None = None
    version: str = ""
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
        #: the folder is shared with other replicas (see the module docstring)
        self.shared = False
        self._lock = threading.Lock()
        self._saved: dict[tuple[str, str], UserAdapter] = {}
        #: bytes of this replica's forks, per owner (:meth:`charge`, :meth:`release`)
        self._charged: dict[str, int] = {}
        self._sync_lock = threading.Lock()
        #: shared mode: owner -> its folder's mtime ns when last listed (not kept while that mtime is recent)
        self._synced: dict[str, int] = {}
        self._dirs: dict[str, str] = {}  # owner -> its folder

    def enable_persistence(self, root: Path, shared: bool = False) -> int:
        """Keep saved adapters under ``root`` and register those found there
        (on disk only; they count against their owner's quota as they are
        restored, without a check); returns how many.

        Args:
            root: the adapters folder.
            shared: other servers (replicas) use the same folder: names are
                looked up in it and checked against it (module docstring).

        Raises:
            OSError: the folder cannot be created.
        """
        self.store = AdapterStore(root, self.engine)
        self.shared = shared
        self._synced, self._dirs = {}, {}
        n = 0
        for found in self.store.scan(tmp_age_s=SHARED_TMP_AGE_S if shared else 0.0):
            with self._lock:
                if (found.owner, found.name) in self._saved:
                    continue
                self._saved[(found.owner, found.name)] = UserAdapter(
                    found.owner, found.name, found.weight_bytes, None, found.path, found.version)
            n += 1
        return n

    # -- the shared folder ---------------------------------------------------------------
    def _sync(self, owner: str) -> None:
        """Shared mode: make this manager's view of ``owner``'s saved
        adapters the folder's (module docstring); nothing otherwise."""
        store = self.store
        if not self.shared or store is None:
            return
        d = self._dirs.get(owner)
        if d is None:
            d = self._dirs[owner] = str(store.user_dir(owner))
        try:
            mtime: int | None = os.stat(d).st_mtime_ns  # before listing: a later change shows next time
        except FileNotFoundError:
            mtime = None
        except OSError:
            return  # unreadable now: keep what we have
        with self._sync_lock:
            if mtime is not None and self._synced.get(owner) == mtime:
                return
            found: dict[str, StoredAdapter] = {}
            if mtime is not None:
                with self._lock:  # versions read before: their safetensors headers are not read again
                    sizes = {ua.version: ua.weight_bytes for (o, _), ua in self._saved.items() if o == owner and ua.path}
                found = {f.name: f for f in store.scan(SHARED_TMP_AGE_S, owner, sizes) if f.owner == owner}
            with self._lock:
                for key, ua in list(self._saved.items()):
                    if key[0] != owner or ua.path is None:  # another's, or being saved here
                        continue
                    f = found.get(key[1])
                    if f is None or f.version != ua.version:
                        del self._saved[key]
                        log.info("adapter %r of user %r dropped from this replica: %s through another replica",
                                 ua.name, owner, "deleted" if f is None else "saved again")
                for name, f in found.items():
                    if (owner, name) not in self._saved:
                        self._saved[(owner, name)] = UserAdapter(owner, name, f.weight_bytes, None, f.path, f.version)
            if mtime is not None and time.time_ns() - mtime > RACY_MTIME_NS:
                self._synced[owner] = mtime
            else:
                self._synced.pop(owner, None)

    def _replaced(self, ua: UserAdapter) -> bool:
        """Shared mode: whether ``ua``'s folder is gone or holds another
        version now; if so, ``ua`` is dropped here and the owner's folder
        will be listed again."""
        assert self.store is not None and ua.path is not None
        if self.store.version(ua.path) == ua.version:
            return False
        with self._sync_lock, self._lock:
            if self._saved.get((ua.owner, ua.name)) is ua:
                del self._saved[(ua.owner, ua.name)]
            self._synced.pop(ua.owner, None)
        return True

    # -- names ----------------------------------------------------------------------------
    def names(self, owner: str) -> list[str]:
        """Names ``owner`` may use: the served adapters and its own, sorted."""
        self._sync(owner)
        with self._lock:
            own = {n for (o, n) in self._saved if o == owner}
        return sorted(own | set(self.engine.adapters))

    def saved_names(self, owner: str) -> list[str]:
        """``owner``'s own saved and uploaded adapters, sorted."""
        self._sync(owner)
        with self._lock:
            return sorted(n for (o, n) in self._saved if o == owner)

    def find(self, owner: str, name: str) -> LoraAdapter | None:
        """The adapter ``owner`` sees as ``name`` (its own first, then the
        served one), loading a saved one from disk on first use; None when
        there is none.

        Raises:
            AdapterError: its folder is damaged, or gone (in shared mode:
                kept being replaced while it was read).
        """
        for _ in range(4):
            self._sync(owner)
            with self._lock:
                ua = self._saved.get((owner, name))
            if ua is None:
                return self.engine.adapters.get(name)
            with ua.lock:
                if ua.adapter is not None:
                    return ua.adapter
                assert ua.path is not None  # only restored adapters lie on disk only
                try:
                    adapter = self.engine.read_adapter(ua.path, name)
                except AdapterError:
                    if self.shared and self._replaced(ua):
                        continue  # deleted or saved again through another replica meanwhile: look again
                    raise
                if self.shared and self._replaced(ua):
                    continue  # read while it was replaced: read the new one whole
                ua.adapter = adapter
                return adapter
        raise AdapterError(f"adapter {name!r} was saved again through other replicas while it was read: try again")

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
        """Bytes counted against ``owner``'s quota now: its saved adapters
        (in shared mode: those in the folder) and its instances' forks."""
        self._sync(owner)
        with self._lock:
            return self._usage(owner)

    def _usage(self, owner: str) -> int:
        saved = sum(ua.weight_bytes for (o, _), ua in self._saved.items() if o == owner)
        return saved + self._charged.get(owner, 0)

    def charge(self, owner: str, nbytes: int) -> None:
        """Count ``nbytes`` more (a fork) for ``owner``.

        Raises:
            LimitError: past ``[limits] max_adapter_mb_per_user`` (nothing counted).
        """
        self._sync(owner)
        with self._lock:
            self._check(owner, nbytes)
            self._charged[owner] = self._charged.get(owner, 0) + nbytes

    def _check(self, owner: str, nbytes: int) -> None:
        have = self._usage(owner)
        cap = self.max_bytes_per_user
        if cap is not None and have + nbytes > cap:
            raise LimitError(f"user {owner or '(local)'!r}'s adapters would take {(have + nbytes) / 2**20:.1f} MiB, more than "
                             f"the limit of {cap / 2**20:.1f} MiB (limits.max_adapter_mb_per_user): drop or delete some first")

    def release(self, owner: str, nbytes: int) -> None:
        """Count ``nbytes`` less (a fork dropped) for ``owner``."""
        with self._lock:
            left = max(0, self._charged.get(owner, 0) - nbytes)
            if left:
                self._charged[owner] = left
            else:
                self._charged.pop(owner, None)

    # -- saved adapters -----------------------------------------------------------------------
    def save(self, owner: str, name: str, adapter: LoraAdapter) -> None:
        """Register ``adapter`` as ``owner``'s ``name`` and, with a folder,
        write it there (in PEFT's format) before returning.

        Raises:
            AdapterError: an invalid name, or one ``owner`` sees already
                (in shared mode: saved through another replica too).
            LimitError: past the owner's quota.
            OSError: the write failed (nothing is saved then).
        """
        check_name(name)
        self._sync(owner)
        nbytes = adapter.weight_bytes
        with self._lock:
            if (owner, name) in self._saved or name in self.engine.adapters:
                raise AdapterError(f"an adapter named {name!r} exists already (delete it first, or choose another name)")
            self._check(owner, nbytes)
            ua = UserAdapter(owner, name, nbytes, adapter)
            self._saved[(owner, name)] = ua  # the name is taken (and counted) while the folder is written
        try:
            if self.store is not None:
                stored = self.store.write(owner, name, adapter.parts)
                ua.version = stored.version
                ua.path = stored.path  # last: a listing skips an adapter without a path
        except BaseException as e:
            with self._lock:
                self._saved.pop((owner, name), None)
            if isinstance(e, FileExistsError):
                raise AdapterError(f"an adapter named {name!r} exists already (saved on disk, perhaps through another "
                                   "replica just now: delete it first, or choose another name)") from None
            raise

    def delete(self, owner: str, name: str) -> None:
        """Remove ``owner``'s adapter ``name`` and its folder. Passes that
        were queued with it still run with it.

        Raises:
            AdapterError: ``owner`` has no adapter of that name (a served
                one cannot be deleted by an inferlet or a user; in shared
                mode: deleted through another replica too).
        """
        self._sync(owner)
        with self._lock:
            ua = self._saved.pop((owner, name), None)
            if ua is None:
                what = "is served by the server's config" if name in self.engine.adapters else "does not exist"
                raise AdapterError(f"no adapter of yours named {name!r} to delete (it {what})")
        if ua.path is not None and self.store is not None:
            self.store.delete(ua.path)

    def listing(self, owner: str) -> list[dict[str, object]]:
        """What ``owner`` sees, for ``tartlet adapter list``: per adapter its
        ``name``, ``owner`` (``"served"`` or ``"user"``), ``weight_bytes``
        (None for a served adapter's), and ``modules`` / ``rank`` when
        loaded. In shared mode: the adapters in the folder now."""
        self._sync(owner)
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
