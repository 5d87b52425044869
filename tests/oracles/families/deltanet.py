"""The gated delta rule alone: ``deltanet.npz``, random inputs (T = 80 > one 64-token chunk, 2 key heads, 4 value
heads, dk = 16, dv = 24, a nonzero initial state) and transformers' outputs: ``o_recurrent`` / ``state_recurrent``
from ``torch_recurrent_gated_delta_rule`` and ``o_chunk`` / ``state_chunk`` from ``torch_chunk_gated_delta_rule``
(models/qwen3_next/modeling_qwen3_next.py), both with use_qk_l2norm_in_kernel=True."""
from __future__ import annotations

import numpy as np

NAMES = ["deltanet"]


def make(name: str, ctx) -> dict:
    import torch
    import torch.nn.functional as Fn
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    g = torch.Generator().manual_seed(7000)
    T, Hk, Hv, dk, dv = 80, 2, 4, 16, 24
    q = torch.randn(1, T, Hk, dk, generator=g)
    k = torch.randn(1, T, Hk, dk, generator=g)
    v = torch.randn(1, T, Hv, dv, generator=g)
    # as Qwen3NextGatedDeltaNet makes them: beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
    beta = torch.randn(1, T, Hv, generator=g).sigmoid()
    decay = -torch.rand(Hv, generator=g).mul(2).exp() * Fn.softplus(torch.randn(1, T, Hv, generator=g))
    s0 = 0.1 * torch.randn(1, Hv, dk, dv, generator=g)
    o_r, s_r = m.torch_recurrent_gated_delta_rule(q, k, v, decay, beta, initial_state=s0.clone(),
                                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
    o_c, s_c = m.torch_chunk_gated_delta_rule(q, k, v, decay, beta, initial_state=s0.clone(),
                                              output_final_state=True, use_qk_l2norm_in_kernel=True)
    f = lambda x: x[0].detach().float().numpy()  # noqa: E731
    np.savez(ctx.out / f"{name}.npz", q=f(q), k=f(k), v=f(v), g=f(decay), beta=f(beta), state0=f(s0),
             o_recurrent=f(o_r), state_recurrent=f(s_r), o_chunk=f(o_c), state_chunk=f(s_c))
    return {"max_abs_o": float(o_r.abs().max()), "recurrent_vs_chunk": float((o_r - o_c).abs().max())}
