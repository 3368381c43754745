"""Configuration of an MoE layer (`MoEConfig`) and of a small GPT built from such layers (`GPTConfig`).

Both are frozen dataclasses validated at construction: a bad combination raises ValueError naming the
field, so a typo fails at config time rather than as a shape error deep in a forward.

One rule for every numeric and bool field (fmoe/_checks.py), applied at construction:
- int fields take any integral number that is not a bool (numpy integers included) and store an int;
  8.0, True and "8" are refused;
- float fields take any finite real number that is not a bool (int, numpy floating, Fraction) and store
  a Python float; NaN, infinities, bools and strings are refused, and each has its range (coefficients
  >= 0, scales > 0, rope_theta > 0, ...);
- bool fields must be exactly True or False ("False" is a truthy string, numpy.bool_ is not a bool).
So after construction a config holds only Python ints, floats, bools, strings and None.

Legend (the package's, docs/moe.md): D model width, F expert ffn width, E routed experts, K top-k slots,
J expert groups, H query heads, G kv heads, d head dim; with multi-head latent attention (MLA) also
r rotary qk dim, e v head dim, Cq query latent width, Ckv key/value latent width.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fmoe._checks import choice as _choice
from fmoe._checks import flag as _flag
from fmoe._checks import integer as _integer
from fmoe._checks import real as _real
from fmoe.import_path import check_seam
from fmoe.recompute import Recompute

SCORE_FUNCS = ("softmax", "sigmoid")
TOPK_NORMS = ("before", "after")
DROP_POLICIES = ("probs", "position")
BACKENDS = (None, "grouped_mm", "loop", "npu")


def _normalise(cfg: object, ints: dict[str, int], reals: dict[str, tuple[float, bool]],
               flags: tuple[str, ...]) -> None:
    """Validate and normalise the numeric and bool fields of the frozen dataclass `cfg` in place.

    ints: field -> minimum (an integral number, not a bool, stored as int; None allowed for the fields
    whose default is None); reals: field -> (lower bound, strict) (a finite real number, not a bool,
    stored as float; None allowed likewise); flags: fields that must be Python bools. The rules are
    those of fmoe/_checks.py; messages name the field as `ClassName.field`.
    """
    cls = type(cfg).__name__
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}  # type: ignore[arg-type]
    for name, minimum in ints.items():
        value = getattr(cfg, name)
        if value is not None or defaults[name] is not None:
            object.__setattr__(cfg, name, _integer(f"{cls}.{name}", value, minimum))
    for name, (lower, strict) in reals.items():
        value = getattr(cfg, name)
        if value is not None or defaults[name] is not None:
            object.__setattr__(cfg, name, _real(f"{cls}.{name}", value, lower, strict))
    for name in flags:
        _flag(f"{cls}.{name}", getattr(cfg, name))


@dataclass(frozen=True)
class MoEConfig:
    """One MoE layer. Sizes first; every option has the default of a plain dropless top-k softmax MoE.

    Router
    - score_func: "softmax" or "sigmoid" over the E router logits (fp32, fp64 for fp64 inputs).
    - topk_norm: "after": the K selected scores are renormalised to sum to 1 (for softmax this equals a
      softmax over the K selected logits); "before": the selected entries of the full score
      distribution are used as they are (no renormalisation).
    - topk_scale: factor multiplied into the K gate weights (DeepSeek's routed_scaling_factor).
    - num_groups / topk_groups: group-limited routing: experts split into num_groups equal groups, a
      token may only pick experts from its topk_groups best groups (group score: sum of the top-2
      selection scores in the group, top-1 when groups have one expert).
    Balancing
    - aux_loss_coef: micro-batch load-balancing loss coef * E * sum_e f_e * P_e.
    - seq_aux_loss_coef: DeepSeek-V3 sequence-wise balance loss (per sequence, averaged).
    - z_loss_coef: coef * mean_t logsumexp(logits_t)^2.
    - bias_update_rate: aux-loss-free balancing; > 0 keeps an expert bias in the state pytree that is
      added to the scores for selection only and updated by rate * sign(mean load - load).
    Capacity
    - capacity_factor: None = dropless; else each expert keeps at most
      C = ceil(capacity_factor * T * K / E) rows, choosing by drop_policy ("probs": highest gate
      weights; "position": earliest tokens).
    - pad_to_capacity: with a capacity factor, every expert gets exactly C rows (zero padding): static
      shapes, no host sync for the layout.
    - dynamic_capacity_window: W > 0 selects dropless with a forecast capacity: rows are padded to
      C = ceil(margin * max load over the last W steps); a step whose load exceeds it is a *miss* and
      uses its true max load instead (still dropless). Misses are counted in the state.
    Experts
    - num_shared_experts: S = num_shared_experts * d_ff wide shared SwiGLU expert (0 = none);
      shared_expert_gate adds a sigmoid gate per token on its output.
    - probs_in_expert: apply the gate weight inside the expert (before w_down) rather than at combine.
    - backend: grouped_linear backend ("grouped_mm", "loop", "npu") or None (automatic).
    Remat
    - adaptive_remat: rematerialise the layer's expert activations with `fmoe.transforms.remat` when the
      largest expert load exceeds remat_load_scale x the mean load (fmoe/remat_policy.py).
    Seams (fmoe/seams.py; docs/research.md): None (today's function), a callable, or an import path
    "package.module:function" (checked when the config is built; keeps the config plain data)
    - router: replaces fmoe.router.route (signature fmoe.seams.Router); the options above are its own.
    - experts: replaces fmoe.experts.routed_experts (signature fmoe.seams.Experts).
    """

    d_model: int
    d_ff: int
    num_experts: int
    top_k: int
    score_func: str = "softmax"
    topk_norm: str = "after"
    topk_scale: float = 1.0
    num_groups: int = 1
    topk_groups: int = 1
    aux_loss_coef: float = 0.0
    seq_aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    bias_update_rate: float = 0.0
    capacity_factor: float | None = None
    drop_policy: str = "probs"
    pad_to_capacity: bool = False
    dynamic_capacity_window: int = 0
    dynamic_capacity_margin: float = 1.0
    num_shared_experts: int = 0
    shared_expert_gate: bool = False
    probs_in_expert: bool = False
    backend: str | None = None
    adaptive_remat: bool = False
    remat_load_scale: float = 2.0
    router: Callable[..., Any] | str | None = None
    experts: Callable[..., Any] | str | None = None

    def __post_init__(self) -> None:
        _normalise(self,
                   ints={"d_model": 1, "d_ff": 1, "num_experts": 1, "top_k": 1, "num_groups": 1,
                         "topk_groups": 1, "dynamic_capacity_window": 0, "num_shared_experts": 0},
                   reals={"topk_scale": (0.0, True), "aux_loss_coef": (0.0, False),
                          "seq_aux_loss_coef": (0.0, False), "z_loss_coef": (0.0, False),
                          "bias_update_rate": (0.0, False), "capacity_factor": (0.0, True),
                          "dynamic_capacity_margin": (1.0, False), "remat_load_scale": (0.0, True)},
                   flags=("pad_to_capacity", "shared_expert_gate", "probs_in_expert", "adaptive_remat"))
        if self.top_k > self.num_experts:
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        _choice("MoEConfig.score_func", self.score_func, SCORE_FUNCS)
        _choice("MoEConfig.topk_norm", self.topk_norm, TOPK_NORMS)
        _choice("MoEConfig.drop_policy", self.drop_policy, DROP_POLICIES)
        _choice("MoEConfig.backend", self.backend, BACKENDS)
        if self.num_experts % self.num_groups:
            raise ValueError(f"MoEConfig.num_groups ({self.num_groups}) must divide num_experts "
                             f"({self.num_experts})")
        if self.topk_groups > self.num_groups:
            raise ValueError(f"MoEConfig.topk_groups ({self.topk_groups}) must be <= num_groups "
                             f"({self.num_groups})")
        if self.top_k > self.topk_groups * (self.num_experts // self.num_groups):
            raise ValueError(f"MoEConfig.top_k ({self.top_k}) exceeds the experts reachable in topk_groups "
                             f"({self.topk_groups} x {self.num_experts // self.num_groups})")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ValueError("MoEConfig.pad_to_capacity needs a capacity_factor (drop-and-pad)")
        if self.dynamic_capacity_window and self.capacity_factor is not None:
            raise ValueError("MoEConfig.dynamic_capacity_window is dropless: leave capacity_factor None")
        if self.shared_expert_gate and not self.num_shared_experts:
            raise ValueError("MoEConfig.shared_expert_gate needs num_shared_experts > 0")
        check_seam("MoEConfig.router", self.router)
        check_seam("MoEConfig.experts", self.experts)

    def replace(self, **changes: Any) -> MoEConfig:
        """Return a copy with `changes` applied (validated again)."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class GPTConfig:
    """A small GPT: embedding, num_dense_layers dense blocks, then MoE blocks, final norm, head.

    Attention: n_heads query heads (H), n_kv_heads key/value heads (G, GQA), head_dim (d), RoPE with
    rope_theta, causal. qk_norm: an RMSNorm over each head's d features of q and of k (own [d] gains
    "q_norm", "k_norm", eps norm_eps) before RoPE, as Qwen3 (default off: no such weights).
    Dense blocks use a SwiGLU of width d_ff_dense.
    n_kv_heads, head_dim and d_ff_dense may be given as None: construction resolves them to n_heads,
    d_model // n_heads and 4 * d_model, so after it they are always ints (read cfg.head_dim etc.).
    mtp: add a DeepSeek-V3 multi-token-prediction module (depth 1, predicts token t+2), whose loss is
    added with weight mtp_loss_weight. The MoE layers use `moe` (its d_model must equal d_model).
    Ranges: sizes are positive ints (num_dense_layers an int in [0, n_layers]); rope_theta a finite
    float > 0 (0 or NaN make the rotary angles NaN: attention runs on, its gradients NaN); norm_eps and
    mtp_loss_weight finite floats >= 0; mtp and qk_norm bools.
    recompute: what a backward recomputes instead of keeping from the forward (fmoe/recompute.py: nothing,
    whole layers, or named parts); the MoE layer's load-aware adaptive recompute is moe.adaptive_remat.
    attention: the core attention, None (fmoe.ops.attention), a callable or an import path
    "package.module:function" (signature fmoe.seams.Attention; docs/research.md).
    Multi-head latent attention (DeepSeek-V2/V3; fmoe/mla.py), on when kv_lora_rank > 0 (`cfg.mla`):
    keys and values come from a kv_lora_rank-wide latent, queries through a q_lora_rank-wide one (0: a
    plain projection), each of the H heads has head_dim (d) non-rotary qk features, qk_rope_head_dim (r,
    even) rotary ones (the keys' shared by all heads) and v_head_dim (e; None: head_dim) value features.
    With MLA n_kv_heads is n_heads (None resolves to it), qk_norm and the attention seam do not apply;
    without it q_lora_rank and qk_rope_head_dim are 0 and v_head_dim None.
    """

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    moe: MoEConfig
    n_kv_heads: int | None = None
    head_dim: int | None = None
    d_ff_dense: int | None = None
    num_dense_layers: int = 0
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    mtp: bool = False
    mtp_loss_weight: float = 0.3
    qk_norm: bool = False
    recompute: Recompute = Recompute()
    attention: Callable[..., Any] | str | None = None
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.moe, MoEConfig):
            raise ValueError(f"GPTConfig.moe must be a MoEConfig, got {self.moe!r}")
        if not isinstance(self.recompute, Recompute):
            raise ValueError(f"GPTConfig.recompute must be a fmoe.recompute.Recompute, got "
                             f"{self.recompute!r}")
        _normalise(self,
                   ints={"vocab_size": 1, "d_model": 1, "n_layers": 1, "n_heads": 1, "n_kv_heads": 1,
                         "head_dim": 1, "d_ff_dense": 1, "num_dense_layers": 0, "q_lora_rank": 0,
                         "kv_lora_rank": 0, "qk_rope_head_dim": 0, "v_head_dim": 1},
                   reals={"rope_theta": (0.0, True), "norm_eps": (0.0, False),
                          "mtp_loss_weight": (0.0, False)},
                   flags=("mtp", "qk_norm"))
        kv = self.n_kv_heads if self.n_kv_heads is not None else self.n_heads
        if self.n_heads % kv:
            raise ValueError(f"GPTConfig.n_kv_heads ({kv}) must divide n_heads ({self.n_heads})")
        hd = self.head_dim if self.head_dim is not None else self.d_model // self.n_heads
        if self.kv_lora_rank:
            self._check_mla(kv, hd)
        elif hd <= 0 or hd % 2:
            raise ValueError(f"GPTConfig.head_dim must be positive and even (RoPE), got {hd}")
        else:
            for name in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, name):
                    raise ValueError(f"GPTConfig.{name} is multi-head latent attention's: it needs "
                                     "kv_lora_rank > 0")
        if not 0 <= self.num_dense_layers <= self.n_layers:
            raise ValueError(f"GPTConfig.num_dense_layers must lie in [0, n_layers={self.n_layers}], got "
                             f"{self.num_dense_layers}")
        check_seam("GPTConfig.attention", self.attention)
        if self.moe.d_model != self.d_model:
            raise ValueError(f"GPTConfig.moe.d_model ({self.moe.d_model}) must equal d_model "
                             f"({self.d_model})")
        d_ff_dense = self.d_ff_dense if self.d_ff_dense is not None else 4 * self.d_model
        # Resolve the defaults in place: one name per quantity (frozen, hence object.__setattr__).
        object.__setattr__(self, "n_kv_heads", kv)
        object.__setattr__(self, "head_dim", hd)
        object.__setattr__(self, "d_ff_dense", d_ff_dense)
        if self.kv_lora_rank and self.v_head_dim is None:
            object.__setattr__(self, "v_head_dim", hd)

    def _check_mla(self, kv: int, hd: int) -> None:
        """Raise ValueError naming the field that multi-head latent attention cannot take."""
        if hd <= 0:
            raise ValueError(f"GPTConfig.head_dim (the non-rotary qk part under MLA) must be positive, "
                             f"got {hd}")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim % 2:
            raise ValueError("GPTConfig.qk_rope_head_dim must be positive and even (RoPE) with "
                             f"kv_lora_rank > 0, got {self.qk_rope_head_dim}")
        if kv != self.n_heads:
            raise ValueError(f"GPTConfig.n_kv_heads ({kv}): multi-head latent attention gives every one of "
                             f"the {self.n_heads} heads its own keys and values; leave it None")
        if self.qk_norm:
            raise ValueError("GPTConfig.qk_norm does not apply to multi-head latent attention (its latents "
                             "have their own norms)")
        if self.attention is not None:
            raise ValueError("GPTConfig.attention (a core attention that applies RoPE to whole heads, "
                             "fmoe.seams.Attention) does not apply to multi-head latent attention")

    @property
    def mla(self) -> bool:
        """True for multi-head latent attention (kv_lora_rank > 0), else grouped-query attention."""
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:
        """The width of one head's queries and keys: d, or d + r under MLA."""
        return self.head_dim + self.qk_rope_head_dim

    @property
    def o_head_dim(self) -> int:
        """The width of one head's values and attention output: d, or e under MLA."""
        return self.v_head_dim if self.mla else self.head_dim
