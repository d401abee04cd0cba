"""KDA kernels against the float32 recurrence: outputs, final states and every gradient, on fresh random inputs.

Without CUDA the Triton kernels run under the interpreter: in fp32, and in bf16 with the interpreter given a GPU's
bf16 and tf32 arithmetic (`gpu_numerics.py`; as it ships, it multiplies bf16 `tl.dot` operands wrongly).
"""
from __future__ import annotations

import re
import sys

import pytest
import torch

from checks import block_shapes, fresh_seed
from interpreted import INTERPRET, import_interpreted

import_interpreted("kernels.kda")

from kernels.kda import chunk_kda, naive_chunk_kda, naive_recurrent_kda  # noqa: E402
from kernels.kda.gate import GRAD_ROWS, gate_param_grads, kda_gate, naive_gate_param_grads  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; the absolute error where the reference is exactly zero (e.g. dg when
    T = 1 from a zero state, where the decay acts on nothing)."""
    out, ref = out.double(), ref.double()
    norm = ref.norm()
    return ((out - ref).norm() / (norm if norm > 0 else 1.0)).item()


def make_inputs(B: int, T: int, H: int, K: int, V: int, h0: bool, n_docs: int = 1, device: str = DEVICE,
                dtype: torch.dtype = torch.float32) -> dict:
    """Fresh random KDA inputs (never zeros): unit-norm keys, g = -5 sigmoid(randn), beta in (0, 1)."""
    fresh_seed()
    kw = dict(device=device)
    x = dict(
        q=torch.randn(B, T, H, K, **kw).to(dtype),
        k=torch.nn.functional.normalize(torch.randn(B, T, H, K, **kw), dim=-1).to(dtype),
        v=torch.randn(B, T, H, V, **kw).to(dtype),
        g=-5 * torch.sigmoid(torch.randn(B, T, H, K, **kw)),
        beta=torch.rand(B, T, H, **kw).to(dtype),
        h0=torch.randn(max(B, n_docs), H, K, V, **kw) if h0 else None,
    )
    cu = None
    if n_docs > 1:
        cuts = torch.randperm(T - 1)[: n_docs - 1].add(1).sort().values.tolist()
        cu = torch.tensor([0, *cuts, T], dtype=torch.int32, device=device)
    return dict(inputs=x, cu_seqlens=cu)


def run(fn, inputs: dict, cu_seqlens: torch.Tensor | None, grad_out: tuple[torch.Tensor, torch.Tensor] | None,
        **kw) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Output, final state and the gradient of every input under <o, do> + <ht, dht>."""
    leaves = {n: t.clone().requires_grad_() for n, t in inputs.items() if t is not None}
    o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves.get("h0"),
               output_final_state=True, cu_seqlens=cu_seqlens, **kw)
    if grad_out is None:
        grad_out = (torch.randn_like(o), torch.randn_like(ht))
    ((o * grad_out[0]).sum() + (ht * grad_out[1]).sum()).backward()
    return o, ht, {n: t.grad for n, t in leaves.items()}, grad_out


def check_against_recurrence(case: dict, tol: float, dg_tol: float | None = None, **kw) -> None:
    ref_in = {n: (t.float() if t is not None else None) for n, t in case["inputs"].items()}
    o_ref, ht_ref, g_ref, grad_out = run(naive_recurrent_kda, ref_in, case["cu_seqlens"], None)
    o, ht, grads, _ = run(chunk_kda, case["inputs"], case["cu_seqlens"], grad_out, **kw)
    errors = {"o": rel_err(o, o_ref), "ht": rel_err(ht, ht_ref)}
    errors |= {f"d{n}": rel_err(grads[n], g_ref[n]) for n in grads}
    bad = {n: e for n, e in errors.items() if not e <= (dg_tol if n == "dg" and dg_tol is not None else tol)}
    assert not bad, f"relative errors over {tol}: {bad} (all: {errors})"


CPU_CASES = [
    pytest.param(T, K, h0, id=f"T{T}-H2-K{K}{'-h0' if h0 else ''}")
    for T in (1, 15, 16, 17, 63, 64, 65, 200) for K in (32, 64) for h0 in (False, True)
]


@pytest.mark.parametrize("T, K, h0", CPU_CASES)
def test_chunk_matches_recurrence(T: int, K: int, h0: bool) -> None:
    check_against_recurrence(make_inputs(1 if T > 64 else 2, T, 2, K, K, h0), 1e-4)


@pytest.mark.parametrize("T, K, docs", [
    pytest.param(T, K, docs, id=f"T{T}-H2-K{K}{f'-varlen{docs}' if docs > 1 else ''}")
    for T, docs in ((1, 1), (16, 1), (31, 1), (32, 1), (33, 1), (150, 3)) for K in (32, 128)
])
def test_chunks_of_32_match_recurrence(T: int, K: int, docs: int) -> None:
    """``chunk_size=32``: two sub-chunks a chunk, twice the chunks; partial and whole chunks, documents, h0."""
    check_against_recurrence(make_inputs(1 if docs > 1 else 2, T, 2, K, K, True, n_docs=docs), 1e-4, chunk_size=32)


@pytest.mark.skipif(not INTERPRET, reason="on a GPU, test_gpu_bf16_matches_fp32_reference runs bf16 itself")
@pytest.mark.parametrize("docs, chunk", [pytest.param(None, 64, id="T1024-H1-K128"),
                                         pytest.param(3, 64, id="T1024-H1-K128-varlen3"),
                                         pytest.param(3, 32, id="T1024-H1-K128-varlen3-chunk32")])
def test_bf16_with_gpu_numerics(gpu_numerics: None, docs: int | None, chunk: int) -> None:
    """bf16 through the interpreter with a GPU's bf16 and tf32 arithmetic (tests/kernels/gpu_numerics.py): every
    error within 5e-3, gradients included (fla-core's are <= 3.4e-3 on the H200 at T=4096). dg was 7.1e-3 here
    while its tf32 operands differed between the two sides of a cancellation."""
    check_against_recurrence(make_inputs(1, 1024, 1, 128, 128, True, n_docs=docs or 1, dtype=torch.bfloat16), 5e-3,
                             chunk_size=chunk)


@pytest.mark.parametrize("K, h0", [pytest.param(32, True, id="T150-H2-K32-varlen-h0"),
                                   pytest.param(64, False, id="T150-H2-K64-varlen")])
def test_varlen_matches_recurrence(K: int, h0: bool) -> None:
    check_against_recurrence(make_inputs(1, 150, 2, K, K, h0, n_docs=3), 1e-4)


def test_empty_documents_keep_their_initial_state() -> None:
    case = make_inputs(1, 90, 2, 32, 32, True, n_docs=4)
    case["cu_seqlens"] = torch.tensor([0, 0, 40, 40, 90], dtype=torch.int32, device=DEVICE)
    check_against_recurrence(case, 1e-4)


@pytest.mark.parametrize("g", [-5.0, -4.9], ids=["at-the-bound", "near-it"])
@pytest.mark.parametrize("chunk", [64, 32], ids=["chunk64", "chunk32"])
def test_strongest_decay_stays_exact(g: float, chunk: int) -> None:
    """Every step at the gate's bound: the sub-chunk decay factors reach their widest range (e^-80 to e^80 across a
    sub-chunk: 16 steps of -5 from the anchor just before it), where an overflow, or a term lost to underflow that
    still matters, would show (as errors of order 1). dg's float32 error there is 6e-5 to 1.1e-4 by the seed (seed
    270697589: 1.06e-4, the same before the bf16 Gram products), the rest about 1e-7: dg gets 3e-4."""
    case = make_inputs(1, 200, 2, 64, 64, True, n_docs=2)
    case["inputs"]["g"] = torch.full_like(case["inputs"]["g"], g)
    check_against_recurrence(case, 1e-4, dg_tol=3e-4, chunk_size=chunk)


def test_identical_keys_without_decay_stay_exact() -> None:
    """The hardest UT inverse: one key repeated, beta = 1, g ~ 0, so (I + A_kk) has ones everywhere below the
    diagonal; the recursive-doubling inverse must still match the recurrence."""
    case = make_inputs(1, 130, 1, 32, 32, False)
    x = case["inputs"]
    x["k"] = x["k"][:, :1].expand_as(x["k"]).contiguous()
    x["g"] = torch.full_like(x["g"], -1e-3)
    x["beta"] = torch.ones_like(x["beta"])
    check_against_recurrence(case, 1e-4)


def tuning_spaces() -> dict[str, tuple]:
    """Every autotuned KDA kernel with its whole search space (the interpreter otherwise runs only the first)."""
    from kernels.kda import chunk_bwd, chunk_fwd, chunk_intra
    return {
        "intra": (chunk_intra.chunk_kda_fwd_intra_kernel, chunk_intra.INTRA_SPACE),
        "state-pass": (chunk_fwd.chunk_kda_fwd_h_kernel, chunk_fwd.STATE_PASS_SPACE),
        "reverse-pass": (chunk_bwd.chunk_kda_bwd_dh_kernel, chunk_fwd.STATE_PASS_SPACE),
        "dA": (chunk_bwd.chunk_kda_bwd_dA_kernel, chunk_bwd.DA_SPACE),
        "dqkg": (chunk_bwd.chunk_kda_bwd_dqkg_kernel, chunk_bwd.DQKG_SPACE),
    }


@pytest.mark.skipif(not INTERPRET, reason="the interpreter runs one config per kernel; a GPU tunes over all of them")
@pytest.mark.parametrize("kernel", ["intra", "state-pass", "reverse-pass", "dA", "dqkg"])
@pytest.mark.parametrize("chunk", [64, 32], ids=["chunk64", "chunk32"])
def test_every_tuning_config_matches_recurrence(kernel: str, chunk: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The GPU autotuner may pick any config of a kernel's space, so each one must be right: K = V = 128 (every
    block width fits), two documents, a partly filled last chunk, at both chunk sizes (one entry per block shape:
    ``block_shapes``)."""
    from kernels.tuning import config

    tuned, space = tuning_spaces()[kernel]
    for entry in block_shapes(space):
        monkeypatch.setattr(tuned, "configs", [config(*entry)])
        case = make_inputs(1, 100, 1, 128, 128, True, n_docs=2)
        check_against_recurrence(case, 1e-4, chunk_size=chunk)


@pytest.mark.parametrize("chunk", [64, 32], ids=["chunk64", "chunk32"])
def test_in_kernel_gate_matches_recurrence(chunk: int) -> None:
    """Raw gate input z, A_log and dt_bias: the kernel's bounded gate and its gradients (dz, dA_log, d dt_bias)."""
    case = make_inputs(1, 80, 2, 32, 32, True)
    z = torch.randn(1, 80, 2, 32, device=DEVICE)
    A_log = torch.randn(2, device=DEVICE) * 0.5
    dt_bias = torch.randn(64, device=DEVICE)
    raw = {"z": z, "A_log": A_log, "dt_bias": dt_bias}
    leaves = {n: t.clone().requires_grad_() for n, t in raw.items()}
    x = case["inputs"]
    o, ht = chunk_kda(x["q"], x["k"], x["v"], leaves["z"], x["beta"], initial_state=x["h0"],
                      output_final_state=True, A_log=leaves["A_log"], dt_bias=leaves["dt_bias"], chunk_size=chunk)
    refs = {n: t.clone().requires_grad_() for n, t in raw.items()}
    g = kda_gate(refs["z"], refs["A_log"], refs["dt_bias"], -5.0)
    o_ref, ht_ref = naive_recurrent_kda(x["q"], x["k"], x["v"], g, x["beta"], initial_state=x["h0"],
                                        output_final_state=True)
    do, dht = torch.randn_like(o), torch.randn_like(ht)
    ((o * do).sum() + (ht * dht).sum()).backward()
    ((o_ref * do).sum() + (ht_ref * dht).sum()).backward()
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(ht, ht_ref) <= 1e-4
    for n in leaves:
        assert rel_err(leaves[n].grad, refs[n].grad) <= 1e-4, n


@pytest.mark.parametrize("T, bias, dtype", [
    pytest.param(GRAD_ROWS + 77, True, torch.bfloat16, id="two-programs-a-partial-tile-bf16"),
    pytest.param(5, False, torch.float32, id="five-tokens-no-bias"),
])
def test_gate_param_grads_pass_matches_the_pytorch_form(T: int, bias: bool, dtype: torch.dtype) -> None:
    """The one-pass dA_log and d dt_bias against their PyTorch form on the same inputs (dz and z in the model's
    dtype, as the KDA backward has them); dA_log measured against the size of its terms, which cancel."""
    fresh_seed()
    H, K = 3, 32
    dz, z = (torch.randn(1, T, H, K, device=DEVICE).to(dtype) for _ in range(2))
    dt_bias = torch.randn(H * K, device=DEVICE) if bias else None
    dA, db = gate_param_grads(dz, z, dt_bias)
    dA_ref, db_ref = naive_gate_param_grads(dz, z, dt_bias)
    x = z.float() + (dt_bias.view(H, K) if bias else 0)
    terms = (dz.float() * x).abs().sum((0, 1, 3))
    assert dA.shape == (H,) and db.shape == (H * K,)
    assert ((dA - dA_ref).abs() / terms).max() <= 1e-5 and rel_err(db, db_ref) <= 1e-5


def test_qk_l2norm_option_matches_recurrence() -> None:
    """use_qk_l2norm: the same as normalising q and k first, gradients included."""
    case = make_inputs(1, 40, 2, 32, 32, True)
    case["inputs"]["q"] = case["inputs"]["q"] * 3

    def normalised_recurrence(q, k, *args, **kw):
        return naive_recurrent_kda(torch.nn.functional.normalize(q, dim=-1, eps=0.0),
                                   torch.nn.functional.normalize(k, dim=-1, eps=0.0), *args, **kw)

    o_ref, ht_ref, g_ref, grad_out = run(normalised_recurrence, case["inputs"], None, None)
    o, ht, grads, _ = run(chunk_kda, case["inputs"], None, grad_out, use_qk_l2norm=True)
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(ht, ht_ref) <= 1e-4
    for n in grads:
        assert rel_err(grads[n], g_ref[n]) <= 1e-4, n


def test_naive_chunk_matches_recurrence() -> None:
    case = make_inputs(1, 200, 2, 32, 32, True, n_docs=3, device="cpu")
    check = {n: t for n, t in case["inputs"].items()}
    o_ref, ht_ref, g_ref, grad_out = run(naive_recurrent_kda, check, case["cu_seqlens"], None)
    o, ht, grads, _ = run(naive_chunk_kda, check, case["cu_seqlens"], grad_out)
    assert rel_err(o, o_ref) <= 1e-4 and rel_err(ht, ht_ref) <= 1e-4
    for n in grads:
        assert rel_err(grads[n], g_ref[n]) <= 1e-4, n


@pytest.mark.parametrize("tau", [pytest.param(35, id="T45-tau35-partial-subchunk"),
                                 pytest.param(63, id="T100-tau63-chunk-end"),
                                 pytest.param(16, id="T45-tau16-subchunk-start")])
@pytest.mark.parametrize("chunk", [64, 32], ids=["chunk64", "chunk32"])
def test_exactly_causal(tau: int, chunk: int) -> None:
    """New values of q, k, v, g, beta after tau leave every output up to tau bit-for-bit unchanged."""
    T = 45 if tau < 45 else 100
    x = make_inputs(1, T, 2, 32, 32, True)["inputs"]
    y = {n: t.clone() for n, t in x.items()}
    for n in ("q", "k", "v", "g", "beta"):
        fresh = make_inputs(1, T, 2, 32, 32, False)["inputs"][n]
        y[n][:, tau + 1:] = fresh[:, tau + 1:]
    o_x, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"], chunk_size=chunk)
    o_y, _ = chunk_kda(y["q"], y["k"], y["v"], y["g"], y["beta"], initial_state=y["h0"], chunk_size=chunk)
    assert torch.equal(o_x[:, : tau + 1], o_y[:, : tau + 1])
    assert not torch.equal(o_x[:, tau + 1:], o_y[:, tau + 1:])


SEGMENT_CASES = [
    pytest.param([0, 300], id="one-document-over-five-segments"),
    pytest.param([0, 50, 64, 64, 200, 260, 300], id="documents-cut-at-and-across-boundaries-and-empty"),
    pytest.param([0, 0, 128, 300, 300], id="empty-first-and-last"),
]


@pytest.mark.parametrize("cu", SEGMENT_CASES)
@pytest.mark.parametrize("gate", [False, True], ids=["g", "in-kernel-gate"])
def test_segments_match_one_pass(cu: list[int], gate: bool) -> None:
    """Checkpointed 64-token segments give the outputs, final states and every gradient (initial states and
    the gate parameters included) of one pass over the packed sequence, to float32 rounding."""
    from kernels.kda.segments import chunk_kda_segmented

    N, T = len(cu) - 1, cu[-1]
    x = make_inputs(1, T, 2, 32, 32, False)["inputs"]
    x["h0"] = torch.randn(N, 2, 32, 32, device=DEVICE)
    if gate:
        x |= dict(g=torch.randn(1, T, 2, 32, device=DEVICE), A_log=torch.randn(2, device=DEVICE) * 0.5,
                  dt_bias=torch.randn(64, device=DEVICE))
    cu_seqlens = torch.tensor(cu, dtype=torch.int32)
    grad_out = (torch.randn(1, T, 2, 32, device=DEVICE), torch.randn(N, 2, 32, 32, device=DEVICE))

    def forward_backward(fn, **kw) -> tuple[torch.Tensor, torch.Tensor, dict]:  # noqa: ANN001
        leaves = {n: t.clone().requires_grad_() for n, t in x.items() if t is not None}
        gate_args = {n: leaves[n] for n in ("A_log", "dt_bias") if n in leaves}
        o, ht = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["h0"],
                   output_final_state=True, cu_seqlens=cu_seqlens, **gate_args, **kw)
        ((o * grad_out[0]).sum() + (ht * grad_out[1]).sum()).backward()
        return o, ht, {n: t.grad for n, t in leaves.items()}

    o_ref, ht_ref, g_ref = forward_backward(chunk_kda)
    o, ht, grads = forward_backward(chunk_kda_segmented, segment_tokens=64)
    errors = {"o": rel_err(o, o_ref), "ht": rel_err(ht, ht_ref)}
    errors |= {f"d{n}": rel_err(grads[n], g_ref[n]) for n in grads}
    if gate:  # dA_log [H] sums dz (z + dt_bias) over T*K terms that can cancel: measure it against their size
        terms = (g_ref["g"] * (x["g"] + x["dt_bias"].view(2, 32))).abs().sum(dim=(0, 1, 3))
        errors["dA_log"] = ((grads["A_log"] - g_ref["A_log"]).double().norm() / terms.double().norm()).item()
    assert max(errors.values()) <= 1e-4, errors   # float32 sums in another order (d dt_bias: ~1e-5)


def test_documents_are_independent() -> None:
    """Changing document 1 (and its initial state) leaves documents 2 and 3 unchanged."""
    case = make_inputs(1, 150, 2, 32, 32, True, n_docs=3)
    x, cu = case["inputs"], case["cu_seqlens"]
    end = int(cu[1])
    y = {n: t.clone() for n, t in x.items()}
    for n in ("q", "k", "v", "g", "beta"):
        y[n][:, :end] = make_inputs(1, 150, 2, 32, 32, False)["inputs"][n][:, :end]
    y["h0"][0] = torch.randn_like(y["h0"][0])
    o_x, ht_x = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["h0"],
                          output_final_state=True, cu_seqlens=cu)
    o_y, ht_y = chunk_kda(y["q"], y["k"], y["v"], y["g"], y["beta"], initial_state=y["h0"],
                          output_final_state=True, cu_seqlens=cu)
    assert torch.equal(o_x[:, end:], o_y[:, end:]) and torch.equal(ht_x[1:], ht_y[1:])
    assert not torch.equal(o_x[:, :end], o_y[:, :end])


def _args(**over) -> dict:
    B, T, H, K = 1, 8, 2, 32
    a = dict(q=torch.randn(B, T, H, K), k=torch.randn(B, T, H, K), v=torch.randn(B, T, H, K),
             g=-torch.rand(B, T, H, K), beta=torch.rand(B, T, H))
    a.update(over)
    return a


@pytest.mark.parametrize("over, match", [
    pytest.param(dict(q=torch.randn(8, 2, 32)), r"q must be \[B, T, H, K\], got shape \(8, 2, 32\)", id="q-rank"),
    pytest.param(dict(k=torch.randn(1, 8, 2, 16)), r"k must have q's shape .* got \(1, 8, 2, 16\)", id="k-shape"),
    pytest.param(dict(v=torch.randn(1, 7, 2, 32)), r"v must be \[B, T, H, V\].* got shape \(1, 7, 2, 32\)",
                 id="v-shape"),
    pytest.param(dict(g=torch.randn(1, 8, 2, 16)), r"g must have q's shape .* got \(1, 8, 2, 16\)", id="g-shape"),
    pytest.param(dict(beta=torch.rand(1, 8, 3)), r"beta must be \[B, T, H\].* got shape \(1, 8, 3\)",
                 id="beta-shape"),
    pytest.param(dict(v=torch.randn(1, 8, 2, 48)), r"head dim V must be one of .* got 48", id="V-size"),
    pytest.param(dict(q=torch.randn(1, 8, 2, 16), k=torch.randn(1, 8, 2, 16), g=-torch.rand(1, 8, 2, 16)),
                 r"head dim K must be one of .* got 16", id="K-size"),
    pytest.param(dict(q=torch.randn(1, 8, 2, 32, dtype=torch.float16)), r"q must be float32 or bfloat16, got "
                 r"torch.float16", id="q-dtype"),
    pytest.param(dict(v=torch.randn(1, 8, 2, 32).bfloat16()), r"v must have q's dtype .* got torch.bfloat16",
                 id="v-dtype"),
    pytest.param(dict(scale=-1.0), r"scale must be positive, got -1.0", id="scale"),
    pytest.param(dict(q=torch.randn(2, 8, 2, 32), k=torch.randn(2, 8, 2, 32), v=torch.randn(2, 8, 2, 32),
                      g=-torch.rand(2, 8, 2, 32), beta=torch.rand(2, 8, 2), cu_seqlens=torch.tensor([0, 8])),
                 r"need B == 1, got B=2", id="cu_seqlens-batch"),
    pytest.param(dict(cu_seqlens=torch.tensor([0.0, 8.0])), r"cu_seqlens must be a 1-D int32/int64",
                 id="cu_seqlens-dtype"),
    pytest.param(dict(cu_seqlens=torch.tensor([0, 5, 3, 8])), r"cu_seqlens must rise from 0 to T=8, got \[0, 5, 3",
                 id="cu_seqlens-order"),
    pytest.param(dict(initial_state=torch.randn(2, 2, 32, 32)), r"initial_state must be \[N, H, K, V\] = "
                 r"\[1, 2, 32, 32\], got shape \(2, 2, 32, 32\)", id="initial_state"),
    pytest.param(dict(dt_bias=torch.randn(64)), r"dt_bias needs A_log", id="dt_bias-alone"),
    pytest.param(dict(A_log=torch.randn(3)), r"A_log must be \[H\] = \[2\], got shape \(3,\)", id="A_log"),
    pytest.param(dict(A_log=torch.randn(2), dt_bias=torch.randn(32)), r"dt_bias must be \[H\*K\] = \[64\]",
                 id="dt_bias"),
    pytest.param(dict(A_log=torch.randn(2), g_min=-8.0), r"g_min must lie in \[-5, 0\).* got -8.0", id="g_min"),
    pytest.param(dict(chunk_size=16), r"chunk_size must be one of \(32, 64\), got 16", id="chunk_size"),
])
def test_argument_errors(over: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        a = _args(**over)
        chunk_kda(a.pop("q"), a.pop("k"), a.pop("v"), a.pop("g"), a.pop("beta"), **a)


# --- GPU: bf16 at real shapes, fp32 exactness, and agreement with fla-core -------------------------------------

GPU_CASES = [
    pytest.param(2, 4096, 4, 128, None, id="B2-T4096-H4-K128"),
    pytest.param(1, 8192, 4, 128, 5, id="B1-T8192-H4-K128-varlen5"),
    pytest.param(2, 2000, 2, 64, None, id="B2-T2000-H2-K64"),
]


def _gpu_reference(case: dict) -> tuple:
    ref_in = {n: (t.float() if t is not None else None) for n, t in case["inputs"].items()}
    return run(naive_chunk_kda, ref_in, case["cu_seqlens"], None)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, K, docs", GPU_CASES)
@pytest.mark.parametrize("chunk", [64, 32], ids=["chunk64", "chunk32"])
def test_gpu_bf16_matches_fp32_reference(B: int, T: int, H: int, K: int, docs: int | None, chunk: int) -> None:
    case = make_inputs(B, T, H, K, K, True, n_docs=docs or 1, dtype=torch.bfloat16)
    o_ref, ht_ref, g_ref, grad_out = _gpu_reference(case)
    o, ht, grads, _ = run(chunk_kda, case["inputs"], case["cu_seqlens"], grad_out, chunk_size=chunk)
    errors = {"o": rel_err(o, o_ref), "ht": rel_err(ht, ht_ref)}
    assert max(errors.values()) <= 5e-3, errors
    errors = {f"d{n}": rel_err(grads[n], g_ref[n]) for n in grads}
    assert max(errors.values()) <= 1e-2, errors


@pytest.mark.gpu
@pytest.mark.parametrize("T, docs", [pytest.param(1000, None, id="T1000-H2-K64"),
                                     pytest.param(1000, 3, id="T1000-H2-K64-varlen3")])
def test_gpu_fp32_matches_recurrence(T: int, docs: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled float32 (IEEE products) against the recurrence, one config per kernel: the first of its space that
    fits K = 64. Every config is checked under the interpreter (``test_every_tuning_config_matches_recurrence``);
    tuning all five spaces at IEEE precision here took over 100 s of device time per case (2026-12-07)."""
    from kernels.tuning import config

    for tuned, space in tuning_spaces().values():
        monkeypatch.setattr(tuned, "configs", [config(*next(e for e in space if max(e[0].values()) <= 64))])
    check_against_recurrence(make_inputs(1, T, 2, 64, 64, True, n_docs=docs or 1), 1e-4)


@pytest.mark.gpu
def test_gpu_in_kernel_gate_bf16() -> None:
    case = make_inputs(1, 4096, 4, 128, 128, False, dtype=torch.bfloat16)
    x = case["inputs"]
    z = torch.randn(1, 4096, 4, 128, device="cuda", dtype=torch.bfloat16)
    A_log = torch.zeros(4, device="cuda")
    o, _ = chunk_kda(x["q"], x["k"], x["v"], z, x["beta"], A_log=A_log)
    g = kda_gate(z, A_log, None, -5.0)
    o_ref, _ = naive_chunk_kda(x["q"].float(), x["k"].float(), x["v"].float(), g, x["beta"].float())
    assert rel_err(o, o_ref) <= 5e-3


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, K, docs", GPU_CASES[:2])
def test_gpu_agrees_with_fla(B: int, T: int, H: int, K: int, docs: int | None) -> None:
    fla_kda = pytest.importorskip("fla.ops.kda")
    case = make_inputs(B, T, H, K, K, True, n_docs=docs or 1, dtype=torch.bfloat16)
    cu = case["cu_seqlens"]

    def fla(q, k, v, g, beta, *, initial_state, output_final_state, cu_seqlens):
        return fla_kda.chunk_kda(q, k, v, g, beta, initial_state=initial_state, output_final_state=True,
                                 safe_gate=True, lower_bound=-5.0,
                                 cu_seqlens=cu_seqlens.long() if cu_seqlens is not None else None)

    o_ref, ht_ref, g_ref, grad_out = run(fla, case["inputs"], cu, None)
    o, ht, grads, _ = run(chunk_kda, case["inputs"], cu, grad_out)
    errors = {"o": rel_err(o, o_ref), "ht": rel_err(ht, ht_ref)}
    errors |= {f"d{n}": rel_err(grads[n], g_ref[n]) for n in grads}
    assert max(errors.values()) <= 5e-3, errors


def test_host_cu_seqlens_pass_through() -> None:
    """A CPU cu_seqlens is already the host copy: returned as is, nothing cached."""
    from kernels.kda.host_cache import HostCopies

    cache, cu = HostCopies(), torch.tensor([0, 5, 9], dtype=torch.int32)
    assert cache.get(cu) is cu and cache.misses == 0


def test_chunk_tables_are_built_once_per_cu_seqlens() -> None:
    """Every layer of a micro-batch gets the same cu_seqlens tensor: its chunk tables are built on the first call and
    reused; a new tensor, another device argument or an in-place edit builds them again, and the tables match."""
    from kernels.kda.chunk import CHUNK, CHUNK_PLANS, prepare_chunks

    cu, cpu = torch.tensor([0, 5, 9 + CHUNK], dtype=torch.int32), torch.device("cpu")
    before = CHUNK_PLANS.misses
    first = prepare_chunks(cu, cpu)
    assert prepare_chunks(cu, cpu) is first and CHUNK_PLANS.misses == before + 1
    offsets, chunks, order = first
    assert offsets.tolist() == [0, 1, 3] and chunks.tolist() == [[0, 5], [5, 9 + CHUNK], [5 + CHUNK, 9 + CHUNK]]
    assert order.tolist() == [1, 0]
    cu[2] = 10
    assert prepare_chunks(cu, cpu)[1].tolist() == [[0, 5], [5, 10]] and CHUNK_PLANS.misses == before + 2
    assert prepare_chunks(cu.clone(), cpu)[0].tolist() == [0, 1, 2] and CHUNK_PLANS.misses == before + 3
    assert prepare_chunks(cu, cpu, 32)[1].tolist() == [[0, 5], [5, 10]] and CHUNK_PLANS.misses == before + 4
    cu[2] = 9 + CHUNK
    assert prepare_chunks(cu, cpu, 32)[1].tolist() == [[0, 5], [5, 9 + CHUNK], [37, 9 + CHUNK], [69, 9 + CHUNK]]


@pytest.mark.gpu
def test_gpu_device_cu_seqlens_read_back_once() -> None:
    """A device cu_seqlens is read back once per tensor (and again after an in-place edit); a forward + backward
    that reuses it makes no host sync at all."""
    from kernels.kda.host_cache import HostCopies

    cache, cu = HostCopies(), torch.tensor([0, 5, 9], dtype=torch.int32, device="cuda")
    assert cache.get(cu) is cache.get(cu) and cache.misses == 1
    cu[1] = 6
    assert cache.get(cu).tolist() == [0, 6, 9] and cache.misses == 2

    case = make_inputs(1, 4096, 4, 128, 128, False, n_docs=5, dtype=torch.bfloat16)
    x = {n: t.requires_grad_() for n, t in case["inputs"].items() if t is not None}
    grad_out = torch.randn_like(x["v"])

    def step() -> None:
        o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=case["cu_seqlens"])
        o.backward(grad_out)

    step()   # autotuning and the first read-back synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("shape", [(3, 37, 2, 32), (1, 65, 3, 128)], ids=["odd-rows-K32", "K128"])
def test_l2norm_kernel_matches_reference(shape: tuple[int, ...]) -> None:
    from kernels.kda.l2norm import l2norm, l2norm_reference

    fresh_seed()
    x = torch.randn(*shape, device=DEVICE) * 3
    dy = torch.randn(*shape, device=DEVICE)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = l2norm(xa), l2norm_reference(xb)
    (ya * dy).sum().backward()
    (yb * dy).sum().backward()
    assert rel_err(ya, yb) <= 1e-6
    assert rel_err(xa.grad, xb.grad) <= 1e-5


def test_intermediates_go_through_saved_tensor_hooks() -> None:
    """Activation checkpointing drops what autograd saves through its hooks; the A matrices, w, v_new and the
    chunk-start states must be among them, or every checkpointed layer would keep them alive until backward."""
    case = make_inputs(1, 80, 2, 32, 32, h0=False)
    x = {n: t.clone().requires_grad_() for n, t in case["inputs"].items() if t is not None}
    shapes = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (shapes.append(tuple(t.shape)), t)[1], lambda t: t):
        o, _ = chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"])
    assert shapes.count((1, 80, 2, 64)) == 2      # A_qk and the UT inverse
    assert shapes.count((1, 80, 2, 32)) == 6      # q, k, v, g, w and v_new
    assert (2, 2, 32, 32) in shapes               # chunk-start states [NT, H, K, V]
    o.sum().backward()
    assert all(x[n].grad is not None for n in ("q", "k", "v", "g", "beta"))


@pytest.mark.skipif(not INTERPRET, reason="a CUDA machine measures instead (and may carry another Triton)")
def test_programs_per_sm_is_what_runs_out_first() -> None:
    """Registers (255 rounded to 256 a thread: two 4-warp programs), warps (64 a multiprocessor), the 32-program cap,
    and shared memory with its 1 KB reserve each (64 KB a program: three)."""
    from kernels.ptxas_report import programs_per_sm

    assert programs_per_sm(255, 4, 0) == 2
    assert programs_per_sm(129, 4, 0) == 3      # 136 registers a thread after rounding
    assert programs_per_sm(32, 8, 0) == 8       # 64 warps
    assert programs_per_sm(16, 1, 0) == 32      # the program cap
    assert programs_per_sm(64, 4, 65536) == 3   # shared memory
    assert programs_per_sm(64, 4, 0) == 8


def test_ptxas_report_compiles_every_kernel_for_hopper() -> None:
    """The offline sm_90 report (its own process: the compiler, not the interpreter; pointers 16-byte aligned, as
    launches on PyTorch's allocations specialise them) covers the five KDA kernels, the three short-convolution
    kernels, the two AttnRes ones, the four of AttnRes in two phases and the MoE SwiGLU pair; no short-convolution,
    SwiGLU, AttnRes forward or merge config spills more than 8 B per thread (one short-convolution da tile spills
    8), and the AttnRes backward configs (unrolled over nine sources, or eight finished blocks for five queries)
    spill under 256 B: the 4-warp ones spill at nine sources (a second block per SM for some spills, as the tuning
    spaces in ``kernels.attn_res`` were chosen)."""
    import os
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "kernels.ptxas_report", "--head-dim", "32", "--heads", "1"],
                         env=env, capture_output=True, text=True, timeout=300, check=True).stdout
    kernels = {line.split()[0] for line in out.splitlines()}
    assert kernels == {"chunk_kda_fwd_intra_kernel", "chunk_kda_fwd_h_kernel", "chunk_kda_bwd_dh_kernel",
                       "chunk_kda_bwd_dA_kernel", "chunk_kda_bwd_dqkg_kernel", "short_conv_fwd_kernel",
                       "short_conv_bwd_da_kernel", "short_conv_bwd_dx_kernel", "attn_res_fwd_kernel",
                       "attn_res_bwd_kernel", "block_mix_fwd_kernel", "block_mix_bwd_kernel", "merge_fwd_kernel",
                       "merge_bwd_kernel", "swiglu_fwd_kernel", "swiglu_bwd_kernel"}, out
    assert all("registers=" in line and "spilled stores/loads=" in line and "programs/SM=" in line
               for line in out.splitlines())
    lines = out.splitlines()
    def spilled(prefixes: tuple[str, ...]) -> list[int]:
        found = [re.search(r"spilled stores/loads=(\d+)/(\d+) B", line) for line in lines if line.startswith(prefixes)]
        return [max(int(m[1]), int(m[2])) for m in found]

    light = spilled(("short_conv", "attn_res_fwd", "swiglu", "block_mix_fwd", "merge"))
    assert light and max(light) <= 8, out
    heavy = spilled(("attn_res_bwd", "block_mix_bwd"))
    assert heavy and max(heavy) < 256, out
