"""Where the kernel launches and host syncs of a model step come from, counted on the CPU (no GPU needed).

    python -m trainer.model.launches [--seq-len 4096] [--width 128] [--top 30]

One forward + backward of the ``small`` layer structure (20 layers, 8 AttnRes blocks, 128 experts top-4, a 12-block
vision tower, the synthetic batch of ``trainer.model.synthetic``) at a reduced width, under a dispatch mode that counts
every ATen operator that would launch a kernel (views and allocations excluded) by the source line that issued it: the
forward's own frame, or for backward operators the frame that built their autograd node. Operators issued from
``kernels/`` and from the attention call (FlexAttention, one kernel on the GPU, a per-segment loop here) are counted
in buckets of their own, since their CPU fallbacks launch differently from the GPU path. Host syncs are the operators
that read device data back on a GPU (``nonzero``, ``item``, ``tolist``, ``repeat_interleave`` without
``output_size``, boolean-mask indexing).
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import os
import sys
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.model.config import KDAConfig, MLAConfig, ModelConfig, small
from trainer.model.multimodal import LongweaveModel
from trainer.model.synthetic import synthetic_batch
from vision.config import VisionEncoderConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
VENV = os.path.join(ROOT, ".venv")
CHECKPOINT = os.path.join("torch", "utils", "checkpoint.py")
NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh", "set_",
             "resize_", "_to_copy_noop", "detach", "_local_scalar_dense_noop"}
SYNC_OPS = {"nonzero", "_local_scalar_dense", "masked_select", "unique", "_unique2", "nonzero_numpy"}
OPAQUE = ("document_attention",)  # one fused kernel on the GPU


def _fused_sites() -> set[tuple[str, str]]:
    """(file, function) of every ``cuda_compiled`` function: one compiled graph each way on CUDA."""
    import vision.fusion

    return {(fn.__code__.co_filename, fn.__name__) for fn in vision.fusion.FUSED}


def _where(frames: list[tuple[str, int, str]]) -> str:
    """The innermost repository frame: ``path:line (function)``, with kernels/, the attention call and the functions
    compiled on CUDA bucketed."""
    inside = [(f, n, fn) for f, n, fn in frames if f.startswith(ROOT) and not f.startswith(VENV)
              and not f.endswith(os.sep + "launches.py")]
    fused = _fused_sites()
    for f, n, fn in inside:
        if fn in OPAQUE:
            return f"[{fn}]"
        if (f, fn) in fused:
            return f"[fused {fn}]"
    if not inside:
        return "[autograd engine]"
    f, n, fn = inside[-1]
    rel = os.path.relpath(f, ROOT)
    if rel.startswith("kernels" + os.sep):
        return f"[kernels/{rel.split(os.sep)[1]}]"
    return f"{rel}:{n} ({fn})"


def _python_frames() -> list[tuple[str, int, str]]:
    frame, out = sys._getframe(2), []
    while frame is not None:
        out.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return out[::-1]


def _traceback_frames(lines: list[str]) -> list[tuple[str, int, str]]:
    out = []
    for entry in lines:
        head = entry.strip().splitlines()[0]  # '  File "x.py", line 3, in f'
        if head.startswith("File "):
            path, rest = head[6:].split('", line ', 1)
            number, _, fn = rest.partition(", in ")
            out.append((path, int(number), fn))
    return out


class LaunchCounter(TorchDispatchMode):
    """Counts launching ATen operators by (phase, source line) and sync operators by source line."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: collections.Counter[tuple[str, str]] = collections.Counter()
        self.ops: collections.Counter[str] = collections.Counter()
        self.syncs: collections.Counter[tuple[str, str]] = collections.Counter()

    def _site(self) -> tuple[str, str]:
        node = torch._C._current_autograd_node()
        frames = _python_frames()
        if node is None:
            return "forward", _where(frames)
        if any(f.endswith(CHECKPOINT) for f, _, _ in frames):  # a layer's forward re-run inside the backward
            return "recompute", _where(frames)
        if _where(frames) != "[autograd engine]":  # a Python autograd Function's backward
            return "backward", _where(frames)
        trace = node.metadata.get("traceback_")
        return "backward", (_where(_traceback_frames(trace)) if trace else f"[{node.name()}]")

    def record_sync(self, what: str) -> None:
        self.syncs[(what, self._site()[1])] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206 - dispatch protocol
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in SYNC_OPS or (name == "repeat_interleave" and func._overloadname != "self_int"
                                and kwargs.get("output_size") is None):
            self.record_sync(name)
        if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
                                   if i is not None):
            self.record_sync("index(bool mask)")
        if not (func.is_view or name in NO_LAUNCH or name.startswith("_local_scalar")):
            site = self._site()
            self.launches[site] += 1
            self.ops[name] += 1
        return func(*args, **kwargs)


@contextlib.contextmanager
def count_tolist(counter: LaunchCounter) -> Iterator[None]:
    """``Tensor.tolist`` reads memory without dispatching: count it as a sync by hand."""
    original = torch.Tensor.tolist

    def tolist(self: torch.Tensor):  # noqa: ANN202
        counter.record_sync("tolist")
        return original(self)

    torch.Tensor.tolist = tolist
    try:
        yield
    finally:
        torch.Tensor.tolist = original


def reduced_small(width: int) -> ModelConfig:
    """``small``'s structure (layers, pattern, experts, top-k, blocks, vision depth) at width ``width``."""
    config = small()
    heads = max(width // 64, 1)
    config.d_model = width
    config.kda = KDAConfig(n_heads=heads, head_dim=32)
    config.mla = MLAConfig(n_heads=heads, head_dim=32, kv_rank=32)
    config.moe.d_expert, config.moe.d_dense = 32, 2 * width
    config.vision = VisionEncoderConfig(d_model=64, n_layers=12, n_heads=2, checkpoint_layers=True)
    return config


class _OpaqueKDA(torch.autograd.Function):
    """Stands in for ``chunk_kda`` (its own launches are the kernels' business): o = v, every gradient = do."""

    @staticmethod
    def forward(ctx, q, k, v, z, beta):  # noqa: ANN001, ANN205
        return v.clone()

    @staticmethod
    def backward(ctx, do):  # noqa: ANN001, ANN205
        return do, do, do, do, do[..., 0]


def _opaque_kda(q, k, v, z, beta, **kwargs):  # noqa: ANN001, ANN202 - chunk_kda's signature
    return _OpaqueKDA.apply(q, k, v, z, beta.to(q.dtype)), None


def _opaque_experts(tokens, w13, w2, plan, row_gates, backend, keep_rows=False, sink=None):  # noqa: ANN001, ANN202, ARG001 - moe_experts' signature
    """One row per (token, slot), times its gate (so the router's backward runs as on the GPU); the tokens' gradient
    through autograd, which the sink's node adds (the GPU's gather-sum adds it in place)."""
    return tokens.repeat_interleave(plan.top_k, dim=0) * row_gates[:, None].to(tokens.dtype)


@contextlib.contextmanager
def opaque_kernels() -> Iterator[None]:
    """The KDA recurrence and the routed experts as one op each: their CPU references (a chunk loop, an expert
    loop) take minutes and launch nothing like the GPU kernels."""
    import kernels.moe.layer as moe_layer
    import trainer.model.kda as kda

    saved = kda.chunk_kda, moe_layer.moe_experts
    kda.chunk_kda, moe_layer.moe_experts = _opaque_kda, _opaque_experts
    try:
        yield
    finally:
        kda.chunk_kda, moe_layer.moe_experts = saved


@contextlib.contextmanager
def count_fused_calls(calls: collections.Counter[str]) -> Iterator[None]:
    """Count the calls of every ``cuda_compiled`` wrapper, wherever a module imported it."""
    import vision.fusion

    plain = {id(fn) for fn in vision.fusion.FUSED}
    patched = []
    for module in list(sys.modules.values()):
        if not getattr(module, "__name__", "").startswith(("trainer.", "vision.")):
            continue
        for attr, value in list(vars(module).items()):
            if id(getattr(value, "plain", None)) in plain:
                def counting(*args, _wrapped=value, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
                    calls[_wrapped.__name__] += 1
                    return _wrapped(*args, **kwargs)
                setattr(module, attr, counting)
                patched.append((module, attr, value))
    try:
        yield
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)


def count_step(model: LongweaveModel, batch: dict) -> tuple[LaunchCounter, collections.Counter[str]]:
    """One forward + backward under the counter (anomaly mode records each node's forward frame)."""
    counter, calls = LaunchCounter(), collections.Counter()
    model.zero_grad(set_to_none=True)
    with (torch.autograd.set_detect_anomaly(True, check_nan=False), counter, count_tolist(counter),
          count_fused_calls(calls)):
        model(**batch).loss.backward()
    return counter, calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    model = LongweaveModel(reduced_small(args.width))
    batch, _ = synthetic_batch(args.seq_len, torch.Generator().manual_seed(0), device="cpu")
    with opaque_kernels():
        model(**batch).loss.backward()  # warm-up (lazy initialisation)
        counter, calls = count_step(model, batch)
    total = sum(counter.launches.values())

    def summed(prefix: str) -> int:
        return sum(n for (_, site), n in counter.launches.items() if site.startswith(prefix))

    kernels, attention, fused = summed("[kernels/"), summed("[document_attention"), summed("[fused ")
    print(f"launching ATen ops per step: {total:,}; in kernels/ {kernels:,}, in the attention call {attention:,}, "
          f"in functions compiled on CUDA {fused:,} ({sum(calls.values())} calls: "
          f"{', '.join(f'{k} {v}' for k, v in calls.most_common())}); the rest {total - kernels - attention - fused:,}")
    by_site: collections.Counter[str] = collections.Counter()
    for (phase, site), n in counter.launches.items():
        by_site[f"{phase:8s} {site}"] += n
    for site, n in by_site.most_common(args.top):
        print(f"  {n:6d}  {site}")
    print("top operators:", ", ".join(f"{k} {v}" for k, v in counter.ops.most_common(15)))
    print(f"host syncs per step: {sum(counter.syncs.values())}")
    for (what, site), n in counter.syncs.most_common():
        print(f"  {n:6d}  {what:18s} {site}")


if __name__ == "__main__":
    main()
