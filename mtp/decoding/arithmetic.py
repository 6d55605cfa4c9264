"""The arithmetic of a decode forward: its dtype (`--dtype`) and, on a CPU, the product of each
linear layer, chosen by measurement.

A decode forward multiplies 1 to a few dozen token vectors by every weight matrix of the model.
On a CPU three products can do that, and which is fastest depends on the CPU, the threads,
torch's build and the weight's shape:

- ``plain``: `torch.nn.functional.linear`, torch's general matrix product, which may re-lay out
  (pack) the whole weight matrix on every call; with so few rows the packing can cost more than
  reading the weights. Its result for a row depends on how many rows come with it.
- ``onednn``: oneDNN's product over a weight packed once into its blocked layout
  (`torch.ops.mkldnn._reorder_linear_weight`, the prepacking inductor applies to frozen CPU
  models), in fp32 or bf16.
- ``mkl``: MKL's packed GEMM (`torch.ops.mkl._mkl_linear`), fp32 only, over a weight packed for
  one row (the greedy forward); other row counts take the unpacked weight within the same op.

:func:`decode_linears` gives every `nn.Linear` of a model the fastest of them for the duration
of a block. The first decode on a machine times each candidate on the model's own weight shapes,
over one row and over `ROUND_ROWS` rows (a greedy forward and a speculative round), and keeps
the one of least total time per shape among those that are row-invariant there (each row of a
product bit for bit what that row alone gives, so that a speculative round's verify forward
computes greedy's own logits; where none is, the fastest). The choice is cached in
``linear-paths.json`` under `mtp.util.environment.cache_dir`, keyed by the CPU model, cores,
threads and torch version, so later runs read it. One path serves every row count of a shape.
The paths compute the same product and differ from `F.linear` by a few ulps (the order of the
sums). Prepared weights are made once and kept beside each module (keyed by the weight's storage
and version, so a weight changed in place is prepared again); those of ``onednn`` and ``mkl``
cost as much memory as the weights they mirror.

Drafting need not be exact: whatever the drafts, the verify forward keeps greedy's output. With
`draft_int8` (`generate(draft_int8=True)`, `--draft-int8`) the heads draft with 8-bit integer
products (`int8_products`): weights quantised per output row once, activations per call (torch's
dynamically quantised product, fbgemm's kernels), so that reading a weight, what a product over a
few rows costs, reads a quarter of the bytes. The verify forward stays as above.

``--dtype bf16`` (`decode_dtype`, `to_decode_dtype`) decodes with bf16 weights and activations where
the CPU multiplies bf16 natively (avx512_bf16 or AMX); elsewhere it is refused, as emulated bf16 is
slower than fp32. The rotary tables stay fp64, norms compute in fp32 (`mtp.model.layers`), and on a
CPU the KV cache and attention stay fp32, as the CPU's bf16 attention kernel is the slower one
(`mtp.decoding.engine.new_cache`). Greedy and sampling only: in bf16 a verify forward's rows do not
round as one-token forwards do (the CPU attention kernel blocks by the number of queries and keys,
and the long products by rows), and a last-bit difference is 0.4%, so speculative decoders are
refused in bf16 (`mtp.decoding.DecodeRequest`).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F
from torch import nn

from mtp.decoding.names import DTYPE_NAMES, LINEAR_PATHS
from mtp.decoding.stacked import StackedLinear

__all__ = ["DTYPES", "LINEAR_PATHS", "ROUND_ROWS", "LinearPaths", "choose_paths",
           "decode_dtype", "decode_linears", "int8_available", "int8_products", "int8_weight",
           "path_available", "to_decode_dtype"]

#: `--dtype`'s values.
DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16), strict=True))
#: The rows of a speculative round's forward the paths are timed at, beside one row.
ROUND_ROWS = 8
#: Rows the oneDNN layout is chosen for (its hint; any number of rows works).
_ONEDNN_ROWS_HINT = 4
#: The CPU flags of native bf16 products.
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
_CACHE_FILE = "linear-paths.json"
# (cache file, machine) -> shape -> entry: the choices this process has read or measured.
_SEEN: dict[tuple[str, str], dict[str, dict]] = {}

# module -> ((path, weight storage, version, shape, dtype), prepared weight); weak, so it goes
# with the module.
_PREPARED: WeakKeyDictionary[nn.Linear, tuple[tuple, torch.Tensor | None]] = WeakKeyDictionary()


def decode_dtype(name: str, device: str | torch.device = "cpu", *,
                 flag: str = "--dtype") -> torch.dtype:
    """The dtype of `--dtype NAME` on `device`.

    Raises:
        ValueError: an unknown name, or bf16 on a CPU without native bf16 products, naming the
            flag and the CPU.
    """
    if name not in DTYPES:
        raise ValueError(f"{flag} must be one of {', '.join(DTYPES)} (got {name!r})")
    if name == "bf16" and torch.device(device).type == "cpu":
        from mtp.util.environment import cpu_flags, cpu_model

        if not set(_BF16_FLAGS) & cpu_flags():
            raise ValueError(f"{flag} bf16: this CPU ({cpu_model()}) has no native bf16 products "
                             f"({' or '.join(_BF16_FLAGS)}), so bf16 would be emulated, slower "
                             "than fp32; decode in fp32")
    return DTYPES[name]


def to_decode_dtype(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """`model` (in place) with its fp32 parameters in `dtype`; buffers keep theirs (the fp64
    rotary tables, integer ids), unlike `nn.Module.to`, which would cast the rotary tables
    too."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dtype == torch.float32 and dtype != torch.float32:
                p.data = p.data.to(dtype)
    return model


def path_available(path: str, dtype: torch.dtype) -> bool:
    """Whether this torch build runs `path` in `dtype` on the CPU."""
    if path == "plain":
        return dtype in (torch.float32, torch.bfloat16)
    if path == "onednn":
        return torch.backends.mkldnn.is_available() and (
            dtype == torch.float32
            or dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if path == "mkl":
        return torch.backends.mkl.is_available() and dtype == torch.float32
    raise ValueError(f"unknown linear path {path!r}; choose from {', '.join(LINEAR_PATHS)}")


def _eligible(module: nn.Linear) -> bool:
    """Whether `module`'s product can take another path: a CPU weight of a decode dtype in an
    ordinary strided tensor, and no per-instance `forward` already installed (a hook library's,
    or an enclosing `decode_linears`)."""
    w = module.weight
    return (w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16)
            and w.layout == torch.strided and type(w.data) is torch.Tensor
            and "forward" not in vars(module))


def _prepare(path: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The weight as `path` multiplies by it (None: the weight itself)."""
    with torch.no_grad():
        w = weight.detach()
        if path == "onednn":
            return torch.ops.mkldnn._reorder_linear_weight(w, _ONEDNN_ROWS_HINT)
        if path == "mkl":
            return torch.ops.mkl._mkl_reorder_linear_weight(w, 1)
    return None


def _product(path: str, weight: torch.Tensor, bias: torch.Tensor | None,
             prepared: torch.Tensor | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T + bias on `path` (no autograd)."""
    w = weight.detach()
    b = None if bias is None else bias.detach()
    if path == "onednn":
        return lambda x: torch.ops.mkldnn._linear_pointwise(x.contiguous(), prepared, b, "none",
                                                            [], "")
    if path == "mkl":
        def mkl(x: torch.Tensor) -> torch.Tensor:
            rows = x.reshape(-1, x.shape[-1]).contiguous()
            return torch.ops.mkl._mkl_linear(rows, prepared, w, b, 1).view(*x.shape[:-1], -1)
        return mkl
    return lambda x: F.linear(x, w, b)


def _prepared(module: nn.Linear, path: str) -> torch.Tensor | None:
    w = module.weight
    key = (path, w.data_ptr(), w._version, tuple(w.shape), w.dtype)
    cached = _PREPARED.get(module)
    if cached is None or cached[0] != key:
        cached = (key, _prepare(path, w))
        _PREPARED[module] = cached
    return cached[1]


def _forward(module: nn.Linear, path: str) -> Callable[[torch.Tensor], torch.Tensor]:
    product = _product(path, module.weight, module.bias, _prepared(module, path))
    dtype = module.weight.dtype

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != dtype or x.device.type != "cpu":
            return F.linear(x, module.weight, module.bias)
        return product(x)

    return forward


# --------------------------------------------------------------------------------------------
# The choice: measured once per machine and shape, cached


def _shape_key(module: nn.Linear) -> str:
    """`576x1536:bf16`, `+bias` where it has one: what a path's time depends on."""
    out, inp = module.weight.shape
    dtype = {torch.float32: "fp32", torch.bfloat16: "bf16"}[module.weight.dtype]
    return f"{out}x{inp}{'+bias' if module.bias is not None else ''}:{dtype}"


def _machine() -> str:
    from mtp.util.environment import machine_key

    return f"{machine_key().split(' | ')[0]} | torch {torch.__version__} | " \
           f"threads {torch.get_num_threads()}"


def _row_invariant(product: Callable[[torch.Tensor], torch.Tensor],
                   x: torch.Tensor) -> bool:
    """Whether `product` gives each row of `x` (rows, in) bit for bit what it gives that row
    alone: a kernel blocked by the number of rows may sum in another order. One input tells a
    kernel that never matches from one that did here (a kernel whose order depends on the values
    may still pass)."""
    with torch.no_grad():
        together = product(x)
        return all(torch.equal(product(x[i:i + 1]), together[i:i + 1]) for i in range(len(x)))


def _measure(module: nn.Linear, paths: list[str], budget_s: float = 0.4) -> dict[str, float]:
    """Each path's median seconds over one row plus over `ROUND_ROWS` rows, the paths taking
    turns (so that a machine's drift falls on all alike), within about `budget_s`; only the
    paths that are row-invariant on this shape (`_row_invariant`), where any is: with them a
    speculative round's verify forward gives each row exactly greedy's one-token logits."""
    w, b = module.weight, module.bias
    products = {p: _product(p, w, b, _prepare(p, w)) for p in paths}
    rng = torch.Generator().manual_seed(0)  # the caller's random state stays as it was
    inputs = [torch.randn(rows, w.shape[1], generator=rng).to(w.dtype) for rows in (1, ROUND_ROWS)]
    invariant = {p: f for p, f in products.items() if _row_invariant(f, inputs[1])}
    products = invariant or products
    paths = list(products)
    times: dict[str, list[float]] = {p: [] for p in paths}
    with torch.no_grad():
        for fn in products.values():  # warm up: first calls allocate and dispatch
            for x in inputs:
                fn(x)
        start = time.perf_counter()
        while True:
            for p, fn in products.items():
                t0 = time.perf_counter()
                for x in inputs:
                    fn(x)
                times[p].append(time.perf_counter() - t0)
            n = len(times[paths[0]])
            if n >= 30 or n >= 5 and time.perf_counter() - start > budget_s:
                break
    return {p: statistics.median(t) for p, t in times.items()}


def _read_cache(path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _entry(value) -> dict | None:
    """A cached shape's entry, `{"path": ..., "ms": {path: ms}}`, or None if it is not one."""
    if isinstance(value, dict) and value.get("path") in LINEAR_PATHS and \
            isinstance(value.get("ms"), dict):
        return value
    return None


def choose_paths(modules: list[nn.Linear], *, cache: bool = True) -> dict[str, dict]:
    """The path of each weight shape of `modules` (`_shape_key`) and the times it was chosen
    by, `{"path": "onednn", "ms": {"plain": 0.35, "onednn": 0.18}}` (ms of one row plus
    `ROUND_ROWS` rows): read from the cache, else measured (and cached). A cache that cannot be
    written is warned about, not fatal."""
    from mtp.util.atomic import write_json
    from mtp.util.environment import cache_dir

    shapes = {_shape_key(m): m for m in modules}
    file = cache_dir() / _CACHE_FILE
    machine = _machine()
    seen = _SEEN.setdefault((str(file), machine), {}) if cache else {}
    if all(k in seen for k in shapes):  # every generate call asks: read the file once
        return {k: seen[k] for k in shapes}
    data = _read_cache(file) if cache else {}
    known = data.get(machine) if isinstance(data.get(machine), dict) else {}
    chosen = {k: _entry(known.get(k)) for k in shapes if _entry(known.get(k))}
    missing = [k for k in shapes if k not in chosen]
    for key in missing:
        module = shapes[key]
        paths = [p for p in LINEAR_PATHS if path_available(p, module.weight.dtype)]
        times = _measure(module, paths)
        chosen[key] = {"path": min(times, key=times.get),
                       "ms": {p: round(1000 * t, 4) for p, t in times.items()}}
    seen.update(chosen)
    if missing and cache:
        data = _read_cache(file)  # another process may have added shapes meanwhile
        entry = data.get(machine) if isinstance(data.get(machine), dict) else {}
        data[machine] = {**entry, **{k: chosen[k] for k in missing}}
        try:
            write_json(file, data, indent=1, sort_keys=True,
                       what="the cache of linear paths")
        except OSError as err:
            warnings.warn(f"{err}; the linear paths will be measured again next time",
                          stacklevel=2)
    return chosen


@dataclass
class LinearPaths:
    """What a `decode_linears` block runs: each path's layers (by count), and for each weight
    shape the path and the times it was chosen by (`choose_paths`; none for a forced path)."""

    layers: Counter[str] = field(default_factory=Counter)
    shapes: dict[str, dict] = field(default_factory=dict)

    def table(self) -> str:
        """The weight shapes, each with its path and the candidates' times."""
        lines = []
        for shape, entry in self.shapes.items():
            times = ", ".join(f"{p} {ms:.3f}" for p, ms in entry.get("ms", {}).items())
            lines.append(f"  {shape}: {entry['path']}" + (f" (ms of 1 + {ROUND_ROWS} rows: "
                                                         f"{times})" if times else ""))
        return "\n".join(lines)

    def __str__(self) -> str:
        if not self.layers:
            return "none (not on a CPU, or no linear layer)"
        return ", ".join(f"{path} ({n} layers)" for path, n in self.layers.most_common())

    @property
    def name(self) -> str:
        """The paths, most layers first, joined by `+` (`onednn`, `onednn+plain`)."""
        return "+".join(path for path, _ in self.layers.most_common()) or "none"


@contextmanager
def decode_linears(*models: nn.Module | None, path: str | None = None) -> Iterator[LinearPaths]:
    """Within the block, every `nn.Linear` of `models` with a CPU weight multiplies on its
    shape's chosen path (`choose_paths`; `path` forces one where it is available, else
    ``plain``) wherever gradients are off and its input has the weight's dtype on the CPU;
    elsewhere it runs as before. On exit the modules are as they were. Models on another
    device, or None, are left alone; so are modules an enclosing block already took, so an
    outer `decode_linears` (a forced path) decides for `generate`'s own.

    Compiled modules (`--compile.enabled`) run eagerly within the block: inductor cannot compile
    the prepared products, whose weights are inputs rather than constants, and the decode loop
    is not compiled anyway (`mtp.decoding.engine`)."""
    if path is not None and path not in LINEAR_PATHS:
        raise ValueError(f"unknown linear path {path!r}; choose from {', '.join(LINEAR_PATHS)}")
    forced = path or os.environ.get("MTP_LINEAR_PATH") or None
    if forced is not None and forced not in LINEAR_PATHS:
        raise ValueError(f"MTP_LINEAR_PATH={forced!r}: choose from {', '.join(LINEAR_PATHS)}")
    modules = [m for model in models if model is not None for m in model.modules()
               if isinstance(m, nn.Linear) and _eligible(m)]
    if forced is None:
        chosen = choose_paths(modules) if modules else {}
    else:
        chosen = {_shape_key(m): {"path": forced if path_available(forced, m.weight.dtype)
                                  else "plain"} for m in modules}
    used = LinearPaths(shapes=chosen)
    with ExitStack() as stack:
        stack.enter_context(torch.compiler.set_stance("force_eager"))
        for module in modules:
            if "forward" in vars(module):  # listed twice (a model given twice, shared layers)
                continue
            choice = chosen[_shape_key(module)]["path"]
            module.forward = _forward(module, choice)
            stack.callback(delattr, module, "forward")
            used.layers[choice] += 1
        yield used


# --------------------------------------------------------------------------------------------
# Drafting in 8-bit integers

# module -> ((weight storage, version, shape), packed int8 weights); weak, as `_PREPARED`
_INT8: WeakKeyDictionary[nn.Module, tuple[tuple, list[torch.Tensor]]] = WeakKeyDictionary()


def int8_available() -> bool:
    """Whether this torch build has the CPU's dynamically quantised product (fbgemm's kernels,
    torch's `x86` or `fbgemm` quantised engine)."""
    return bool({"x86", "fbgemm"} & set(torch.backends.quantized.supported_engines)) and \
        hasattr(torch, "_make_per_channel_quantized_tensor") and \
        hasattr(torch.ops.quantized, "linear_dynamic")


def int8_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` (out, in) quantised symmetrically per output row: its int8 values and each row's
    scale (its largest magnitude over 127), so that weight ~ values * scale[:, None]."""
    w = weight.detach().float()
    scale = (w.abs().amax(1) / 127).clamp(min=torch.finfo(torch.float32).tiny)
    return (w / scale[:, None]).round().clamp(-127, 127).to(torch.int8), scale


def _maps(module: nn.Module) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor | None]]]:
    """A linear module's weight tensor and its maps, each (weight (out, in), bias or None): one
    for an `nn.Linear`, J for a `StackedLinear` (heads 2..h as one module)."""
    if isinstance(module, StackedLinear):
        w, b = module.weight_t, module.bias  # (J, in, out), (J, 1, out) or None
        return w, [(w[j].T, None if b is None else b[j, 0]) for j in range(len(w))]
    return module.weight, [(module.weight, module.bias)]


def _pack_int8(module: nn.Module) -> list[torch.Tensor]:
    w, maps = _maps(module)
    key = (w.data_ptr(), w._version, tuple(w.shape))
    cached = _INT8.get(module)
    if cached is None or cached[0] != key:
        packed = []
        for weight, bias in maps:
            values, scale = int8_weight(weight)
            with warnings.catch_warnings():  # torch marks its quantised tensors for removal
                warnings.simplefilter("ignore")
                q = torch._make_per_channel_quantized_tensor(
                    values, scale.double(), torch.zeros(len(scale), dtype=torch.long), 0)
                packed.append(torch.ops.quantized.linear_prepack(
                    q, None if bias is None else bias.detach().float()))
        cached = (key, packed)
        _INT8[module] = cached
    return cached[1]


def _int8_forward(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = _pack_int8(module)
    exact = type(module).forward.__get__(module)

    def forward(x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.float32 or x.device.type != "cpu":
            return exact(x)
        # (J, rows, in): a stacked module's J maps each take their own slice of the leading axis
        parts = x.reshape(len(packed), -1, x.shape[-1])
        # reduce_range: 7-bit activations, whose pairwise products cannot saturate the 16-bit
        # sums of CPUs without VNNI (AVX2's vpmaddubsw)
        out = [torch.ops.quantized.linear_dynamic(part.contiguous(), p, True)
               for part, p in zip(parts, packed, strict=True)]
        out = out[0] if len(out) == 1 else torch.stack(out)
        return out.view(*x.shape[:-1], -1)

    return forward


@contextmanager
def int8_products(modules: list[nn.Module]) -> Iterator[None]:
    """Within the block, each of `modules` (`nn.Linear` or `mtp.decoding.stacked.StackedLinear`,
    fp32 weights on the CPU) multiplies in 8-bit integers wherever gradients are off and its
    input is fp32 on the CPU: each weight quantised per output row (`int8_weight`, packed once
    and kept beside the module), its input per call over all its elements (7 bits, from their
    range), the sums in int32, the result in fp32, whatever path an enclosing `decode_linears`
    gave it (a `decode_linears` within leaves it as it is). On exit the modules are as they
    were.

    Raises:
        ValueError: a module whose weight is not fp32 on the CPU, or no int8 product in this
            torch build.
    """
    if modules and not int8_available():
        raise ValueError(f"torch {torch.__version__} has no int8 product on the CPU (fbgemm)")
    for m in modules:
        w = _maps(m)[0]
        if w.device.type != "cpu" or w.dtype != torch.float32:
            raise ValueError(f"int8 products take fp32 weights on the CPU (got "
                             f"{w.dtype} on {w.device})")
    before = {m: vars(m).get("forward") for m in modules}  # an enclosing block's, or none
    try:
        for m in before:
            m.forward = _int8_forward(m)
        yield
    finally:
        for m, forward in before.items():
            if forward is None:
                vars(m).pop("forward", None)
            else:
                m.forward = forward
