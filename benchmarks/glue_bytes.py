"""The MoE layer's traffic around its expert GEMMs: bytes per aten op, against the least the layer must move.

    .venv/bin/python benchmarks/glue_bytes.py                           # the device check's shape, bf16
    .venv/bin/python benchmarks/glue_bytes.py --shape 4096,1024,1024,16,4 --dtype float32 --device cpu

Legend (docs/moe.md): T tokens, D model width, F expert width, E experts, K top-k slots, N = T * K rows.

Traced on the meta device (shapes only: no memory, no time), forward + backward of `fmoe.moe` (dropless,
softmax top-k, SwiGLU experts) against a cotangent, through `fmoe.transforms.op_bytes` (every aten op's
inputs + outputs but GEMMs and views; a gather's source counted as the rows it reads). Meta tensors take
the device path (the permute Functions, not the CPU's native autograd path); `--device cpu` runs the step
for real on the CPU's path (fp32 there: the meta device takes no fp32 grouped GEMM). Prints the bytes per
op, the total, the GEMMs' own bytes (inputs + outputs of the matrix products) and the ratio to the least
the layer must move, docs/moe.md's b * (7 N D + 2 T D + 8 N F).
"""

from __future__ import annotations

import argparse

import torch

from fmoe import MoEConfig, init_moe, moe
from fmoe._compat import tree_flatten, tree_map
from fmoe.transforms.op_bytes import GEMMS, OpBytes, op_bytes


def least_bytes(T: int, D: int, F: int, K: int, itemsize: int) -> int:
    """docs/moe.md's least traffic around the expert GEMMs of one dropless layer, forward + backward."""
    N = T * K
    return itemsize * (7 * N * D + 2 * T * D + 8 * N * F)


def layer_step(shape: tuple[int, int, int, int, int], dtype: torch.dtype, device: str = "meta"):
    """fmoe.moe forward + backward on `device` tensors of `shape` (T, D, F, E, K); returns the step."""
    T, D, F, E, K = shape
    cfg = MoEConfig(d_model=D, d_ff=F, num_experts=E, top_k=K)
    params = tree_map(lambda t: t.to(device).requires_grad_(), init_moe(cfg, dtype=dtype))
    x_TD = torch.randn(T, D, dtype=dtype, device=device, requires_grad=True)
    ct_TD = torch.randn(T, D, dtype=dtype, device=device)
    return lambda: torch.autograd.grad(moe(params, x_TD, cfg)[0], [x_TD, *tree_flatten(params)[0]], ct_TD)


class _GemmBytes(OpBytes):
    """The GEMMs' own inputs + outputs (what OpBytes leaves out)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in GEMMS:
            ts = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            self.by_op[func.overloadpacket.__name__] += sum(t.numel() * t.element_size() for t in ts)
        return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="8192,2048,1024,64,8", help="T,D,F,E,K")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="meta", choices=["meta", "cpu"])
    args = ap.parse_args()
    shape = tuple(int(v) for v in args.shape.split(","))
    dtype = getattr(torch, args.dtype)
    T, D, F, E, K = shape
    counts = op_bytes(layer_step(shape, dtype, args.device))
    with _GemmBytes() as gemms:
        layer_step(shape, dtype, args.device)()
    glue, gemm = sum(counts.values()), sum(gemms.by_op.values())
    least = least_bytes(T, D, F, K, dtype.itemsize)
    print(f"T,D,F,E,K = {shape} {args.dtype} on {args.device}: glue {glue / 1e9:.2f} GB, "
          f"GEMMs {gemm / 1e9:.2f} GB, least {least / 1e9:.2f} GB (glue / least {glue / least:.2f})")
    for name, n in sorted(counts.items(), key=lambda kv: -kv[1])[:12]:
        print(f"  {name:24s} {n / 1e9:7.3f} GB")


if __name__ == "__main__":
    main()
