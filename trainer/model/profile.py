"""Where a training step of the model spends its time: ``torch.profiler`` over forward + backward on one GPU.

    python -m trainer.model.profile --preset small --seq-len 8192 [--steps 2] [--rows 40] [--csv kernels.csv]
        [--recompute-layers N [N ...]] [--attention varlen flex] [--shapes]

The 8k stage's micro-batch of 16 × 8,192 tokens is one packed sequence to the model: ``--seq-len 131072``.

Prints step time, tokens/s and MFU, the operators by self GPU time and by self CPU time, the GPU time per step of
each kind of kernel (dense GEMM, expert GEMM, KDA, attention, Inductor-fused, MoE routing and indexing, copies,
eager elementwise, other), the host-device synchronisations and device-to-host copies (each one stalls the
launch queue) and the GPU's idle gaps with the host op running as each began, so the next optimisation targets a
measured hot spot. When the CPU time per step exceeds the GPU time, the step is host-bound (launches, Python).
``--csv`` writes every kernel (bucket, calls and GPU ms per step).
Several ``--recompute-layers`` values are a sweep in one process (the compiles are shared): the profile is of the
first, then each further value gets its step time, MFU and peak memory, or "out of memory". Several ``--attention``
backends likewise (``LONGWEAVE_ATTENTION``, read as each step builds its mask): the profile is of the first, each
further one gets a plain-step line at the first recompute setting.
"""
from __future__ import annotations

import argparse
import bisect
import collections
import csv
import heapq
import os
import re

import torch
from torch.profiler import ProfilerActivity, profile

from trainer.engine import one_host_thread
from trainer.model import LongweaveModel, preset
from trainer.model.flops import mfu, training_flops
from trainer.model.synthetic import IMAGE_GRIDS, synthetic_batch
from trainer.model.timing import timed_forward_backward
from vision.attention import SETTINGS, cuda_backend

# What stalls the launch queue: explicit synchronisations and device-to-host copies. `aten::item` is not listed: most
# of a step's calls read host tensors (block masks, chunk tables), 191 of them at 32K against 4 stream syncs.
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "Memcpy DtoH (Device -> Pageable)",
            "Memcpy DtoH (Device -> Pinned)")
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaLaunchKernelExC")
PY_FRAME = re.compile(r"\.py\(\d+\): ")  # a Python frame's event name under with_stack=True
AUTOGRAD_NODE = "autograd::engine::evaluate_function: "
TORCH_FRAME = f"{os.sep}torch{os.sep}"  # frames inside torch's own Python code
SMALL_KINDS = ("eager elementwise", "copy", "routing & indexing")  # the kinds whose launch sites the summary lists


# Kernel kinds by name, first match wins: ours and FlexAttention's Triton kernels before Inductor's generic prefixes.
BUCKETS = (
    ("kda", re.compile(r"chunk_kda|l2norm")),
    ("attention", re.compile(r"flex_attention|triton_tem_fused|flash|fmha")),
    ("expert gemm", re.compile(r"grouped|GroupProblemShape")),  # torch._grouped_mm runs CUTLASS's grouped GEMM
    ("dense gemm", re.compile(r"gemm|nvjet|xmma|cutlass|cublas|sm90_|_mm_", re.IGNORECASE)),
    ("inductor fused", re.compile(r"^triton_(poi|red|per)_")),
    ("routing & indexing", re.compile(r"swiglu_|topk|sort|histogram|scatter|gather|index", re.IGNORECASE)),
    ("copy", re.compile(r"memcpy|memset|copy|cat|CatArray", re.IGNORECASE)),
    ("eager elementwise", re.compile(r"elementwise|vectorized|reduce_kernel|unrolled")),
)


def bucket(kernel: str) -> str:
    """The kind of a GPU kernel, from its name."""
    return next((kind for kind, pattern in BUCKETS if pattern.search(kernel)), "other")


def kernel_rows(events, steps: int) -> list[tuple[str, str, float, float]]:
    """(bucket, kernel, calls per step, GPU ms per step) of every GPU kernel, most time first."""
    rows = [(bucket(e.key), e.key, e.count / steps, e.self_device_time_total / steps / 1e3)
            for e in events if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total > 0]
    return sorted(rows, key=lambda r: -r[3])


def bucket_lines(rows: list[tuple[str, str, float, float]]) -> list[str]:
    total = sum(r[3] for r in rows) or 1.0
    lines = [f"GPU time per step by kind of kernel ({total:.1f} ms in all):"]
    for kind in [k for k, _ in BUCKETS] + ["other"]:
        mine = [r for r in rows if r[0] == kind]
        ms = sum(r[3] for r in mine)
        lines.append(f"  {kind:18s} {ms:9.2f} ms {ms / total:6.1%}  {sum(r[2] for r in mine):8.0f} launches")
    return lines


def kernel_sites(events, kinds: tuple[str, ...]) -> dict[tuple[str, str], list[float]]:  # noqa: ANN001
    """GPU time (µs) and launches of the kernels of ``kinds``, by the host site that launched them: the launching
    op, then the innermost autograd node running it (a backward op) or else the innermost Python frame (recorded
    under ``with_stack``, as an event or in the op's own stack). Events of one thread nest like a call stack, so one
    sweep per thread finds each op's enclosing ones."""
    by_thread: dict[int, list] = {}
    for e in events:
        if e.device_type != torch.autograd.DeviceType.CUDA:
            by_thread.setdefault(e.thread, []).append(e)
    sites: dict[tuple[str, str], list[float]] = {}
    for ops in by_thread.values():
        ops.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
        stack: list = []
        for e in ops:
            while stack and stack[-1].time_range.end <= e.time_range.start:
                stack.pop()
            stack.append(e)
            for kernel in e.kernels:
                kind = bucket(kernel.name)
                if kind not in kinds:
                    continue
                node = next((f.name for f in reversed(stack) if f.name.startswith(AUTOGRAD_NODE)), None)
                frame = node or next((f.name for f in reversed(stack) if PY_FRAME.search(f.name)), None)
                site = label(e, frames=1) if frame is None else f"{e.name} < {frame.removeprefix(AUTOGRAD_NODE)}"
                entry = sites.setdefault((kind, site), [0.0, 0])
                entry[0] += kernel.duration
                entry[1] += 1
    return sites


def site_lines(prof: profile, steps: int, kinds: tuple[str, ...] = SMALL_KINDS, top: int = 12) -> list[str]:
    """The largest launch sites of the small-kernel kinds: which code their GPU time comes from."""
    sites = kernel_sites(prof.events(), kinds)
    lines = []
    for kind in kinds:
        mine = sorted(((v[0], v[1], site) for (k, site), v in sites.items() if k == kind), reverse=True)
        lines.append(f"{kind} kernels by launch site (GPU ms and launches per step; op < autograd node or Python "
                     "frame):")
        lines += [f"  {us / steps / 1e3:9.2f} ms {n / steps:7.0f}  {site[:200]}" for us, n, site in mine[:top]]
    return lines


def write_kernel_csv(path: str | os.PathLike, prof: profile, steps: int) -> None:
    """Every GPU kernel (bucket, calls and GPU ms per step), most time first: the whole list behind the summary's
    buckets, for finding whose launches a bucket holds."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["bucket", "kernel", "calls_per_step", "gpu_ms_per_step"])
        writer.writerows(kernel_rows(prof.key_averages(), steps))


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, non-overlapping cover of ``(start, end)`` intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def idle_gaps(busy: list[tuple[float, float]], window: tuple[float, float],
              min_gap: float = 200.0) -> tuple[float, list[tuple[float, float]]]:
    """The GPU's idle time inside ``window`` (µs) and each gap of at least ``min_gap`` µs as ``(start, length)``.

    ``busy``: device activity (kernels, copies, memsets) as ``(start, end)``."""
    lo, hi = window
    idle, gaps, cursor = 0.0, [], lo
    for start, end in merged([(max(a, lo), min(b, hi)) for a, b in busy if b > lo and a < hi]) + [(hi, hi)]:
        if start > cursor:
            idle += start - cursor
            if start - cursor >= min_gap:
                gaps.append((cursor, start - cursor))
        cursor = max(cursor, end)
    return idle, gaps


def host_chains(ops: list[tuple[float, float, str]], gaps: list[tuple[float, float]],
                share: float = 0.5) -> list[tuple[list[str], list[str]]]:
    """For each gap ``(start, length)``, in time order as ``idle_gaps`` gives them, the ops of one thread
    (``(start, end, name)``, nested as a call stack) that were running as it began, and those that took at least
    ``share`` of it (they nest too: two disjoint ops cannot both cover more than half); each list outermost first.
    The second says where the host spent the gap."""
    ops = sorted(ops)
    starts = [op[0] for op in ops]
    chains, active, i = [], [], 0
    for start, length in gaps:  # a sweep: the ops begun by each gap's start, minus those ended by then
        while i < len(ops) and ops[i][0] <= start:
            heapq.heappush(active, (ops[i][1], ops[i][0], ops[i][2]))
            i += 1
        while active and active[0][0] <= start:
            heapq.heappop(active)
        end = start + length
        inside = ops[i:bisect.bisect_left(starts, end, lo=i)]
        spent = [(b, a, name) for a, b, name in inside] + active
        chains.append(([op[2] for op in sorted(active, key=lambda op: op[1] - op[0])],
                       [name for b, a, name in sorted(spent, key=lambda op: op[1] - op[0])
                        if min(b, end) - max(a, start) >= share * length]))
    return chains


def label(event, frames: int = 2) -> str:  # noqa: ANN001 - a FunctionEvent
    """An op's name, then the innermost Python frames of its recorded stack (``with_stack``) outside torch itself:
    where releases record no Python-function events (torch 2.11 on the device did not), the op's own stack is
    what names the code."""
    stack = [f for f in (getattr(event, "stack", None) or []) if TORCH_FRAME not in f]
    return " < ".join([event.name] + stack[:frames])


def launching_thread(events) -> int | None:  # noqa: ANN001 - torch.autograd.profiler_util.EventList
    """The thread that launched the most kernels (autograd's device thread runs the backward's)."""
    threads = collections.Counter(e.thread for e in events if e.name in LAUNCHES)
    return threads.most_common(1)[0][0] if threads else None


def where(chain: list[str], frames: int = 3) -> str:
    """A host chain in one line: the innermost op, then the innermost Python frames (``file(line): fn``, recorded
    when profiling ``with_stack=True``) innermost first."""
    if not chain:
        return "-"
    python = [name for name in chain if PY_FRAME.search(name)]
    return " < ".join([chain[-1]] + [name for name in reversed(python) if name != chain[-1]][:frames])


def idle_lines(prof: profile, top: int = 15) -> list[str]:
    """The GPU's idle time over the profiled window and its largest gaps, each with where the main thread spent it
    and what the kernel-launching thread (autograd's, in the backward) was running as it began: a step whose wall
    time exceeds its kernels' time waits on the host somewhere."""
    events = prof.events()
    cuda = torch.autograd.DeviceType.CUDA
    busy = [(e.time_range.start, e.time_range.end) for e in events if e.device_type == cuda]
    cpu = [e for e in events if e.device_type != cuda]
    if not busy or not cpu:
        return ["GPU idle time: no device events"]
    main = max(cpu, key=lambda e: e.time_range.end - e.time_range.start).thread  # it runs the whole profiled step
    launcher = launching_thread(events)
    window = (min(e.time_range.start for e in cpu), max(e.time_range.end for e in cpu))
    idle, gaps = idle_gaps(busy, window)

    def chains(thread: int | None) -> list[tuple[list[str], list[str]]]:
        ops = [(e.time_range.start, e.time_range.end, label(e)) for e in cpu if e.thread == thread]
        return host_chains(ops, gaps)

    # what took half the gap or more; else (a run of short ops) what was running as it began
    spent = [where(took or running) for running, took in chains(main)]
    began = [where(chain) for chain, _ in chains(launcher)] if launcher != main else ["-"] * len(gaps)
    by_site: dict[str, list[float]] = {}
    for (_, length), chain in zip(gaps, spent):
        by_site.setdefault(" < ".join(chain.split(" < ")[:2]), []).append(length)
    lines = [f"GPU idle {idle / 1e3:.1f} ms of the {(window[1] - window[0]) / 1e3:.1f} ms profiled; gaps of 0.2 ms "
             f"or more: {len(gaps)}, {sum(g[1] for g in gaps) / 1e3:.1f} ms. By where the main thread spent each "
             "(innermost op < Python frame):"]
    for site, lengths in sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:top]:
        lines.append(f"  {sum(lengths) / 1e3:9.1f} ms {len(lengths):5d} gaps  {site[:200]}")
    lines.append("largest gaps (ms from the window's start, ms idle; where the main thread spent it; what the "
                 "launching thread ran as it began):")
    largest = sorted(range(len(gaps)), key=lambda k: -gaps[k][1])
    for k in largest[:top]:
        lines.append(f"  {(gaps[k][0] - window[0]) / 1e3:10.1f} {gaps[k][1] / 1e3:8.1f}  main: {spent[k][:300]}")
        if began[k] != "-":
            lines.append(f"  {'':20}launcher: {began[k][:300]}")
    for k in largest[:3]:
        lines += overlap_lines(cpu, gaps[k], window[0], main, launcher)
    return lines


def overlap_lines(cpu, gap: tuple[float, float], origin: float, main: int, launcher: int | None,  # noqa: ANN001
                  rows: int = 30) -> list[str]:
    """Every thread's host events that overlap one gap by 1 ms or a tenth of it, by thread then start: the whole
    host picture of a gap, when the chosen threads' chains say little."""
    start, end = gap[0], gap[0] + gap[1]
    least = min(1e3, 0.1 * gap[1])
    hits = sorted((e.thread, e.time_range.start, e.time_range.end, label(e)) for e in cpu
                  if min(e.time_range.end, end) - max(e.time_range.start, start) >= least)
    role = {main: "main", launcher: "launcher"}
    out = [f"host events over the gap at {(start - origin) / 1e3:.1f} ms ({gap[1] / 1e3:.1f} ms; thread, ms from the "
           "gap's start, ms long, name):"]
    out += [f"    {role.get(t, t)!s:>10} {(a - start) / 1e3:9.1f} {(b - a) / 1e3:9.1f}  {name[:150]}"
            for t, a, b, name in hits[:rows]]
    if len(hits) > rows:
        out.append(f"    … {len(hits) - rows} more")
    return out


def summary(prof: profile, steps: int, rows: int, shapes: bool = False) -> str:
    """The operators by self GPU and CPU time (and by input shapes), the GPU time per kind of kernel and the
    host-device synchronisations, per step of ``steps`` profiled ones."""
    events = prof.key_averages()
    parts = [events.table(sort_by="self_cuda_time_total", row_limit=rows, max_name_column_width=70),
             events.table(sort_by="self_cpu_time_total", row_limit=rows // 2, max_name_column_width=70)]
    if shapes:
        parts.append(prof.key_averages(group_by_input_shape=True).table(
            sort_by="cuda_time_total", row_limit=rows, max_name_column_width=40, max_shapes_column_width=90))
    parts += bucket_lines(kernel_rows(events, steps))
    parts += site_lines(prof, steps)
    parts.append("host-device synchronisations per step:")
    parts += [f"  {e.key:30s} {e.count / steps:8.1f} calls, {e.cpu_time_total / steps / 1e3:8.1f} ms"
              for e in events if e.key in SYNC_OPS]
    parts += idle_lines(prof)
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small")
    parser.add_argument("--seq-len", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=2, help="profiled steps after two warm-up steps")
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--csv", help="write every GPU kernel (bucket, calls and ms per step) here")
    parser.add_argument("--shapes", action="store_true",
                        help="also the operators by input shapes (which adds and copies are whose)")
    parser.add_argument("--recompute-layers", type=int, nargs="+",
                        help="only the first N decoder layers recompute in the backward (0: none; default: the "
                             "preset's setting, every layer for small); several values: a sweep")
    parser.add_argument("--attention", nargs="+", choices=SETTINGS,
                        help="document attention kernels on CUDA (default: LONGWEAVE_ATTENTION or the module's "
                             "default; CAUSAL/BIDIRECTIONAL: the decoder's, then the vision tower's); several: the "
                             "first is profiled, each further one timed")
    args = parser.parse_args(argv)
    if args.attention:
        os.environ["LONGWEAVE_ATTENTION"] = args.attention[0]
    one_host_thread(torch.device("cuda"))  # as the trainer runs
    torch.manual_seed(0)
    with torch.device("cuda"):
        config = preset(args.preset)
        sweep = args.recompute_layers or [config.checkpoint_layers]
        config.checkpoint_layers = sweep[0]
        model = LongweaveModel(config).to(torch.bfloat16)
    batch, doc_lengths = synthetic_batch(args.seq_len, torch.Generator().manual_seed(0))
    batch["pixel_values"] = batch["pixel_values"].to(torch.bfloat16)

    def step() -> float:
        return timed_forward_backward(model, lambda: batch)[0]

    warm = [step() for _ in range(2)]
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=args.shapes) as prof:
        times = [step() for _ in range(args.steps)]
    with torch.no_grad():
        n_loss = model(**batch).n_loss_tokens
    flops = training_flops(model.config, doc_lengths, IMAGE_GRIDS, n_loss_tokens=n_loss).total

    def label() -> str:
        return f"{cuda_backend()} attention, {config.recomputed_layers()} of {config.n_layers} layers recomputed"

    def plain_step() -> str:
        """Step time (the best of two, without the profiler's overhead), tokens/s, MFU and peak memory."""
        plain = min(step() for _ in range(2))
        return (f"{label()}: plain step {plain * 1e3:.0f} "
                f"ms, {args.seq_len / plain:,.0f} tokens/s, MFU {mfu(flops, plain):.1%}, peak "
                f"{torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")

    print(f"{args.preset} seq_len={args.seq_len}: warm-up {[round(t, 2) for t in warm]} s, profiled "
          f"{[round(t, 3) for t in times]} s, {plain_step()}")
    print(summary(prof, args.steps, args.rows, args.shapes))
    if args.csv:
        write_kernel_csv(args.csv, prof, args.steps)
    settings = [(setting, cuda_backend()) for setting in sweep[1:]]
    settings += [(sweep[0], backend) for backend in (args.attention or [])[1:]]
    for setting, backend in settings:
        config.checkpoint_layers = setting
        os.environ["LONGWEAVE_ATTENTION"] = backend
        torch.cuda.reset_peak_memory_stats()
        try:
            line = plain_step()
        except torch.OutOfMemoryError:  # the traceback's tensors are freed once the handler has run
            line = f"{label()}: out of memory"
        torch.cuda.empty_cache()
        print(f"{args.preset} seq_len={args.seq_len}, {line}", flush=True)


if __name__ == "__main__":
    main()
