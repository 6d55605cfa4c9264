"""A sha256 of each tensor of a state dict, recorded where weights are written and checked where
they are read: torch checks no checksum of a checkpoint's zip members and safetensors none of
its buffers, so bytes flipped inside a tensor would otherwise load, and decode, silently."""

from __future__ import annotations

import hashlib
import os

import torch

__all__ = ["DIGESTS", "digest_mismatch", "tensor_digests"]

#: The key, in a checkpoint's `mtp` entry and an export's `mtp_config.json`, of the digests.
DIGESTS = "tensors_sha256"


def _sha256(t: torch.Tensor) -> str:
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    data = t.detach().reshape(-1).contiguous().cpu()
    h.update(data.view(torch.uint8).numpy())  # the bytes as stored, read in place (mmap too)
    return h.hexdigest()


def tensor_digests(state: dict) -> dict[str, str]:
    """The sha256 of each tensor of a state dict (its dtype, shape and bytes), by name."""
    return {k: _sha256(v) for k, v in state.items() if isinstance(v, torch.Tensor)}


def digest_mismatch(want: dict[str, str], state: dict, path: str | os.PathLike) -> str | None:
    """What is wrong, naming the file and the tensors, where `state`'s tensors differ from the
    digests `want` recorded for them; None where they match."""
    got = tensor_digests(state)
    bad = sorted(k for k in set(want) | set(got) if want.get(k) != got.get(k))
    if not bad:
        return None
    shown = ", ".join(bad[:5]) + (f" and {len(bad) - 5} more" if len(bad) > 5 else "")
    which = f"tensor {shown} does" if len(bad) == 1 else f"tensors {shown} do"
    return (f"{path} is corrupted: {which} not match the sha256 it records ({DIGESTS}); the "
            "file changed after it was written (disk, copy or download): use an intact copy")
