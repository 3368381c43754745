"""Structural checks of parameter and state pytrees against their config: keys, shapes and dtypes.

    check_moe(params, cfg, state, num_local_experts=L)    # what fmoe.moe runs first
    check_gpt(params, cfg, state, num_local_experts=L)    # what fmoe.gpt_loss runs first

A tree built for another config mostly *runs*: a [D, 3] router for E = 4 never uses expert 3, a shared
expert the config does not have is silently added, a [1] expert bias broadcasts, a GPT with 3 blocks
for n_layers = 4 runs 3 (zip stops at the shorter list). So every function that takes params (or state)
and a config checks them first, against a spec built from the config, and raises ValueError naming the
leaf, e.g. "moe params: router.w has shape (8, 3), config says [D=8, E=4]",
"gpt params: layers has 3 blocks, config says n_layers=4",
"moe state: expert_bias_E has shape (3,), config says [E=4]".

Legend (the package's, docs/moe.md): D model width, F ffn width, E experts, L local experts, H, G, d
query heads, kv heads, head dim, V vocabulary, W capacity forecast window; multi-head latent attention's
Q, C, r, e, k: fmoe/mla.py.

The specs (`moe_params_spec`, `moe_state_spec`, `block_params_spec`, `gpt_params_spec`,
`gpt_state_spec`) are the layouts of docs/moe.md, written once here with a legend name per axis (so a
message can say which size the config gives); tests/test_moe_structure.py checks, for random configs,
that they equal what the init functions build (run on the meta device). The rules:
- params: exactly the spec's keys; every leaf a tensor of the spec's shape and a floating dtype (the
  dtypes may differ between leaves: a fp32 router next to bf16 experts is fine).
- expert parallelism: a rank holds only its local experts, so the routed-expert leaves are
  [L, D, F] with L = `num_local_experts` (the dispatcher's `num_local_experts`; default E). Router,
  shared expert and state stay global.
- moe state: every key optional (a state without the expert bias starts it at zero; without the
  dynamic-capacity entries, they start from fmoe.init_moe_state), but the three dynamic-capacity entries
  come together; expert_bias_E a floating [E] (also accepted when bias_update_rate is 0: the bias then
  still shifts selection and stays fixed); load_history_W an integer [W], capacity_misses and
  capacity_steps integer scalars; no key the config does not have.
- gpt state: "layers" one entry per layer (None or a moe state; {} or None for a dense layer), "mtp"
  (optional, with cfg.mtp only).
- `paths` restricts a check to the subtrees at those key paths (a pipeline rank reads only its chunks'
  params); the keys outside them are not looked at.

Cost and skipping: specs are cached per (config, local expert count), so a check is one pass over the
leaves reading `.shape` and `.dtype`: no device work, no host sync, and it works on the wrapped tensors
of torch.func transforms. Every checking function takes `check=True`; pass `check=False` only for trees
that already passed a check with the same config, e.g. from the second step of a training loop on. The
entry points do so for their inner calls (gpt_loss checks the whole GPT once, then calls block with
check=False). There is no cache of passed trees: its key would have to be the tree's structure and every
leaf's shape (ids of containers are reused and rebuilt by torch.func), which is the check itself.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from fmoe._compat import trace_safe_cache
from fmoe.config import GPTConfig, MoEConfig
from fmoe.outline import outline

Path = tuple[str, ...]
CAPACITY_KEYS = ("load_history_W", "capacity_misses", "capacity_steps")


@dataclass(frozen=True)
class Leaf:
    """A tensor leaf: `dims` one (legend name, size) per axis (name "" for a literal size), `kind` the
    dtype class: "float" (floating), "int" (integer, not bool) or "number" (either)."""

    dims: tuple[tuple[str, int], ...]
    kind: str = "float"
    shape: tuple[int, ...] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(n for _, n in self.dims))  # the expected shape

    def describe(self) -> str:
        """The shape as the config gives it, e.g. "[D=8, E=4]"."""
        return "[" + ", ".join(f"{a}={n}" if a else str(n) for a, n in self.dims) + "]"


@dataclass(frozen=True)
class Opt:
    """A dict entry that may be absent; entries with the same `group` are all present or all absent."""

    spec: Spec
    group: str | None = None


@dataclass(frozen=True)
class Nullable:
    """A value that may be None (meaning "the default", e.g. a fresh layer state)."""

    spec: Spec


@dataclass(frozen=True)
class Absent:
    """A dict key the config has none of; `why` says which config field excludes it."""

    why: str


@dataclass(frozen=True)
class Seq:
    """A list of exactly len(items) entries; the message says "has N `noun`, config says `count`"."""

    items: tuple[Spec, ...]
    noun: str
    count: str


Spec = Leaf | Opt | Nullable | Absent | Seq | Mapping[str, Any]
_DTYPE_KIND = {"float": "a floating dtype", "int": "an integer dtype", "number": "a real dtype"}


def _dtype_ok(dtype: torch.dtype, kind: str) -> bool:
    if dtype.is_floating_point:
        return kind != "int"
    return kind != "float" and not dtype.is_complex and dtype != torch.bool


def _at(path: Path) -> str:
    return ".".join(path)


def _fail(what: str, path: Path, message: str) -> None:
    raise ValueError(f"{what}: {_at(path)} {message}" if path else f"{what} {message}")


def _entry(tree: Mapping[str, Any], spec: Mapping[str, Any], key: str, what: str,
           path: Path) -> tuple[Any, Spec] | None:
    """Return (tree[key], its spec), or None when the entry is absent and may be; raise ValueError for a
    required entry that is missing or one the config excludes that is present."""
    entry = spec[key]
    if type(entry) is Absent:
        if key in tree:
            _fail(what, (*path, key), f"is not in the config ({entry.why})")
        return None
    if type(entry) is Opt:
        if key not in tree:
            return None
        entry = entry.spec
    elif key not in tree:
        hint = f", config says {entry.describe()}" if type(entry) is Leaf else ""
        _fail(what, (*path, key), f"is missing{hint}")
    return tree[key], entry


def _check(tree: Any, spec: Spec, what: str, path: Path) -> None:
    """Raise ValueError naming the first leaf of `tree` (at `path`) that does not match `spec`."""
    if type(spec) is Nullable:
        if tree is None:
            return
        spec = spec.spec
    if type(spec) is Leaf:
        if not isinstance(tree, torch.Tensor):
            _fail(what, path, f"must be a tensor {spec.describe()}, got {type(tree).__name__}")
        if tree.shape != spec.shape:
            _fail(what, path, f"has shape {tuple(tree.shape)}, config says {spec.describe()}")
        if not _dtype_ok(tree.dtype, spec.kind):
            _fail(what, path, f"has dtype {tree.dtype}, expected {_DTYPE_KIND[spec.kind]}")
        return
    if type(spec) is Seq:
        if not isinstance(tree, (list, tuple)):
            _fail(what, path, f"must be a list of {len(spec.items)} {spec.noun}, got {type(tree).__name__}")
        if len(tree) != len(spec.items):
            _fail(what, path, f"has {len(tree)} {spec.noun}, config says {spec.count}")
        for i, (item, item_spec) in enumerate(zip(tree, spec.items)):
            _check(item, item_spec, what, (*path, str(i)))
        return
    if type(tree) is not dict and not isinstance(tree, Mapping):
        _fail(what, path, f"must be a dict, got {type(tree).__name__}")
    for key in tree:  # extra entries first: "not in the config (why)" says more than what is then missing
        entry = spec.get(key)
        if entry is None:
            _fail(what, (*path, str(key)), "is not in the config's layout (unexpected key)")
        if type(entry) is Absent:
            _fail(what, (*path, key), f"is not in the config ({entry.why})")
    groups: dict[str, list[str]] = {}
    for key, entry in spec.items():
        if type(entry) is Opt and entry.group is not None:
            groups.setdefault(entry.group, []).append(key)
        found = _entry(tree, spec, key, what, path)
        if found is not None:
            _check(*found, what, (*path, key))
    for group, keys in groups.items():
        present = [k for k in keys if k in tree]
        if present and len(present) != len(keys):
            missing = next(k for k in keys if k not in tree)
            _fail(what, (*path, missing), f"is missing ({group}: {', '.join(keys)} come together)")


def _descend(tree: Any, spec: Spec, what: str, path: Path) -> tuple[Any, Spec] | None:
    """Return (subtree, subspec) at `path`, or None when the config allows it to be absent there."""
    where: list[str] = []
    for key in path:
        if type(spec) is Nullable:
            if tree is None:
                return None
            spec = spec.spec
        if type(spec) is Seq:
            if not isinstance(tree, (list, tuple)):
                _fail(what, tuple(where), f"must be a list of {len(spec.items)} {spec.noun}, "
                                          f"got {type(tree).__name__}")
            i = int(key)
            if i >= len(spec.items):
                _fail(what, (*where, key), f"is not in the config ({spec.count})")
            if i >= len(tree):
                _fail(what, (*where, key), f"is missing ({_at(tuple(where))} has {len(tree)} {spec.noun}, "
                                           f"config says {spec.count})")
            tree, spec = tree[i], spec.items[i]
        else:
            if not isinstance(spec, Mapping) or key not in spec:
                _fail(what, (*where, key), "is not in the config's layout")
            if not isinstance(tree, Mapping):
                _fail(what, tuple(where), f"must be a dict, got {type(tree).__name__}")
            found = _entry(tree, spec, key, what, tuple(where))
            if found is None:
                return None
            tree, spec = found
        where.append(key)
    return tree, spec


def check_tree(tree: Any, spec: Spec, what: str, paths: Iterable[Path] | None = None) -> None:
    """Raise ValueError ("`what`: <leaf path> ...") unless `tree` matches `spec` (module docstring);
    with `paths`, only the subtrees at those key paths are checked. Returns None."""
    if paths is None:
        _check(tree, spec, what, ())
        return
    for path in paths:
        found = _descend(tree, spec, what, tuple(path))
        if found is not None:
            _check(found[0], found[1], what, tuple(path))


# --- specs -------------------------------------------------------------------------------------------


@trace_safe_cache(maxsize=256)
def moe_params_spec(cfg: MoEConfig, num_local_experts: int | None = None) -> Mapping[str, Any]:
    """Return the spec of `fmoe.init_moe(cfg)` params; the routed experts have `num_local_experts`
    (L, default E) experts. Do not mutate the result (it is cached)."""
    D, F, E = cfg.d_model, cfg.d_ff, cfg.num_experts
    ex = ("E", E) if num_local_experts is None or num_local_experts == E else ("L", num_local_experts)
    spec: dict[str, Any] = {
        "router": {"w": Leaf((("D", D), ("E", E)))},
        "experts": {"w_gate_up": Leaf((ex, ("D", D), ("Z", 2 * F))),
                    "w_down": Leaf((ex, ("F", F), ("D", D)))},
    }
    if cfg.num_shared_experts:
        S = cfg.num_shared_experts * cfg.d_ff
        shared: dict[str, Any] = {"w_gate": Leaf((("D", D), ("F", S))), "w_up": Leaf((("D", D), ("F", S))),
                                  "w_down": Leaf((("F", S), ("D", D)))}
        shared["w_out_gate"] = (Leaf((("D", D), ("", 1))) if cfg.shared_expert_gate
                                else Absent("shared_expert_gate=False"))
        spec["shared"] = shared
    else:
        spec["shared"] = Absent("num_shared_experts=0")
    return spec


@trace_safe_cache(maxsize=256)
def moe_state_spec(cfg: MoEConfig) -> Mapping[str, Any]:
    """Return the spec of a layer state (`fmoe.init_moe_state(cfg)`, every entry optional)."""
    spec: dict[str, Any] = {"expert_bias_E": Opt(Leaf((("E", cfg.num_experts),)))}
    W = cfg.dynamic_capacity_window
    for key in CAPACITY_KEYS:
        if not W:
            spec[key] = Absent("dynamic_capacity_window=0")
        else:
            dims = (("W", W),) if key == "load_history_W" else ()
            spec[key] = Opt(Leaf(dims, "int"), group=f"dynamic_capacity_window={W}")
    return spec


MLA_KEYS = ("w_q_a", "q_a_norm", "w_q_b", "w_kv_a", "kv_a_norm", "w_kv_b")


def _attention_spec(cfg: GPTConfig) -> dict[str, Any]:
    if cfg.mla:
        return _mla_spec(cfg)
    D, Hd, Gd = cfg.d_model, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    spec: dict[str, Any] = {"attn_norm": Leaf((("D", D),)), "w_q": Leaf((("D", D), ("H*d", Hd))),
                            "w_k": Leaf((("D", D), ("G*d", Gd))), "w_v": Leaf((("D", D), ("G*d", Gd))),
                            "w_o": Leaf((("H*d", Hd), ("D", D)))}
    for name in ("q_norm", "k_norm"):
        spec[name] = Leaf((("d", cfg.head_dim),)) if cfg.qk_norm else Absent("qk_norm=False")
    spec.update({k: Absent("kv_lora_rank=0") for k in MLA_KEYS})
    return spec


def _mla_spec(cfg: GPTConfig) -> dict[str, Any]:
    """The attention weights of multi-head latent attention (fmoe/mla.py's layout; legend there: Q, C the
    query and key/value latent widths, k = d + r a head's qk width, e its value width)."""
    D, H, Q, C, r = cfg.d_model, cfg.n_heads, cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_rope_head_dim
    Hk, He, Hde = H * cfg.qk_head_dim, H * cfg.o_head_dim, H * (cfg.head_dim + cfg.o_head_dim)
    spec: dict[str, Any] = {"attn_norm": Leaf((("D", D),)),
                            "w_kv_a": Leaf((("D", D), ("C+r", C + r))), "kv_a_norm": Leaf((("C", C),)),
                            "w_kv_b": Leaf((("C", C), ("H*(d+e)", Hde))),
                            "w_o": Leaf((("H*e", He), ("D", D)))}
    if Q:
        spec.update(w_q_a=Leaf((("D", D), ("Q", Q))), q_a_norm=Leaf((("Q", Q),)),
                    w_q_b=Leaf((("Q", Q), ("H*k", Hk))), w_q=Absent(f"q_lora_rank={Q}: w_q_a, w_q_b"))
    else:
        spec.update({k: Absent("q_lora_rank=0") for k in ("w_q_a", "q_a_norm", "w_q_b")})
        spec["w_q"] = Leaf((("D", D), ("H*k", Hk)))
    for name in ("w_k", "w_v"):
        spec[name] = Absent("multi-head latent attention: keys and values from w_kv_a, w_kv_b")
    for name in ("q_norm", "k_norm"):
        spec[name] = Absent("multi-head latent attention")
    return spec


@trace_safe_cache(maxsize=256)
def block_params_spec(cfg: GPTConfig, dense: bool = False,
                      num_local_experts: int | None = None) -> Mapping[str, Any]:
    """Return the spec of `fmoe.block.init_block(cfg, dense=dense)` params (MoE experts: L local)."""
    spec = _attention_spec(cfg)
    D, F = cfg.d_model, cfg.d_ff_dense
    if dense:
        spec["mlp"] = {"norm": Leaf((("D", D),)), "w_gate": Leaf((("D", D), ("F", F))),
                       "w_up": Leaf((("D", D), ("F", F))), "w_down": Leaf((("F", F), ("D", D)))}
        spec["mlp_norm"] = spec["moe"] = Absent("a dense block")
    else:
        spec["mlp_norm"] = Leaf((("D", D),))
        spec["moe"] = moe_params_spec(cfg.moe, num_local_experts)
        spec["mlp"] = Absent("an MoE block")
    return spec


def block_keys(cfg: GPTConfig, dense: bool = False, but: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Returns the top-level keys of one block's params under `cfg` (`block_params_spec`'s present
    entries), less those in `but`: what a phase of the block takes, known without a params tree."""
    spec = block_params_spec(cfg, dense)
    return tuple(k for k, v in spec.items() if type(v) is not Absent and k not in but)


@trace_safe_cache(maxsize=256)
def gpt_params_spec(cfg: GPTConfig, num_local_experts: int | None = None) -> Mapping[str, Any]:
    """Return the spec of `fmoe.init_gpt(cfg)` params (MoE experts: L local)."""
    D, V = cfg.d_model, cfg.vocab_size
    blocks = tuple(block_params_spec(cfg, not site.is_moe, num_local_experts)
                   for site in map(outline(cfg).layer, range(cfg.n_layers)))
    spec: dict[str, Any] = {"embed": {"table": Leaf((("V", V), ("D", D)))},
                            "layers": Seq(blocks, "blocks", f"n_layers={cfg.n_layers}"),
                            "norm": Leaf((("D", D),)), "head": {"w": Leaf((("D", D), ("V", V)))}}
    if cfg.mtp:
        spec["mtp"] = {"hidden_norm": Leaf((("D", D),)), "embed_norm": Leaf((("D", D),)),
                       "w_proj": Leaf((("2D", 2 * D), ("D", D))),
                       "block": block_params_spec(cfg, False, num_local_experts), "norm": Leaf((("D", D),))}
    else:
        spec["mtp"] = Absent("mtp=False")
    return spec


@trace_safe_cache(maxsize=256)
def gpt_state_spec(cfg: GPTConfig) -> Mapping[str, Any]:
    """Return the spec of `fmoe.init_gpt_state(cfg)` (entries may be None: a fresh layer state)."""
    moe_state = Nullable(moe_state_spec(cfg.moe))
    dense = Nullable({k: Absent(f"a dense layer, num_dense_layers={cfg.num_dense_layers}")
                      for k in ("expert_bias_E", *CAPACITY_KEYS)})
    o = outline(cfg)
    layers = tuple(moe_state if o.layer(i).is_moe else dense for i in range(cfg.n_layers))
    return {"layers": Seq(layers, "entries", f"n_layers={cfg.n_layers}"),
            "mtp": Opt(moe_state) if cfg.mtp else Absent("mtp=False")}


# --- checks of the entry points ----------------------------------------------------------------------


def local_experts(dispatcher: Any) -> int | None:
    """Return the dispatcher's `num_local_experts` (None without a dispatcher: all E are local)."""
    return None if dispatcher is None else getattr(dispatcher, "num_local_experts", None)


def check_moe_state(state: Mapping[str, Any] | None, cfg: MoEConfig, what: str = "moe state") -> None:
    """Check a layer state (None passes: it means init_moe_state); raises ValueError."""
    if state is not None:
        check_tree(state, moe_state_spec(cfg), what)


def check_router(params: Mapping[str, Any], cfg: MoEConfig, state: Mapping[str, Any] | None = None) -> None:
    """Check router params ({"w": [D, E]}) and the layer state against `cfg`."""
    check_tree(params, moe_params_spec(cfg)["router"], "router params")
    check_moe_state(state, cfg)


def check_moe(params: Mapping[str, Any], cfg: MoEConfig, state: Mapping[str, Any] | None = None, *,
              num_local_experts: int | None = None, paths: Sequence[Path] | None = None) -> None:
    """Check MoE params (at `paths` only, if given) and the layer state against `cfg`."""
    check_tree(params, moe_params_spec(cfg, num_local_experts), "moe params", paths)
    check_moe_state(state, cfg)


def check_block(params: Mapping[str, Any], cfg: GPTConfig, state: Mapping[str, Any] | None = None, *,
                dense: bool = False, num_local_experts: int | None = None,
                paths: Sequence[Path] | None = None) -> None:
    """Check one block's params (at `paths` only, if given) and, for an MoE block, its layer state."""
    check_tree(params, block_params_spec(cfg, dense, num_local_experts), "block params", paths)
    if not dense:
        check_moe_state(state, cfg.moe)


def check_gpt_state(state: Mapping[str, Any] | None, cfg: GPTConfig,
                    paths: Sequence[Path] | None = None) -> None:
    """Check a GPT state (None passes: it means init_gpt_state), at `paths` only if given."""
    if state is not None:
        check_tree(state, gpt_state_spec(cfg), "gpt state", paths)


def check_gpt(params: Mapping[str, Any], cfg: GPTConfig, state: Mapping[str, Any] | None = None, *,
              num_local_experts: int | None = None, paths: Sequence[Path] | None = None) -> None:
    """Check GPT params and state against `cfg`. With `paths` (param paths such as ("layers", "3") or
    ("mtp",)), only those subtrees of the params and the matching layer states are checked."""
    check_tree(params, gpt_params_spec(cfg, num_local_experts), "gpt params", paths)
    state_paths = None
    if paths is not None:
        state_paths = [p[:2] for p in paths if p[0] == "layers" and len(p) > 1] + (
            [("mtp",)] if any(p[0] == "mtp" for p in paths) else [])
    check_gpt_state(state, cfg, state_paths)
