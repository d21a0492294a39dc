"""Writing files the user keeps: atomically, never over an existing file, never outside their folder.

A LoRA that took an hour to train must not be lost to a crash halfway through a write, nor
silently replace another LoRA of the same name, nor land outside ``models/loras`` because a
user-typed name contained ``..``. Three small tools cover this:

* :func:`safe_child_path` turns a user-given name into a path that stays inside its folder.
* :func:`unique_path` picks the first free ``<stem>_00001_.safetensors``-style name (the
  counter style ComfyUI's own save nodes use).
* :func:`atomic_write_safetensors` writes to a temporary file in the target folder, flushes it
  to disk, and only then gives it its final name. Without ``overwrite`` the final step is a hard
  link, which the operating system refuses when the name exists, so two writers racing for one
  name cannot overwrite each other; where the file system has no hard links it falls back to
  a check followed by ``os.replace``.

Only safetensors is written or read here: no pickle.
"""

from __future__ import annotations

import errno
import os
import re
import tempfile
from pathlib import Path, PurePosixPath
from typing import Mapping

import torch
from safetensors.torch import save_file

_DRIVE = re.compile(r"^[A-Za-z]:")
_COUNTER_DIGITS = 5


def safe_child_path(folder: str | os.PathLike[str], name: str, *, field: str = "filename") -> Path:
    """``folder / name`` for a user-given relative ``name``, refusing anything that could leave ``folder``.

    ``name`` may contain sub-folders written with ``/`` (or ``\\``, treated the same on every
    system). Rejected with a ``ValueError`` that names ``field`` and the value: an empty name,
    an absolute path, a drive letter (``C:x``), a ``..`` component, a NUL character, or a name
    whose resolved path (symbolic links followed) is not inside the resolved ``folder``.
    """
    if not isinstance(name, str):
        raise ValueError(f"{field} must be a string, got {type(name).__name__}")
    stripped = name.strip()
    if not stripped:
        raise ValueError(f"{field} is empty: give a file name such as 'my_lora'.")
    if "\x00" in name:
        raise ValueError(f"{field} {name!r} contains a NUL character: use a plain file name.")
    if _DRIVE.match(stripped):
        raise ValueError(
            f"{field} {name!r} starts with a drive letter: give a name relative to {str(folder)!r}, "
            "such as 'my_lora' or 'subfolder/my_lora'."
        )
    unified = stripped.replace("\\", "/")
    if unified.startswith("/") or PurePosixPath(unified).is_absolute() or os.path.isabs(stripped):
        raise ValueError(
            f"{field} {name!r} is an absolute path: give a name relative to {str(folder)!r}, "
            "such as 'my_lora' or 'subfolder/my_lora'."
        )
    parts = [part for part in unified.split("/") if part not in ("", ".")]
    if any(part == ".." for part in parts):
        raise ValueError(
            f"{field} {name!r} contains '..', which would leave {str(folder)!r}: "
            "use a name without '..'."
        )
    if not parts:
        raise ValueError(f"{field} {name!r} names no file: give a file name such as 'my_lora'.")
    base = Path(folder).resolve()
    candidate = base.joinpath(*parts)
    resolved = candidate.resolve()
    if resolved != base and base not in resolved.parents:
        raise ValueError(
            f"{field} {name!r} resolves to {str(resolved)!r}, outside {str(base)!r} "
            "(a symbolic link leads out): choose another name."
        )
    if resolved == base:
        raise ValueError(f"{field} {name!r} names the folder itself: give a file name.")
    return candidate


def unique_path(
    directory: str | os.PathLike[str], stem: str, suffix: str = ".safetensors", *, field: str = "filename"
) -> Path:
    """The first free ``<directory>/<stem>_NNNNN_<suffix>``, counting from 00001.

    ``stem`` is checked with :func:`safe_child_path` (it may name a sub-folder). The name is
    free when this function returns; a writer that races for it is stopped by
    :func:`atomic_write_safetensors` (``FileExistsError``), and can ask again.
    """
    if suffix and not suffix.startswith("."):
        suffix = "." + suffix
    stem_path = safe_child_path(directory, stem, field=field)
    counter = 1
    while True:
        candidate = stem_path.parent / f"{stem_path.name}_{counter:0{_COUNTER_DIGITS}d}_{suffix}"
        if not os.path.lexists(candidate):
            return candidate
        counter += 1


def atomic_write_safetensors(
    path: str | os.PathLike[str],
    tensors: Mapping[str, torch.Tensor],
    metadata: Mapping[str, str] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write ``tensors`` (and string ``metadata``) as a safetensors file at ``path``, atomically.

    The data goes to a temporary file in the same folder, is flushed and ``fsync``-ed, and then
    takes the final name in one step, so ``path`` holds either nothing (or its old content) or
    the complete new file, never a partial one. Missing parent folders are created.

    Without ``overwrite`` an existing ``path`` raises ``FileExistsError`` naming it, and the
    existing file is untouched. On any failure the temporary file is removed.
    """
    target = Path(path)
    metadata = dict(metadata or {})
    for key, value in metadata.items():
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(
                f"metadata[{key!r}] is {type(value).__name__}; safetensors metadata keys and values "
                "must be strings (encode numbers with str(), structures with json.dumps())"
            )
    if not overwrite and os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, "will not overwrite an existing file; choose another name", str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    contiguous = {key: value.detach().contiguous() for key, value in tensors.items()}

    fd, tmp_name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        save_file(contiguous, str(tmp), metadata=metadata or None)
        with open(tmp, "rb+") as handle:
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(tmp, target)
        else:
            _place_without_overwrite(tmp, target)
        _fsync_directory(target.parent)
    finally:
        # After a successful link the temporary name is still there; after os.replace it is gone.
        try:
            tmp.unlink()
        except FileNotFoundError:
            pass
    return target


def _place_without_overwrite(tmp: Path, target: Path) -> None:
    try:
        os.link(tmp, target)  # atomic, and refused by the OS when target exists
        return
    except FileExistsError:
        raise FileExistsError(
            errno.EEXIST, "will not overwrite an existing file; choose another name", str(target)
        ) from None
    except (OSError, NotImplementedError):
        pass  # no hard links on this file system (FAT, some network shares): check, then rename
    if os.path.lexists(target):
        raise FileExistsError(errno.EEXIST, "will not overwrite an existing file; choose another name", str(target))
    os.replace(tmp, target)


def _fsync_directory(directory: Path) -> None:
    """Make the new directory entry durable (POSIX); a no-op where directories cannot be opened."""
    if os.name != "posix":
        return
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
