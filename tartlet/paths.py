"""Where Tartlet keeps files on this machine: one place for every folder.

Each folder is an environment variable when set (``~`` expanded), else the
platform's user folder from ``platformdirs`` (``~/.cache/tartlet``,
``~/.local/share/tartlet``, ``~/.config/tartlet`` on Linux):

====================  =======================  ==========================================
folder                variable                 default
====================  =======================  ==========================================
:func:`cache_dir`     ``TARTLET_CACHE_DIR``    user cache dir: builds, compiled
                                               components, C kernels, models
:func:`models_dir`    ``TARTLET_MODELS_DIR``   ``cache_dir() / "models"``
:func:`kernels_dir`   (none)                   ``cache_dir() / "kernels"``
:func:`data_dir`      ``TARTLET_DATA_DIR``     user data dir: the server's keys, store,
                                               programs, uploads, snapshots
:func:`config_path`   ``TARTLET_CONFIG``       ``<user config dir>/config.toml``
====================  =======================  ==========================================

Read at each call (not at import), so a test or a benchmark can point a
variable elsewhere. Nothing here creates the folders. Host side only: the
WASM build leaves this module out of the SDK it bundles.
"""

from __future__ import annotations

import os
from pathlib import Path

APP = "tartlet"


def _env(name: str) -> Path | None:
    value = os.environ.get(name)
    return Path(value).expanduser() if value else None


def cache_dir() -> Path:
    """Tartlet's cache folder: ``$TARTLET_CACHE_DIR``, else the user cache dir."""
    import platformdirs

    return _env("TARTLET_CACHE_DIR") or Path(platformdirs.user_cache_dir(APP))


def models_dir() -> Path:
    """Root of the model cache: ``$TARTLET_MODELS_DIR``, else ``cache_dir() / "models"``."""
    return _env("TARTLET_MODELS_DIR") or cache_dir() / "models"


def kernels_dir() -> Path:
    """Where the compiled C kernels are cached: ``cache_dir() / "kernels"``."""
    return cache_dir() / "kernels"


def data_dir() -> Path:
    """The server's default data folder: ``$TARTLET_DATA_DIR``, else the user data dir."""
    import platformdirs

    return _env("TARTLET_DATA_DIR") or Path(platformdirs.user_data_dir(APP))


def config_path() -> Path:
    """The default server config file: ``$TARTLET_CONFIG``, else
    ``<user config dir>/config.toml``."""
    import platformdirs

    return _env("TARTLET_CONFIG") or Path(platformdirs.user_config_dir(APP)) / "config.toml"
