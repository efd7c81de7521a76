"""`fzero.optim` against `torch.optim` on float16 / bfloat16 tensors and on non-contiguous
(transposed, strided) and 0-d parameters, over several steps.

The existing parity tests draw contiguous float32/float64 tensors only. The reference is
torch.optim with ``foreach=True``, the implementation fzero's docstring names
(``_multi_tensor_adam`` / ``_multi_tensor_sgd``); the comparison is bitwise. (Note: in
float16, torch's own single-tensor AdamW, its CPU default, differs from its foreach AdamW in
the last bits, so it cannot be the reference there.)
"""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fzero import optim

MEMORY = ("contiguous", "transposed", "strided", "scalar")
# name -> (fzero optimizer, torch.optim constructor over a parameter list), same settings
OPTIMIZERS = {
    "adamw": (lambda: optim.adamw(lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1),
              lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), eps=1e-6,
                                           weight_decay=0.1, foreach=True)),
    "adam": (lambda: optim.adam(lr=1e-2, eps=1e-6, weight_decay=0.05),
             lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-6, weight_decay=0.05,
                                         foreach=True)),
    "sgd": (lambda: optim.sgd(lr=0.1, momentum=0.9, dampening=0.2, weight_decay=0.01),
            lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.2,
                                       weight_decay=0.01, foreach=True)),
    "sgd_nesterov": (lambda: optim.sgd(lr=0.1, momentum=0.8, nesterov=True, weight_decay=0.01),
                     lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.8, nesterov=True,
                                                weight_decay=0.01, foreach=True)),
}


def make(kind: str, rows: int, cols: int, dtype: torch.dtype, gen: torch.Generator
         ) -> torch.Tensor:
    if kind == "scalar":
        return torch.randn((), generator=gen, dtype=torch.float64).to(dtype)
    if kind == "transposed":
        return torch.randn(cols, rows, generator=gen, dtype=torch.float64).to(dtype).t()
    if kind == "strided":
        return torch.randn(rows, 2 * cols, generator=gen, dtype=torch.float64).to(dtype)[:, ::2]
    return torch.randn(rows, cols, generator=gen, dtype=torch.float64).to(dtype)


def problem(kinds, dims, dtype, steps, seed):
    """Parameters of the drawn memory kinds and per-step gradients laid out like them
    (``empty_like`` keeps a transposed tensor's strides); the same on every call."""
    gen = torch.Generator().manual_seed(seed)
    params = [make(k, *dims, dtype, gen) for k in kinds]
    grads = []
    for i in range(steps):
        scale = 10.0 ** (i % 3 - 1)
        grads.append([torch.empty_like(p).copy_(
            torch.randn(p.shape, generator=gen, dtype=torch.float64) * scale) for p in params])
    return params, grads


@settings(deadline=None, max_examples=40)
@given(kinds=st.lists(st.sampled_from(MEMORY), min_size=1, max_size=4),
       dims=st.tuples(st.integers(1, 5), st.integers(1, 5)),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
       which=st.sampled_from(sorted(OPTIMIZERS)),
       steps=st.integers(1, 5), seed=st.integers(0, 2**31 - 1))
def test_matches_torch_foreach(kinds, dims, dtype, which, steps, seed) -> None:
    params, grads = problem(kinds, dims, dtype, steps, seed)
    make_ours, theirs = OPTIMIZERS[which]
    ours = make_ours()
    moments = ours.init(params)
    for step, gs in enumerate(grads, start=1):
        ours.update([g.clone() for g in gs], moments, params, step=step)

    ref = [p.requires_grad_() for p in problem(kinds, dims, dtype, steps, seed)[0]]
    opt = theirs(ref)
    for gs in grads:
        for p, g in zip(ref, gs, strict=True):
            p.grad = g.clone()
        opt.step()
    for got, want in zip(params, ref, strict=True):
        torch.testing.assert_close(got, want.detach(), rtol=0, atol=0, equal_nan=True)
    for name, values in moments.items():
        for got, p in zip(values, ref, strict=True):
            torch.testing.assert_close(got, opt.state[p][name], rtol=0, atol=0, equal_nan=True)
