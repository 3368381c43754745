"""Donated buffers on the CPU (fmoe/ops/_donate.py): a backward's result written into a new buffer against
the same result written over the donated input, side by side in one run.

    .venv/bin/python benchmarks/donated.py                    # the peers' first two shapes (peers.py)
    .venv/bin/python benchmarks/donated.py --rows 512 --d 256 --f 256    # the pipeline benchmark's

Per shape (M rows of the expert-sorted layout, D model width, F expert width; fp32, one thread):
- swiglu: the packed SwiGLU backward (`packed_swiglu_grad`, a new [M, 2F] buffer) against
  `packed_swiglu_grad_over` (over the donated gate | up);
- unpermute dy: each row's cotangent times its gate weight, the bag sum into a new [M, D] buffer
  against `_rows_over` (a gather into the donated rows, the weights multiplied in place);
- experts dx: the gate | up product's input gradient, `torch._grouped_mm` into a new [M, D] buffer
  against one GEMM per expert over the donated rows (`_dx_over`), E balanced experts;
- swiglu + down: the SwiGLU and the down product, forward and backward (dw, and the [M, 2F] gate | up
  gradient), composed (silu and h as [M, F] buffers, `torch._grouped_mm`) against the CPU's blocked
  product (`_SwiGLUDownBlocked`: one expert's rows at a time, the gradient over the donated gate | up).
The donated side gets a fresh copy of its input each round outside the timing (the backward would own
it); both sides' results are checked equal first. Rounds alternate the order; medians; ratio = donated /
new. "new MiB": the buffer the undonated side allocates (glibc maps blocks above 32 MiB afresh).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fmoe.ops._grouped_linear import Counts, Grouped, _dx_over, grouped_linear
from fmoe.ops._mlp_products import _SwiGLUDownBlocked
from fmoe.ops._permute import _rows_over, _weighted_rows
from fmoe.ops._swiglu import packed_swiglu_grad, packed_swiglu_grad_over, swiglu_packed


def _seconds(fn, prepare) -> float:
    """The seconds of fn(prepare()), prepare outside the timing."""
    arg = prepare()
    t0 = time.perf_counter()
    fn(arg)
    return time.perf_counter() - t0


def _swiglu_down(gate_up_MZ: torch.Tensor, w_EFD: torch.Tensor, ct_MD: torch.Tensor, counts: tuple[int, ...],
                 blocked: bool) -> tuple[torch.Tensor, ...]:
    """(y, d gate_up, dw) of the SwiGLU + down product, composed or blocked; gate_up is handed over."""
    mine = gate_up_MZ.requires_grad_()
    w = w_EFD.detach().requires_grad_()
    if blocked:
        y = _SwiGLUDownBlocked.apply(mine * 1, w, Grouped(Counts(counts), "grouped_mm"), True)
    else:
        y = grouped_linear(swiglu_packed(mine * 1, donate=True), w, counts)
    return (y.detach(), *torch.autograd.grad(y, [mine, w], ct_MD))


def measure(M: int, D: int, F: int, E: int, rounds: int) -> list[tuple[str, float, float, float]]:
    """Returns (what, new ms, donated ms, new buffer MiB) for each case at [M, D, F] with E experts."""
    g = torch.Generator().manual_seed(0)
    gate_up = torch.randn(M, 2 * F, generator=g)
    dh = torch.randn(M, F, generator=g)
    silu = torch.nn.functional.silu(gate_up[:, :F])
    T = M // 4
    ct_TD = torch.randn(T, D, generator=g)
    tok_R = torch.randint(0, T, (M,), generator=g)
    p_R1 = torch.rand(M, 1, generator=g)
    y_RD = torch.randn(M, D, generator=g)
    counts = Counts(tuple(M // E + (e < M % E) for e in range(E)))
    w_EDZ, w_EFD = torch.randn(E, D, 2 * F, generator=g), torch.randn(E, F, D, generator=g)
    g_MZ, ct_MD = torch.randn(M, 2 * F, generator=g), torch.randn(M, D, generator=g)
    cases = {
        "swiglu backward": (lambda _: packed_swiglu_grad(dh, gate_up, silu),
                            lambda a: packed_swiglu_grad_over(dh, a, silu), gate_up, 2 * M * F * 4),
        "unpermute dy": (lambda _: _weighted_rows(ct_TD, tok_R.view(-1, 1), p_R1),
                         lambda a: _rows_over(a, ct_TD, tok_R, p_R1), y_RD, M * D * 4),
        "experts dx": (lambda _: Grouped(counts, "grouped_mm").dx(g_MZ, w_EDZ),
                       lambda a: _dx_over(a, g_MZ, w_EDZ, counts), y_RD, M * D * 4),
        "swiglu + down": (lambda a: _swiglu_down(a, w_EFD, ct_MD, counts.host, blocked=False),
                          lambda a: _swiglu_down(a, w_EFD, ct_MD, counts.host, blocked=True), gate_up,
                          2 * M * F * 4),
    }
    rows = []
    for what, (new, donated, src, nbytes) in cases.items():
        a, b = new(src.clone()), donated(src.clone())
        same = all(map(torch.equal, a, b)) if isinstance(a, tuple) else torch.equal(a, b)
        assert same, f"{what}: the two sides differ"
        t_new: list[float] = []
        t_don: list[float] = []
        for r in range(rounds):
            order = [(new, t_new), (donated, t_don)]
            for fn, acc in order if r % 2 == 0 else order[::-1]:
                acc.append(_seconds(fn, src.clone))
        rows.append((what, 1e3 * statistics.median(t_new), 1e3 * statistics.median(t_don), nbytes / 2**20))
        del a, b
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="*", default=[16384, 16384], help="M per shape")
    p.add_argument("--d", type=int, nargs="*", default=[1024, 512], help="D per shape")
    p.add_argument("--f", type=int, nargs="*", default=[1024, 256], help="F per shape")
    p.add_argument("--experts", type=int, nargs="*", default=[16, 64], help="E per shape")
    p.add_argument("--rounds", type=int, default=9)
    args = p.parse_args(argv)
    if not len(args.rows) == len(args.d) == len(args.f) == len(args.experts):
        p.error("give --rows, --d, --f and --experts one value per shape each")
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, fp32; {args.rounds} rounds, medians; ratio = donated / new")
    print(f"{'shape':<30} {'backward':<16} {'new ms':>8} {'donated ms':>10} {'ratio':>6} {'new MiB':>8}")
    for M, D, F, E in zip(args.rows, args.d, args.f, args.experts):
        for what, t_new, t_don, mib in measure(M, D, F, E, args.rounds):
            shape = f"M {M}, D {D}, F {F}, E {E}"
            print(f"{shape:<30} {what:<16} {t_new:>8.2f} {t_don:>10.2f} {t_don / t_new:>6.3f} {mib:>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
