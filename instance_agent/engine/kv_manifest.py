"""The disk KV tier's manifest: what its file holds, so the tier survives an agent restart.

Contract:
- Beside the disk file ``X.bin`` lies ``X.json`` (`manifest_path`): the format version, the header
  (everything the bytes depend on: the model as given, its config digest and weights, the KV dtype,
  block size, per-block layout and bytes, slots, hash algorithm and root), and each occupied slot's
  block hash, parent hash, token ids and checksum, least recently used first (`ManifestSlot`).
- `write_manifest` fsyncs the data file, then replaces the manifest atomically (a temp file,
  fsync, rename, fsync of the folder): a crash leaves the old manifest or the new one, never a mix.
- The trust rule: a slot's checksum is taken from its bytes when they are written (`TierBuffers`);
  on start a listed slot is restored only if its bytes still hash to it. A slot written again after
  the manifest (the old manifest names its old block), torn by a crash, or lost with the page cache
  fails that check and is dropped: never served as a block's KV unless it is that block's.
- `read_manifest` returns the listing when the header equals the expected one; otherwise, or when
  the manifest cannot be read, None and a WARNING naming what differed, and the manifest is
  removed (the tier starts empty and the file's bytes are overwritten as it fills).
- `ManifestWriter` writes on its own thread, one write at a time; `close` waits for it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from instance_agent.engine.config import PRESETS, ModelConfig
from kvherd.block_hash import ROOT_PARENT_HASH, BlockHash

log = logging.getLogger(__name__)

FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class ManifestSlot:
    slot: int
    block_hash: BlockHash
    parent: BlockHash | None
    tokens: bytes  # uint32 token ids, packed
    checksum: int  # xxh3-64 of the slot's bytes when they were written


def manifest_path(disk_file: str | Path) -> Path:
    return Path(disk_file).with_suffix(".json")


def model_identity(model: str, config: ModelConfig, seed: int) -> dict[str, Any]:
    """What names the weights: a preset and its seed, or a checkpoint folder (absolute) and its
    weight files' names, sizes and modification times; with the config's digest either way."""
    config_digest = hashlib.sha256(json.dumps(asdict(config), sort_keys=True).encode()).hexdigest()
    if model in PRESETS:
        weights = f"random init, seed {seed}"
    else:
        files = sorted(
            (p.name, p.stat().st_size, p.stat().st_mtime_ns)
            for p in Path(model).iterdir()
            if p.suffix in (".safetensors", ".bin", ".pt")
        )
        weights = hashlib.sha256(json.dumps(files).encode()).hexdigest()
        model = os.path.abspath(model)
    return {"model": model, "model_config": config_digest[:16], "weights": weights[:64]}


def manifest_header(
    identity: dict[str, Any],
    *,
    dtype: str,
    block_size: int,
    block_layout: list[int],
    bytes_per_block: int,
    num_blocks: int,
    hash_algo: str,
) -> dict[str, Any]:
    # The tenant salt and a LoRA name are folded into each block's hash, so a listed block only
    # ever matches a request with the same ones: nothing instance-wide to check for them.
    return {
        "format": FORMAT_VERSION,
        **identity,
        "dtype": dtype,
        "block_size": block_size,
        "block_layout": block_layout,
        "bytes_per_block": bytes_per_block,
        "num_blocks": num_blocks,
        "hash_algo": hash_algo,
        "hash_root": ROOT_PARENT_HASH,
    }


def write_manifest(
    path: Path, data_file: Path, header: dict[str, Any], slots: list[ManifestSlot]
) -> None:
    fd = os.open(data_file, os.O_RDONLY)
    try:
        os.fsync(fd)  # the bytes the checksums describe reach the disk before the manifest does
    finally:
        os.close(fd)
    body = {
        **header,
        "slots": [
            [
                s.slot,
                f"{s.block_hash:x}",
                None if s.parent is None else f"{s.parent:x}",
                base64.b64encode(s.tokens).decode("ascii"),
                f"{s.checksum:x}",
            ]
            for s in slots
        ],
    }
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        json.dump(body, handle, separators=(",", ":"))
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power loss
    finally:
        os.close(dir_fd)


def read_manifest(path: Path, header: dict[str, Any]) -> list[ManifestSlot] | None:
    """The listing of a manifest written under `header`; None (with a WARNING) otherwise."""
    if not path.exists():
        return None
    listing = _read(path, header)
    if listing is None:
        path.unlink(missing_ok=True)
    return listing


def _read(path: Path, header: dict[str, Any]) -> list[ManifestSlot] | None:
    try:
        with open(path) as handle:
            body = json.load(handle)
        found = {key: body.get(key) for key in header}
        differ = [
            f"{key} {found[key]!r} (now {value!r})"
            for key, value in header.items()
            if found[key] != value
        ]
        if differ:
            log.warning(
                "discarding the disk KV tier in %s: it was written with %s",
                path.parent,
                ", ".join(differ),
            )
            return None
        return [
            ManifestSlot(
                int(slot),
                int(block_hash, 16),
                None if parent is None else int(parent, 16),
                base64.b64decode(tokens, validate=True),
                int(checksum, 16),
            )
            for slot, block_hash, parent, tokens, checksum in body["slots"]
        ]
    except (OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        log.warning("discarding the disk KV tier in %s: unreadable manifest (%r)", path.parent, exc)
        return None


class ManifestWriter:
    """Writes manifests on one background thread; a write asked for while one runs is skipped
    (`write` returns False) and the caller asks again later."""

    def __init__(self, path: Path, data_file: Path, header: dict[str, Any]) -> None:
        self.path = path
        self.data_file = data_file
        self.header = header
        self._thread: threading.Thread | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def write(self, slots: list[ManifestSlot]) -> bool:
        if self.busy:
            return False
        self._thread = threading.Thread(
            target=self._write, args=(slots,), name="kv-manifest", daemon=True
        )
        self._thread.start()
        return True

    def _write(self, slots: list[ManifestSlot]) -> None:
        try:
            write_manifest(self.path, self.data_file, self.header, slots)
        except OSError as exc:  # the old manifest stays; its stale slots fail their checksums
            log.warning("cannot write the disk KV tier's manifest %s: %r", self.path, exc)

    def close(self, slots: list[ManifestSlot]) -> None:
        """Wait for a write in flight, then write `slots` on this thread."""
        if self._thread is not None:
            self._thread.join()
        self._write(slots)
