"""A folder of checkpoints: tags, atomic commits, the ``latest`` pointer and retention.

[Note: atomic checkpoints]
Every rank writes its shard file into ``<dir>/.<tag>.partial``; once all ranks have
written and flushed their files, rank 0 writes the manifest there, renames the folder
to ``<dir>/<tag>`` and only then replaces ``<dir>/latest`` (written to a temporary file
and renamed). A rename is atomic, so a crash at any moment leaves either the previous
checkpoint and ``latest`` untouched, or the new checkpoint complete: a folder without a
manifest is never a checkpoint, and ``latest`` never names one that is incomplete.
Saving again under an existing tag moves the old folder aside (``.<tag>.old``) for the
instant of the swap; a reader that finds ``<tag>`` missing falls back to it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from terascale.checkpoint.client_state import file_problem as client_file_problem
from terascale.checkpoint.integrity import content_problem
from terascale.checkpoint.manifest import MANIFEST, CheckpointError, Manifest

LATEST = "latest"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Replace ``path`` with ``data`` atomically and durably (temp file, fsync, rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def copy_durably(source: Path, target: Path) -> None:
    """Copy file ``source`` to ``target`` (in the kernel where it can) and flush it."""
    shutil.copyfile(source, target)
    with open(target, "rb+") as f:
        os.fsync(f.fileno())


def verify(folder: Path, *, content: bool = False, share: tuple[int, int] = (0, 1)) -> str | None:
    """None when checkpoint ``folder`` is complete: its manifest parses, every shard
    file it lists is there with the size it records and a readable safetensors header, and
    so are its client-state files (by size); otherwise what is wrong. With ``content``, also re-reads the files this caller's
    ``share`` ``(i, n)`` of them covers (the ``i``-th, ``i + n``-th, ...: one rank's part,
    ``[Note: checkpoint checksums]``) and compares their checksums with the manifest's."""
    try:
        manifest = Manifest.read(folder)
    except Exception as exc:  # noqa: BLE001 - any failure to read it makes it unusable
        return f"its manifest cannot be read ({exc})"
    for shard in manifest.files:
        path = folder / shard.name
        try:
            size = path.stat().st_size
            if size != shard.nbytes:
                return f"'{path}' has {size} bytes, the manifest records {shard.nbytes}"
            with open(path, "rb") as f:
                header = int.from_bytes(f.read(8), "little")
                if not 0 < header <= size - 8:
                    return f"'{path}' has no valid safetensors header"
                json.loads(f.read(header))
        except (OSError, ValueError) as exc:
            return f"'{path}' cannot be read ({exc})"
    for entry in manifest.client_files:  # [Note: client state as data]
        if (problem := client_file_problem(folder, entry)) is not None:
            return problem
    if content:  # after every file's cheap checks: a missing file is found without reading any
        index, count = share
        return content_problem(folder, (manifest.files + manifest.client_files)[index::count])
    return None


def validate_tag(tag: str) -> str:
    if not tag or tag != tag.strip() or "/" in tag or os.sep in tag or tag.startswith(".") or tag == LATEST:
        raise ValueError(
            f"checkpoint tag {tag!r} is not usable as a folder name: use letters, digits, '_', '-' "
            "(not starting with '.', not 'latest')"
        )
    return tag


class CheckpointDirectory:
    """Checkpoints under ``root``, one folder per tag (see ``[Note: atomic checkpoints]``)."""

    def __init__(self, root: str | os.PathLike) -> None:
        self.root = Path(root)

    def staging(self, tag: str) -> Path:
        return self.root / f".{tag}.partial"

    def prepare(self, tag: str) -> Path:
        """(Rank 0) an empty staging folder for ``tag`` (leftovers of a crashed save go)."""
        self.root.mkdir(parents=True, exist_ok=True)
        staging = self.staging(tag)
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        return staging

    def commit(self, tag: str, manifest_json: str, *, save_latest: bool) -> Path:
        """(Rank 0, after every rank flushed its file) write the manifest and move the
        staging folder to ``<root>/<tag>``; then point ``latest`` at it."""
        staging = self.staging(tag)
        write_atomic(staging / MANIFEST, manifest_json.encode())
        final = self.root / tag
        old = self.root / f".{tag}.old"
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
        os.replace(staging, final)
        _fsync_dir(self.root)
        shutil.rmtree(old, ignore_errors=True)
        if save_latest:
            write_atomic(self.root / LATEST, tag.encode())
        return final

    def abort(self, tag: str) -> None:
        shutil.rmtree(self.staging(tag), ignore_errors=True)

    def tags(self) -> list[str]:
        """Committed checkpoints, oldest first (by the time their manifest was written)."""
        if not self.root.is_dir():
            return []
        found = [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / MANIFEST).exists()]
        return [p.name for p in sorted(found, key=lambda p: (p / MANIFEST).stat().st_mtime_ns)]

    def latest(self) -> str | None:
        try:
            return (self.root / LATEST).read_text().strip() or None
        except FileNotFoundError:
            return None

    @staticmethod
    def find(path: str | os.PathLike, tag: str | None) -> Path | None:
        """A checkpoint folder: ``path`` itself when it is one and no tag is given, else
        :meth:`resolve` ``tag`` in the save directory ``path``."""
        path = Path(path)
        if tag is None and (path / MANIFEST).exists():
            return path
        return CheckpointDirectory(path).resolve(tag)

    def resolve(self, tag: str | None) -> Path | None:
        """The folder of ``tag`` (default: the one ``latest`` names); None when no tag was
        given and there is no ``latest``. A missing tag is an error listing those present."""
        if tag is None:
            tag = self.latest()
            if tag is None:
                return None
        folder = self.root / tag
        if (folder / MANIFEST).exists():
            return folder
        moved = self.root / f".{tag}.old"
        if (moved / MANIFEST).exists():  # a save under the same tag was interrupted mid-swap
            return moved
        present = self.tags()
        raise CheckpointError(
            f"no checkpoint with tag '{tag}' in '{self.root}'; tags present: "
            + (", ".join(present) if present else "none")
        )

    def prune(self, keep_last_n: int, protect: str) -> list[str]:
        """(Rank 0) delete the oldest checkpoints beyond ``keep_last_n``, never ``protect``."""
        tags = self.tags()
        doomed = [t for t in tags[: max(0, len(tags) - keep_last_n)] if t != protect]
        for t in doomed:
            shutil.rmtree(self.root / t, ignore_errors=True)
        return doomed
