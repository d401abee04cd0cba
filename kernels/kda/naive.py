"""Float32 PyTorch references for KDA: the token-by-token recurrence (the truth) and a chunked version.

Per head, with state S [K, V]:
    S_t = Diag(exp(g_t)) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T;  o_t = scale * S_t^T q_t.
"""
from __future__ import annotations

import torch

CHUNK = 64
SUB_CHUNK = 16


def _segments(T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int]]:
    """(start, end) of each document along T; one segment when the batch is not packed."""
    if cu_seqlens is None:
        return [(0, T)]
    bounds = cu_seqlens.tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def _initial(initial_state: torch.Tensor | None, n: int, B: int, H: int, K: int, V: int,
             like: torch.Tensor, packed: bool) -> torch.Tensor:
    """Initial state of segment n as float32 [B, H, K, V] (zeros when none is given)."""
    if initial_state is None:
        return like.new_zeros(B, H, K, V, dtype=torch.float32)
    state = initial_state[n:n + 1] if packed else initial_state
    return state.float()


def naive_recurrent_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token recurrence in float32: the reference every kernel is checked against.

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log-decay; beta [B, T, H];
    initial_state [N, H, K, V]; cu_seqlens [N+1] with B == 1 for packed documents.
    Returns o [B, T, H, V] and the final state [N, H, K, V] in float32 (or None).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    outs, finals = [], []
    for n, (bos, eos) in enumerate(_segments(T, cu_seqlens)):
        S = _initial(initial_state, n, B, H, K, V, q, cu_seqlens is not None)
        for t in range(bos, eos):
            S = S * g[:, t].exp()[..., None]
            k_t = k[:, t]
            err = v[:, t] - torch.einsum("bhk,bhkv->bhv", k_t, S)
            S = S + torch.einsum("bhk,bhv->bhkv", beta[:, t, :, None] * k_t, err)
            outs.append(torch.einsum("bhk,bhkv->bhv", q[:, t] * scale, S))
        finals.append(S)
    o = torch.stack(outs, dim=1) if outs else v.new_zeros(B, 0, H, V)
    final = torch.cat(finals, 0) if output_final_state else None
    return o, final


def _chunk_segment(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   scale: float, S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One document in float32: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H], S [B, H, K, V]."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    NT = -(-T // CHUNK)
    pad = NT * CHUNK - T

    def chunked(x: torch.Tensor) -> torch.Tensor:
        # [B, T, H, D] -> [B, H, NT, C, D]; padded tokens have k = q = v = beta = g = 0 and change nothing.
        x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, pad))
        return x.reshape(B, NT, CHUNK, H, -1).permute(0, 3, 1, 2, 4)

    q, k, v, g = chunked(q), chunked(k), chunked(v), chunked(g)
    b = chunked(beta.unsqueeze(-1))                             # [B, H, NT, C, 1]
    G = g.cumsum(3)
    # Rescale each row sub-chunk around the decay just before it (never a later token): exponents stay in (-80, 80)
    # because g is bounded below by -5, so every block is one dense product.
    n_sub = CHUNK // SUB_CHUNK
    anchor = torch.cat([G.new_zeros(*G.shape[:3], 1, K), G[:, :, :, SUB_CHUNK - 1:-1:SUB_CHUNK]], 3)
    anchor = anchor.unsqueeze(4)                                 # [B, H, NT, n_sub, 1, K]
    G_rows = G.reshape(B, H, NT, n_sub, SUB_CHUNK, K)
    pos = torch.arange(CHUNK, device=q.device)
    upto = pos[None, :] < (torch.arange(n_sub, device=q.device)[:, None] + 1) * SUB_CHUNK   # [n_sub, C]
    col_exp = torch.where(upto[:, :, None], anchor - G.unsqueeze(3), float("-inf")).exp()  # [B,H,NT,n_sub,C,K]
    row_exp = (G_rows - anchor).exp()                            # [B, H, NT, n_sub, 16, K]
    k_cols = k.unsqueeze(3) * col_exp
    A_qk = torch.einsum("bhnaik,bhnajk->bhnaij", q.reshape_as(row_exp) * row_exp, k_cols)
    A_kk = torch.einsum("bhnaik,bhnajk->bhnaij", k.reshape_as(row_exp) * row_exp, k_cols)
    A_qk = A_qk.reshape(B, H, NT, CHUNK, CHUNK)
    A_kk = A_kk.reshape(B, H, NT, CHUNK, CHUNK)
    causal = pos[:, None] >= pos[None, :]
    A_qk = A_qk.masked_fill(~causal, 0.0)
    A_kk = (A_kk * b).masked_fill(pos[:, None] <= pos[None, :], 0.0)
    eye = torch.eye(CHUNK, device=q.device, dtype=q.dtype)
    # WY/UT form: W = (I + A_kk)^-1 diag(beta) K exp(G), U = (I + A_kk)^-1 diag(beta) V.
    rhs = torch.cat([b * k * G.exp(), b * v], -1)
    wu = torch.linalg.solve_triangular(eye + A_kk, rhs, upper=False, unitriangular=True)
    w, u = wu[..., :K], wu[..., K:]
    q_g = q * G.exp() * scale
    gamma = G[:, :, :, -1:]                                      # [B, H, NT, 1, K]
    k_d = k * (gamma - G).exp()
    outs = []
    for n in range(NT):
        v_new = u[:, :, n] - w[:, :, n] @ S
        outs.append(q_g[:, :, n] @ S + scale * A_qk[:, :, n] @ v_new)
        S = S * gamma[:, :, n].transpose(-1, -2).exp() + k_d[:, :, n].transpose(-1, -2) @ v_new
    o = torch.stack(outs, 2).permute(0, 2, 3, 1, 4).reshape(B, NT * CHUNK, H, V)[:, :T]
    return o, S


def naive_chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Chunked (64) float32 KDA in plain PyTorch, differentiable by autograd: the CPU path for tiny models.

    Same arguments and results as `naive_recurrent_kda`; needs the bounded decay g >= -5 (sub-chunk rescaling).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    outs, finals = [], []
    for n, (bos, eos) in enumerate(_segments(T, cu_seqlens)):
        S = _initial(initial_state, n, B, H, K, V, q, cu_seqlens is not None)
        if eos > bos:
            o, S = _chunk_segment(q[:, bos:eos], k[:, bos:eos], v[:, bos:eos], g[:, bos:eos], beta[:, bos:eos],
                                  scale, S)
            outs.append(o)
        finals.append(S)
    o = torch.cat(outs, 1) if outs else v.new_zeros(B, 0, H, V)
    final = torch.cat(finals, 0) if output_final_state else None
    return o, final
