"""Writing result files so that a reader, a crash or a Ctrl-C never meets half of one."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

# Permissions of a new file when the umask cannot be read (the usual umask 022 applied to 0666).
_FALLBACK_MODE = 0o644


def write_atomic(path: Path, content: str | bytes) -> None:
    """Replace `path` with `content` (text as UTF-8) in one step: until the rename, readers see the old file.

    The content goes to a uniquely named temporary file in the same folder (a rename is atomic only within
    one file system, and two writers must not share a temporary name), is flushed to disk, then renamed
    over `path`. An interrupt or error before the rename removes the temporary file and leaves `path` as
    it was.
    """
    data = content.encode() if isinstance(content, str) else content
    mode = _mode_for(path)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        # mkstemp creates the file readable by its owner only; a result file is as readable as any other.
        tmp.chmod(mode)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


def _mode_for(path: Path) -> int:
    """The replaced file's permissions (an executable script stays executable), else a new file's."""
    try:
        return path.stat().st_mode & 0o7777
    except FileNotFoundError:
        return 0o666 & ~_umask()


def _umask() -> int:
    # os.umask can only be read by setting it, which races with other threads: Linux shows it in /proc.
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    return 0o666 & ~_FALLBACK_MODE


def _sync_folder(folder: Path) -> None:
    """Make the rename itself durable; some file systems cannot sync a folder, which only costs that."""
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def ensure_writable_folder(folder: Path, what: str) -> None:
    """Create `folder` if needed and prove a file can be written in it, before any long work starts.

    Raises ConfigError naming `what` (the flag or field) and the fix.
    """
    # Imported here: config_errors is a leaf module about documents, files.py must stay importable alone.
    from kvtune.config_errors import ConfigError

    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{what} {folder}: exists and is not a folder; pass a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{what} {folder}: cannot write there ({exc.strerror}); pass a folder you can write"
        ) from None
