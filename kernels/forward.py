"""The forward of the fused linear cross-entropy: per-row loss without the ``[N, V]`` logits.

``loss_i = logsumexp_v(h_i . w_v) - h_i . w_{t_i}``, in two twins that share one contract:

* **Triton**: :func:`triton_forward` launches ``_linear_cross_entropy_fwd_kernel``, which tiles
  tokens x vocabulary, computes logit tiles with ``tl.dot`` and keeps an online log-sum-exp per
  row, so no logit is written to memory. Also here: :class:`TritonConfig` and
  :func:`default_config` (the tiles), and the tile helpers the backward kernels share
  (:func:`grouped_program_id`, :func:`load_tile`, :func:`logits_tile`).
* **Torch**: :func:`torch_forward` walks chunks of tokens in plain PyTorch
  (:func:`torch_forward_chunks`), one ``[chunk, V]`` logits buffer at a time, in the accumulation
  dtype (fp32, fp64 for fp64 inputs); half-precision weights are cast one row slice at a time
  (:func:`weight_slices`), never as a whole.

Both take validated, contiguous inputs (:mod:`mtp.kernels.dispatch` checks them). Triton decides
between compiling and interpreting when a kernel is decorated, i.e. when this module is imported:
``TRITON_INTERPRET=1`` must be set before then for the kernels to run on CPU tensors. Importable
without triton; the Triton functions then cannot be called.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is an optional dependency on CPU-only installs
    HAS_TRITON = False


# ----------------------------------------------------------------------------------------------
# Tiles and launch options (shared by the backward kernels)
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TritonConfig:
    """Tile sizes and launch parameters shared by the four kernels.

    The forward and dlogits kernels tile (tokens x vocabulary) with a K-loop over d; dhidden tiles
    (tokens x d) with a K-loop over V; dweight tiles (vocabulary x d) with a K-loop over tokens.
    """

    block_n: int = 128
    block_v: int = 128
    block_d: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group: int = 8
    """Rows of tiles per column in the launch order (L2 reuse, see grouped_program_id)."""
    v_splits: int | None = None
    """Vocabulary splits of the forward grid; ``None`` picks enough to fill the GPU."""


def default_config(dtype: torch.dtype, device: torch.device) -> TritonConfig:
    """The tiles for ``dtype`` on ``device`` when the caller gives none."""
    # NOTE: the sizes follow the Triton matmul tutorial's H100 configs.
    # bf16/fp16, 3 stages: the forward and dlogits kernels (128 x 128 tiles, K step 64 over d)
    # hold 3 x (128 + 128) x 64 x 2 B = 96 KiB of shared memory, dhidden and dweight (128 x 64
    # tiles, K step 128) 3 x 48 KiB = 144 KiB. fp32 (IEEE, no tensor cores unless torch allows
    # TF32) and fp64 double the bytes per element, so their tiles shrink to stay within the
    # 228 KiB of an SM. scripts/gpu_check.sh sweeps these.
    if device.type != "cuda":
        # The interpreter runs numpy on whole tiles: small tiles keep test shapes multi-tile.
        return TritonConfig(block_n=16, block_v=16, block_d=16, num_warps=1, num_stages=1)
    if dtype in (torch.bfloat16, torch.float16):
        return TritonConfig()
    if dtype == torch.float32:
        return TritonConfig(block_n=64, block_v=64, block_d=32, num_warps=4, num_stages=3)
    return TritonConfig(block_n=32, block_v=32, block_d=32, num_warps=4, num_stages=2)


def triton_dtypes(dtype: torch.dtype) -> tuple:
    """The kernels' accumulation dtype and ``tl.dot`` input precision for inputs of ``dtype``."""
    acc = tl.float64 if dtype == torch.float64 else tl.float32
    if dtype == torch.float32:
        # Follow torch's own fp32 matmul setting: TF32 only where the user opted in.
        precision = "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    elif dtype == torch.float64:
        precision = "ieee"
    else:
        precision = "tf32"  # Triton's default; it only affects fp32 operands, i.e. none here
    return acc, precision


def launch_options(cfg: TritonConfig, dtype: torch.dtype) -> dict:
    """The compile-time constants and launch settings every kernel takes."""
    tl_acc, precision = triton_dtypes(dtype)
    return dict(BLOCK_N=cfg.block_n, BLOCK_V=cfg.block_v, BLOCK_D=cfg.block_d, GROUP=cfg.group,
                ACC_DTYPE=tl_acc, INPUT_PRECISION=precision, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)


def triton_is_interpreted() -> bool:
    """Whether the kernels were built by the CPU interpreter (``TRITON_INTERPRET=1`` at import)."""
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_linear_cross_entropy_fwd_kernel, InterpretedFunction)


def _sm_count(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1


# ----------------------------------------------------------------------------------------------
# Triton: the kernel and its launcher
# ----------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def grouped_program_id(num_m, num_n, GROUP: tl.constexpr):
        """This program's (m, n) tile, ordered so that programs running together share inputs.

        A 2-D grid launches row after row of tiles, so the ~132 programs resident at once would
        each need a distinct tile of one operand and evict each other from L2; walking GROUP rows
        of tiles per column (the Triton matmul tutorial's ordering) keeps both operands' tiles of
        the resident programs in L2.
        """
        pid = tl.program_id(0)
        per_group = GROUP * num_n
        first_m = (pid // per_group) * GROUP
        group_size = tl.minimum(num_m - first_m, GROUP)
        pid_m = first_m + (pid % per_group) % group_size
        pid_n = (pid % per_group) // group_size
        return pid_m, pid_n

    @triton.jit
    def load_tile(ptr, rows, cols, stride, mask_rows, mask_cols):
        """The [rows, cols] tile of a row-major matrix, zero outside the masks. Row offsets are
        widened to int64 before the stride multiply: V x d reaches 2^31 elements at V = 256k,
        d = 8192, and chunk x V at 16k x 128k."""
        return tl.load(ptr + rows[:, None].to(tl.int64) * stride + cols[None, :],
                       mask=mask_rows[:, None] & mask_cols[None, :], other=0.0)

    @triton.jit
    def logits_tile(hidden_ptr, weight_ptr, offs_n, offs_v, mask_n, mask_v, D, stride_h,
                    stride_w, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                    BLOCK_D: tl.constexpr, ACC_DTYPE: tl.constexpr,
                    INPUT_PRECISION: tl.constexpr):
        """hidden[offs_n] @ weight[offs_v].T, accumulated over d in ACC_DTYPE."""
        logits = tl.zeros((BLOCK_N, BLOCK_V), dtype=ACC_DTYPE)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            h = load_tile(hidden_ptr, offs_n, offs_d, stride_h, mask_n, mask_d)
            w = load_tile(weight_ptr, offs_v, offs_d, stride_w, mask_v, mask_d)
            logits = tl.dot(h, tl.trans(w), logits, input_precision=INPUT_PRECISION,
                            out_dtype=ACC_DTYPE)
        return logits

    @triton.jit
    def _linear_cross_entropy_fwd_kernel(
        hidden_ptr,  # (N, d)
        weight_ptr,  # (V, d)
        targets_ptr,  # (N,)
        lse_ptr,  # (SPLITS, N): log-sum-exp of each row over this split's vocabulary range
        target_logit_ptr,  # (SPLITS, N): the target's logit if it lies in this split, else 0
        N,
        V,
        D,
        stride_h,
        stride_w,
        ignore_index,
        n_splits,
        tiles_per_split,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        # every 2-D load and store widens row offsets to int64 (see `load_tile`)
        pid_n, split = grouped_program_id(tl.cdiv(N, BLOCK_N), n_splits, GROUP)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        tgt = tl.load(targets_ptr + offs_n, mask=mask_n, other=ignore_index)
        v_begin = split * tiles_per_split * BLOCK_V
        v_end = tl.minimum(v_begin + tiles_per_split * BLOCK_V, V)

        row_max = tl.full((BLOCK_N,), float("-inf"), dtype=ACC_DTYPE)
        row_sum = tl.zeros((BLOCK_N,), dtype=ACC_DTYPE)
        target_logit = tl.zeros((BLOCK_N,), dtype=ACC_DTYPE)
        for v0 in range(v_begin, v_end, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < v_end
            logits = logits_tile(hidden_ptr, weight_ptr, offs_n, offs_v, mask_n, mask_v, D,
                                 stride_h, stride_w, BLOCK_N, BLOCK_V, BLOCK_D, ACC_DTYPE,
                                 INPUT_PRECISION)
            logits = tl.where(mask_v[None, :], logits, float("-inf"))
            # Online log-sum-exp: rescale the running sum to the new running max.
            new_max = tl.maximum(row_max, tl.max(logits, axis=1))
            row_sum = row_sum * tl.exp(row_max - new_max) + tl.sum(
                tl.exp(logits - new_max[:, None]), axis=1
            )
            row_max = new_max
            is_target = offs_v[None, :] == tgt[:, None]
            target_logit += tl.sum(tl.where(is_target, logits, 0.0), axis=1)

        lse = row_max + tl.log(row_sum)
        tl.store(lse_ptr + split * N + offs_n, lse, mask=mask_n)
        tl.store(target_logit_ptr + split * N + offs_n, target_logit, mask=mask_n)

    #: The kernels of this module by name, for ahead-of-time compilation (:mod:`mtp.kernels.aot`).
    TRITON_KERNELS = {"_linear_cross_entropy_fwd_kernel": _linear_cross_entropy_fwd_kernel}
else:  # pragma: no cover
    TRITON_KERNELS = {}


def triton_forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, cfg: TritonConfig
) -> tuple[Tensor, Tensor]:
    """Per-row ``lse`` and loss (0 on ignored rows), in the accumulation dtype."""
    n, d = hidden.shape
    vocab = weight.shape[0]
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    n_blocks = triton.cdiv(n, cfg.block_n)
    v_tiles = triton.cdiv(vocab, cfg.block_v)
    # Few token blocks (N = 8192 is 64 blocks of 128 on a 132-SM H100) would leave SMs idle, so the
    # vocabulary is split across programs too and the partial log-sum-exps merged afterwards.
    splits = cfg.v_splits or max(1, triton.cdiv(4 * _sm_count(hidden.device), n_blocks))
    splits = min(splits, v_tiles)
    tiles_per_split = triton.cdiv(v_tiles, splits)
    splits = triton.cdiv(v_tiles, tiles_per_split)  # no empty split
    lse_parts = torch.empty(splits, n, dtype=acc_dtype, device=hidden.device)
    target_parts = torch.empty(splits, n, dtype=acc_dtype, device=hidden.device)
    _linear_cross_entropy_fwd_kernel[(n_blocks * splits,)](
        hidden,
        weight,
        targets,
        lse_parts,
        target_parts,
        n,
        vocab,
        d,
        hidden.stride(0),
        weight.stride(0),
        ignore_index,
        splits,
        tiles_per_split,
        **launch_options(cfg, hidden.dtype),
    )
    lse = torch.logsumexp(lse_parts, dim=0) if splits > 1 else lse_parts[0]
    target_logit = target_parts.sum(dim=0)
    loss = torch.where(targets != ignore_index, lse - target_logit, 0.0)
    return lse, loss


# ----------------------------------------------------------------------------------------------
# Torch: the chunked twin
# ----------------------------------------------------------------------------------------------

# NOTE: the torch path computes in fp32 from half-precision inputs (fp32 logits, gradients
# accumulated in fp32, as the Triton kernels do), but never holds an fp32 copy of the whole
# [V, d] weight (2 GiB at V = 128256, d = 4096): it casts row slices of this size as it reaches
# them, twice per token chunk (logits, dhidden), each small enough to stay in cache for the
# matmul that reads it: on CPU, bf16, 2 MiB slices were faster than 8 or 32 MiB ones and no
# slower than one full fp32 copy (`mtp bench kernel --dtype bf16` times this path at its CPU
# shapes). The loss and dweight are bit-identical to an unsliced pass, dhidden differs by
# rounding only (the sum over V runs slice by slice); fp32 and fp64 weights are used as they
# are, unsliced.
_TORCH_WEIGHT_SLICE_BYTES = 2 << 20


def weight_slices(weight: Tensor, acc_dtype: torch.dtype) -> Iterator[tuple[int, int, Tensor]]:
    """``(v0, v1, weight[v0:v1])`` in ``acc_dtype``: the whole weight when it already has that
    dtype, else row slices of at most ``_TORCH_WEIGHT_SLICE_BYTES``, each cast when reached."""
    vocab, d = weight.shape
    if weight.dtype == acc_dtype:
        yield 0, vocab, weight
        return
    rows = max(1, _TORCH_WEIGHT_SLICE_BYTES // (d * acc_dtype.itemsize))
    for v0 in range(0, vocab, rows):
        v1 = min(v0 + rows, vocab)
        yield v0, v1, weight[v0:v1].to(acc_dtype)


def torch_forward_chunks(
    hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk: int, loss: Tensor
) -> Iterator[tuple[int, int, Tensor, Tensor, Tensor, Tensor]]:
    """The chunked torch forward, one chunk of tokens at a time.

    Writes each chunk's per-row losses (0 on ignored rows) into ``loss`` (``[N]``, accumulation
    dtype), then yields ``(start, end, h, tgt, exps, row_sum)``: the chunk's rows ``h`` (``[C, d]``,
    accumulation dtype), targets ``tgt`` (``[C, 1]``, ignored ones set to 0), ``exps =
    exp(logits - row max)`` (``[C, V]``) and their row sums (``[C, 1]``), from which the backward
    (:func:`mtp.kernels.backward.torch_forward_backward`) takes the chunk's gradients. ``exps``
    lives in one buffer that the next chunk overwrites.
    """
    acc_dtype = loss.dtype
    n, vocab = hidden.shape[0], weight.shape[0]
    valid = targets != ignore_index  # (N,)
    safe_targets = targets.masked_fill(~valid, 0)
    logits_buf = torch.empty(min(chunk, n), vocab, dtype=acc_dtype, device=hidden.device)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h = hidden[start:end].to(acc_dtype)  # (C, d)
        logits = logits_buf[:end - start]  # (C, V)
        for v0, v1, w in weight_slices(weight, acc_dtype):
            torch.mm(h, w.T, out=logits[:, v0:v1])
        tgt = safe_targets[start:end, None]  # (C, 1)
        target_logit = logits.gather(1, tgt)  # (C, 1)
        # One exp pass serves both the log-sum-exp and the softmax: exp(z - max) in place.
        row_max = logits.amax(dim=1, keepdim=True)  # (C, 1)
        exps = logits.sub_(row_max).exp_()  # (C, V)
        row_sum = exps.sum(dim=1, keepdim=True)  # (C, 1)
        lse = row_max + row_sum.log()
        loss[start:end] = torch.where(valid[start:end], (lse - target_logit).squeeze(1), 0.0)
        yield start, end, h, tgt, exps, row_sum


def torch_forward(
    hidden: Tensor, weight: Tensor, targets: Tensor, ignore_index: int, chunk: int
) -> Tensor:
    """Per-row loss (0 on ignored rows) in the accumulation dtype, ``chunk`` tokens at a time."""
    acc_dtype = torch.promote_types(hidden.dtype, torch.float32)
    loss = torch.empty(hidden.shape[0], dtype=acc_dtype, device=hidden.device)
    for _ in torch_forward_chunks(hidden, weight, targets, ignore_index, chunk, loss):
        pass
    return loss
