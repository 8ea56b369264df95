"""Writing result files so that a reader, a crash or a Ctrl-C never meets half of one."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import tempfile
from pathlib import Path

# Permissions of a new file when the umask cannot be read (the usual umask 022 applied to 0666).
_FALLBACK_MODE = 0o644
# Profile, engine and run names become file and folder names (`<name>.log`, `<name>-<stamp>/`), Prometheus
# labels and Kubernetes object names: no separator, no dot-only name, nothing a shell or a URL must quote.
NAME_LENGTH = 63
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9._-]{{0,{NAME_LENGTH - 1}}}")


class NotARegularFile(OSError):
    """A result file's path names a folder, device, FIFO or socket: writing there would replace it."""


def name_problem(name: str) -> str | None:
    """Why `name` cannot name a file or folder kvtune writes, or None."""
    if _NAME.fullmatch(name):
        return None
    return (
        f"{name[:80]!r} cannot be a name: use 1 to 63 letters, digits, '.', '_' or '-', starting with a "
        "letter or digit (it names files, folders and metric labels)"
    )


def derived_name(base: str, suffix: str) -> str:
    """`<base>-<suffix>` within the name length (a trial's or a tuned profile's name from its spec's)."""
    return f"{base[: NAME_LENGTH - len(suffix) - 1]}-{suffix}"


def output_file_problem(path: Path) -> str | None:
    """Why a result cannot be written at `path`, or None: checked before long work, so none is lost."""
    try:
        if path.exists() and not path.is_file():
            return "is not a regular file (a folder, device or pipe); give the path of a file"
        if not path.parent.is_dir():
            return f"its folder {path.parent} does not exist; create it or give another path"
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            return "cannot be written (permission denied); give a path you can write"
    except (OSError, ValueError) as exc:  # a name too long, a NUL byte, a loop of links
        return f"cannot be used ({getattr(exc, 'strerror', None) or exc})"
    return None


def child_path(folder: Path, name: str) -> Path:
    """`folder / name`, refused (ValueError) unless it stays inside `folder` once links and '..' resolve."""
    path = folder / name
    if not path.resolve().is_relative_to(folder.resolve()):
        raise ValueError(f"{name!r} would write outside {folder}; use a plain name")
    return path


def write_atomic(path: Path, content: str | bytes) -> None:
    """Replace `path` with `content` (text as UTF-8) in one step: until the rename, readers see the old file.

    The content goes to a uniquely named temporary file in the same folder (a rename is atomic only within
    one file system, and two writers must not share a temporary name), is flushed to disk, then renamed
    over `path`. An interrupt or error before the rename removes the temporary file and leaves `path` as
    it was. A path that names a folder, device, FIFO or socket raises NotARegularFile: the rename would
    replace it (`/dev/null` turned into a file).
    """
    with contextlib.suppress(FileNotFoundError):
        if not stat.S_ISREG(path.stat().st_mode):
            raise NotARegularFile(f"{path} is not a regular file; results are written to files only")
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
