"""Checkpoints that are never half-written: a kill, an exception or a crashed rank during a save leaves the
previous checkpoint under its name, complete and loadable.

* One file (every ``mgpu_*`` strategy, and ``MGPUShardedStrategy(checkpoint="consolidated")``):
  :class:`AtomicCheckpointIO` writes ``.<name>.tmp-<pid>`` beside the checkpoint, flushes and fsyncs it, and
  ``os.replace``\\ s it onto the name (then fsyncs the directory). A reader sees the old file or the new one.
* A directory (``MGPUShardedStrategy(checkpoint="sharded")``): every rank writes into a hidden sibling
  ``.<name>.tmp-<pid>``; once all have written, rank 0 puts a completion marker (:data:`COMPLETE_MARKER`) in it
  and swaps it in place of the old directory (:func:`commit_dir`). A directory without the marker is refused
  on load (:class:`IncompleteCheckpointError`). At an fsspec URL (``s3://bucket/ckpts/last.ckpt``, ``gs://``, ...)
  the same protocol runs on the object store, which has no rename: see :func:`commit_dir`.

Every read takes the checkpoint for data, wherever it came from (a download, a colleague's directory, object
storage): files are read with the user's ``weights_only`` (``Trainer.fit(..., weights_only=...)``; not given, torch's
default ``True``), so an entry whose unpickling would run code is refused, naming the file and the call that loads it
once you trust it (:func:`load_file`, :meth:`AtomicCheckpointIO.load_checkpoint`, :func:`load_sharded_dir`).

Leftovers of a killed save start with a dot and do not end in ``.ckpt``: ``ModelCheckpoint`` and
``ckpt_path="last"`` never take them for checkpoints; the next save of the same name removes them.

Example::

    from lightning_mgpu import AtomicCheckpointIO
    from pytorch_lightning import Trainer

    # the default of every mgpu strategy; name it to wrap it, e.g. AsyncCheckpointIO(AtomicCheckpointIO())
    trainer = Trainer(strategy="mgpu_ddp", plugins=[AtomicCheckpointIO()])
"""

from __future__ import annotations

import dataclasses
import enum
import glob
import io
import json
import logging
import os
import pathlib
import pickle
import posixpath
import re
import shutil
import warnings
from collections.abc import Iterable
from contextlib import suppress
from pathlib import Path
from typing import IO, Any, Callable, Optional, Union

import torch
from fsspec import AbstractFileSystem
from fsspec.core import url_to_fs
from fsspec.implementations.local import LocalFileSystem
from lightning_fabric.plugins import CheckpointIO
from lightning_fabric.plugins.io.torch_io import TorchCheckpointIO
from typing_extensions import override

from lightning_mgpu import comm
from lightning_mgpu._compat import dcp_fsspec_storage, is_strided_shard, is_wrapping_checkpoint_io, torch_layout_decoder
from lightning_mgpu.quantization import loads_once_imported

# a local path, or a URL fsspec understands (what Lightning calls _PATH)
PathLike = Union[str, "os.PathLike[str]"]
#: Lightning's ``Strategy.save_checkpoint(checkpoint, filepath, storage_options)``, handed to what writes one file
LightningSave = Callable[[dict[str, Any], Any, Optional[Any]], None]

log = logging.getLogger(__name__)

COMPLETE_MARKER = "mgpu_complete.json"
"""Written last, by rank 0, into a sharded checkpoint directory once every rank has written its part."""
EMA_STATE_KEY = "ema_state_dict"
"""The checkpoint entry of the :class:`~lightning_mgpu.EMA` average: parameter name -> tensor (a ``DTensor`` shard
in a sharded directory, where it is written beside ``state_dict``)."""
_TMP = ".tmp-"  # a save in progress (or killed): .<name>.tmp-<pid>
_OLD = ".old-"  # the previous directory, set aside for the instant of the swap: .<name>.old-<pid>
_DEL = ".del-"  # a directory being removed: .<name>.del-<pid>


class IncompleteCheckpointError(RuntimeError):
    """A sharded checkpoint directory whose save did not finish (no completion marker, or files missing).

    ``Trainer.fit(ckpt_path=...)`` and ``trainer.strategy.load_checkpoint`` raise it instead of loading a partial
    state; the message lists the complete checkpoints beside the refused one, newest first.

    Example:

        >>> import tempfile
        >>> from lightning_mgpu import IncompleteCheckpointError
        >>> from lightning_mgpu.plugins.checkpoint_io import check_complete
        >>> half_written = tempfile.mkdtemp()  # a checkpoint directory without its completion marker
        >>> try:
        ...     check_complete(half_written)
        ... except IncompleteCheckpointError as err:
        ...     print("is not a complete sharded checkpoint" in str(err))
        True
    """


def local_path(path: PathLike) -> Optional[str]:
    """``path`` on the local filesystem (``file://`` stripped), or ``None`` for a remote fsspec URL."""
    fs, urlpath = url_to_fs(str(path))
    return urlpath if isinstance(fs, LocalFileSystem) else None


def join_path(path: PathLike, name: str) -> str:
    """``name`` inside the checkpoint directory ``path``, a local path or an fsspec URL."""
    text = os.fspath(path)
    return os.path.join(text, name) if local_path(text) is not None else f"{text.rstrip('/')}/{name}"


def checkpoint_kind(path: PathLike) -> Optional[str]:
    """``"dir"`` (a sharded checkpoint), ``"file"`` or ``None`` (nothing) at ``path``, a local path or an fsspec
    URL (read afresh: fsspec's listing cache may predate another rank's writes)."""
    local = local_path(path)
    if local is not None:
        return "dir" if os.path.isdir(local) else "file" if os.path.exists(local) else None
    fs, root = _remote(path)
    fs.invalidate_cache(root)
    if fs.isdir(root):
        return "dir"
    return "file" if fs.exists(root) else None


def write_checkpoint_file(path: PathLike, write: Callable[[IO[bytes]], object]) -> None:
    """A file of a checkpoint: atomic and durable on a local filesystem (:func:`write_file_atomic`); at an fsspec
    URL one upload, which an object store publishes only once it is complete."""
    if (local := local_path(path)) is not None:
        write_file_atomic(local, write)
        return
    fs, file = _remote(path)
    with fs.open(file, "wb") as f:
        write(f)


def _sibling(path: Path, kind: str) -> Path:
    # hidden, and never ending in ".ckpt" (ModelCheckpoint lists "*.ckpt" as checkpoints)
    return path.with_name(f".{path.name}{kind}{os.getpid()}")


def _siblings(path: Path, kinds: Iterable[str]) -> list[Path]:
    found: list[Path] = []
    for kind in kinds:
        pattern = os.path.join(glob.escape(str(path.parent)), f".{glob.escape(path.name)}{kind}*")
        found += (Path(p) for p in glob.glob(pattern))
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with suppress(FileNotFoundError):
            path.unlink()


def fsync_dir(path: PathLike) -> None:
    """Make renames and new entries in directory ``path`` durable (POSIX: a rename survives a power loss only
    once its directory is synced). Windows cannot open a directory, and some filesystems refuse to sync one:
    skipped there, the rename itself is still atomic."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_atomic(path: PathLike, write: Callable[[IO[bytes]], object]) -> None:
    """Write a local file through ``write(f)`` so that ``path`` holds its old content or the whole new one, at
    every instant and after a power loss; the temporary file goes on a failure, and leftovers of earlier
    killed writes of this name go after a success. One writer per name at a time (rank 0 for checkpoints)."""
    final = Path(path)
    tmp = _sibling(final, _TMP)
    try:
        # "w", not exclusive: a leftover with our pid is from a dead process that had it (pid reuse)
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points to it
        os.replace(tmp, final)  # atomic on POSIX and Windows, on the same filesystem (same directory: always)
    except BaseException:
        with suppress(OSError):
            os.remove(tmp)
        raise
    fsync_dir(final.parent)
    for stale in _siblings(final, (_TMP,)):
        _remove(stale)


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's :class:`~lightning_fabric.plugins.io.TorchCheckpointIO`, with saves that are atomic and
    durable on local (and mounted network) filesystems: a process killed during a save leaves the previous
    checkpoint complete under its name, and a hidden ``.<name>.tmp-<pid>`` that the next save of that name
    removes. The checkpoint is streamed to disk (no in-memory copy of the serialized bytes).

    Lightning's own plugin writes the file to ``$TMPDIR`` and moves it into place. On the checkpoint's
    filesystem the move is a rename (atomic, but nothing is fsynced); on another one (a local ``/tmp`` or
    ``/dev/shm`` beside a network checkpoint directory) it is a copy onto the checkpoint, which a kill
    truncates. Either way a killed save leaves its file in ``$TMPDIR``, where nothing removes it.

    Every mgpu strategy uses this plugin unless you pass your own ``checkpoint_io`` (strategy argument or
    ``Trainer(plugins=[...])``): yours is then used as it is, and single-file atomicity is up to it. A wrapping
    plugin without a base (``AsyncCheckpointIO()``) gets this one as its base. Sharded checkpoint directories
    are committed atomically by :class:`~lightning_mgpu.MGPUShardedStrategy` whatever the plugin.

    Remote paths (``s3://``, ``gs://``, ...) are saved by Lightning's code, unchanged.

    Example:

        >>> import os, tempfile, torch
        >>> from lightning_mgpu import AtomicCheckpointIO
        >>> io = AtomicCheckpointIO()
        >>> folder = tempfile.mkdtemp()
        >>> io.save_checkpoint({"step": 3, "weight": torch.ones(2)}, os.path.join(folder, "last.ckpt"))
        >>> io.load_checkpoint(os.path.join(folder, "last.ckpt"))["step"]
        3
        >>> os.listdir(folder)  # no temporary file is left beside it
        ['last.ckpt']
    """

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: PathLike, storage_options: Optional[Any] = None
    ) -> None:
        local = local_path(path)
        if local is None or storage_options is not None:
            # Remote (fsspec, non-local): Lightning's code, an fsspec transaction; object stores have no rename
            # and publish an object only once its upload completes. storage_options: Lightning raises its error.
            super().save_checkpoint(checkpoint, os.fspath(path), storage_options)
            return
        os.makedirs(os.path.dirname(os.path.abspath(local)), exist_ok=True)
        write_file_atomic(local, lambda f: torch.save(checkpoint, f))

    @override
    def load_checkpoint(
        self,
        path: PathLike,
        map_location: Optional[Any] = "cpu",
        weights_only: Optional[bool] = None,
    ) -> dict[str, Any]:
        """Lightning's load, with the user's ``weights_only`` (``None``: ``True``, torch's default, for remote URLs
        too, which Lightning reads with ``False``); a file that is not plain data is refused naming it and the
        call that loads it once you trust it (:func:`refusal_message`). The tensors are read onto the CPU, as
        Lightning's default ``lambda storage, loc: storage`` does, but named ``"cpu"``: torch takes no callable for a
        tensor subclass (a 4-bit ``NF4Tensor`` base)."""
        trust = True if weights_only is None else weights_only
        try:
            return super().load_checkpoint(os.fspath(path), map_location=map_location, weights_only=trust)
        except pickle.UnpicklingError as err:
            if not trust:
                raise  # a damaged file, read as the user asked
            raise pickle.UnpicklingError(refusal_message(path, path, err)) from err

    @override
    def remove_checkpoint(self, path: PathLike) -> None:
        local = local_path(path)
        if local is not None and os.path.isdir(local) and not os.path.islink(local):
            remove_dir(local)
            return
        super().remove_checkpoint(os.fspath(path))


# --- sharded checkpoint directories ---------------------------------------------------------------------
# The protocol (MGPUShardedStrategy.save_checkpoint): rank 0 calls begin_dir; every rank writes into the
# staging directory; barrier; rank 0 calls commit_dir. Under the final name there is, at every instant, the
# old complete directory or the new complete one, except between the two renames of the swap (microseconds),
# where both exist under hidden names and recover_dir (run by the next save or load of that name) renames the
# new one in.


def begin_dir(path: PathLike) -> str:
    """Rank 0, before a sharded save to ``path``: finish an interrupted swap, remove leftovers of killed saves
    of this name, and create the empty staging directory every rank writes into (returned)."""
    if local_path(path) is None:
        return _remote_begin(path)
    final = Path(path)
    recover_dir(final)
    for stale in _siblings(final, (_TMP, _OLD, _DEL)):
        _remove(stale)
    staging = _sibling(final, _TMP)
    staging.mkdir(parents=True)
    return str(staging)


def commit_dir(staging: PathLike, path: PathLike, info: dict[str, Any]) -> None:
    """Rank 0, once every rank has written into ``staging``: mark it complete (``info`` and the list of its
    files go into the marker) and swap it in under ``path``; the previous directory is then removed.

    At an fsspec URL (an object store: no rename, no fsync) the swap is a copy: the old checkpoint's marker goes
    first (a partial directory is never taken for complete), then its files; the staging's files are copied under
    the name, the marker last, and the staging goes. A save killed during the copy leaves the complete staging,
    which the next save or load of the name copies in (:func:`recover_dir`)."""
    if local_path(path) is None:
        _remote_commit(staging, path, info)
        return
    staging = Path(staging)
    final = Path(path)
    fsync_dir(staging)  # torch.distributed.checkpoint fsyncs each rank's files; this syncs their names
    marker = {**info, "files": sorted(p.name for p in staging.iterdir())}
    write_file_atomic(staging / COMPLETE_MARKER, lambda f: f.write(json.dumps(marker, indent=1).encode()))
    old: Optional[Path] = None
    if final.exists():
        old = _sibling(final, _OLD)
        os.rename(final, old)
    # A kill between these two renames leaves no directory under the name: recover_dir renames staging in.
    os.rename(staging, final)
    fsync_dir(final.parent)
    if old is not None:
        _remove(old)


def recover_dir(path: PathLike) -> Optional[Path]:
    """If ``path`` is missing because a save was killed in the middle of its swap, rename the complete new
    directory in (or, failing that, the old one back); returns what was renamed in."""
    if local_path(path) is None:
        return _remote_recover(path)
    final = Path(path)
    if final.exists() or final.is_symlink():
        return None
    for kind in (_TMP, _OLD):  # the new one, complete, was being swapped in: finish the commit
        complete = [p for p in _siblings(final, (kind,)) if (p / COMPLETE_MARKER).is_file()]
        if complete:
            found = max(complete, key=lambda p: (p / COMPLETE_MARKER).stat().st_mtime)
            os.rename(found, final)
            fsync_dir(final.parent)
            log.warning(f"{final} was missing after an interrupted save; recovered it from {found.name}.")
            return found
    return None


def check_complete(path: PathLike) -> dict[str, Any]:
    """The marker of sharded checkpoint directory ``path``; raises :class:`IncompleteCheckpointError` if the
    save that wrote it did not finish."""
    if local_path(path) is None:
        return _remote_check_complete(path)
    final = Path(path)
    fix = _previous_checkpoints(final)
    marker_path = final / COMPLETE_MARKER
    if not marker_path.is_file():
        raise IncompleteCheckpointError(
            f"{final} is not a complete sharded checkpoint: it has no {COMPLETE_MARKER}, which lightning_mgpu "
            f"writes only after every rank has saved its part. Its save was interrupted (a process was killed or "
            f"a rank failed), or another program wrote it. {fix}"
        )
    marker: dict[str, Any] = json.loads(marker_path.read_text())
    missing = sorted(set(marker.get("files", [])) - {p.name for p in final.iterdir()})
    if missing:
        raise IncompleteCheckpointError(f"{final} is damaged: {missing}, listed in {COMPLETE_MARKER}, are gone. {fix}")
    return marker


def _previous_checkpoints(final: Path) -> str:
    """The fix for a refused directory: the complete checkpoints beside it, newest first."""
    try:
        found = [
            p
            for p in final.parent.iterdir()
            if p != final
            and not p.name.startswith(".")
            and ((p.is_file() and p.suffix == ".ckpt") or (p / COMPLETE_MARKER).is_file())
        ]
    except OSError:
        found = []
    if not found:
        return "Resume from an earlier checkpoint, or start without ckpt_path, and delete this directory."
    found.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    names = ", ".join(str(p) for p in found[:5])
    return f"Resume from the previous checkpoint instead: ckpt_path='{found[0]}' (beside it, newest first: {names})."


# --- the same protocol at an fsspec URL (an object store) ---------------------------------------------


def _remote(path: PathLike) -> tuple[AbstractFileSystem, str]:
    fs, root = url_to_fs(os.fspath(path))
    return fs, root.rstrip("/")


def _remote_children(fs: AbstractFileSystem, root: str) -> list[str]:
    """The names in the directory (prefix) ``root``, read afresh."""
    fs.invalidate_cache(root)
    try:
        return sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False))
    except FileNotFoundError:
        return []


def _remote_siblings(fs: AbstractFileSystem, root: str, kinds: Iterable[str]) -> list[str]:
    parent, name = posixpath.split(root)
    prefixes = tuple(f".{name}{kind}" for kind in kinds)
    return [f"{parent}/{n}" for n in _remote_children(fs, parent) if n.startswith(prefixes)]


def _remote_begin(path: PathLike) -> str:
    fs, root = _remote(path)
    _remote_recover(path)
    for stale in _remote_siblings(fs, root, (_TMP,)):
        fs.rm(stale, recursive=True)
    parent, name = posixpath.split(root)
    staging = f"{parent}/.{name}{_TMP}{os.getpid()}"
    fs.makedirs(staging, exist_ok=True)  # nothing to make on an object store; a directory elsewhere
    return str(fs.unstrip_protocol(staging))


def _remote_commit(staging_url: PathLike, path: PathLike, info: dict[str, Any]) -> None:
    fs, staging = _remote(staging_url)
    files = [n for n in _remote_children(fs, staging) if n != COMPLETE_MARKER]
    marker = {**info, "files": files}
    fs.pipe_file(f"{staging}/{COMPLETE_MARKER}", json.dumps(marker, indent=1).encode())
    _remote_replace(fs, staging, _remote(path)[1], files)


def _remote_replace(fs: AbstractFileSystem, staging: str, final: str, files: list[str]) -> None:
    """Copy the complete ``staging`` under ``final`` (see :func:`commit_dir`), then remove it."""
    if COMPLETE_MARKER in _remote_children(fs, final):
        fs.rm_file(f"{final}/{COMPLETE_MARKER}")
    if _remote_children(fs, final):
        fs.rm(final, recursive=True)
    for name in files:
        fs.copy(f"{staging}/{name}", f"{final}/{name}")
    fs.copy(f"{staging}/{COMPLETE_MARKER}", f"{final}/{COMPLETE_MARKER}")
    fs.rm(staging, recursive=True)
    fs.invalidate_cache(posixpath.dirname(final))


def _remote_recover(path: PathLike) -> Optional[Path]:
    fs, final = _remote(path)
    if COMPLETE_MARKER in _remote_children(fs, final):
        return None
    for staging in _remote_siblings(fs, final, (_TMP,)):
        names = _remote_children(fs, staging)
        if COMPLETE_MARKER in names:
            _remote_replace(fs, staging, final, [n for n in names if n != COMPLETE_MARKER])
            log.warning(f"{path} was incomplete after an interrupted save; recovered it from {staging}.")
            return Path(staging)
    return None


def _remote_check_complete(path: PathLike) -> dict[str, Any]:
    fs, final = _remote(path)
    names = _remote_children(fs, final)
    fix = "Resume from an earlier checkpoint, or start without ckpt_path, and delete this directory."
    if COMPLETE_MARKER not in names:
        raise IncompleteCheckpointError(
            f"{path} is not a complete sharded checkpoint: it has no {COMPLETE_MARKER}, which lightning_mgpu "
            f"writes only after every rank has saved its part. Its save was interrupted (a process was killed or "
            f"a rank failed), or another program wrote it. {fix}"
        )
    marker: dict[str, Any] = json.loads(fs.cat_file(f"{final}/{COMPLETE_MARKER}"))
    missing = sorted(set(marker.get("files", [])) - set(names))
    if missing:
        raise IncompleteCheckpointError(f"{path} is damaged: {missing}, listed in {COMPLETE_MARKER}, are gone. {fix}")
    return marker


def remove_dir(path: PathLike) -> None:
    """Remove a checkpoint directory so that a kill midway never leaves a partial one under its name (it is
    renamed aside first; a leftover ``.<name>.del-<pid>`` is no checkpoint)."""
    final = Path(path)
    aside = _sibling(final, _DEL)
    _remove(aside)
    try:
        os.rename(final, aside)
    except OSError:
        aside = final
    shutil.rmtree(aside, ignore_errors=True)


def sharded_directory_message(path: PathLike, owner: str) -> str:
    """Why ``owner`` (a strategy that reads one-file checkpoints) cannot load the directory ``path``, and the
    strategy to resume with: the one that wrote it, from its completion marker where there is one."""
    final = Path(path)
    marker_path = final / COMPLETE_MARKER
    stage, backend = 2, "torch"
    try:
        marker = json.loads(marker_path.read_text()) if marker_path.is_file() else {}
        stage = int(marker.get("stage", stage))
        backend = str(marker.get("backend", backend))
    except (OSError, ValueError, TypeError):  # a damaged marker: name the default sharded strategy
        pass
    args = f"stage={stage}" + (f", backend={backend!r}" if backend != "torch" else "")
    preset = {1: "mgpu_zero1", 2: "mgpu_sharded", 3: "mgpu_zero3"}.get(stage, "mgpu_sharded")
    if backend == "fairscale":
        preset = "mgpu_sharded_fairscale"
    return (
        f"{final} is a directory: a sharded checkpoint (written by MGPUShardedStrategy(checkpoint='sharded')), which "
        f"{owner} cannot load; it reads one-file checkpoints. Resume with the strategy that wrote it: "
        f"strategy=MGPUShardedStrategy({args}, checkpoint='sharded') (the preset {preset!r} with checkpoint='sharded')."
    )


# ----------------------------------------------------------------------------------------------------
# Reading: a checkpoint is data. Every file of a checkpoint (one file; a sharded directory's meta.pt, the
# metadata file of torch.distributed.checkpoint and the non-tensor entries of its .distcp files) is read with
# the user's weights_only; None is torch's default, True. What the pack writes there is plain data (tensors,
# containers, numbers, strings: tests/integration/plugins/test_checkpoint_io.py loads each layout with
# weights_only=True). The one file written by torch, not by the pack, with other objects is the metadata file
# of torch.distributed.checkpoint (a pickle of its dataclasses): _dcp_metadata_global, the one list of the globals
# allowed there, each with its reason.

_REASON = re.compile(r"WeightsUnpickler error: (.*?)(?: Please use|\n|$)")


def refusal_message(file: PathLike, ckpt_path: PathLike, cause: BaseException) -> str:
    """Why ``file`` (of the checkpoint ``ckpt_path``) was not loaded under ``weights_only=True``, and the call
    that loads it once the user trusts it.

    Example:

        >>> import pickle
        >>> message = refusal_message("ckpt/meta.pt", "ckpt", pickle.UnpicklingError("Unsupported global: os.system"))
        >>> "trainer.fit(model, ckpt_path='ckpt', weights_only=False)" in message
        True
    """
    return (
        f"{file} was not loaded: it holds something other than tensors, containers, numbers and strings, and "
        f"unpickling it could run code from the file ({_reason(cause)}). Checkpoints are read with weights_only=True "
        f"(torch's default) unless you pass weights_only=False. If you trust where this checkpoint comes from, load "
        f"it with trainer.fit(model, ckpt_path={os.fspath(ckpt_path)!r}, weights_only=False) (the same argument for "
        f"trainer.validate, test and predict); otherwise do not load it."
    )


def _reason(cause: BaseException) -> str:
    """torch's reason for a refusal (the global it does not allow), without its long advice."""
    found = _REASON.search(str(cause))
    reason = found.group(1) if found else (str(cause).strip().splitlines() or [type(cause).__name__])[0]
    return reason.strip().rstrip(".")


def load_file(
    path: PathLike,
    weights_only: Optional[bool] = None,
    map_location: Any = None,
    ckpt_path: Optional[PathLike] = None,
    mmap: bool = False,
) -> Any:
    """``torch.load(path, weights_only=weights_only)`` of a checkpoint file, local or at an fsspec URL
    (``ckpt_path``, what the user passed, defaults to ``path``); refused with :func:`refusal_message` (a
    ``pickle.UnpicklingError``) unless ``weights_only=False``. ``mmap`` (a local file): the tensors are mapped from
    the file, read when used.

    Example:

        >>> import os, tempfile, torch
        >>> path = os.path.join(tempfile.mkdtemp(), "meta.pt")
        >>> torch.save({"epoch": 3, "loops": {"step": torch.tensor(7)}}, path)
        >>> load_file(path)["epoch"]
        3
    """

    def read() -> Any:
        if local_path(path) is not None:
            return torch.load(path, map_location=map_location, weights_only=weights_only, mmap=mmap)
        fs, file = _remote(path)
        return torch.load(io.BytesIO(fs.cat_file(file)), map_location=map_location, weights_only=weights_only)

    try:
        try:
            return read()
        except pickle.UnpicklingError as err:
            if weights_only is False or not loads_once_imported(err):
                raise
            return read()  # a 4-bit base: torchao's class, allowed once its module is imported
    except pickle.UnpicklingError as err:
        if weights_only is False:
            raise
        raise pickle.UnpicklingError(refusal_message(path, ckpt_path or path, err)) from err


def _dcp_metadata_global(module: str, found: Any) -> bool:
    """The globals a ``torch.distributed.checkpoint`` metadata file may name; each constructs data, runs nothing:

    * its own dataclasses and enums (``Metadata``, ``TensorStorageMetadata``, ``ChunkStorageMetadata``,
      ``BytesStorageMetadata``, ``TensorProperties``, ``MetadataIndex``, ``StorageMeta``, the file reader's
      storage entries, the memory-format enum): the description of every saved entry;
    * ``torch.Size`` and the ``torch`` dtypes: each tensor's shape and dtype;
    * ``torch.serialization._get_layout`` (``_compat.torch_layout_decoder``): each tensor's layout, by name;
    * the ``pathlib`` path classes (``pathlib._local`` on Python 3.13): ``StorageMeta.checkpoint_id``, the directory it
      was saved to.
    """
    if isinstance(found, type):
        if module.startswith("torch.distributed.checkpoint."):
            return dataclasses.is_dataclass(found) or issubclass(found, enum.Enum)
        if module in _PATHLIB_MODULES:
            return issubclass(found, pathlib.PurePath)
        return found is torch.Size
    if isinstance(found, torch.dtype):
        return True
    decoder = torch_layout_decoder()
    return decoder is not None and found is decoder


# Python 3.13 defines the path classes in pathlib._local, and pickles name them there
_PATHLIB_MODULES = ("pathlib", "pathlib._local")
_DCP_METADATA_MODULES = ("torch", "torch.serialization", *_PATHLIB_MODULES)


class _DCPMetadataUnpickler(pickle.Unpickler):
    """Unpickles a ``torch.distributed.checkpoint`` metadata file (torch writes it with ``pickle.dump`` and reads it
    with ``pickle.load``, whatever ``weights_only``) allowing only :func:`_dcp_metadata_global`; a module outside
    those is not even imported."""

    @override
    def find_class(self, module: str, name: str) -> Any:
        if module in _DCP_METADATA_MODULES or module.startswith("torch.distributed.checkpoint."):
            found = super().find_class(module, name)
            if _dcp_metadata_global(module, found):
                return found
        raise pickle.UnpicklingError(f"Unsupported global: {module}.{name} is not data of a sharded checkpoint")


def check_sharded_metadata(path: PathLike, weights_only: Optional[bool] = None) -> None:
    """Unless ``weights_only=False``: refuse the directory ``path`` if a ``torch.distributed.checkpoint`` metadata
    file in it (``.metadata``, or a rank's ``__<rank>.metadata``) names anything but :func:`_dcp_metadata_global`.
    Every rank checks before loading, so all refuse alike (no rank waits in a collective)."""
    if weights_only is False:
        return
    if local_path(path) is None:
        fs, root = _remote(path)
        for name in (n for n in _remote_children(fs, root) if n.endswith(".metadata")):
            try:
                _DCPMetadataUnpickler(io.BytesIO(fs.cat_file(f"{root}/{name}"))).load()
            except pickle.UnpicklingError as err:
                raise pickle.UnpicklingError(refusal_message(join_path(path, name), path, err)) from err
        return
    final = Path(path)
    for file in sorted(p for p in final.iterdir() if p.name.endswith(".metadata") and p.is_file()):
        try:
            with open(file, "rb") as f:
                _DCPMetadataUnpickler(f).load()
        except pickle.UnpicklingError as err:
            raise pickle.UnpicklingError(refusal_message(file, final, err)) from err


def _data_only_load_planner() -> Any:
    """``torch.distributed.checkpoint``'s default load planner, reading the non-tensor entries of the ``.distcp``
    files (optimizer hyper-parameters, ``step`` counts saved as numbers) as data: torch's reads them with
    ``torch.load(weights_only=False)``. Each entry is checked with ``weights_only=True`` first."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class DataOnlyLoadPlanner(DefaultLoadPlanner):
        @override
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as err:
                fqn = getattr(read_item.dest_index, "fqn", "?")
                raise pickle.UnpicklingError(f"{_reason(err)}, in the entry {fqn!r} of a .distcp file") from err
            value.seek(0)
            super().load_bytes(read_item, value)

    return DataOnlyLoadPlanner()


def _unpickling_cause(error: BaseException) -> Optional[BaseException]:
    """The ``pickle.UnpicklingError`` behind a ``torch.distributed.checkpoint`` failure (its ``failures``: every
    rank's exception), if any."""
    if isinstance(error, pickle.UnpicklingError):
        return error
    per_rank = getattr(error, "failures", None)
    if isinstance(per_rank, dict):
        for wrapped in per_rank.values():
            inner = wrapped[0] if isinstance(wrapped, tuple) and wrapped else wrapped
            if isinstance(inner, BaseException) and (found := _unpickling_cause(inner)) is not None:
                return found
    return None


# ----------------------------------------------------------------------------------------------------
# torch.distributed.checkpoint's save and load of a sharded directory's tensors (collectives of torch's own).


def _fsspec_storage(path: str, reader: bool) -> Any:
    """torch.distributed.checkpoint's fsspec reader or writer for a URL (``s3://...``), ``None`` for a local path
    (its default file system storage)."""
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    if isinstance(url_to_fs(path)[0], LocalFileSystem):
        return None
    return dcp_fsspec_storage(path, reader)


def save_sharded(state: dict[str, Any], path: str, group: Optional[Any] = None) -> None:
    """``torch.distributed.checkpoint.save`` of ``state`` into the directory ``path`` (local, or an fsspec URL):
    a collective over ``group`` (every rank writes its shards; the ranks agree on one save plan first). ``state``
    as :func:`dcp_layout` gives it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(state, checkpoint_id=path, storage_writer=_fsspec_storage(path, reader=False), process_group=group)


def _scattered_dims(tensor: Any) -> list[int]:
    """The mesh dimensions over which ``tensor`` (a ``DTensor``) holds pieces that are no contiguous block of the
    whole: a strided shard that no later mesh dimension shards again (a packed query/key/value projection's
    ``_StridedShard(1, split_factor=3)``; FSDP2's strided shard under a tensor-parallel ``Shard(0)`` is contiguous).
    ``torch.distributed.checkpoint`` writes a shard as one block, so these dimensions are saved replicated."""
    placements = getattr(tensor, "placements", None)
    if placements is None:
        return []
    return [
        i
        for i, p in enumerate(placements)
        if is_strided_shard(p) and not any(q.is_shard(p.dim) for q in placements[i + 1 :])
    ]


def _map_tensors(state: Any, fn: Any) -> Any:
    if isinstance(state, dict):
        return {k: _map_tensors(v, fn) for k, v in state.items()}
    if isinstance(state, list):
        return [_map_tensors(v, fn) for v in state]
    return fn(state) if isinstance(state, torch.Tensor) else state


def _any_scattered(state: Any) -> bool:
    if isinstance(state, dict):
        return any(_any_scattered(v) for v in state.values())
    if isinstance(state, list):
        return any(_any_scattered(v) for v in state)
    return bool(_scattered_dims(state))


def _blockwise(tensor: Any) -> Any:
    from torch.distributed.tensor import Replicate

    dims = _scattered_dims(tensor)
    if not dims:
        return tensor
    placements = [Replicate() if i in dims else p for i, p in enumerate(tensor.placements)]
    return tensor.redistribute(tensor.device_mesh, placements)


def dcp_layout(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` as ``torch.distributed.checkpoint`` can write it: each ``DTensor`` whose local pieces are no
    contiguous block of the whole (a packed projection split by heads) replicated over those mesh dimensions (a
    collective over them; call it on every rank, on the training thread); everything else as it is."""
    return _map_tensors(state, _blockwise)


def load_sharded(
    template: dict[str, Any],
    path: str,
    group: Optional[Any] = None,
    planner: Optional[Any] = None,
    *,
    local: bool = False,
) -> None:
    """``torch.distributed.checkpoint.load`` into ``template`` in place, from ``path`` (local, or an fsspec URL): a
    collective over ``group`` (every rank reads the slices it owns now, whatever the world size at save time);
    ``planner``: a ``LoadPlanner`` (default: torch's). ``local``: this process alone reads whole tensors, no
    collective even where a process group is up."""
    import torch.distributed.checkpoint as dcp

    reader = _fsspec_storage(path, reader=True)
    with warnings.catch_warnings():
        if local:  # torch warns that it assumes one process: here that is what was asked
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        # a tensor scattered over a mesh dimension is read replicated over it, then copied back into its layout
        blockwise = dcp_layout(template) if _any_scattered(template) else template
        dcp.load(
            blockwise, checkpoint_id=path, storage_reader=reader, process_group=group, planner=planner, no_dist=local
        )
    if blockwise is not template:
        _copy_back(template, blockwise)


def _copy_back(template: Any, loaded: Any) -> None:
    """What DCP read into ``loaded`` (:func:`dcp_layout` of ``template``) put into ``template``: each tensor read
    replicated copied into the split layout, every other entry set as DCP set it."""
    if isinstance(template, (dict, list)):
        keys = list(loaded) if isinstance(loaded, dict) else range(len(loaded))
        for k in keys:
            if isinstance(template[k], (dict, list, torch.Tensor)):
                _copy_back(template[k], loaded[k])
            else:
                template[k] = loaded[k]
    elif loaded is not template:  # a DTensor read replicated over the dimensions it is scattered on
        with torch.no_grad():
            comm.local_shard(template).copy_(
                comm.local_shard(loaded.redistribute(template.device_mesh, template.placements))
            )


def load_sharded_dir(template: dict[str, Any], path: PathLike, group: Any, weights_only: Optional[bool] = None) -> None:
    """Read the tensors of the sharded checkpoint directory ``path`` into ``template`` in place (every rank the
    slices it owns: a collective over ``group``), its metadata and non-tensor entries as data unless
    ``weights_only=False`` (:func:`check_sharded_metadata`); refused with :func:`refusal_message`. ``path``: a local
    directory or an fsspec URL."""
    final = Path(path) if local_path(path) is not None else os.fspath(path)
    check_sharded_metadata(final, weights_only)
    planner = None if weights_only is False else _data_only_load_planner()
    try:
        load_sharded(template, str(final), group, planner=planner)
    except BaseException as err:  # torch's CheckpointException is a BaseException
        cause = _unpickling_cause(err)
        if weights_only is False or cause is None:
            raise
        raise pickle.UnpicklingError(refusal_message(final, final, cause)) from err


# ----------------------------------------------------------------------------------------------------
# Which checkpoint IO plugin a strategy uses: atomic file writes unless the user chose a plugin.


def choose_checkpoint_io(current: Optional[CheckpointIO]) -> CheckpointIO:
    """:class:`~lightning_mgpu.AtomicCheckpointIO` for ``None``; a plugin that was given is used as it is; a
    wrapping plugin without a base (e.g. ``AsyncCheckpointIO()``) gets ``AtomicCheckpointIO`` as its base.

    Example::

        io = choose_checkpoint_io(None)  # AtomicCheckpointIO()
    """
    if current is None:
        return AtomicCheckpointIO()
    if is_wrapping_checkpoint_io(current):
        current.checkpoint_io = AtomicCheckpointIO()  # type: ignore[attr-defined]  # ignored when it has a base
    return current
