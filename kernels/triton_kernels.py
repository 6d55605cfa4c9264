"""The ``@triton.jit`` kernels of the fused linear cross-entropy, defined when triton imports.

* ``_linear_cross_entropy_fwd_kernel``: per-row log-sum-exp and target logit over a vocabulary
  split, from logit tiles that never leave the chip;
* ``_linear_cross_entropy_dlogits_kernel``: one token chunk's ``(softmax - onehot) * scale``;
* ``_linear_cross_entropy_dhidden_kernel`` and ``_linear_cross_entropy_dweight_kernel``: the two
  gradient matmuls on those dlogits.

Triton decides between compiling and interpreting when a kernel is decorated, i.e. when this
module is imported: ``TRITON_INTERPRET=1`` must be set before then for the kernels to run on CPU
tensors. :mod:`mtp.kernels.launch` launches them.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # pragma: no cover - triton is an optional dependency on CPU-only installs
    HAS_TRITON = False


if HAS_TRITON:

    @triton.jit
    def _grouped_program_id(num_m, num_n, GROUP: tl.constexpr):
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
    def _load_tile(ptr, rows, cols, stride, mask_rows, mask_cols):
        """The [rows, cols] tile of a row-major matrix, zero outside the masks. Row offsets are
        widened to int64 before the stride multiply: V x d reaches 2^31 elements at V = 256k,
        d = 8192, and chunk x V at 16k x 128k."""
        return tl.load(ptr + rows[:, None].to(tl.int64) * stride + cols[None, :],
                       mask=mask_rows[:, None] & mask_cols[None, :], other=0.0)

    @triton.jit
    def _logits_tile(hidden_ptr, weight_ptr, offs_n, offs_v, mask_n, mask_v, D, stride_h,
                     stride_w, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                     BLOCK_D: tl.constexpr, ACC_DTYPE: tl.constexpr,
                     INPUT_PRECISION: tl.constexpr):
        """hidden[offs_n] @ weight[offs_v].T, accumulated over d in ACC_DTYPE."""
        logits = tl.zeros((BLOCK_N, BLOCK_V), dtype=ACC_DTYPE)
        for d0 in range(0, D, BLOCK_D):
            offs_d = d0 + tl.arange(0, BLOCK_D)
            mask_d = offs_d < D
            h = _load_tile(hidden_ptr, offs_n, offs_d, stride_h, mask_n, mask_d)
            w = _load_tile(weight_ptr, offs_v, offs_d, stride_w, mask_v, mask_d)
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
        # every 2-D load and store widens row offsets to int64 (see `_load_tile`)
        pid_n, split = _grouped_program_id(tl.cdiv(N, BLOCK_N), n_splits, GROUP)
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
            logits = _logits_tile(hidden_ptr, weight_ptr, offs_n, offs_v, mask_n, mask_v, D,
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

    @triton.jit
    def _linear_cross_entropy_dlogits_kernel(
        hidden_ptr,  # (C, d): one chunk of tokens
        weight_ptr,  # (V, d)
        targets_ptr,  # (C,)
        lse_ptr,  # (C,)
        scale_ptr,  # (C,): d(loss)/d(loss_i), 0 on ignored rows
        dlogits_ptr,  # (C, V) out, in the input dtype
        C,
        V,
        D,
        stride_h,
        stride_w,
        stride_g,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        pid_n, pid_v = _grouped_program_id(tl.cdiv(C, BLOCK_N), tl.cdiv(V, BLOCK_V), GROUP)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        mask_n = offs_n < C
        mask_v = offs_v < V
        logits = _logits_tile(hidden_ptr, weight_ptr, offs_n, offs_v, mask_n, mask_v, D, stride_h,
                              stride_w, BLOCK_N, BLOCK_V, BLOCK_D, ACC_DTYPE, INPUT_PRECISION)
        tgt = tl.load(targets_ptr + offs_n, mask=mask_n, other=-1)
        lse = tl.load(lse_ptr + offs_n, mask=mask_n, other=0.0)
        scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
        probs = tl.exp(logits - lse[:, None])
        dlogits = probs - tl.where(offs_v[None, :] == tgt[:, None], 1.0, 0.0)
        dlogits = dlogits * scale[:, None]
        tl.store(
            dlogits_ptr + offs_n[:, None].to(tl.int64) * stride_g + offs_v[None, :],
            dlogits.to(dlogits_ptr.dtype.element_ty),
            mask=mask_n[:, None] & mask_v[None, :],
        )

    @triton.jit
    def _linear_cross_entropy_dhidden_kernel(
        dlogits_ptr,  # (C, V)
        weight_ptr,  # (V, d)
        dhidden_ptr,  # (C, d) out, in the input dtype
        C,
        V,
        D,
        stride_g,
        stride_w,
        stride_dh,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        pid_n, pid_d = _grouped_program_id(tl.cdiv(C, BLOCK_N), tl.cdiv(D, BLOCK_D), GROUP)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_n = offs_n < C
        mask_d = offs_d < D
        acc = tl.zeros((BLOCK_N, BLOCK_D), dtype=ACC_DTYPE)
        for v0 in range(0, V, BLOCK_V):
            offs_v = v0 + tl.arange(0, BLOCK_V)
            mask_v = offs_v < V
            g = _load_tile(dlogits_ptr, offs_n, offs_v, stride_g, mask_n, mask_v)
            w = _load_tile(weight_ptr, offs_v, offs_d, stride_w, mask_v, mask_d)
            acc = tl.dot(g, w, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)
        tl.store(
            dhidden_ptr + offs_n[:, None].to(tl.int64) * stride_dh + offs_d[None, :],
            acc.to(dhidden_ptr.dtype.element_ty),
            mask=mask_n[:, None] & mask_d[None, :],
        )

    @triton.jit
    def _linear_cross_entropy_dweight_kernel(
        dlogits_ptr,  # (C, V)
        hidden_ptr,  # (C, d)
        dweight_ptr,  # (V, d) accumulator in ACC_DTYPE, read-modify-written once per chunk
        C,
        V,
        D,
        stride_g,
        stride_h,
        stride_dw,
        BLOCK_N: tl.constexpr,
        BLOCK_V: tl.constexpr,
        BLOCK_D: tl.constexpr,
        GROUP: tl.constexpr,
        ACC_DTYPE: tl.constexpr,
        INPUT_PRECISION: tl.constexpr,
    ):
        pid_v, pid_d = _grouped_program_id(tl.cdiv(V, BLOCK_V), tl.cdiv(D, BLOCK_D), GROUP)
        offs_v = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_v = offs_v < V
        mask_d = offs_d < D
        acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=ACC_DTYPE)
        for n0 in range(0, C, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < C
            g = _load_tile(dlogits_ptr, offs_n, offs_v, stride_g, mask_n, mask_v)
            h = _load_tile(hidden_ptr, offs_n, offs_d, stride_h, mask_n, mask_d)
            acc = tl.dot(tl.trans(g), h, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_DTYPE)
        # Each program owns its [BLOCK_V, BLOCK_D] tile, so the cross-chunk sum needs no atomics.
        dw_ptrs = dweight_ptr + offs_v[:, None].to(tl.int64) * stride_dw + offs_d[None, :]
        mask = mask_v[:, None] & mask_d[None, :]
        tl.store(dw_ptrs, tl.load(dw_ptrs, mask=mask, other=0.0) + acc, mask=mask)
