"""What memfit's on-disk caches key on and where they live, without importing torch or sympy.

Both caches (traces in ``memfit.tracing.trace_cache``, answers in ``memfit.cli.answers``) say which code made an
entry the same way: the versions of Python and of every installed distribution, and memfit's own source by content
(an editable install changes without a new version). ``MEMFIT_CACHE=off`` turns both off; ``MEMFIT_CACHE_DIR``
moves both (``DIR/traces``, ``DIR/answers``), else the platform's user cache folder for memfit.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

__all__ = [
    "CACHE_DIR_ENV",
    "CACHE_ENV",
    "cache_root",
    "enabled",
    "installed_distributions",
    "memfit_source_digest",
]

CACHE_ENV = "MEMFIT_CACHE"
CACHE_DIR_ENV = "MEMFIT_CACHE_DIR"
_OFF = ("0", "off", "false", "no")


_ON = ("", "1", "on", "true", "yes")


def enabled() -> bool:
    """Whether the caches are on (``MEMFIT_CACHE``); a value that is neither on nor off warns once and keeps them."""
    value = os.environ.get(CACHE_ENV, "on").strip().lower()
    if value not in _ON and value not in _OFF:
        from memfit.diagnostics import warn_once

        warn_once(f"cache-env-{value}", f"{CACHE_ENV}={value!r} is neither on nor off; memfit's caches stay on "
                  f"(set {CACHE_ENV}=off to turn them off, or on)")  # fmt: skip
    return value not in _OFF


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


def installed_distributions() -> list[str]:
    """Every installed distribution as its metadata folder names it (``torch-2.13.0.dist-info``), in import order.

    Every distribution's name and version (a ``.dist-info`` folder's name holds the name and version; a
    ``.egg-info`` one is read for its version) from listing the import path's folders alone, a tenth of the time
    of reading every distribution's metadata: for a key computed before every answer."""
    import sys

    found = []
    for entry in sys.path:
        try:
            names = sorted(os.listdir(entry or "."))
        except OSError:
            continue
        for name in names:
            if name.endswith(".dist-info"):
                found.append(name)
            elif name.endswith(".egg-info"):
                info = Path(entry or ".", name)
                info = info / "PKG-INFO" if info.is_dir() else info
                version = next((line for line in _lines(info) if line.startswith("Version:")), "")
                found.append(f"{name} {version.strip()}")
    return found


def _lines(path: Path) -> list[str]:
    try:
        return path.read_text(errors="replace").splitlines()[:20]
    except OSError:
        return []


@functools.cache
def memfit_source_digest() -> str:
    """memfit's own code by content."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(path.relative_to(root).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()
