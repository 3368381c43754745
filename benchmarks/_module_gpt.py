"""The GPT of fmoe/model.py written as a plain `torch.nn.Module` (the torchtitan / nanoGPT idiom), for
side-by-side training benchmarks: the same function as `fmoe.gpt_loss`, the same weights, but
`nn.Parameter`s, standard torch ops and `loss.backward()`.

    module = module_from_params(cfg, params, state)   # copies of init_gpt params (+ state's expert biases)
    loss = module(ids_BS, targets_BS)                 # == fmoe.gpt_loss(params, ids, targets, cfg, state)[0]
    loss.backward(); opt.step()
    module.update_expert_bias()                       # aux-loss-free bias step (fmoe's new_state)
    grads = grads_as_params(module, cfg)              # .grad in fmoe's params layout

    .venv/bin/python benchmarks/_module_gpt.py        # check_same_function on the presets, then a timing

Legend (the package's, docs/moe.md): B sequences, S positions, T = B * S tokens, D model width, V
vocabulary, H query heads, G kv heads, d head dim, h = d / 2 rotation pairs, E experts, K top-k slots,
N = T * K (token, slot) pairs, F expert ffn width.

Independent of fmoe's implementation: only `fmoe.config` (the dataclasses) and `fmoe._compat` (the one
name for `torch._grouped_mm`, and the pytree helpers of the check) are imported at module level;
`check_same_function` imports fmoe's model to compare against it.

Ops: attention is `F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)` after a half-split
("rotate_half") RoPE computed in fp32 (fp64 for fp64); norms are `nn.RMSNorm`; linears are
`nn.Linear(bias=False)` (weights [out, in], i.e. fmoe's [in, out] transposed); the routed experts are
one `torch._grouped_mm` per projection over the expert-sorted rows where it has a kernel (fp32 / bf16 /
fp16 with 16-byte aligned rows, probed once per dtype and device), else a python loop over experts
(float64); routing is `torch.topk` on fp32 scores (fp64 for fp64); the loss is `F.cross_entropy` on
fp32 logits. Every quantity fmoe computes in fp32 for low-precision inputs (router, RoPE angles,
combine, loss) is computed in fp32 here too; the RMSNorm and SwiGLU of `nn.RMSNorm` / `F.silu` round in
the input dtype, so in bf16 the two agree to bf16 rounding only (they agree to ~1e-15 in fp64).

Scope: the features of the benchmark presets: dense SwiGLU blocks then MoE blocks, GQA, softmax top-k
routing with renormalised gate weights, the micro-batch aux loss, shared experts, aux-loss-free expert
bias, DeepSeek-V3 MTP (depth 1), dropless. Any other MoEConfig option set to a non-default value raises
NotImplementedError naming it.

Known differences, none reached by the checks: selection ties (equal biased scores) go to the lowest
expert index in fmoe (stable sort) but are unspecified with `torch.topk`; low-precision RMSNorm / SwiGLU
rounding (above). Reproduced on purpose: a batch whose targets are all -100 has loss 0 (not NaN), and
the MTP input embedding of an ignored target is that of token 0 (fmoe clamps the ids).
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from fmoe._compat import HAS_GROUPED_MM, grouped_mm, tree_flatten_with_path, tree_map
from fmoe.config import GPTConfig, MoEConfig

Path = tuple[Any, ...]  # a leaf's place in fmoe's params tree: ("layers", 0, "w_q")

# The MoEConfig fields this module implements (any value); every other field must keep its default.
_MOE_SUPPORTED = ("d_model", "d_ff", "num_experts", "top_k", "aux_loss_coef", "bias_update_rate",
                  "num_shared_experts")
# The GPTConfig fields this module implements (all of them at the time of writing).
_GPT_SUPPORTED = ("vocab_size", "d_model", "n_layers", "n_heads", "moe", "n_kv_heads", "head_dim",
                  "d_ff_dense", "num_dense_layers", "rope_theta", "norm_eps", "mtp", "mtp_loss_weight")


def check_supported(cfg: GPTConfig) -> None:
    """Raise NotImplementedError naming the first GPTConfig / MoEConfig option outside this module's scope
    that is set to a non-default value; returns None."""
    for obj, supported in ((cfg, _GPT_SUPPORTED), (cfg.moe, _MOE_SUPPORTED)):
        for f in dataclasses.fields(obj):
            if f.name in supported or f.default is dataclasses.MISSING:
                continue
            if getattr(obj, f.name) != f.default:
                raise NotImplementedError(
                    f"ModuleGPT: {type(obj).__name__}.{f.name}={getattr(obj, f.name)!r} is not implemented "
                    f"(only the default {f.default!r}); supported options: {', '.join(supported)}")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp64 stays fp64, everything else computes in fp32 (router, RoPE angles, combine, loss)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _normal_(w: torch.Tensor, fan_in: int, generator: torch.Generator | None) -> None:
    """Fill `w` in place with N(0, 1 / fan_in) draws (fp32, then cast), fmoe's initialisation."""
    w.copy_(torch.randn(w.shape, generator=generator) / fan_in ** 0.5)


# ---- RoPE -------------------------------------------------------------------------------------------

def rope_tables(S: int, head_dim: int, theta: float, device: torch.device,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (cos_S1h, sin_S1h), each [S, 1, h] in the compute dtype of `dtype`: the rotation of pair i
    at position s is s * theta^(-2i/d) (broadcasts over [B, S, H, h])."""
    ct = _compute_dtype(dtype)
    inv_freq_h = theta ** (-torch.arange(0, head_dim // 2, device=device, dtype=ct) * 2 / head_dim)
    ang_Sh = torch.arange(S, device=device).to(ct).unsqueeze(-1) * inv_freq_h
    return ang_Sh.cos().unsqueeze(-2), ang_Sh.sin().unsqueeze(-2)


def apply_rope(x_BSHd: torch.Tensor, cos_S1h: torch.Tensor, sin_S1h: torch.Tensor) -> torch.Tensor:
    """Return x rotated by half-split RoPE: pair (x[i], x[i + d/2]) turned by the table's angle; [B, S, H, d]
    in x's dtype (math in the tables' dtype)."""
    h = x_BSHd.shape[-1] // 2
    xf = x_BSHd.to(cos_S1h.dtype)
    x1, x2 = xf[..., :h], xf[..., h:]
    return torch.cat([x1 * cos_S1h - x2 * sin_S1h, x2 * cos_S1h + x1 * sin_S1h], dim=-1).to(x_BSHd.dtype)


# ---- modules ----------------------------------------------------------------------------------------

class Attention(nn.Module):
    """Causal GQA self-attention with RoPE: forward(x_BSD, cos, sin) -> [B, S, D] (no residual)."""

    def __init__(self, cfg: GPTConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        D, H, G, d = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.n_heads, self.n_kv_heads, self.head_dim = H, G, d
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.wq, self.wk = nn.Linear(D, H * d, **kw), nn.Linear(D, G * d, **kw)
        self.wv, self.wo = nn.Linear(D, G * d, **kw), nn.Linear(H * d, D, **kw)

    def forward(self, x_BSD: torch.Tensor, cos_S1h: torch.Tensor, sin_S1h: torch.Tensor) -> torch.Tensor:
        """Return wo(softmax(rope(q) rope(k)^T / sqrt(d) + causal) v): [B, S, D]."""
        B, S, _ = x_BSD.shape
        H, G, d = self.n_heads, self.n_kv_heads, self.head_dim
        q_BHSd = apply_rope(self.wq(x_BSD).view(B, S, H, d), cos_S1h, sin_S1h).transpose(1, 2)
        k_BGSd = apply_rope(self.wk(x_BSD).view(B, S, G, d), cos_S1h, sin_S1h).transpose(1, 2)
        v_BGSd = self.wv(x_BSD).view(B, S, G, d).transpose(1, 2)
        o_BHSd = F.scaled_dot_product_attention(q_BHSd, k_BGSd, v_BGSd, is_causal=True, enable_gqa=G != H)
        return self.wo(o_BHSd.transpose(1, 2).reshape(B, S, H * d))


class FeedForward(nn.Module):
    """SwiGLU MLP: forward(x_XD) -> w_down(silu(w_gate x) * w_up x), [..., D] (no norm, no residual)."""

    def __init__(self, d_model: int, d_ff: int, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        kw = {"bias": False, "dtype": dtype, "device": device}
        self.w_gate, self.w_up = nn.Linear(d_model, d_ff, **kw), nn.Linear(d_model, d_ff, **kw)
        self.w_down = nn.Linear(d_ff, d_model, **kw)

    def forward(self, x_XD: torch.Tensor) -> torch.Tensor:
        """Return the MLP output, x's shape."""
        return self.w_down(F.silu(self.w_gate(x_XD)) * self.w_up(x_XD))


@functools.cache
def _grouped_mm_works(dtype: torch.dtype, device_type: str) -> bool:
    """Whether torch._grouped_mm runs forward and backward for `dtype` on `device_type` (probed once)."""
    if not HAS_GROUPED_MM or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    try:
        x = torch.randn(4, 16, dtype=dtype, device=device_type, requires_grad=True)
        w = torch.randn(2, 16, 16, dtype=dtype, device=device_type, requires_grad=True)
        y = grouped_mm(x, w, offs=torch.tensor([1, 4], dtype=torch.int32, device=device_type))
        y.backward(torch.ones_like(y))
        return True
    except Exception:  # no kernel for this dtype / device / arch: the loop does it
        return False


class GroupedExperts(nn.Module):
    """E routed SwiGLU experts, weights [E, D, 2F] (gate | up) / [E, F, D] (x @ w per expert, fmoe's layout).

    forward(x_RD, counts_E) -> y_RD: rows grouped by expert (counts_E[e] consecutive rows for expert e).
    """

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        E, D, Fd = cfg.num_experts, cfg.d_model, cfg.d_ff
        self.w_gate_up = nn.Parameter(torch.empty(E, D, 2 * Fd, dtype=dtype, device=device))
        self.w_down = nn.Parameter(torch.empty(E, Fd, D, dtype=dtype, device=device))

    def uses_grouped_mm(self) -> bool:
        """True when forward runs torch._grouped_mm (else a python loop over the experts)."""
        w = self.w_gate_up
        aligned = all(n * w.element_size() % 16 == 0 for n in w.shape[1:])
        return aligned and _grouped_mm_works(w.dtype, w.device.type)

    def forward(self, x_RD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        """Return y_RD [R, D]: w_down(silu(gate) * up), gate | up = w_gate_up x, with expert e's weights on
        its rows."""
        if self.uses_grouped_mm():
            offs_E = torch.cumsum(counts_E, 0).to(torch.int32)  # stays on the device: no host sync
            g_RF, u_RF = grouped_mm(x_RD, self.w_gate_up, offs=offs_E).chunk(2, dim=-1)
            return grouped_mm(F.silu(g_RF) * u_RF, self.w_down, offs=offs_E)
        outs, start = [], 0
        for e, c in enumerate(counts_E.tolist()):  # one host read
            g, u = (x_RD[start:start + c] @ self.w_gate_up[e]).chunk(2, dim=-1)
            outs.append((F.silu(g) * u) @ self.w_down[e])
            start += c
        return torch.cat(outs)


class MoE(nn.Module):
    """Dropless top-k MoE: router, routed experts, optional shared expert, micro-batch aux loss.

    forward(x_TD) -> (y_TD [T, D], balancing loss: scalar tensor (compute dtype) or None when
    aux_loss_coef is 0). Selection adds `expert_bias` (aux-loss-free balancing; buffer [E] fp32) to the
    detached scores; gate weights use the unbiased scores. `tokens_per_expert` (int64 [E]) sums the
    load of every forward since the last `update_expert_bias`.
    """

    expert_bias: torch.Tensor | None

    def __init__(self, cfg: MoEConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(cfg.d_model, cfg.num_experts, bias=False, dtype=dtype, device=device)
        self.experts = GroupedExperts(cfg, dtype, device)
        self.shared = (FeedForward(cfg.d_model, cfg.num_shared_experts * cfg.d_ff, dtype, device)
                       if cfg.num_shared_experts else None)
        bias = torch.zeros(cfg.num_experts, dtype=torch.float32, device=device)
        self.register_buffer("expert_bias", bias if cfg.bias_update_rate > 0 else None)
        load = torch.zeros(cfg.num_experts, dtype=torch.int64, device=device)
        self.register_buffer("tokens_per_expert", load, persistent=False)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (y_TD [T, D] in x's dtype, balancing loss scalar or None)."""
        T, D = x_TD.shape
        E, K = self.cfg.num_experts, self.cfg.top_k
        ct = _compute_dtype(x_TD.dtype)
        logits_TE = F.linear(x_TD.to(ct), self.router.weight.to(ct))
        scores_TE = logits_TE.softmax(dim=-1)
        choice_TE = scores_TE.detach()
        if self.expert_bias is not None:
            choice_TE = choice_TE + self.expert_bias.to(ct)
        ids_TK = torch.topk(choice_TE, K, dim=-1).indices
        probs_TK = scores_TE.gather(1, ids_TK)
        probs_TK = probs_TK / probs_TK.sum(-1, keepdim=True).clamp(min=torch.finfo(ct).tiny)
        ids_N = ids_TK.reshape(-1)  # pair n = t * K + k
        counts_E = torch.bincount(ids_N, minlength=E)
        if self.expert_bias is not None:
            with torch.no_grad():
                self.tokens_per_expert += counts_E

        # Dropless dispatch: pairs sorted by expert (stable), expert blocks, back to (token, slot) order.
        order_N = torch.argsort(ids_N, stable=True)
        y_RD = self.experts(x_TD.index_select(0, order_N // K), counts_E)
        y_TKD = y_RD.new_empty(T * K, D).index_copy(0, order_N, y_RD).view(T, K, D)
        y_TD = (y_TKD.to(ct) * probs_TK.unsqueeze(-1)).sum(1).to(x_TD.dtype)
        if self.shared is not None:
            y_TD = y_TD + self.shared(x_TD)

        loss = None
        if self.cfg.aux_loss_coef:
            f_E = counts_E.to(ct) / max(T * K, 1)
            loss = self.cfg.aux_loss_coef * E * (f_E * scores_TE.mean(0)).sum()
        return y_TD, loss

    @torch.no_grad()
    def update_expert_bias(self) -> None:
        """bias += rate * sign(mean load - load) over the load since the last call, then reset the load
        (fmoe's update_moe_state); a no-op without a bias. Returns None."""
        if self.expert_bias is None:
            return
        load_E = self.tokens_per_expert.to(self.expert_bias.dtype)
        self.expert_bias += self.cfg.bias_update_rate * torch.sign(load_E.mean() - load_E)
        self.tokens_per_expert.zero_()


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + ffn(norm(.)) (dense SwiGLU or MoE).

    forward(x_BSD, cos, sin) -> (y_BSD [B, S, D], balancing loss scalar or None).
    """

    def __init__(self, cfg: GPTConfig, dense: bool, dtype: torch.dtype,
                 device: torch.device | str | None) -> None:
        super().__init__()
        D = cfg.d_model
        self.dense = dense
        self.attn_norm = nn.RMSNorm(D, eps=cfg.norm_eps, dtype=dtype, device=device)
        self.attn = Attention(cfg, dtype, device)
        self.ffn_norm = nn.RMSNorm(D, eps=cfg.norm_eps, dtype=dtype, device=device)
        self.ffn = FeedForward(D, cfg.d_ff_dense, dtype, device) if dense else MoE(cfg.moe, dtype, device)

    def forward(self, x_BSD: torch.Tensor, cos_S1h: torch.Tensor,
                sin_S1h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return (y_BSD, balancing loss or None)."""
        r_BSD = x_BSD + self.attn(self.attn_norm(x_BSD), cos_S1h, sin_S1h)
        h_BSD = self.ffn_norm(r_BSD)
        if self.dense:
            return r_BSD + self.ffn(h_BSD), None
        y_TD, loss = self.ffn(h_BSD.reshape(-1, h_BSD.shape[-1]))
        return r_BSD + y_TD.view_as(r_BSD), loss


class MTP(nn.Module):
    """DeepSeek-V3 multi-token prediction, depth 1: proj([norm(h_i); norm(emb(t_{i+1}))]) -> MoE block ->
    norm (the shared head is the caller's)."""

    def __init__(self, cfg: GPTConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        D = cfg.d_model
        self.hidden_norm = nn.RMSNorm(D, eps=cfg.norm_eps, dtype=dtype, device=device)
        self.embed_norm = nn.RMSNorm(D, eps=cfg.norm_eps, dtype=dtype, device=device)
        self.proj = nn.Linear(2 * D, D, bias=False, dtype=dtype, device=device)
        self.block = Block(cfg, False, dtype, device)
        self.norm = nn.RMSNorm(D, eps=cfg.norm_eps, dtype=dtype, device=device)


class ModuleGPT(nn.Module):
    """fmoe's GPT (fmoe/model.py) as an nn.Module: embedding, cfg.num_dense_layers dense blocks, MoE blocks,
    final norm, head (+ MTP with cfg.mtp).

    forward(ids_BS, targets_BS) -> scalar loss = mean CE + sum of the balancing losses
    + cfg.mtp_loss_weight * MTP loss: the value of fmoe.gpt_loss(params, ids, targets, cfg, state)[0].
    Weights are drawn as fmoe.init_gpt draws them (from `generator`), not the same values: use
    `module_from_params` for fmoe's values.
    """

    def __init__(self, cfg: GPTConfig, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, generator: torch.Generator | None = None) -> None:
        super().__init__()
        check_supported(cfg)
        self.cfg = cfg
        D, V = cfg.d_model, cfg.vocab_size
        self.embed = nn.Embedding(V, D, dtype=dtype, device=device)
        self.layers = nn.ModuleList([Block(cfg, i < cfg.num_dense_layers, dtype, device)
                                     for i in range(cfg.n_layers)])
        self.norm = nn.RMSNorm(D, eps=cfg.norm_eps, dtype=dtype, device=device)
        self.head = nn.Linear(D, V, bias=False, dtype=dtype, device=device)
        self.mtp = MTP(cfg, dtype, device) if cfg.mtp else None
        self.init_weights(generator)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator | None = None) -> None:
        """Draw the weights by fmoe's rule: embedding N(0, 0.02^2), norms 1, every other weight
        N(0, 1 / fan_in); returns None."""
        self.embed.weight.copy_(torch.randn(self.embed.weight.shape, generator=generator) * 0.02)
        for m in self.modules():
            if isinstance(m, nn.RMSNorm):
                nn.init.ones_(m.weight)
            elif isinstance(m, nn.Linear):
                _normal_(m.weight, m.in_features, generator)
            elif isinstance(m, GroupedExperts):
                for w in (m.w_gate_up, m.w_down):
                    _normal_(w, w.shape[1], generator)

    def moe_layers(self) -> list[MoE]:
        """The MoE modules in fmoe's state order: main MoE layers, then the MTP block's."""
        blocks = [*self.layers, *([self.mtp.block] if self.mtp is not None else [])]
        return [b.ffn for b in blocks if isinstance(b.ffn, MoE)]

    def update_expert_bias(self) -> None:
        """Apply the aux-loss-free bias step of every MoE layer (once per optimizer step); returns None."""
        for m in self.moe_layers():
            m.update_expert_bias()

    def _ce(self, h_BSD: torch.Tensor, norm: nn.RMSNorm, targets_BS: torch.Tensor) -> torch.Tensor:
        """Mean CE of head(norm(h)) over targets != -100 (0 when all are ignored): scalar, fp32 / fp64."""
        logits_TV = self.head(norm(h_BSD)).flatten(0, 1)
        logits_TV = logits_TV.to(_compute_dtype(logits_TV.dtype))
        targets_T = targets_BS.reshape(-1)
        count = (targets_T != -100).sum().clamp(min=1)
        return F.cross_entropy(logits_TV, targets_T, ignore_index=-100, reduction="sum") / count

    def forward(self, ids_BS: torch.Tensor, targets_BS: torch.Tensor) -> torch.Tensor:
        """Return the scalar training loss (fp32, fp64 for fp64 weights). ids_BS, targets_BS: int [B, S];
        targets[:, i] is token i + 1, -100 ignored."""
        S = ids_BS.shape[1]
        x_BSD = self.embed(ids_BS)
        cos_S1h, sin_S1h = rope_tables(S, self.cfg.head_dim, self.cfg.rope_theta, x_BSD.device, x_BSD.dtype)
        losses = []
        for layer in self.layers:
            x_BSD, loss = layer(x_BSD, cos_S1h, sin_S1h)
            if loss is not None:
                losses.append(loss)
        main = self._ce(x_BSD, self.norm, targets_BS)
        total = main
        mtp_loss = None
        if self.mtp is not None and S > 1:
            m = self.mtp
            h_BSD = m.hidden_norm(x_BSD[:, :-1])
            e_BSD = m.embed_norm(self.embed(targets_BS[:, :-1].clamp(min=0)))  # an ignored target embeds id 0
            z_BSD, loss = m.block(m.proj(torch.cat([h_BSD, e_BSD], dim=-1)), cos_S1h[:-1], sin_S1h[:-1])
            if loss is not None:
                losses.append(loss)
            mtp_loss = self._ce(z_BSD, m.norm, targets_BS[:, 1:])
        if losses:
            total = total + sum(losses[1:], losses[0]).to(main.dtype)
        if mtp_loss is not None:
            total = total + self.cfg.mtp_loss_weight * mtp_loss
        return total


# ---- fmoe params <-> module -------------------------------------------------------------------------

def _block_leaves(prefix: Path, b: Block) -> list[tuple[Path, nn.Parameter, bool]]:
    """(fmoe path, module parameter, transposed) for one block."""
    a = b.attn
    out = [(prefix + ("attn_norm",), b.attn_norm.weight, False), (prefix + ("w_q",), a.wq.weight, True),
           (prefix + ("w_k",), a.wk.weight, True), (prefix + ("w_v",), a.wv.weight, True),
           (prefix + ("w_o",), a.wo.weight, True)]

    def ffn(p: Path, f: FeedForward) -> list[tuple[Path, nn.Parameter, bool]]:
        return [(p + (n,), getattr(f, n).weight, True) for n in ("w_gate", "w_up", "w_down")]

    if b.dense:
        return [*out, (prefix + ("mlp", "norm"), b.ffn_norm.weight, False), *ffn(prefix + ("mlp",), b.ffn)]
    moe = b.ffn
    out += [(prefix + ("mlp_norm",), b.ffn_norm.weight, False),
            (prefix + ("moe", "router", "w"), moe.router.weight, True)]
    out += [(prefix + ("moe", "experts", n), getattr(moe.experts, n), False)
            for n in ("w_gate_up", "w_down")]
    if moe.shared is not None:
        out += ffn(prefix + ("moe", "shared"), moe.shared)
    return out


def param_leaves(module: ModuleGPT) -> list[tuple[Path, nn.Parameter, bool]]:
    """Return (fmoe params path, module parameter, transposed) for every leaf of fmoe's params layout;
    `transposed`: the module stores the leaf as [out, in] (nn.Linear), fmoe as [in, out]."""
    out: list[tuple[Path, nn.Parameter, bool]] = [(("embed", "table"), module.embed.weight, False)]
    for i, b in enumerate(module.layers):
        out += _block_leaves(("layers", i), b)
    out += [(("norm",), module.norm.weight, False), (("head", "w"), module.head.weight, True)]
    if module.mtp is not None:
        m = module.mtp
        out += [(("mtp", "hidden_norm"), m.hidden_norm.weight, False),
                (("mtp", "embed_norm"), m.embed_norm.weight, False),
                (("mtp", "w_proj"), m.proj.weight, True), *_block_leaves(("mtp", "block"), m.block),
                (("mtp", "norm"), m.norm.weight, False)]
    return out


def _key_path(kp: tuple[Any, ...]) -> Path:
    """A torch pytree key path as a plain tuple of dict keys and list indices."""
    return tuple(k.key if hasattr(k, "key") else k.idx for k in kp)


def path_str(path: Path) -> str:
    """The leaf path as pytree's keystr writes it: ['layers'][0]['w_q']."""
    return "".join(f"[{p!r}]" for p in path)


def _tree_leaves(tree: Any) -> dict[Path, torch.Tensor]:
    """Return {path: tensor} over the leaves of a nested dict / list tree."""
    return {_key_path(kp): leaf for kp, leaf in tree_flatten_with_path(tree)[0]}


def module_from_params(cfg: GPTConfig, params: dict[str, Any],
                       state: dict[str, Any] | None = None) -> ModuleGPT:
    """Return a ModuleGPT whose parameters are copies of fmoe's `params` (init_gpt layout: same values,
    dtype and device; nn.Linear weights are the transposes) and whose expert biases are copies of
    `state`'s "expert_bias_E" entries (fmoe.init_gpt_state layout; zeros when absent). A state bias on a
    config with bias_update_rate 0 is kept too (fmoe selects with it; it then never moves).
    Raises ValueError when params do not have exactly the module's leaves and shapes."""
    table = params["embed"]["table"]
    module = ModuleGPT(cfg, dtype=table.dtype, device=table.device)
    leaves = param_leaves(module)
    given = _tree_leaves(params)
    wanted = {p for p, _, _ in leaves}
    if set(given) != wanted:
        missing = [path_str(p) for p in wanted - set(given)]
        extra = [path_str(p) for p in set(given) - wanted]
        raise ValueError(f"module_from_params: params leaves differ; missing {missing}, extra {extra}")
    with torch.no_grad():
        for path, param, transposed in leaves:
            value = given[path].detach()
            value = value.t() if transposed else value
            if value.shape != param.shape:
                need = tuple(param.shape[::-1] if transposed else param.shape)
                raise ValueError(f"module_from_params: {path_str(path)} has shape "
                                 f"{tuple(given[path].shape)}, the config needs {need}")
            param.data = value.clone(memory_format=torch.contiguous_format)
        if state is not None:
            states = [s for i, s in enumerate(state["layers"]) if i >= cfg.num_dense_layers]
            if cfg.mtp:
                states.append(state.get("mtp") or {})
            for moe, s in zip(module.moe_layers(), states, strict=True):
                bias = (s or {}).get("expert_bias_E")
                if bias is not None:
                    moe.expert_bias = bias.detach().clone()  # a registered buffer name: stays a buffer
    return module


def grads_as_params(module: ModuleGPT, cfg: GPTConfig) -> dict[str, Any]:
    """Return the module's `.grad`s in fmoe's params layout (fmoe's shapes: nn.Linear grads transposed
    back to [in, out]); a parameter without a grad gives zeros."""
    tree: dict[str, Any] = {"layers": [{} for _ in range(cfg.n_layers)]}
    for path, param, transposed in param_leaves(module):
        g = param.grad if param.grad is not None else torch.zeros_like(param)
        node: Any = tree
        for key in path[:-1]:
            node = node[key] if isinstance(key, int) else node.setdefault(key, {})
        node[path[-1]] = g.t() if transposed else g
    return tree


# ---- the check and the timing -----------------------------------------------------------------------

def _data(cfg: GPTConfig, B: int, S: int, seed: int,
          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Random ids [B, S] and targets [B, S] (int64) with two ignored (-100) targets."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(cfg.vocab_size, (B, S), generator=g)
    targets = torch.randint(cfg.vocab_size, (B, S), generator=g)
    targets[0, S // 3] = -100
    targets[-1, -2] = -100
    return ids.to(device), targets.to(device)


def random_bias_state(cfg: GPTConfig, seed: int = 0, scale: float = 0.05) -> dict[str, Any]:
    """Return fmoe.init_gpt_state(cfg) with every "expert_bias_E" replaced by N(0, scale^2) draws (fp32)."""
    from fmoe import init_gpt_state

    g = torch.Generator().manual_seed(seed)
    state = init_gpt_state(cfg)
    for s in [*state["layers"], state.get("mtp", {})]:
        if "expert_bias_E" in s:
            s["expert_bias_E"] = torch.randn(cfg.moe.num_experts, generator=g) * scale
    return state


def check_same_function(cfg: GPTConfig, seed: int = 0, dtype: torch.dtype = torch.float64,
                        state: dict[str, Any] | None = None, B: int = 2, S: int = 16,
                        device: torch.device | str = "cpu") -> float:
    """Check ModuleGPT against fmoe.gpt_loss on one random batch; return max |loss difference| (float).

    Params: fmoe.init_gpt(cfg, Generator(seed), dtype), moved to `device` (as are `state` and the data);
    ids / targets random [B, S] (two targets -100); `state`: fmoe.init_gpt_state layout or None.
    fmoe's loss and gradient come from torch.func.vjp of gpt_loss, the module's from forward +
    .backward(); the losses and EVERY parameter leaf's gradient must agree (rtol 1e-9, atol 1e-12 in
    float64; rtol 1e-4, atol 1e-5 otherwise), and with expert biases the module's bias step must equal
    fmoe's new_state. Raises AssertionError naming the parameter path on a mismatch.
    """
    from fmoe import gpt_loss, init_gpt

    tol = {"rtol": 1e-9, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-4, "atol": 1e-5}
    params = tree_map(lambda t: t.to(device), init_gpt(cfg, torch.Generator().manual_seed(seed), dtype))
    state = None if state is None else tree_map(lambda t: t.to(device), state)
    ids, targets = _data(cfg, B, S, seed + 1, device)

    def f(p: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        loss, aux = gpt_loss(p, ids, targets, cfg, state)
        return loss, aux.new_state

    loss_f, vjp_fn, new_state = torch.func.vjp(f, params, has_aux=True)
    (grads_f,) = vjp_fn(torch.ones_like(loss_f))

    module = module_from_params(cfg, params, state)
    loss_m = module(ids, targets)
    loss_m.backward()
    torch.testing.assert_close(loss_m.detach(), loss_f, **tol, msg=lambda m: f"loss: {m}")
    want, got = _tree_leaves(grads_f), _tree_leaves(grads_as_params(module, cfg))
    assert set(want) == set(got), f"gradient leaves differ: {sorted(map(path_str, set(want) ^ set(got)))}"
    for path, g_f in want.items():
        torch.testing.assert_close(got[path], g_f, **tol, msg=lambda m, p=path: f"grad {path_str(p)}: {m}")

    module.update_expert_bias()
    new_states = [s for i, s in enumerate(new_state["layers"]) if i >= cfg.num_dense_layers]
    if cfg.mtp:
        new_states.append(new_state["mtp"])
    for i, (moe, s) in enumerate(zip(module.moe_layers(), new_states, strict=True)):
        if "expert_bias_E" in s:
            torch.testing.assert_close(moe.expert_bias, s["expert_bias_E"], rtol=0, atol=0,
                                       msg=lambda m, i=i: f"expert bias of MoE layer {i} after the step: {m}")
    return float((loss_m.detach() - loss_f).abs())


def time_step(cfg: GPTConfig, B: int = 4, S: int = 64, repeats: int = 10, dtype: torch.dtype = torch.float32,
              threads: int | None = None) -> tuple[float, float]:
    """Return (module seconds, fmoe seconds): median wall time of one forward + backward on CPU, the
    module's (`loss.backward()`) and torch.func.vjp of fmoe.gpt_loss (check=False, the steady state of a
    loop), interleaved, after two warm-ups each. `threads`: torch intra-op threads during the timing
    (None: leave as is), restored afterwards."""
    from fmoe import gpt_loss, init_gpt, init_gpt_state

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)

    params = init_gpt(cfg, torch.Generator().manual_seed(0), dtype)
    state = init_gpt_state(cfg)
    ids, targets = _data(cfg, B, S, 1)
    module = module_from_params(cfg, params, state)

    def module_step() -> None:
        module.zero_grad(set_to_none=True)
        module(ids, targets).backward()

    def fmoe_step() -> None:
        loss, vjp_fn = torch.func.vjp(lambda p: gpt_loss(p, ids, targets, cfg, state, check=False)[0], params)
        vjp_fn(torch.ones_like(loss))

    steps = {"module": module_step, "fmoe": fmoe_step}
    times: dict[str, list[float]] = {k: [] for k in steps}
    try:
        for fn in (*steps.values(), *steps.values()):
            fn()
        for r in range(repeats):
            for name in (("module", "fmoe") if r % 2 else ("fmoe", "module")):
                t0 = time.perf_counter()
                steps[name]()
                times[name].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return statistics.median(times["module"]), statistics.median(times["fmoe"])


if __name__ == "__main__":
    tiny = GPTConfig(vocab_size=64, d_model=64, n_layers=4, n_heads=4, num_dense_layers=1, d_ff_dense=128,
                     moe=MoEConfig(d_model=64, d_ff=64, num_experts=8, top_k=2, aux_loss_coef=1e-2,
                                   num_shared_experts=1))
    small = GPTConfig(vocab_size=256, d_model=128, n_layers=8, n_heads=8, n_kv_heads=4, num_dense_layers=1,
                      d_ff_dense=384, moe=MoEConfig(d_model=128, d_ff=128, num_experts=16, top_k=4,
                                                    aux_loss_coef=1e-2, num_shared_experts=1))
    small_bias = dataclasses.replace(small, moe=small.moe.replace(bias_update_rate=1e-3))
    cases = [("tiny", tiny, None), ("small", small, None),
             ("tiny+mtp", dataclasses.replace(tiny, mtp=True), None),
             ("small+bias", small_bias, random_bias_state(small_bias, seed=7))]
    for name, cfg, state in cases:
        d64 = check_same_function(cfg, dtype=torch.float64, state=state)
        d32 = check_same_function(cfg, dtype=torch.float32, state=state)
        print(f"{name:11s} ok: every leaf agrees; |loss diff| float64 {d64:.2e} (rtol 1e-9), "
              f"float32 {d32:.2e} (rtol 1e-4)")
    # One thread: on a small shared CPU, ops this small suffer from OpenMP thread hand-offs (medians of
    # seconds under load with 2 threads); one thread gives a stable ratio.
    t_mod, t_fmoe = time_step(tiny, threads=1)
    grouped = GroupedExperts(tiny.moe, torch.float32, None).uses_grouped_mm()
    print(f"tiny B=4 S=64 fp32 fwd+bwd, 1 thread (median of 10): nn.Module {t_mod * 1e3:.1f} ms, "
          f"fmoe torch.func.vjp {t_fmoe * 1e3:.1f} ms (fmoe / module = {t_fmoe / t_mod:.2f}); "
          f"module experts via {'torch._grouped_mm' if grouped else 'a loop'}")
