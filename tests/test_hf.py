"""Hugging Face import / export (fmoe/hf) against transformers' own Qwen3-MoE and Mixtral.

Oracles: transformers' models, built from small configs (no download), every weight re-drawn from a seed
(norm gains around 1, routers spread enough that top-k choices matter), saved with save_pretrained.
fmoe's logits of the imported checkpoint match transformers' to ATOL in fp32 (measured: at most 1.5e-6
with logits of std 1); the export loads in transformers with identical tensors and identical logits.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from fmoe.cli.main import main as fmoe_main
from fmoe.config import GPTConfig, MoEConfig
from fmoe.hf import config_from_hf, config_to_hf, load_hf, params_from_hf, read_config, save_hf
from fmoe.hf.checkpoint import load_fmoe, one_process
from fmoe.hf.config_map import DEFAULTS
from fmoe.model import gpt_logits
from fmoe.train.checkpoint import CheckpointError

ATOL = 1e-5
V, S = 64, 12
CLASSES = {"qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM), "mixtral": (MixtralConfig, MixtralForCausalLM)}


def _hf_config(arch: str, **changes: Any) -> Any:
    """A small config: head_dim 16 != hidden / heads = 8, GQA, non-default eps and RoPE base."""
    common = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    if arch == "qwen3_moe":
        kw = dict(common, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3, num_experts=4,
                  num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[0])
    else:
        kw = dict(common, intermediate_size=16, num_hidden_layers=2, num_local_experts=4,
                  num_experts_per_tok=2)
    return CLASSES[arch][0](**{**kw, **changes})


def _hf_model(arch: str, seed: int = 0, **changes: Any) -> torch.nn.Module:
    """A transformers model of `_hf_config(arch, **changes)` with every weight drawn from `seed`."""
    model = CLASSES[arch][1](_hf_config(arch, **changes))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.3 * r)  # not ones: a norm mapped to the wrong place shows
            elif name.endswith("embed_tokens.weight"):
                p.copy_(r)
            else:
                p.copy_(r / math.sqrt(p.shape[-1]))  # fan-in scaled, so activations stay O(1)
    return model.eval()


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, V, (2, S), generator=torch.Generator().manual_seed(seed))


def _hf_logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def _saved(model: torch.nn.Module, path: Path) -> Path:
    model.save_pretrained(path)
    return path


CASES = {  # name -> (arch, config changes): top-k 1, 2 and E; Qwen3 with and without renormalisation
    "qwen3_k2_norm_dense0": ("qwen3_moe", {}),
    "qwen3_k1_no_norm": ("qwen3_moe", {"num_experts_per_tok": 1, "norm_topk_prob": False,
                                       "mlp_only_layers": []}),
    "qwen3_kE_two_dense": ("qwen3_moe", {"num_experts_per_tok": 4, "mlp_only_layers": [0, 1]}),
    "qwen3_k2_no_norm": ("qwen3_moe", {"norm_topk_prob": False}),
    "mixtral_k2": ("mixtral", {}),
    "mixtral_k1": ("mixtral", {"num_experts_per_tok": 1}),
    "mixtral_kE": ("mixtral", {"num_experts_per_tok": 4}),
}


@pytest.mark.parametrize("case", CASES)
def test_imported_logits_match_and_the_export_loads_identically(case: str, tmp_path: Path) -> None:
    arch, changes = CASES[case]
    model = _hf_model(arch, **changes)
    cfg, params = load_hf(_saved(model, tmp_path / "hf"))
    ids = _ids()
    want = _hf_logits(model, ids)
    got = gpt_logits(params, ids, cfg)
    assert got.shape == want.shape == (2, S, V)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    assert cfg.num_dense_layers == len(changes.get("mlp_only_layers", [0] if arch == "qwen3_moe" else []))

    back = AutoModelForCausalLM.from_pretrained(save_hf(tmp_path / "out", cfg, params, arch)).eval()
    assert type(back) is type(model)
    mine, theirs = back.state_dict(), model.state_dict()
    assert mine.keys() == theirs.keys()
    for k in theirs:
        assert torch.equal(mine[k], theirs[k]), k
    assert torch.equal(_hf_logits(back, ids), want)


def test_the_logit_comparison_sees_each_mapped_detail(tmp_path: Path) -> None:
    """Each detail the mapping must get right moves the logits by far more than ATOL when wrong."""
    model = _hf_model("qwen3_moe", num_experts_per_tok=3)
    cfg, params = load_hf(_saved(model, tmp_path / "hf"))
    ids = _ids()
    want = _hf_logits(model, ids)
    layer = params["layers"][1]
    swapped_norms = {**layer, "q_norm": layer["k_norm"], "k_norm": layer["q_norm"]}
    gate_up = layer["moe"]["experts"]["w_gate_up"]
    half = gate_up.shape[-1] // 2
    swapped_ffn = {**layer, "moe": {**layer["moe"], "experts": {
        **layer["moe"]["experts"], "w_gate_up": torch.cat([gate_up[..., half:], gate_up[..., :half]], -1)}}}
    wrong = {
        "topk_norm": (replace(cfg, moe=cfg.moe.replace(topk_norm="before")), params),
        "rope_theta": (replace(cfg, rope_theta=1e4), params),
        "norm_eps": (replace(cfg, norm_eps=1e-1), params),
        "q/k norms swapped": (cfg, {**params, "layers": [params["layers"][0], swapped_norms,
                                                         *params["layers"][2:]]}),
        "gate/up swapped": (cfg, {**params, "layers": [params["layers"][0], swapped_ffn,
                                                       *params["layers"][2:]]}),
    }
    for what, (c, p) in wrong.items():
        assert (gpt_logits(p, ids, c) - want).abs().max() > 100 * ATOL, what


def test_config_objects_fused_state_dicts_and_sharded_files(tmp_path: Path) -> None:
    """A transformers config object maps like its config.json; the fused experts of a live model's
    state_dict import like the files' per-expert tensors; shards with an index go both ways."""
    model = _hf_model("mixtral")
    hf_dir = _saved(model, tmp_path / "hf")
    cfg, params = load_hf(hf_dir)
    assert config_from_hf(model.config) == cfg
    live = params_from_hf(model.state_dict(), cfg, "mixtral")
    torch.testing.assert_close(live, params, atol=0, rtol=0)

    out = save_hf(tmp_path / "sharded", cfg, params, "mixtral", base_config=read_config(hf_dir),
                  max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2
    assert not (out / "model.safetensors").exists()
    cfg2, params2 = load_hf(out)
    assert cfg2 == cfg
    torch.testing.assert_close(params2, params, atol=0, rtol=0)
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.config.bos_token_id == model.config.bos_token_id  # an unmapped field carried by the base
    assert torch.equal(_hf_logits(back, _ids()), _hf_logits(model, _ids()))
    with pytest.raises(FileExistsError, match="already holds a checkpoint"):
        save_hf(out, cfg, params, "mixtral")


def test_tied_embeddings_import_as_an_untied_copy(tmp_path: Path) -> None:
    model = _hf_model("qwen3_moe", tie_word_embeddings=True)
    hf_dir = _saved(model, tmp_path / "hf")
    cfg, params = load_hf(hf_dir)
    assert torch.equal(params["head"]["w"], params["embed"]["table"].t())
    assert params["head"]["w"].data_ptr() != params["embed"]["table"].data_ptr()
    torch.testing.assert_close(gpt_logits(params, _ids(), cfg), _hf_logits(model, _ids()), atol=ATOL, rtol=0)
    assert config_to_hf(cfg, "qwen3_moe")["tie_word_embeddings"] is False


def test_bfloat16_weights_keep_their_dtype_or_cast(tmp_path: Path) -> None:
    model = _hf_model("mixtral").to(torch.bfloat16)
    hf_dir = _saved(model, tmp_path / "hf")
    assert read_config(hf_dir)["dtype"] == "bfloat16"
    _, params = load_hf(hf_dir)
    assert params["layers"][0]["moe"]["experts"]["w_gate_up"].dtype == torch.bfloat16
    cfg, params32 = load_hf(hf_dir, dtype=torch.float32)
    assert params32["norm"].dtype == torch.float32
    out = save_hf(tmp_path / "out", cfg, params, "mixtral")
    assert read_config(out)["dtype"] == "bfloat16"


REFUSED_IMPORTS = [  # (arch, config.json changes, the field the message names)
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 8}, "use_sliding_window"),
    ("qwen3_moe", {"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ("qwen3_moe", {"mlp_only_layers": [1]}, "mlp_only_layers"),
    ("qwen3_moe", {"attention_bias": True}, "attention_bias"),
    ("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen3_moe", {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "rope_parameters.rope_type"),
    ("qwen3_moe", {"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
     "rope_scaling.rope_type"),
    ("mixtral", {"sliding_window": 16}, "sliding_window"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("mixtral", {"attention_dropout": 0.1}, "attention_dropout"),
    ("mixtral", {"model_type": "llama"}, "model_type"),
]


@pytest.mark.parametrize(("arch", "changes", "field"), REFUSED_IMPORTS)
def test_what_cannot_be_mapped_exactly_is_refused_naming_the_field(arch: str, changes: dict,
                                                                   field: str) -> None:
    hf = {**_hf_config(arch).to_dict(), **changes}
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        config_from_hf(hf)


def _gpt(**changes: Any) -> GPTConfig:
    moe = MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2, **changes.pop("moe", {}))
    return GPTConfig(vocab_size=V, d_model=16, n_layers=2, n_heads=2, moe=moe, **changes)


REFUSED_EXPORTS = [  # (arch, GPTConfig changes, the field the message names)
    ("mixtral", {"moe": {"num_shared_experts": 1}}, "MoEConfig.num_shared_experts"),
    ("mixtral", {"mtp": True}, "GPTConfig.mtp"),
    ("mixtral", {"moe": {"capacity_factor": 1.0}}, "MoEConfig.capacity_factor"),
    ("mixtral", {"moe": {"score_func": "sigmoid"}}, "MoEConfig.score_func"),
    ("mixtral", {"moe": {"bias_update_rate": 0.1}}, "MoEConfig.bias_update_rate"),
    ("mixtral", {"moe": {"topk_norm": "before"}}, "MoEConfig.topk_norm"),
    ("mixtral", {"num_dense_layers": 1}, "GPTConfig.num_dense_layers"),
    ("mixtral", {"qk_norm": True}, "GPTConfig.qk_norm"),
    ("qwen3_moe", {}, "GPTConfig.qk_norm"),
    ("qwen3_moe", {"qk_norm": True, "moe": {"num_groups": 2, "topk_groups": 1}}, "MoEConfig.topk_groups"),
]


@pytest.mark.parametrize(("arch", "changes", "field"), REFUSED_EXPORTS)
def test_exports_refuse_what_the_architecture_lacks(arch: str, changes: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        config_to_hf(_gpt(**changes), arch)


@pytest.mark.parametrize("arch", DEFAULTS)
def test_the_defaults_for_absent_fields_are_transformers_own(arch: str) -> None:
    d = CLASSES[arch][0]().to_dict()
    d.setdefault("num_experts", d.get("num_local_experts"))  # qwen3_moe writes num_local_experts
    for name, value in DEFAULTS[arch].items():
        have = d["rope_parameters"]["rope_theta"] if name == "rope_theta" else d[name]
        assert have == value, name


def test_hub_style_fields_map_like_transformers_5_ones() -> None:
    """Hub config.json files of transformers 4 spell RoPE as rope_theta / rope_scaling and Qwen3's expert
    count as num_experts; absent fields take the class defaults."""
    new = _hf_config("qwen3_moe").to_dict()
    old = {k: v for k, v in new.items() if k not in ("rope_parameters", "num_local_experts", "head_dim")}
    old.update(rope_theta=5e5, rope_scaling=None, num_experts=4, head_dim=16)
    assert config_from_hf(old) == config_from_hf(new)
    bare = {"model_type": "mixtral", "hidden_size": 64, "num_attention_heads": 8}
    cfg = config_from_hf(bare)
    assert (cfg.rope_theta, cfg.norm_eps, cfg.moe.num_experts, cfg.n_kv_heads, cfg.head_dim) == (
        1e6, 1e-5, 8, 8, 8)


def test_cli_round_trip_through_an_fmoe_checkpoint(tmp_path: Path, capsys) -> None:
    """hf-to-fmoe writes fmoe train's format (verified load, same params); fmoe-to-hf gives back the same
    tensors and config; fmoe train's --load refuses it when its flags build another model (model.toml
    with --no-qk-layernorm: no q / k norms)."""
    model = _hf_model("qwen3_moe")
    hf_dir = _saved(model, tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    assert fmoe_main(["convert", "hf-to-fmoe", "--hf", str(hf_dir), "--save", str(ckpt)]) == 0
    assert f"train from it: fmoe train --config {ckpt / 'model.toml'}" in capsys.readouterr().out
    cfg, params = load_hf(hf_dir)
    cfg2, params2, meta = load_fmoe(ckpt)
    assert cfg2 == cfg and meta["hf_config"]["model_type"] == "qwen3_moe"
    torch.testing.assert_close(params2, params, atol=0, rtol=0)
    assert fmoe_main(["convert", "hf-to-fmoe", "--hf", str(hf_dir), "--save", str(ckpt)]) == 2
    assert "already holds checkpoints" in capsys.readouterr().out

    out = tmp_path / "out"
    assert fmoe_main(["convert", "fmoe-to-hf", "--load", str(ckpt), "--out", str(out)]) == 0
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    mine, theirs = back.state_dict(), model.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in theirs)
    original, exported = read_config(hf_dir), read_config(out)
    for k in ("hidden_size", "head_dim", "rms_norm_eps", "rope_parameters", "norm_topk_prob",
              "mlp_only_layers", "max_position_embeddings", "moe_intermediate_size", "intermediate_size"):
        assert exported[k] == original[k], k
    assert fmoe_main(["convert", "fmoe-to-hf", "--load", str(ckpt), "--out", str(tmp_path / "m"),
                      "--arch", "mixtral"]) == 2
    assert "GPTConfig.qk_norm=True cannot be exported: mixtral" in capsys.readouterr().out

    from fmoe.train.config import TrainConfig, read_toml
    from fmoe.train.loop import Trainer, World

    tc = TrainConfig.build({**read_toml(str(ckpt / "model.toml")), "pp": 1, "ep": 1, "progress": False,
                            "qk_layernorm": False})
    with one_process(), pytest.raises(CheckpointError, match="qk_norm: checkpoint True, this run False"):
        Trainer(tc, World(0, 1, None, torch.device("cpu"))).load(str(ckpt / "step_00000000"))


def test_fmoe_train_starts_from_a_converted_checkpoint(tmp_path: Path) -> None:
    """A Mixtral that fmoe train's flags can build (RoPE base 1e4, eps 1e-6, head_dim = hidden / heads)
    loads into a Trainer with the converted model.toml: its weights are the HF ones, and it trains."""
    model = _hf_model("mixtral", head_dim=None, rms_norm_eps=1e-6,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e4})
    hf_dir = _saved(model, tmp_path / "hf")
    ckpt = tmp_path / "ckpt"
    assert fmoe_main(["convert", "hf-to-fmoe", "--hf", str(hf_dir), "--save", str(ckpt)]) == 0
    cfg, params = load_hf(hf_dir)

    from fmoe.train.config import TrainConfig, read_toml
    from fmoe.train.loop import Trainer, World

    flags = {"pp": 1, "ep": 1, "progress": False, "seq_length": 8, "micro_batch_size": 2,
             "global_batch_size": 2, "markov_sequences": 16, "steps": 2, "keep_host_memory": False}
    tc = TrainConfig.build({**read_toml(str(ckpt / "model.toml")), **flags})
    assert tc.model() == replace(cfg, moe=cfg.moe.replace(aux_loss_coef=tc.moe_aux_loss_coeff))
    with one_process():
        trainer = Trainer(tc, World(0, 1, None, torch.device("cpu")))
        trainer.load(str(ckpt / "step_00000000"))
        torch.testing.assert_close(trainer.params, params, atol=0, rtol=0)
        assert trainer.step_done == 0
        metrics = trainer.step()
    assert math.isfinite(metrics["loss"]) and metrics["step"] == 1


@pytest.mark.parametrize("size", [0, -1])
def test_a_non_positive_shard_size_is_refused(tmp_path: Path, capsys, size: int) -> None:
    """--max-shard-bytes 0 or -1 wrote one safetensors file per tensor: refused in one line, before the
    checkpoint is read, and by save_hf itself."""
    out = tmp_path / "out"
    code = fmoe_main(["convert", "fmoe-to-hf", "--load", str(tmp_path / "none"), "--out", str(out),
                      "--max-shard-bytes", str(size)])
    text = capsys.readouterr().out.strip()
    want = f"fmoe convert: error: --max-shard-bytes must be a positive number of bytes, got {size}"
    assert code == 2 and text == want, text
    with pytest.raises(ValueError, match=f"max_shard_bytes .* must be a positive number of bytes, got "
                                         f"{size}"):
        save_hf(out, None, {}, "qwen3_moe", max_shard_bytes=size)
    assert not out.exists()


def test_the_converter_imports_nothing_a_checkpoint_names(tmp_path: Path, capsys, monkeypatch) -> None:
    """A checkpoint whose model has a router import path: fmoe-to-hf refuses it (an HF checkpoint holds the
    default router only) before importing the module the path names."""
    from fmoe import init_gpt
    from fmoe.hf.checkpoint import save_fmoe
    from fmoe.import_path import load

    (tmp_path / "seam_mark.py").write_text(
        "import pathlib\npathlib.Path(__file__).with_suffix('.imported').touch()\n"
        "from fmoe.router import route\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, num_dense_layers=1,
                    moe=MoEConfig(d_model=16, d_ff=8, num_experts=4, top_k=2, router="seam_mark:route"))
    ckpt = save_fmoe(tmp_path / "ckpt", cfg, init_gpt(cfg, torch.Generator().manual_seed(0)))
    marker = tmp_path / "seam_mark.imported"
    marker.unlink()  # building cfg imported it; forget that import
    monkeypatch.delitem(__import__("sys").modules, "seam_mark")
    load.cache_clear()
    code = fmoe_main(["convert", "fmoe-to-hf", "--load", str(ckpt), "--out", str(tmp_path / "out"),
                      "--arch", "qwen3_moe"])
    text = capsys.readouterr().out.strip()
    assert code == 2 and "--router 'seam_mark:route'" in text and "imports nothing a checkpoint names" in text
    assert not marker.exists()
