"""What memfit's on-disk caches key on and where they live, without importing torch or sympy.

Both caches (traces in ``memfit.tracing.trace_cache``, answers in ``memfit.cli.answers``) say which code made an
entry the same way: the versions of Python and of every installed distribution, and memfit's own source by content
(an editable install changes without a new version). ``MEMFIT_CACHE=off`` turns both off; ``MEMFIT_CACHE_DIR``
moves both (``DIR/traces``, ``DIR/answers``), else the platform's user cache folder for memfit.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
from pathlib import Path

__all__ = ["CACHE_DIR_ENV", "CACHE_ENV", "cache_root", "enabled", "installed_versions", "memfit_source_digest"]

CACHE_ENV = "MEMFIT_CACHE"
CACHE_DIR_ENV = "MEMFIT_CACHE_DIR"
_OFF = ("0", "off", "false", "no")


def enabled() -> bool:
    return os.environ.get(CACHE_ENV, "on").strip().lower() not in _OFF


def cache_root() -> Path:
    """``MEMFIT_CACHE_DIR``, else the platform's user cache folder for memfit (``~/.cache/memfit`` on Linux)."""
    configured = os.environ.get(CACHE_DIR_ENV, "").strip()
    if configured:
        return Path(configured).expanduser()
    try:
        import platformdirs
    except ImportError:  # the XDG default, which platformdirs gives on Linux too
        return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "memfit"
    return Path(platformdirs.user_cache_dir("memfit", appauthor=False))


@functools.cache
def installed_versions() -> dict[str, str]:
    """Every installed distribution's version, by lower-case name."""
    return {dist.metadata["Name"].lower(): dist.version for dist in importlib.metadata.distributions()
            if dist.metadata["Name"]}  # fmt: skip


@functools.cache
def memfit_source_digest() -> str:
    """memfit's own code by content."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
