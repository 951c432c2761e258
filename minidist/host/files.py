"""Files written so that a crash leaves each one whole or as it was.

:func:`write_synced` writes a file and fsyncs it: its bytes are on disk before whatever
depends on them (a directory renamed into place holding it, a pointer renamed to it).
:func:`replace_atomically` writes a temporary file beside the target, fsyncs it and renames it
over the target: ``os.replace`` is atomic on one file system, so a reader sees the old file or
the new one, never half of one, and a link at the target is replaced, not followed.
"""

from __future__ import annotations

import os
from collections.abc import Iterable


def write_synced(path: str, data: str | bytes | Iterable[bytes]) -> None:
    """Write ``data`` to ``path`` and fsync it: text (as UTF-8), bytes, or chunks of bytes
    written one after another (so a large file need not be joined in memory first)."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    chunks = [data] if isinstance(data, (bytes, bytearray, memoryview)) else data
    with open(path, "wb") as f:
        for chunk in chunks:
            f.write(chunk)
        f.flush()
        os.fsync(f.fileno())


def replace_atomically(path: str, data: str | bytes | Iterable[bytes]) -> None:
    """``path`` holds ``data`` whole or is as before: :func:`write_synced` into a temporary file
    beside it (``.NAME.tmp-PID``), then rename it over ``path``; the temporary file is removed
    if anything fails."""
    directory, name = os.path.split(path)
    tmp = os.path.join(directory, f".{name}.tmp-{os.getpid()}")
    if os.path.lexists(tmp):  # a leftover (or a link planted there): writing would follow it
        os.remove(tmp)
    try:
        write_synced(tmp, data)
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.remove(tmp)
