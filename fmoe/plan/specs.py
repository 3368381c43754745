"""What the planner plans for: a model (`ModelSpec`) and a cluster (`ClusterSpec`), their presets, and
reading either from a TOML file.

Every field is checked at construction; a bad value raises PlanError (a ValueError) naming the field, so
`fmoe plan` can print one line and exit. Sizes follow the published configs of each model; where a paper
leaves a size out, the preset's comment says what was assumed and why.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


class PlanError(ValueError):
    """An impossible model, cluster or layout request, with a one-line reason."""


DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
LAYER_KINDS = ("embed", "dense", "moe", "head")  # the kinds of fmoe.plan.layer_costs.LayerCost
# host overheads are priced per layer kind, and apart for an MoE layer whose exchange leaves the device
# (expert parallel: the runtime runs its phases one by one around the all-to-all)
OVERHEAD_KINDS = (*LAYER_KINDS, "moe_ep")
# GEMM groups that may run in FP8 (ModelSpec.fp8_gemms), forward, input and weight gradient alike: the
# attention projections, a dense layer's SwiGLU, the shared and the routed experts, and the MTP modules'
# 2h -> h projections. The attention core, the router, the embedding and the output head stay in the
# compute dtype (as DeepSeek-V3's recipe keeps them: report 3.3.1).
FP8_GROUPS = ("attn_proj", "dense_mlp", "shared_experts", "experts", "mtp_proj")


def _positive_ints(obj: object, names: tuple[str, ...], minimum: int = 1) -> None:
    for name in names:
        v = getattr(obj, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise PlanError(f"{type(obj).__name__}.{name} must be an int >= {minimum}, got {v!r}")


def _positive_reals(
    obj: object,
    names: tuple[str, ...],
    *,
    allow_zero: bool = False,
    upper: float | None = None,
) -> None:
    for name in names:
        v = getattr(obj, name)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        ok = ok and (v >= 0 if allow_zero else v > 0) and (upper is None or v <= upper)
        if not ok:
            rng = (
                f"in {'[' if allow_zero else '('}0, {upper:g}]"
                if upper
                else (">= 0" if allow_zero else "> 0")
            )
            raise PlanError(f"{type(obj).__name__}.{name} must be a finite number {rng}, got {v!r}")


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-only MoE transformer, as the planner sees it.

    layers: transformer blocks (the first `dense_layers` with a SwiGLU of width `dense_ffn`, the rest MoE:
    `routed_experts` SwiGLU experts of width `expert_ffn`, top `top_k`, plus `shared_experts` always-on
    experts of the same width). Attention is GQA (`heads` query heads, `kv_heads` kv heads of
    `head_dim`) unless `kv_lora_rank` > 0, then MLA (DeepSeek-V2/V3): queries through a `q_lora_rank`
    bottleneck (0 = none), keys and values from a `kv_lora_rank` latent, `head_dim` the non-rotary qk
    part, `qk_rope_dim` the rotary part, `v_head_dim` the value width. `mtp`: multi-token-prediction
    modules (each one MoE block plus a 2h -> h projection; it shares the embedding and head).
    `seq`: default sequence length; `dtype`: compute dtype ("bf16" = mixed precision with fp32 master
    weights, gradients and Adam state; "fp32" = everything fp32).
    `fp8_gemms`: the GEMM groups (FP8_GROUPS, or "linear" for all of them) that run in FP8, forward and
    both backward GEMMs, on a cluster with an FP8 peak (ClusterSpec.fp8_flops; else at the dtype's peak);
    their inputs are kept for the backward in FP8 too. `max_nodes_per_token`: node-limited routing (each
    token's experts on at most this many nodes of the expert group; 0 = unlimited).
    """

    name: str
    layers: int
    hidden: int
    heads: int
    head_dim: int
    vocab: int
    seq: int
    routed_experts: int
    top_k: int
    expert_ffn: int
    kv_heads: int = 0  # 0 = heads (MHA)
    dense_layers: int = 0
    dense_ffn: int = 0  # 0 = 4 x hidden
    shared_experts: int = 0
    mtp: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0  # 0 = head_dim
    tied_embeddings: bool = False
    dtype: str = "bf16"
    fp8_gemms: tuple[str, ...] = ()
    max_nodes_per_token: int = 0

    def __post_init__(self) -> None:
        groups = (self.fp8_gemms,) if isinstance(self.fp8_gemms, str) else tuple(self.fp8_gemms)
        if "linear" in groups:
            groups = FP8_GROUPS
        if any(g not in FP8_GROUPS for g in groups):
            raise PlanError(f"ModelSpec.fp8_gemms must name groups of {', '.join(FP8_GROUPS)} (or 'linear'), "
                            f"got {self.fp8_gemms!r}")
        # a tuple, in FP8_GROUPS' order: the spec stays hashable (the cost functions cache on it)
        object.__setattr__(self, "fp8_gemms", tuple(g for g in FP8_GROUPS if g in groups))
        _positive_ints(
            self,
            (
                "layers",
                "hidden",
                "heads",
                "head_dim",
                "vocab",
                "seq",
                "routed_experts",
                "top_k",
                "expert_ffn",
            ),
        )
        _positive_ints(
            self,
            (
                "kv_heads",
                "dense_layers",
                "dense_ffn",
                "shared_experts",
                "mtp",
                "q_lora_rank",
                "kv_lora_rank",
                "qk_rope_dim",
                "v_head_dim",
                "max_nodes_per_token",
            ),
            minimum=0,
        )
        if self.kv_heads == 0:
            object.__setattr__(self, "kv_heads", self.heads)
        if self.dense_ffn == 0:
            object.__setattr__(self, "dense_ffn", 4 * self.hidden)
        if self.v_head_dim == 0:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.heads % self.kv_heads:
            raise PlanError(f"ModelSpec.kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.dense_layers > self.layers:
            raise PlanError(f"ModelSpec.dense_layers ({self.dense_layers}) exceeds layers ({self.layers})")
        if self.top_k > self.routed_experts:
            raise PlanError(f"ModelSpec.top_k ({self.top_k}) exceeds routed_experts ({self.routed_experts})")
        if self.dtype not in DTYPE_BYTES:
            raise PlanError(f"ModelSpec.dtype must be one of {', '.join(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def mla(self) -> bool:
        """True for multi-head latent attention (kv_lora_rank > 0)."""
        return self.kv_lora_rank > 0

    def fp8(self, group: str) -> bool:
        """Whether GEMM group `group` (one of FP8_GROUPS) runs in FP8."""
        return group in self.fp8_gemms

    @property
    def moe_layers(self) -> int:
        """Number of MoE blocks in the main model (MTP modules not counted)."""
        return self.layers - self.dense_layers

    def replace(self, **changes: Any) -> ModelSpec:
        """Returns a copy with `changes` applied (checked again)."""
        return dataclasses.replace(self, **changes)


def _per_kind(table: dict[str, float], kind: str, expert_parallel: bool, default: float) -> float:
    """`table`'s figure for layer `kind` (an expert-parallel MoE layer: "moe_ep" where given, else "moe"),
    or `default`."""
    if kind == "moe" and expert_parallel and "moe_ep" in table:
        kind = "moe_ep"
    return float(table.get(kind, default))


@dataclass(frozen=True)
class ClusterSpec:
    """Devices and links. FLOP/s are dense peaks per device for the model's compute dtype; `gemm_eff` and
    `attn_eff` the shares of peak a large GEMM and the attention kernel reach; `gemm_half_dim` the GEMM
    dimension at which a matmul reaches half of `gemm_eff` (small expert GEMMs run slower: the reason
    TP-extends-EP keeps experts whole). `hbm_bytes_per_s` times the optimizer step (memory bound).
    Links: per device, one direction, bytes/s and latency s, intra-node and inter-node.
    `op_overhead_s`: fixed host cost per layer and phase (kernel launches, Python; large on CPU).
    `layer_overhead_s` overrides it per layer kind (OVERHEAD_KINDS) for the forward, and
    `token_overhead_s` adds host seconds per token of the microbatch per layer kind (work that grows
    with the tokens but is not GEMM or attention FLOPs: norms, softmax, routing, row copies; an MoE layer
    under EP without a "moe_ep" figure takes the "moe" one). Below `token_knee` tokens (0: no knee) that
    growth is `small_token_overhead_s` per token instead, per layer kind, continuous at the knee (on a
    CPU a few tokens cost more each than many do). The
    backward's input- and weight-gradient parts run apart (I, then W later) cost `i_overhead_ratio` and
    `w_overhead_ratio` times the forward's; run as one B, `b_overhead_ratio` times (None: the sum).
    `stage_overhead_s`: host cost per stage and microbatch on top (a pipeline runtime's bookkeeping:
    receives, closures, gradient sums), charged to the stage's backward. `step_overhead_s`: host cost
    per step and per layer a device holds, outside the pipeline (optimizer, gradient norm and
    routing-state bookkeeping over each layer's tensors).
    `base_mem_gib`: memory a process holds before the model (runtime context, libraries).
    `comm_overhead_s`: fixed host cost per collective call on top of the link latency.
    `p2p_overhead_s`: host cost of one pipeline message on each rank it leaves or reaches (posting the
    send or receive, the transport's share of a busy host), charged to the stage that sends or receives
    it: per remote neighbour stage, once in its forward and once in its backward.
    `comm_hides`: whether an exchange progresses while the ranks compute, so that fb overlap can hide
    it (True: a device's links and copy engines move the bytes; False: the transport needs the cores
    the compute holds, as gloo on a CPU with no spare core, where fb overlap measured no faster).
    `pair_hide` / `lone_hide` / `lone_hide_whole` / `pair_self_hide`: the share of the all-to-all hidden
    inside an F&B pair (cross-microbatch pairing), in a lone F or B (warm-up, cool-down) that moves its
    rows in two chunks (self-overlap), in one that moves them whole (only its own shared expert and dw
    run meanwhile), and in a pair whose layers hide themselves in chunks instead of pairing, where
    `comm_hides` (fmoe.overlap names the modes); measured inputs, not constants: the defaults are what
    fmoe's executor hides on a modelled device (BENCHMARKS.md, "fb overlap: lone forwards move the
    all-to-all in two row chunks" and "Adaptive pipe overlap", compute model on: pairs 96.1-96.5 %,
    chunked lone phases 72.0-76.5 %, whole ones 47.9-52.8 %, chunks in a pair 55.0-62.9 %; the seed
    assumed 100 % and 50 %).
    `fp8_flops`: dense FP8 peak FLOP/s per device for the GEMMs a model runs in FP8 (0: the device has
    no FP8, they run at the compute dtype's peak)."""

    name: str
    devices_per_node: int
    peak_flops: dict[str, float]
    mem_gib: float
    intra_bytes_per_s: float
    inter_bytes_per_s: float
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 15e-6
    gemm_eff: float = 0.7
    attn_eff: float = 0.5
    gemm_half_dim: int = 256
    hbm_bytes_per_s: float = 2e12
    op_overhead_s: float = 0.0
    comm_overhead_s: float = 0.0
    base_mem_gib: float = 1.0
    layer_overhead_s: dict[str, float] = dataclasses.field(default_factory=dict)
    i_overhead_ratio: float = 1.0
    w_overhead_ratio: float = 1.0
    step_overhead_s: float = 0.0
    stage_overhead_s: float = 0.0
    b_overhead_ratio: float | None = None
    token_overhead_s: dict[str, float] = dataclasses.field(default_factory=dict)
    p2p_overhead_s: float = 0.0
    comm_hides: bool = True
    small_token_overhead_s: dict[str, float] = dataclasses.field(default_factory=dict)
    token_knee: float = 0.0
    pair_hide: float = 0.96
    lone_hide: float = 0.72
    lone_hide_whole: float = 0.48
    pair_self_hide: float = 0.59
    fp8_flops: float = 0.0

    def __post_init__(self) -> None:
        if not isinstance(self.comm_hides, bool):
            raise PlanError(f"ClusterSpec.comm_hides must be a bool, got {self.comm_hides!r}")
        _positive_ints(self, ("devices_per_node",))
        _positive_ints(self, ("gemm_half_dim",), minimum=0)
        _positive_reals(self, ("mem_gib", "intra_bytes_per_s", "inter_bytes_per_s", "hbm_bytes_per_s"))
        _positive_reals(
            self,
            ("intra_latency_s", "inter_latency_s", "op_overhead_s", "comm_overhead_s", "base_mem_gib",
             "i_overhead_ratio", "w_overhead_ratio", "step_overhead_s", "stage_overhead_s", "p2p_overhead_s",
             "token_knee", "fp8_flops"),
            allow_zero=True,
        )
        shares = ("pair_hide", "lone_hide", "lone_hide_whole", "pair_self_hide")
        _positive_reals(self, shares, allow_zero=True, upper=1.0)
        if self.b_overhead_ratio is not None:
            _positive_reals(self, ("b_overhead_ratio",), allow_zero=True)
        for field in ("layer_overhead_s", "token_overhead_s", "small_token_overhead_s"):
            table = getattr(self, field)
            if not isinstance(table, dict):
                raise PlanError(f"ClusterSpec.{field} must map a layer kind to seconds, got {table!r}")
            for kind, sec in table.items():
                ok = isinstance(sec, (int, float)) and not isinstance(sec, bool)
                ok = ok and math.isfinite(sec) and sec >= 0
                if kind not in OVERHEAD_KINDS or not ok:
                    raise PlanError(f"ClusterSpec.{field}[{kind!r}] must be a layer kind of "
                                    f"{', '.join(OVERHEAD_KINDS)} with seconds >= 0, got {sec!r}")
        _positive_reals(self, ("gemm_eff", "attn_eff"), upper=1.0)
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise PlanError(f"ClusterSpec.peak_flops must map a dtype to FLOP/s, got {self.peak_flops!r}")
        for dtype, flops in self.peak_flops.items():
            if dtype not in DTYPE_BYTES or not isinstance(flops, (int, float)) or not flops > 0:
                raise PlanError(
                    f"ClusterSpec.peak_flops[{dtype!r}] must be a dtype of {', '.join(DTYPE_BYTES)} "
                    f"with FLOP/s > 0, got {flops!r}"
                )

    def flops(self, dtype: str) -> float:
        """Peak dense FLOP/s for `dtype`; PlanError if this cluster gives none."""
        if dtype not in self.peak_flops:
            raise PlanError(
                f"cluster {self.name} gives no peak FLOP/s for {dtype} (has {', '.join(self.peak_flops)})"
            )
        return float(self.peak_flops[dtype])

    def gemm_flops(self, dtype: str, fp8: bool) -> float:
        """Peak FLOP/s of a GEMM in `dtype`, or in FP8 when `fp8` and the device has an FP8 peak."""
        return float(self.fp8_flops) if fp8 and self.fp8_flops else self.flops(dtype)

    def overhead_s(self, kind: str, expert_parallel: bool = False) -> float:
        """Host seconds of one forward of a layer of `kind` (one of LAYER_KINDS); an MoE layer with
        `expert_parallel` takes the "moe_ep" figure where the cluster gives one."""
        return _per_kind(self.layer_overhead_s, kind, expert_parallel, self.op_overhead_s)

    def host_s(self, kind: str, tokens: float, expert_parallel: bool = False) -> float:
        """Host seconds of one forward of a layer of `kind` over a microbatch of `tokens` tokens on one
        device: `overhead_s` plus `tokens` times the kind's `token_overhead_s` (below `token_knee`: its
        host seconds at the knee less `small_token_overhead_s` per token short of it)."""
        per_token = _per_kind(self.token_overhead_s, kind, expert_parallel, 0.0)
        at = self.overhead_s(kind, expert_parallel) + max(tokens, self.token_knee) * per_token
        if tokens < self.token_knee:
            at -= (self.token_knee - tokens) * _per_kind(self.small_token_overhead_s, kind, expert_parallel,
                                                         per_token)
        return max(0.0, at)

    def replace(self, **changes: Any) -> ClusterSpec:
        """Returns a copy with `changes` applied (checked again)."""
        return dataclasses.replace(self, **changes)


def _deepseek_like(name: str, hidden: int, **kw: Any) -> ModelSpec:
    # DeepSeek-V3's MLA sizes: 128 heads, q_lora 1536, kv_lora 512, qk 128 + rope 64, v 128
    base = dict(
        name=name,
        layers=61,
        hidden=hidden,
        heads=128,
        head_dim=128,
        qk_rope_dim=64,
        v_head_dim=128,
        q_lora_rank=1536,
        kv_lora_rank=512,
        dense_layers=3,
        dense_ffn=18432,
        routed_experts=256,
        shared_experts=1,
        top_k=8,
        expert_ffn=2048,
        mtp=1,
        seq=4096,
    )
    base.update(kw)
    return ModelSpec(**base)


MODEL_PRESETS: dict[str, ModelSpec] = {
    # DeepSeek-V3 technical report, Table/Sec. 4.2: 671B total (+14B MTP), 37B active, seq 4096
    "deepseek-v3": _deepseek_like("deepseek-v3", 7168, vocab=129280),
    # Pangu Ultra MoE (seed 003 and its report): 718B / 39B active, 61 layers, hidden 7680, MLA, MTP,
    # 256 routed + 1 shared experts of ffn 2048, top-8. Not published here: the MLA sizes, dense layers
    # and vocabulary; DeepSeek-V3's are assumed (they give 718B total within 1%), vocab of openPangu (153376).
    "pangu-ultra-moe": _deepseek_like("pangu-ultra-moe", 7680, vocab=153376, seq=8192),
    # Mixtral of Experts: 32 layers, hidden 4096, 32 heads / 8 kv, 8 experts of 14336, top-2; 46.7B / 12.9B
    "mixtral-8x7b": ModelSpec(
        name="mixtral-8x7b",
        layers=32,
        hidden=4096,
        heads=32,
        kv_heads=8,
        head_dim=128,
        vocab=32000,
        seq=4096,
        routed_experts=8,
        top_k=2,
        expert_ffn=14336,
    ),
    # Qwen3-30B-A3B: 48 layers, hidden 2048, 32 heads / 4 kv of 128, 128 experts of 768, top-8; 30.5B / 3.3B
    "qwen3-30b-a3b": ModelSpec(
        name="qwen3-30b-a3b",
        layers=48,
        hidden=2048,
        heads=32,
        kv_heads=4,
        head_dim=128,
        vocab=151936,
        seq=4096,
        routed_experts=128,
        top_k=8,
        expert_ffn=768,
    ),
}


def _gbps(x: float) -> float:
    return x * 1e9 / 8  # Gb/s -> bytes/s


CLUSTER_PRESETS: dict[str, ClusterSpec] = {
    # Atlas 800T A2: 8 x Ascend 910B (64 GB HBM, ~313 TFLOP/s fp16/bf16, no FP8: fp8_flops 0), HCCS
    # ~56 GB/s per link inside a node (~196 GB/s per NPU over the full mesh, about half usable one way for
    # all-to-all), 200 Gb/s RoCE per NPU across nodes.
    "ascend-910b": ClusterSpec(
        name="ascend-910b",
        devices_per_node=8,
        peak_flops={"bf16": 313e12, "fp16": 313e12, "fp32": 78e12},
        mem_gib=64,
        intra_bytes_per_s=90e9,
        inter_bytes_per_s=_gbps(200),
        intra_latency_s=10e-6,
        inter_latency_s=20e-6,
        gemm_eff=0.65,
        attn_eff=0.45,
        hbm_bytes_per_s=1.6e12,
        comm_overhead_s=20e-6,
        base_mem_gib=3.0,
    ),
    # H800 SXM: 989 TFLOP/s bf16 dense, 80 GB, NVLink cut to 400 GB/s (160 GB/s achievable, DeepSeek-V3
    # 3.2.2), 400 Gb/s InfiniBand per GPU (~40 GB/s achievable).
    "h800": ClusterSpec(
        name="h800",
        devices_per_node=8,
        peak_flops={"bf16": 989e12, "fp16": 989e12, "fp32": 67e12},
        mem_gib=80,
        intra_bytes_per_s=160e9,
        inter_bytes_per_s=40e9,
        gemm_eff=0.7,
        attn_eff=0.5,
        hbm_bytes_per_s=3.35e12,
        comm_overhead_s=10e-6,
        base_mem_gib=2.0,
        fp8_flops=1979e12,  # H800 / H100 SXM dense FP8 (twice bf16)
    ),
}

# H100 SXM: H800's compute with full NVLink, 900 GB/s both ways (~370 GB/s one way achievable)
CLUSTER_PRESETS["h100"] = CLUSTER_PRESETS["h800"].replace(name="h100", intra_bytes_per_s=370e9)
# H200 SXM: H100 with 141 GB HBM3e at 4.8 TB/s
CLUSTER_PRESETS["h200"] = CLUSTER_PRESETS["h100"].replace(name="h200", mem_gib=141, hbm_bytes_per_s=4.8e12)

@dataclass(frozen=True)
class Published:
    """What a preset's published training run had, for `fmoe plan --published`: the cluster, devices,
    global batch (sequences) and sequence length; the layout (a label `--explain` reads) and schedule;
    the GEMMs in FP8 (ModelSpec.fp8_gemms), node-limited routing (ModelSpec.max_nodes_per_token), the
    recompute choices the search may pick (the planner's names; the nearest the runtime has where it lacks
    the published one); the published throughput (tokens/s) and where each figure comes from."""

    cluster: str
    devices: int
    global_batch: int
    seq: int
    layout: str
    schedule: str
    fp8_gemms: tuple[str, ...]
    max_nodes_per_token: int
    recompute: tuple[str, ...]
    tokens_per_s: float
    source: str

    def model(self, spec: ModelSpec) -> ModelSpec:
        """Returns `spec` with the published run's precision, routing limit and sequence length."""
        return spec.replace(fp8_gemms=self.fp8_gemms, max_nodes_per_token=self.max_nodes_per_token,
                            seq=self.seq)


PUBLISHED: dict[str, Published] = {
    # DeepSeek-V3 technical report: 2048 H800, PP16 (DualPipe) x EP64 over 8 nodes, no TP, ZeRO-1; FP8 for
    # every Linear's fprop / dgrad / wgrad (attention core, embedding, head, router, norms in bf16:
    # 3.3.1); each token to at most 4 nodes (2.1.2); batch 15360 x 4096 tokens (4.2, after the ramp);
    # 2.664M H800 hours for 14.8T tokens: 3.16M tokens/s on 2048 GPUs. Recompute: RMSNorm and the MLA
    # up-projections (3.2.3), the runtime's "layernorm" and "mla_up_proj" parts; where the planner finds
    # that set alone does not fit (at tp1 ep64 it keeps the routed experts' activations: 159 GiB), the
    # routed experts too ("moe"), then full.
    "deepseek-v3": Published(
        cluster="h800", devices=2048, global_batch=15360, seq=4096, layout="tp1 pp16 ep64 dp2 mb1 hier",
        schedule="dualpipe", fp8_gemms=FP8_GROUPS, max_nodes_per_token=4,
        recompute=("layernorm+mla_up_proj", "moe+layernorm+mla_up_proj", "full"),
        tokens_per_s=3.16e6, source="DeepSeek-V3 technical report, 3.2-3.3 and 4.2",
    ),
    # Pangu Ultra MoE (seed 003): 6144 Ascend 910B, PP16 TP8 EP4 VPP2 DP48 (fmoe's dp
    # 12 x ep 4), interleaved 1F1B whose forwards and backwards of different microbatches overlap
    # ("adaptive pipe overlap", a forward-backward overlap: fmoe's interleaved schedule with F&B pairs,
    # "interleaved+extra"), bf16 (the 910B has no FP8), adaptive recompute (seed 002: the MoE
    # layer's load-aware one; MindSpeed's adaptive selection between none and full), no node limit;
    # 30.0% MFU, about 1.46M tokens/s; batch 3072 x 8192 as docs/plan.md plans it.
    "pangu-ultra-moe": Published(
        cluster="ascend-910b", devices=6144, global_batch=3072, seq=8192, layout="tp8 pp16 ep4 vpp2 dp12 mb1",
        schedule="interleaved+extra", fp8_gemms=(), max_nodes_per_token=0,
        recompute=("none", "adaptive", "full"),
        tokens_per_s=1.46e6, source="Pangu Ultra MoE report (seed 003)",
    ),
}


def _read_toml(path: str, what: str, names: Iterable[str]) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise PlanError(f"--{what}: no preset or file {path!r} (presets: {', '.join(names)})")
    try:
        return {k.replace("-", "_"): v for k, v in tomllib.loads(p.read_text()).items()}
    except tomllib.TOMLDecodeError as exc:
        raise PlanError(f"--{what} {path}: {exc}") from None


def _check_fields(cls: type, values: dict[str, Any], what: str) -> None:
    """Raises PlanError naming the keys of `values` that are not fields of `cls`; returns None."""
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise PlanError(
            f"--{what}: unknown field(s) {', '.join(unknown)}; fields are {', '.join(sorted(fields))}"
        )


def _base_of(values: dict[str, Any], what: str) -> str | None:
    """Pops and returns the `base` key of a TOML file's values (PlanError unless it is a string)."""
    base = values.pop("base", None)
    if base is not None and not isinstance(base, str):
        raise PlanError(f"--{what}: base must be a preset name or a file path (a string), got {base!r}")
    return base


def _build(cls: type, values: dict[str, Any], what: str) -> Any:
    _check_fields(cls, values, what)
    try:
        return cls(**values)
    except TypeError as exc:  # a missing required field
        raise PlanError(f"--{what}: {exc}") from None


def _from_toml(path: str, cls: type, what: str, load: Any, names: Iterable[str]) -> Any:
    """The spec a TOML file describes: its fields over `base = "preset"` (loaded by `load`), or alone;
    `names`: the presets, for the error naming a path that is no file."""
    values = _read_toml(path, what, names)
    base = _base_of(values, what)
    fields = {"name": Path(path).stem, **values}
    if base is None:
        return _build(cls, fields, what)
    _check_fields(cls, values, what)  # else dataclasses.replace raises a bare TypeError
    return load(base).replace(**fields)


def load_model(name_or_path: str, overrides: dict[str, Any] | None = None,
               presets: Mapping[str, ModelSpec] = MODEL_PRESETS) -> ModelSpec:
    """Returns the ModelSpec of a preset name (a key of `presets`; fmoe.calibrate.models.load_model adds
    `fmoe train`'s) or a TOML file (a preset's fields via `base = "deepseek-v3"`, then any field), with
    `overrides` applied last. PlanError on a bad spec."""
    if name_or_path in presets:
        spec = presets[name_or_path]
    else:
        spec = _from_toml(name_or_path, ModelSpec, "model", lambda base: load_model(base, None, presets),
                          presets)
    return spec.replace(**overrides) if overrides else spec


def load_cluster(name_or_path: str, overrides: dict[str, Any] | None = None,
                 files: Mapping[str, Callable[[], str]] | None = None) -> ClusterSpec:
    """Returns the ClusterSpec of a preset name (CLUSTER_PRESETS), a name of `files` (name -> a function
    returning the path of its spec file: "local", this machine's calibration, fmoe.calibrate) or a TOML
    file (optionally `base =` any of those; `to_toml` writes one), `overrides` last."""
    files = files or {}
    if name_or_path in CLUSTER_PRESETS:
        spec = CLUSTER_PRESETS[name_or_path]
    elif name_or_path in files:
        spec = load_cluster(files[name_or_path](), None, files)
    else:
        spec = _from_toml(name_or_path, ClusterSpec, "cluster", lambda base: load_cluster(base, None, files),
                          (*CLUSTER_PRESETS, *files))
    return spec.replace(**overrides) if overrides else spec


def _toml_value(v: Any, where: str) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)  # Python's repr of a float is TOML's too (inf, nan, 1e-05) and reads back exactly
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (tuple, list)):
        return "[" + ", ".join(_toml_value(x, f"{where}[{k}]") for k, x in enumerate(v)) + "]"
    if isinstance(v, Mapping):
        pairs = (f"{json.dumps(k)} = {_toml_value(x, f'{where}.{k}')}" for k, x in v.items())
        return "{" + ", ".join(pairs) + "}"
    raise PlanError(f"to_toml: {where} = {v!r} has no TOML form")


def to_toml(spec: ModelSpec | ClusterSpec, comment: str = "") -> str:
    """The TOML file `load_model` / `load_cluster` read back as `spec` (every field but those None at
    their default), after `comment` as `#` lines."""
    lines = [f"# {line}" for line in comment.splitlines()]
    for f in dataclasses.fields(spec):
        v = getattr(spec, f.name)
        if v is None and f.default is None:
            continue
        lines.append(f"{f.name} = {_toml_value(v, f.name)}")
    return "\n".join(lines) + "\n"
