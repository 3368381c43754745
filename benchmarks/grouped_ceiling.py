"""How close can any MoE layer get to the dense-matmul ceiling on this machine? The layer's matmuls alone,
as grouped products, against the same FLOPs as dense `torch.mm` calls (issue 14's ceiling).

    .venv/bin/python benchmarks/grouped_ceiling.py                 # issue 14's three shapes, fp32 and bf16
    .venv/bin/python benchmarks/grouped_ceiling.py --rounds 9 --dtypes bf16

Legend (docs/moe.md): T tokens, D model width, F expert width, E experts, K top-k slots, M = T K rows.

Per (shape, dtype), one thread, the same products a forward + backward of one MoE layer runs (router
fwd / dx / dw as dense products; gate, up and down each fwd, dx and dw over E expert row blocks of
M / E rows: balanced routing, the best case for a grouped kernel):
- ceiling: every product as one dense `torch.mm` of the same FLOPs (benchmarks/moe_layer.py's
  `ceiling_step`, which benchmarks/peers.py divides into);
- grouped_mm: the expert products through `torch._grouped_mm` (what fmoe, transformers' grouped_mm
  block and torchtitan call);
- mm loop: one `torch.mm(out=...)` per expert into a preallocated result (the only other CPU kernel).
Nothing but matmuls: no routing, permutation, activation or combine. So "ceiling / grouped" bounds the
"share of the ceiling" any implementation built on these kernels can reach at that shape; issue 14 asks
for >= 0.7 in bf16. Interleaved rotated rounds, medians (benchmarks/moe_layer.py's
`interleaved_medians`).
"""

from __future__ import annotations

import argparse

import torch
from moe_layer import ceiling_step, interleaved_medians

from fmoe._compat import grouped_mm

SHAPES = ((1024, 1024, 16, 4, 4096), (512, 256, 64, 8, 2048), (256, 512, 8, 2, 64))  # D, F, E, K, T
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def expert_products(T: int, D: int, F: int, E: int, K: int, dtype: torch.dtype, kernel: str,
                    gen: torch.Generator):
    """Returns a step running the layer's products: router dense, experts grouped with `kernel`
    ("grouped_mm" or "loop"), M = T K rows split evenly over E experts (the last takes the rest)."""
    M = T * K

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    x_TD, w_DE, g_TE = randn(T, D), randn(D, E), randn(T, E)
    x_MD, h_MF, g_MF, g_MD = randn(M, D), randn(M, F), randn(M, F), randn(M, D)
    w_EDF, w_EFD = randn(E, D, F), randn(E, F, D)
    counts = [M // E] * (E - 1) + [M - (M // E) * (E - 1)]
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    offs_E = torch.tensor(bounds[1:], dtype=torch.int32)

    def fwd(a_MK: torch.Tensor, w_EKN: torch.Tensor) -> torch.Tensor:
        if kernel == "grouped_mm":
            return grouped_mm(a_MK, w_EKN, offs=offs_E)
        out = a_MK.new_empty(a_MK.shape[0], w_EKN.shape[-1])
        for e in range(E):
            lo, hi = bounds[e], bounds[e + 1]
            torch.mm(a_MK[lo:hi], w_EKN[e], out=out[lo:hi])
        return out

    def dw(a_MK: torch.Tensor, g_MN: torch.Tensor) -> torch.Tensor:
        if kernel == "grouped_mm":
            return grouped_mm(a_MK.t(), g_MN, offs=offs_E)
        out = a_MK.new_empty(E, a_MK.shape[-1], g_MN.shape[-1])
        for e in range(E):
            lo, hi = bounds[e], bounds[e + 1]
            torch.mm(a_MK[lo:hi].t(), g_MN[lo:hi], out=out[e])
        return out

    def step() -> None:
        x_TD @ w_DE, g_TE @ w_DE.t(), x_TD.t() @ g_TE                                 # router
        for _ in range(2):                                                             # gate and up
            fwd(x_MD, w_EDF), fwd(g_MF, w_EDF.transpose(-2, -1)), dw(x_MD, g_MF)
        fwd(h_MF, w_EFD), fwd(g_MD, w_EFD.transpose(-2, -1)), dw(h_MF, g_MD)          # down

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    ap.add_argument("--shapes", nargs="+", default=None, help="D,F,E,K,T ...")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes] if args.shapes else SHAPES
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread, {args.rounds} interleaved rounds, medians")
    print("| shape (D, F, E, K, T) | dtype | ceiling ms | grouped_mm ms | mm loop ms | "
          "ceiling / grouped_mm | ceiling / mm loop |")
    print("|---|---|---|---|---|---|---|")
    for D, F, E, K, T in shapes:
        for name in args.dtypes:
            dtype, gen = DTYPES[name], torch.Generator().manual_seed(0)
            steps = {"ceiling": ceiling_step(T, D, F, E, K, gen, dtype),
                     "grouped_mm": expert_products(T, D, F, E, K, dtype, "grouped_mm", gen),
                     "loop": expert_products(T, D, F, E, K, dtype, "loop", gen)}
            med = interleaved_medians(steps, args.rounds)
            print(f"| {D}, {F}, {E}, {K}, {T} | {name} | {med['ceiling'] * 1e3:.2f} | "
                  f"{med['grouped_mm'] * 1e3:.2f} | {med['loop'] * 1e3:.2f} | "
                  f"{med['ceiling'] / med['grouped_mm']:.3f} | {med['ceiling'] / med['loop']:.3f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
