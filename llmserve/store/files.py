"""Data files only their owner can read: keys' hashes, usage and conversations live in them.

Directories this module creates are 0700 and files 0600, whatever the umask; existing ones are left
as they are (an operator may have opened them up on purpose).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import IO

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600


def ensure_private_dir(path: str | os.PathLike[str]) -> Path:
    """Create `path` and any missing parents as 0700 directories; return it."""
    directory = Path(path).expanduser()
    missing = [d for d in (directory, *directory.parents) if not d.exists()]
    for created in reversed(missing):
        with contextlib.suppress(FileExistsError):  # another process made it meanwhile
            created.mkdir(mode=PRIVATE_DIR_MODE)
            os.chmod(created, PRIVATE_DIR_MODE)  # mkdir's mode is filtered by the umask
    return directory


def ensure_private_file(path: str | os.PathLike[str]) -> Path:
    """Create `path` empty as a 0600 file (its directory as by ensure_private_dir) unless it exists."""
    file = Path(path).expanduser()
    ensure_private_dir(file.parent)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(file, os.O_CREAT | os.O_EXCL | os.O_WRONLY, PRIVATE_FILE_MODE))
    return file


def open_private(path: str | os.PathLike[str], mode: str = "ab") -> IO:
    """`open(path, mode)`, except that a file it creates is 0600 from its first byte (e.g. a journal)."""
    return open(ensure_private_file(path), mode)
