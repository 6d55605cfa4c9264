"""Frozen-trunk training (`--optim.train heads`): heads 2..K learn on a trunk that never changes.

With the trunk, head 1, the embedding, the final norm and the unembedding frozen, a training step
needs of them only what they output for its windows: the trunk output h, and with `--loss.targets
self` or `greedy` head 1's greedy tokens. `FrozenTrunk` computes both in one forward without a
graph and keeps them per window (keyed by its tokens), so later epochs read them back instead of
running the trunk again, in memory or, with `--optim.trunk_cache_dir`, on disk for every later
run of the same model too; the `frozen_trunk` path of `mtp.train.loss` then trains heads 2..K
from h. What this saves per token: docs/design-notes.md, "Frozen-trunk training".
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from mtp.model.transformer import MTPTransformer, Rope
from mtp.train.targets import greedy_predictions, mtp_inputs_targets, targets_from_predictions
from mtp.util.digests import tensor_digests

__all__ = ["DiskStore", "FrozenTrunk", "MemoryStore", "store_folder"]


class MemoryStore:
    """Window entries kept in memory, as computed, up to `max_bytes` (later windows are computed
    each time they come)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.bytes = max_bytes, 0
        self.entries: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}

    def get(self, key: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.entries.get(key)

    def put(self, key: bytes, h: torch.Tensor, targets: torch.Tensor) -> None:
        size = h.nbytes + targets.nbytes
        if self.bytes + size <= self.max_bytes:
            self.entries[key] = (h.clone(), targets.clone())
            self.bytes += size


class DiskStore:
    """Window entries in a folder, the trunk outputs in half precision, memory-mapped, shared by
    every run of the same frozen model, targets and window length (`--optim.trunk_cache_dir`).

    Three files grow a row per window: `features.f16` (T x d), `targets.i64` (K x T) and
    `keys.bin` (the sha256 of the window's tokens), the key written last, so a row counts only
    once all three are whole; a row a killed run left half-written is cut off when the folder
    is opened again. Features are rounded to half precision when they are computed, so a run
    reads the same features in its first epoch as in every later one, and as a later run does.
    """

    KEY_BYTES = 32

    def __init__(self, folder: Path, T: int, d: int, K: int) -> None:
        self.folder, self.shape = folder, ((T, d), (K, T))
        folder.mkdir(parents=True, exist_ok=True)
        self.paths = [folder / "features.f16", folder / "targets.i64", folder / "keys.bin"]
        self.row_bytes = [T * d * 2, K * T * 8, self.KEY_BYTES]
        for path in self.paths:
            path.touch()
        rows = min(path.stat().st_size // n for path, n in zip(self.paths, self.row_bytes))
        for path, n in zip(self.paths, self.row_bytes):
            if path.stat().st_size != rows * n:
                os.truncate(path, rows * n)  # a row a killed run left half-written
        keys = self.paths[2].read_bytes()
        self.index = {keys[i * self.KEY_BYTES:(i + 1) * self.KEY_BYTES]: i for i in range(rows)}
        self.rows = rows
        self.files = [open(path, "ab") for path in self.paths]
        self.maps: tuple[np.ndarray, np.ndarray] | None = None

    @classmethod
    def key(cls, window: bytes) -> bytes:
        return hashlib.sha256(window).digest()

    def get(self, key: bytes) -> tuple[torch.Tensor, torch.Tensor] | None:
        row = self.index.get(self.key(key))
        if row is None:
            return None
        if self.maps is None or len(self.maps[0]) <= row:
            for f in self.files:
                f.flush()
            self.maps = tuple(np.memmap(path, dtype=dtype, mode="r", shape=(self.rows, *shape))
                              for path, dtype, shape in zip(self.paths[:2],
                                                            (np.float16, np.int64), self.shape))
        h, targets = (torch.from_numpy(np.array(m[row])) for m in self.maps)
        return h.float(), targets

    def put(self, key: bytes, h: torch.Tensor, targets: torch.Tensor) -> None:
        features, digest = h.to(torch.float16).cpu().numpy(), self.key(key)
        if digest in self.index:
            return
        if not np.isfinite(features).all():
            raise ValueError("a frozen trunk output does not fit half precision (overflow); "
                             "train without --optim.trunk_cache_dir")
        for f, data in zip(self.files, (features.tobytes(), targets.cpu().numpy().astype(
                np.int64).tobytes(), digest)):
            f.write(data)
        self.index[digest] = self.rows
        self.rows += 1

    def close(self) -> None:
        for f in self.files:
            f.close()


def store_folder(root: str | os.PathLike, model: MTPTransformer, targets: str, T: int) -> Path:
    """The folder under `root` of the frozen model's entries: named by a digest of the frozen
    tensors (all but heads 2..K), the targets and the window length, so another model, other
    targets or another length never reads them."""
    frozen = {name: p for name, p in model.state_dict().items()
              if not (name.startswith("heads.") and not name.startswith("heads.0."))}
    layers = model.cfg.feature_layers
    h = hashlib.sha256((f"v1 {targets} T={T} K={model.cfg.n_future}"
                        + (f" features={layers}" if layers else "")).encode())
    for name, digest in sorted(tensor_digests(frozen).items()):
        h.update(f"{name} {digest}".encode())
    return Path(root) / h.hexdigest()[:24]


class FrozenTrunk:
    """The frozen trunk's output and the targets of each training window, computed once.

    A window's entry is its trunk output h (T, d) and its K target rows (K, T), kept in memory
    (`MemoryStore`, up to `max_bytes`) or, with `folder`, on disk (`DiskStore`). The key is the
    window's tokens, so a window finds its entry whatever batch it comes in (each epoch shuffles
    them). Valid only while the trunk and head 1 do not change, which `--optim.train heads`
    ensures.
    """

    def __init__(self, model: MTPTransformer, *, targets: str, max_bytes: int,
                 folder: str | os.PathLike | None = None) -> None:
        self.model, self.targets = model, targets
        self.store: MemoryStore | DiskStore = MemoryStore(max_bytes)
        self.folder = folder
        self.hits = self.misses = 0

    @torch.no_grad()
    def _compute(self, window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """h (B, T, d) and targets (K, B, T) of windows (B, T + K), in one trunk forward."""
        model, K = self.model, self.model.cfg.n_future
        T = window.shape[1] - K
        if self.targets == "data":
            inputs, targets = mtp_inputs_targets(window, K)
            return model.trunk(inputs)[0], targets
        # Head 1's greedy token after each of the first T + K - 1 tokens, as `self_targets`
        # computes them. The trunk is causal, so its first T outputs are the heads' inputs.
        h, rope = model.trunk(window[:, :-1])  # (B, T + K - 1, d)
        preds = greedy_predictions(model, h, rope)  # (B, T + K - 1)
        return h[:, :T], targets_from_predictions(window, preds, K,
                                                  on_greedy_path=self.targets == "greedy")

    def __call__(self, window: torch.Tensor) -> tuple[torch.Tensor, Rope, torch.Tensor]:
        """h (B, T, d), the rotary tables of its positions and targets (K, B, T) of the windows
        (B, T + K): what the `frozen_trunk` path of `mtp.train.loss.heads_loss` reads."""
        if self.folder is not None and isinstance(self.store, MemoryStore):
            T = window.shape[1] - self.model.cfg.n_future
            self.store = DiskStore(store_folder(self.folder, self.model, self.targets, T), T,
                                   self.model.trunk_width, self.model.cfg.n_future)
        keys = [row.numpy().tobytes() for row in window.cpu()]
        got = [self.store.get(key) for key in keys]
        missing = [b for b, g in enumerate(got) if g is None]
        self.hits += len(keys) - len(missing)
        self.misses += len(missing)
        if missing:
            h_new, t_new = self._compute(window[missing])
            if isinstance(self.store, DiskStore):
                h_new = h_new.to(torch.float16).float()  # what every later read gets
            for j, b in enumerate(missing):
                got[b] = (h_new[j], t_new[:, j])
                self.store.put(keys[b], h_new[j], t_new[:, j])
        h = torch.stack([g[0] for g in got]).to(window.device)
        targets = torch.stack([g[1] for g in got], dim=1).to(window.device)
        positions = torch.arange(h.shape[1], device=h.device).expand(h.shape[0], -1)
        return h, self.model.rotary(positions), targets
