"""The output heads' loss: the sum over heads of w_i * CE_i, computed by one of four paths.

Every path has one signature: `path(model, h, rope, targets, weights, with_accuracy)` from the
trunk output h (B, T, d), the rotary tables, the targets (K, B, T) (`mtp.train.targets`) and the
head weights (K,), returning a `HeadsLoss`. `heads_loss` takes one from `PATHS` by name:

- `naive`: all K heads' logits (K, B, T, V) at once, then cross-entropy: the reference.
- `sequential`: one head at a time through the fused linear cross-entropy, so no [N, V] logits
  are held; each head's backward runs inside this forward (`_SequentialHeads`), so the loss
  path's peak memory does not grow with K. Needs grad mode. `soft_sequential_path(teacher)`
  is the same against a frozen model's distributions (`--loss.soft_targets` in joint training,
  Medusa-2), by a chunked soft cross-entropy (`soft_cross_entropy_fwd_bwd`).
- `frozen_trunk`: heads 2..K only, by plain autograd, from the output of a frozen trunk
  (`--optim.train heads`, `mtp.train.frozen_trunk`): no trunk backward, no loss for head 1.
- `frozen_trunk_soft`: the same against soft targets (`--loss.soft_targets`, EAGLE-3): head i
  learns the frozen model's own distribution of its token over the draft vocabulary.
  `frozen_trunk_path(soft, feature_weight)` adds EAGLE-1's regression of eagle's features
  (`--loss.feature_weight`).
- `metrics`: every head's loss and top-1 accuracy without gradients (validation).

`mtp_loss` runs the trunk and then `heads_loss` inside the model's forward (`heads_fn`), where
FSDP gathers the embedding, final norm and unembedding (`mtp.train.parallel`);
`naive_mtp_loss` and `sequential_mtp_loss` are its two training paths under their public names.
The paths give equal gradients (tests/train/test_loss.py).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from mtp.config import LossConfig
from mtp.kernels import linear_cross_entropy, linear_cross_entropy_fwd_bwd
from mtp.model.transformer import MTPTransformer, Rope
from mtp.train.targets import IGNORE_INDEX, Teacher, greedy_predictions

__all__ = ["PATHS", "HeadsLoss", "HeadsLossPath", "heads_loss", "mtp_loss", "naive_mtp_loss",
           "frozen_trunk_path", "scheduled_head_weights", "sequential_mtp_loss", "sequential_path",
           "simulated_acceptance", "soft_cross_entropy_fwd_bwd", "soft_sequential_path",
           "top1_accuracy"]

@dataclass
class HeadsLoss:
    """The weighted total and each head's detached mean loss and top-1 accuracy."""

    loss: torch.Tensor
    head_losses: torch.Tensor  # (K,) or, from head index `first` on, (K - first,)
    head_accuracies: torch.Tensor | None = None  # like head_losses
    first: int = 0  # head_losses[j] is head index first + j's (frozen_trunk: 1, head 1 has none)
    feature_losses: torch.Tensor | None = None  # like head_losses: EAGLE-1's regression


#: `path(model, h, rope, targets, weights, with_accuracy)`: the one signature of every path.
HeadsLossPath = Callable[[MTPTransformer, torch.Tensor, Rope, torch.Tensor, torch.Tensor, bool],
                         HeadsLoss]


def heads_loss(
    model: MTPTransformer,
    h: torch.Tensor,
    rope: Rope,
    targets: torch.Tensor,
    weights: list[float] | None = None,
    *,
    path: str | HeadsLossPath = "sequential",
    with_accuracy: bool = False,
) -> HeadsLoss:
    """The heads' loss from the trunk output h (B, T, d) by `path`, a name of `PATHS` (or a path
    itself, as `mtp bench loss` passes `sequential_path` of another cross-entropy), with
    `weights` per head (default 1 each). Accuracy costs the `sequential` and `frozen_trunk`
    paths an unembedding matmul per head, so they compute it only `with_accuracy`; `naive` and
    `metrics` always do."""
    if isinstance(path, str):
        if path not in PATHS:
            raise ValueError(f"the heads' loss path must be one of {', '.join(PATHS)} (got "
                             f"{path!r})")
        path = PATHS[path]
    return path(model, h, rope, targets, _head_weights(weights, model.cfg.n_future, h.device),
                with_accuracy)


def mtp_loss(
    model: MTPTransformer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    weights: list[float] | None = None,
    *,
    path: str | HeadsLossPath = "sequential",
    with_accuracy: bool = False,
) -> HeadsLoss:
    """The trunk forward of `inputs` (B, T), then `heads_loss` by `path`, both inside one
    forward of the model, so that FSDP's root unit is gathered for the heads
    (`MTPTransformer.forward`'s `heads_fn`)."""
    return model(inputs, heads_fn=functools.partial(
        heads_loss, model, targets=targets, weights=weights, path=path,
        with_accuracy=with_accuracy))


def naive_mtp_loss(model: MTPTransformer, inputs: torch.Tensor, targets: torch.Tensor,
                   weights: list[float] | None = None) -> HeadsLoss:
    """`mtp_loss` by the `naive` path: all K heads' logits held at once (the reference)."""
    return mtp_loss(model, inputs, targets, weights, path="naive")


def sequential_mtp_loss(model: MTPTransformer, inputs: torch.Tensor, targets: torch.Tensor,
                        weights: list[float] | None = None, *,
                        with_accuracy: bool = False) -> HeadsLoss:
    """`mtp_loss` by the `sequential` path: the loss path's peak memory independent of K, the
    gradients those of `naive_mtp_loss`."""
    return mtp_loss(model, inputs, targets, weights, path="sequential",
                    with_accuracy=with_accuracy)


def _head_weights(weights: list[float] | None, k: int, device: torch.device) -> torch.Tensor:
    return torch.ones(k, device=device) if weights is None else torch.tensor(weights,
                                                                             device=device)


# -- naive ---------------------------------------------------------------------------------------
def _naive(model: MTPTransformer, h: torch.Tensor, rope: Rope, targets: torch.Tensor,
           weights: torch.Tensor, with_accuracy: bool) -> HeadsLoss:
    """All heads' logits (K, B, T, V) at once. With a draft vocabulary, heads 2..K's
    cross-entropy is over it, targets outside it ignored."""
    K = model.cfg.n_future
    logits = torch.stack([model.unembed(z) if i == 0 else model.draft_logits(z)
                          for i, z in enumerate(model.head_states(h, rope, targets))])
    # (K, B, T, V); with a draft vocabulary, heads 2..K's are -inf outside it and their targets
    # outside it are ignored
    targets = torch.stack([torch.where(model.head_targets(i, t) == IGNORE_INDEX, IGNORE_INDEX, t)
                           for i, t in enumerate(targets)])
    # at least fp32 (bf16 logits would round the loss), but keep fp64 when testing in fp64
    dtype = torch.promote_types(logits.dtype, torch.float32)
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(dtype), targets.reshape(-1),
                         ignore_index=IGNORE_INDEX, reduction="none").view(K, -1)  # (K, B*T)
    valid = targets.flatten(1) != IGNORE_INDEX
    head_losses = (ce * valid).sum(1) / valid.sum(1).clamp(min=1)  # (K,)
    loss = (weights * head_losses).sum()
    with torch.no_grad():
        hits = (logits.argmax(-1).flatten(1) == targets.flatten(1)) & valid
        acc = hits.sum(1) / valid.sum(1).clamp(min=1)
    return HeadsLoss(loss, head_losses.detach(), acc)


# -- sequential ----------------------------------------------------------------------------------
def sequential_path(fwd_bwd: Callable = linear_cross_entropy_fwd_bwd) -> HeadsLossPath:
    """The `sequential` path with `fwd_bwd` as its loss-and-gradients function (default the
    fused kernel, `mtp.kernels.linear_cross_entropy_fwd_bwd`; `mtp bench loss` swaps in an
    unfused cross-entropy to separate what the order saves from what the kernel saves)."""
    return functools.partial(_sequential, head_loss=lambda model, i, targets: fwd_bwd)


def soft_sequential_path(teacher: Teacher) -> HeadsLossPath:
    """The `sequential` path against a frozen model's distributions (joint training under
    `--loss.soft_targets`): head i at position t learns `teacher`'s distribution at t + i
    (head 1's own at t: a KL to the frozen logits, Medusa-2's self-distillation), over head i's
    vocabulary, renormalised there, wherever its hard target is scored; the last i positions of
    a window, whose teacher lies past it, are not scored. No [N, V] logits are held: the soft
    cross-entropy runs over chunks of rows (`soft_cross_entropy_fwd_bwd`)."""
    return functools.partial(_sequential, head_loss=functools.partial(_soft_head_loss, teacher))


def _soft_head_loss(teacher: Teacher, model: MTPTransformer, i: int,
                    targets: torch.Tensor) -> Callable:
    """Head i's loss-and-gradients function against `teacher`, shaped as the fused kernel's
    (`linear_cross_entropy_fwd_bwd`); `targets` (K, B, T) say which positions are scored."""
    T = targets.shape[2]
    W = teacher.W if i == 0 or not model.cfg.draft_vocab else teacher.W[model.draft_ids]
    z = teacher.z.roll(-i, dims=1).flatten(0, 1)  # row (b, t): the teacher at t + i
    scored = (targets[i] != IGNORE_INDEX) & (torch.arange(T, device=targets.device) < T - i)

    def fwd_bwd(hidden, weight, _targets, dweight_acc, *, scale, ignore_index):
        return soft_cross_entropy_fwd_bwd(hidden, weight, z, W, scored.flatten(), dweight_acc,
                                          scale=scale)

    return fwd_bwd


@torch.no_grad()
def soft_cross_entropy_fwd_bwd(hidden: torch.Tensor, weight: torch.Tensor,
                               teacher_hidden: torch.Tensor, teacher_weight: torch.Tensor,
                               scored: torch.Tensor, dweight_acc: torch.Tensor, *,
                               scale: float | torch.Tensor = 1.0,
                               chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean over the `scored` rows (N,) of the cross-entropy H(p, q) of q = softmax(hidden @
    weight.T) against p = softmax(teacher_hidden @ teacher_weight.T), and its gradients, with
    `linear_cross_entropy_fwd_bwd`'s contract otherwise: `scale * dloss/dweight` added into
    `dweight_acc`, returns the unscaled mean loss and `scale * dloss/dhidden`. Its gradients are
    those of KL(p || q), which differs by p's entropy. At most `chunk_size` rows of logits are
    held at a time, in `dweight_acc`'s dtype."""
    dtype = dweight_acc.dtype
    rows = scored.nonzero().squeeze(1)
    n = max(len(rows), 1)
    W, Wt = weight.to(dtype), teacher_weight.to(dtype)
    dhidden = torch.zeros_like(hidden)
    loss = torch.zeros((), dtype=dtype, device=hidden.device)
    for part in rows.split(chunk_size):
        x = hidden[part].to(dtype)
        log_q = (x @ W.T).log_softmax(-1)
        p = (teacher_hidden[part].to(dtype) @ Wt.T).softmax(-1)
        loss -= (p * log_q).sum()
        g = log_q.exp_().sub_(p).mul_(scale / n)  # dloss/dlogits, scaled
        dhidden[part] = (g @ W).to(hidden.dtype)
        dweight_acc.addmm_(g.T, x)
    return loss / n, dhidden


def _sequential(model: MTPTransformer, h: torch.Tensor, rope: Rope, targets: torch.Tensor,
                weights: torch.Tensor, with_accuracy: bool, *, head_loss: Callable) -> HeadsLoss:
    """All heads inside one autograd node (`_SequentialHeads`), their backward included, so
    between forward and backward only dL/dh, the heads' parameter gradients and the one shared
    dL/dW are kept, whatever K is. `head_loss(model, i, targets)` gives head i's
    loss-and-gradients function, shaped as `linear_cross_entropy_fwd_bwd`."""
    if not torch.is_grad_enabled():
        raise RuntimeError("the sequential heads' loss computes the heads' gradients in its "
                           "forward and needs grad mode; without gradients, use the `metrics` "
                           "path")
    if model.unrolled and model.cfg.n_future > 1:
        raise ValueError(f"--model.head_type {model.cfg.head_type}: every unrolled step attends "
                         "to the steps before it, which the sequential path, one head at a time, "
                         "does not keep; train with --optim.train heads or --loss.strategy naive")
    params = [*model.heads.parameters(), model.norm.weight, model.unembed.weight]
    if model.cascaded:  # the heads embed the tokens they read with the trunk's embedding
        params.append(model.embed.weight)
    params = list({id(p): p for p in params}.values())  # a tied or shared tensor once
    loss, head_losses, head_accs = _SequentialHeads.apply(model, rope, targets, weights,
                                                          with_accuracy, head_loss, h, *params)
    return HeadsLoss(loss, head_losses, head_accs if with_accuracy else None)


class _SequentialHeads(torch.autograd.Function):
    """All K heads' losses, one head at a time, with every gradient computed in the forward.

    For each head: head forward on the trunk output; fused linear-cross-entropy forward and
    backward (no [N, V] logits), which adds the head's dL/dW straight into one fp32 buffer for the
    shared unembedding W and returns dL/dz; the head's backward from dL/dz into dL/dh and its own
    parameters; then the head's activations are freed. The outer backward only scales the stored
    gradients by the incoming one and hands dL/dh to the trunk.

    Doing the head backward inside an autograd node (rather than calling `.backward()` in the
    training step) keeps the step a single forward and a single backward: gradient accumulation
    and loss scaling arrive as `grad_out`, and DDP's hooks see every gradient in its one backward.
    Under FSDP2 each head is its own sharded unit: it is gathered for its turn, and its gradients
    are reduce-scattered into the sharded layout before it is freed (`_gathered_head`).
    """

    # NOTE: design. The alternative that lets FSDP's own hooks shard the heads keeps each head in
    # the ordinary autograd graph under activation checkpointing, so each head's forward runs
    # again in the backward, keeping each head's dL/dz until then or recomputing the loss. Both
    # variants were slower per step (`mtp bench train`) with a peak that grew at least as much
    # with K (`mtp bench loss`): docs/design-notes.md, "The sequential head pass".

    @staticmethod
    def forward(ctx, model, rope, targets, weights, with_accuracy, head_loss, h, *params):
        W = model.unembed.weight
        with torch.enable_grad():
            h_leaf = h.detach().requires_grad_()
            shared = [p for p in params if not _in_any_head(p, model)]
            grads = dict.fromkeys(params)  # summed over heads, in place
            grads[W] = torch.zeros_like(W, dtype=torch.promote_types(W.dtype, torch.float32))
            run = _cascaded_heads if model.cascaded else _parallel_heads
            dh, head_losses, head_accs = run(model, rope, targets, weights, with_accuracy,
                                             head_loss, h_leaf, shared, grads)
        grads[W] = grads[W].to(W.dtype)
        # Plain attributes, not save_for_backward: backward hands each buffer over (scaled in
        # place) instead of allocating a scaled copy next to it, which would double the
        # gradients' memory right when the trunk backward starts.
        ctx.grads = [dh, *grads.values()]
        head_losses = torch.stack(head_losses)
        head_accs = torch.stack(head_accs) if with_accuracy else head_losses.new_zeros(0)
        ctx.mark_non_differentiable(head_losses, head_accs)
        return (weights * head_losses).sum(), head_losses, head_accs

    @staticmethod
    def backward(ctx, grad_total, _grad_heads, _grad_accs):
        if not hasattr(ctx, "grads"):
            raise RuntimeError("the sequential MTP loss supports a single backward pass "
                               "(its gradients were computed in the forward and handed over)")
        grads = ctx.grads
        del ctx.grads
        # grad_total is 1, or 1 / accumulate_grad_batches, or a loss scale: a scalar
        if not (grad_total == 1).all():
            for g in grads:
                if g is not None:
                    g.mul_(grad_total.to(g.dtype))
        return (None, None, None, None, None, None, *grads)


def _head_step(model, i, run_head, x, rope, targets, weights, head_loss, with_accuracy, wrt,
               grads, g_out=None):
    """Head i's loss and its gradients with respect to `wrt`: its output from input x, the fused
    loss forward and backward (dL/dW added into grads[W]), then the head's backward from dL/dz
    (plus `g_out`, the gradient that later heads send back into this head's output).

    Returns the loss, the accuracy (or None) and a dict id(tensor) -> gradient.
    """
    W, Wi = model.unembed.weight, model.head_unembed(i)  # Wi: W or its draft-vocabulary rows
    out = model.head_output(i, x, rope, tokens=targets[i - 1] if i else None, run=run_head)
    z = model.head_norm(out)  # (B, T, d)
    t = model.head_targets(i, targets[i]).flatten()
    gWi = grads[W] if Wi is W else torch.zeros_like(Wi, dtype=grads[W].dtype)
    loss, dz = head_loss(model, i, targets)(z.detach().flatten(0, 1), Wi.detach(), t, gWi,
                                            scale=weights[i], ignore_index=IGNORE_INDEX)
    if Wi is not W:
        grads[W].index_add_(0, model.draft_ids, gWi)
    acc = top1_accuracy(z.detach().flatten(0, 1), Wi, t) if with_accuracy else None
    # A cascaded head's embedding lookup of a tied W: its gradient joins W's buffer.
    embed_W = model.cascaded and i > 0 and model.embed.weight is W and W.requires_grad
    wrt = [p for p in wrt if p.requires_grad and p is not W] + ([W] if embed_W else [])
    outs, g = ([z, out], [dz.view_as(z), g_out]) if g_out is not None else ([z], [dz.view_as(z)])
    got = dict(zip(map(id, wrt), torch.autograd.grad(outs, wrt, grad_outputs=g,
                                                     allow_unused=True)))
    if embed_W and got.get(id(W)) is not None:
        grads[W].add_(got.pop(id(W)))
    return loss, acc, got


def _collect(got: dict, shared: list, own: list, head_params: list, to_sharded,
             grads: dict) -> None:
    """Add one head's gradients of the shared tensors and set those of its own parameters."""
    for p in shared:
        if id(p) in got:
            grads[p] = _add(grads[p], got.pop(id(p)))
    for p, g in zip(own, to_sharded([got.get(id(q)) for q in head_params])):
        grads[p] = g


def _parallel_heads(model, rope, targets, weights, with_accuracy, head_loss, h_leaf, shared,
                    grads):
    """Heads that all read the trunk output: each runs, is differentiated and is freed in turn,
    dL/dh summed over them."""
    dh, losses, accs = None, [], []
    for i, head in enumerate(model.heads):
        own = list(head.parameters())  # sharded under FSDP, like `params`
        with _gathered_head(head) as (run_head, head_params, to_sharded):
            loss, acc, got = _head_step(model, i, run_head, h_leaf, rope, targets, weights,
                                        head_loss, with_accuracy,
                                        [h_leaf, *shared, *head_params], grads)
            # this head's activations were freed with its graph, before the next head runs
            dh = _add(dh, got.pop(id(h_leaf)))
            _collect(got, shared, own, head_params, to_sharded, grads)
        losses.append(loss)
        accs.append(acc)
    return dh, losses, accs


def _cascaded_heads(model, rope, targets, weights, with_accuracy, head_loss, h_leaf, shared,
                   grads):
    """Cascaded heads (head i reads head i - 1's output): a forward sweep without graphs keeps
    each head's output (B, T, d); a backward sweep from head K to head 1 reruns each head with
    its graph, adds the gradient its successor sent into its output to its own loss's, and
    sends the gradient of its input back. One head's activations live at a time, and K hidden
    states of B x T x d; the cost is one extra forward of every head."""
    K = len(model.heads)
    outs, x = [], h_leaf.detach()
    with torch.no_grad():
        for i, head in enumerate(model.heads):
            with _gathered_head(head) as (run_head, _, _):
                x = model.head_output(i, x, rope, tokens=targets[i - 1] if i else None,
                                      run=run_head)
            outs.append(x)
    losses, accs, g = [None] * K, [None] * K, None
    for i in reversed(range(K)):
        head = model.heads[i]
        own = list(head.parameters())
        x_in = h_leaf if i == 0 else outs[i - 1].requires_grad_()
        with _gathered_head(head) as (run_head, head_params, to_sharded):
            losses[i], accs[i], got = _head_step(model, i, run_head, x_in, rope, targets,
                                                 weights, head_loss, with_accuracy,
                                                 [x_in, *shared, *head_params], grads, g)
            g = got.pop(id(x_in))
            _collect(got, shared, own, head_params, to_sharded, grads)
        outs[i] = None  # no longer needed: free it
    return g, losses, accs


def _add(acc: torch.Tensor | None, g: torch.Tensor | None) -> torch.Tensor | None:
    return g if acc is None else acc if g is None else acc.add_(g)


def _in_any_head(p: torch.Tensor, model: MTPTransformer) -> bool:
    return any(p is q for q in model.heads.parameters())


@contextlib.contextmanager
def _gathered_head(head: torch.nn.Module):
    """How to run the head, its parameters for computing, and a map of their gradients to the
    layout of the head's own parameters.

    A plain head: itself (compiled if it was), its parameters, gradients unchanged. An FSDP2 head
    (`mtp.train.parallel`): gathered (all-gather) for the duration and run through its `forward`,
    not its `__call__`, whose hooks would free the gathered parameters before their gradients are
    taken; each full gradient is reduce-scattered to its shard with the averaging FSDP itself
    applies, in the sharded parameter's dtype; freed again on exit.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(head, FSDPModule):
        yield head, list(head.parameters()), lambda gs: gs
        return
    from torch.distributed.tensor import DTensor, Partial

    sharded = list(head.parameters())
    head.unshard()
    try:
        def to_sharded(gs: list[torch.Tensor | None]) -> list[DTensor | None]:
            return [None if g is None else DTensor.from_local(
                g.to(p.dtype), p.device_mesh, [Partial("avg")] * p.device_mesh.ndim,
            ).redistribute(p.device_mesh, p.placements) for p, g in zip(sharded, gs)]

        yield head.forward, list(head.parameters()), to_sharded
    finally:
        head.reshard()


# -- frozen_trunk --------------------------------------------------------------------------------
def frozen_trunk_path(soft: bool = False, feature_weight: float = 0.0) -> HeadsLossPath:
    """The `frozen_trunk` path, against soft targets with `soft` (`frozen_trunk_soft`), and with
    EAGLE-1's feature regression at `feature_weight` (`--loss.feature_weight`)."""
    return functools.partial(_frozen_trunk, soft=soft, feature_weight=feature_weight)


def _frozen_trunk(model: MTPTransformer, h: torch.Tensor, rope: Rope, targets: torch.Tensor,
                  weights: torch.Tensor, with_accuracy: bool, *, soft: bool = False,
                  feature_weight: float = 0.0) -> HeadsLoss:
    """Heads 2..K from a frozen trunk's output h, differentiable in their parameters only; no
    loss for head 1, whose weights are frozen with the trunk.

    With `soft` (`frozen_trunk_soft`), head i at position t learns the frozen model's
    distribution of the token at t + i + 1 (head 1's at t + i, restricted to the draft
    vocabulary and renormalised there) by cross-entropy, wherever its hard target is not
    ignored; the last i positions of a window, whose teacher lies past it, are not scored.

    With `feature_weight` w > 0 (eagle heads, EAGLE-1), step i's output feature at t, the one
    step i + 1 reads, also regresses to the trunk's own output at t + i (its last block's, the
    feature head 1 predicts token t + i + 1 from) by smooth L1, averaged over channels, where
    its hard target is scored: w_i * w times that joins the loss."""
    T = h.shape[1]
    d = model.cfg.d_model
    if soft:
        with torch.no_grad():  # (B, T, Vd)
            teacher = model.head_norm(model.head_output(0, h, rope)) @ model.head_unembed(1).T
            p = teacher.float().softmax(-1)
    losses, accs, regs, total = [], [], [], h.new_zeros((), dtype=torch.float32)
    for i, out in enumerate(model.head_outputs(h, rope, targets, start=1), start=1):
        z = model.head_norm(out)
        W, t = model.head_unembed(i), model.head_targets(i, targets[i]).flatten()
        if feature_weight:
            scored = targets[i][:, : T - i] != IGNORE_INDEX
            reg = F.smooth_l1_loss(out[:, : T - i].float(), h[:, i:, -d:].float(),
                                   reduction="none").mean(-1)
            reg = (reg * scored).sum() / scored.sum().clamp(min=1)
            total = total + weights[i] * feature_weight * reg
            regs.append(reg.detach())
        if soft:
            log_q = (z[:, : T - i] @ W.T).float().log_softmax(-1)  # (B, T - i, Vd)
            valid = targets[i][:, : T - i] != IGNORE_INDEX
            loss = (-(p[:, i:] * log_q).sum(-1) * valid).sum() / valid.sum().clamp(min=1)
        else:
            loss = linear_cross_entropy(z.flatten(0, 1), W, t, ignore_index=IGNORE_INDEX)
        total = total + weights[i] * loss
        losses.append(loss.detach())
        if with_accuracy:
            accs.append(top1_accuracy(z.detach().flatten(0, 1), W, t))
    return HeadsLoss(total, torch.stack(losses), torch.stack(accs) if accs else None, first=1,
                     feature_losses=torch.stack(regs) if regs else None)


# -- metrics -------------------------------------------------------------------------------------
@torch.no_grad()
def _metrics(model: MTPTransformer, h: torch.Tensor, rope: Rope, targets: torch.Tensor,
             weights: torch.Tensor, with_accuracy: bool) -> HeadsLoss:
    """Per-head loss and top-1 accuracy without gradients, holding 1024 x V logits at most:
    what validation logs, whatever path trains."""
    losses, accs = [], []
    for i, z in enumerate(model.head_states(h, rope, targets)):
        z, W = z.flatten(0, 1), model.head_unembed(i)  # (N, d), (V or Vd, d)
        t = model.head_targets(i, targets[i]).flatten()
        losses.append(linear_cross_entropy(z, W, t, ignore_index=IGNORE_INDEX))
        accs.append(top1_accuracy(z, W, t))
    losses = torch.stack(losses)
    return HeadsLoss((weights * losses).sum(), losses, torch.stack(accs))


#: The heads' loss paths by name (`heads_loss`; `--loss.strategy` names a training one).
PATHS: dict[str, HeadsLossPath] = {
    "naive": _naive,
    "sequential": sequential_path(),
    "frozen_trunk": _frozen_trunk,
    "frozen_trunk_soft": frozen_trunk_path(soft=True),
    "metrics": _metrics,
}


def scheduled_head_weights(cfg: LossConfig, k: int, step: int) -> list[float]:
    """The head weights of training step `step` under `--loss.schedule` (see `LossConfig`)."""
    base = list(cfg.head_weights or [1.0] * k)
    if cfg.schedule == "constant" or k == 1:
        return base
    n = cfg.schedule_steps
    if cfg.schedule == "ramp":
        return [base[0]] + [w * min(1.0, step / n) for w in base[1:]]
    # curriculum: head i + 1 (0-based i >= 1) joins at step i / (K - 1) * n
    return [base[0]] + [w if step * (k - 1) >= i * n else 0.0
                        for i, w in enumerate(base[1:], start=1)]


@torch.no_grad()
def top1_accuracy(z: torch.Tensor, W: torch.Tensor, t: torch.Tensor,
                  chunk: int = 1024) -> torch.Tensor:
    """Top-1 accuracy of z @ W.T (z is (N, d)) over non-ignored targets, chunk x V at a time."""
    hits = z.new_zeros((), dtype=torch.long)
    for a in range(0, len(t), chunk):
        pred = (z[a:a + chunk] @ W.T).argmax(-1)  # (chunk,)
        hits += (pred == t[a:a + chunk]).sum()  # an ignored target (-100) never matches
    return hits / (t != IGNORE_INDEX).sum().clamp(min=1)


@torch.no_grad()
def simulated_acceptance(model: MTPTransformer, window: torch.Tensor,
                         chunk: int = 1024) -> torch.Tensor:
    """Per draft depth d = 1..K-1, the share of the T positions of windows (B, T + K) where a
    chain drafted by heads 2..d+1 would all be accepted under teacher forcing: head j's top-1 at
    t is head 1's greedy token at t + j - 1 for every j <= d + 1 (NeMo's simulated acceptance).

    1 + their sum is the tokens per forward (L) that greedy self-speculation with all K heads
    would reach on this text. Cascaded heads read head 1's greedy tokens, as they read accepted
    drafts when decoding; the context is the data's, where decoding's is the greedy path, so
    it approximates L on text the model itself wrote.
    """
    K = model.cfg.n_future
    T = window.shape[1] - K

    def rates(h: torch.Tensor, rope) -> torch.Tensor:
        greedy = greedy_predictions(model, h, rope, chunk)  # (B, T + K - 1)
        # tokens[i][:, s]: the greedy token at the position head i + 1 predicts from s
        tokens = torch.stack([F.pad(greedy[:, i:], (0, i)) for i in range(K)])
        accepted = torch.ones_like(greedy[:, :T], dtype=torch.bool)
        out = []
        for i, z in enumerate(model.head_states(h, rope, tokens)):
            if i == 0:
                continue
            z, W = z[:, :T].flatten(0, 1), model.head_unembed(i)
            pred = torch.cat([(part @ W.T).argmax(-1) for part in z.split(chunk)])
            accepted &= pred.view(-1, T) == model.head_targets(i, tokens[i][:, :T])
            out.append(accepted.float().mean())
        return torch.stack(out) if out else h.new_zeros(0)

    return model(window[:, :-1], heads_fn=rates)
