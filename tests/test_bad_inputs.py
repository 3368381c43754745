"""Inputs that used to end in a torch, JSON, TOML or Key error that did not name the user's mistake (issue
48's study) now fail in one line that names it. Each case is reproduced as the user met it (a command
line, a file, a call) and checked for the line, before any process starts where the input enters there.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fmoe._compat import tree_flatten
from fmoe.cli.main import main, negatives_as_values


def _one_line(capsys: pytest.CaptureFixture, argv: list[str], code: int = 2) -> str:
    got = main(argv)
    out = capsys.readouterr()
    lines = [ln for ln in (out.out + out.err).splitlines() if ln.strip()]
    assert got == code and len(lines) == 1, (argv, got, lines)
    return lines[0]


@pytest.mark.parametrize("flags, needle", [
    (["--lr", "inf"], "--lr must be a finite number, got inf"),
    (["--lr", "nan"], "--lr must be a finite number, got nan"),
    (["--adam-eps", "-inf"], "--adam-eps must be a finite number, got -inf"),
    (["--lr-warmup-init", "-1e-3"], "--lr-warmup-init must lie in [0, --lr 0.003], got -0.001"),
    (["--seed", str(2**63)], f"--seed must lie in [0, 2**40), got {2**63}"),
])
def test_a_bad_number_is_named_before_launch(capsys, no_launch: None, flags: list[str], needle: str) -> None:
    line = _one_line(capsys, ["train", "--no-progress", *flags])
    assert line == f"fmoe train: error: {needle}", line


def test_negative_numbers_after_a_flag_are_its_values() -> None:
    assert negatives_as_values(["train", "--lr-warmup-init", "-1e-3", "--steps", "-5", "--x", "-.5E+2"]) == [
        "train", "--lr-warmup-init=-1e-3", "--steps=-5", "--x=-.5E+2"]
    plain = ["train", "--no-progress", "--pp", "1"]
    assert negatives_as_values(plain) == plain


def test_a_toml_file_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    from fmoe.train.config import TrainConfig

    toml = tmp_path / "run.toml"
    toml.write_bytes(b"\xef\xbb\xbfsteps = 7\n")  # what Windows editors save as "UTF-8"
    assert TrainConfig.from_sources("tiny", str(toml)).steps == 7


NOT_OBJECTS = [("{not json", "is not JSON"), ("[1, 2]", "must hold a JSON object"),
               ('"qwen3"', "must hold a JSON object")]


@pytest.mark.parametrize("text, needle", NOT_OBJECTS)
def test_a_damaged_meta_json_names_the_file(tmp_path: Path, text: str, needle: str) -> None:
    from fmoe.train.checkpoint import CheckpointError, read_meta

    (tmp_path / "meta.json").write_text(text)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'meta.json'} {needle}"):
        read_meta(tmp_path)


@pytest.mark.parametrize("text, needle", NOT_OBJECTS)
def test_an_hf_config_that_is_no_json_object_names_the_file(tmp_path: Path, capsys, text: str,
                                                           needle: str) -> None:
    (tmp_path / "config.json").write_text(text)
    line = _one_line(capsys, ["convert", "hf-to-fmoe", "--hf", str(tmp_path), "--save", str(tmp_path / "s")])
    assert f"{tmp_path / 'config.json'} " in line and needle in line, line


def test_a_truncated_safetensors_file_names_the_file(tmp_path: Path) -> None:
    import safetensors.torch
    import torch

    from fmoe.hf.files import read_state_dict

    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file({"w": torch.ones(64, 64)}, str(path))
    path.write_bytes(path.read_bytes()[:100])  # a download cut short
    with pytest.raises(ValueError, match=f"{path} is not a readable safetensors file"):
        read_state_dict(tmp_path)


def _tiny_gpt():
    import torch

    import fmoe
    from fmoe.config import GPTConfig, MoEConfig

    cfg = GPTConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff_dense=32, num_dense_layers=0,
                    moe=MoEConfig(d_model=16, d_ff=16, num_experts=4, top_k=2))
    return cfg, fmoe.init_gpt(cfg, torch.Generator().manual_seed(0), dtype=torch.float64)


def test_gpt_loss_refuses_targets_of_another_shape() -> None:
    import torch

    from fmoe.model import gpt_loss

    cfg, params = _tiny_gpt()
    ids = torch.randint(0, 32, (2, 8))
    for targets in (ids[:, :4], ids.reshape(-1)):  # the second one used to train on silently
        with pytest.raises(ValueError, match=r"targets_BS must have ids_BS's shape \[B, S\] = \(2, 8\)"):
            gpt_loss(params, ids, targets, cfg)


def test_block_names_an_input_dtype_other_than_the_params() -> None:
    import torch

    from fmoe.model import block

    cfg, params = _tiny_gpt()
    with pytest.raises(ValueError, match="block: the input is torch.float32 but the params are torch.float6"):
        block(params["layers"][0], torch.randn(2, 8, 16), cfg)


def test_remat_suggests_the_policy_meant() -> None:
    import torch

    from fmoe.transforms import remat

    with pytest.raises(ValueError, match="unknown policy 'nothing' .did you mean 'nothing_saveable'.."):
        remat(lambda x: x * 2, policy="nothing")(torch.ones(2, requires_grad=True))


@pytest.mark.parametrize("shape, hint", [(3, r"write \(3,\)"), ("ab", "got 'ab'"),
                                         ([2, 3], r"write \(2, 3\)")])
def test_test_strategies_name_a_shape_that_is_none(shape: object, hint: str) -> None:
    from fmoe.transforms.testing import param_pytrees, tensors

    with pytest.raises(TypeError, match=f"param_pytrees: shapes\\['w'\\] must be a shape.*{hint}"):
        param_pytrees({"w": shape})
    if not isinstance(shape, list):  # tensors takes any sequence of ints
        with pytest.raises(TypeError, match=f"tensors: shape must be a shape.*{hint}"):
            tensors(shape)


def test_init_gpt_shard_names_a_bad_share_or_a_holds_that_matches_nothing() -> None:
    from fmoe.gpt_init import init_gpt_shard

    cfg, _ = _tiny_gpt()
    for tp in ((0, 0), (2, 2), (-1, 1)):
        with pytest.raises(ValueError, match=r"init_gpt_shard: tp must be \(rank, size\)"):
            init_gpt_shard(cfg, 0, tp=tp)
    with pytest.raises(ValueError, match=r"holds \[\('layer', '0'\)\] match no parameter path"):
        init_gpt_shard(cfg, 0, holds=[("layer", "0")])  # "layers"
    held = init_gpt_shard(cfg, 0, holds=[("layers", "0")])
    import torch

    leaves = lambda tree: [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor)]  # noqa: E731
    assert not any(t.is_meta for t in leaves(held["layers"][0]))
    assert all(t.is_meta for t in leaves(held["layers"][1]))


def test_split_vjp_with_has_aux_needs_a_pair() -> None:
    import torch

    from fmoe.transforms import split_vjp

    for engine in ("func", "autograd"):  # a [2] tensor used to unpack into out = x[0], aux = x[1]
        with pytest.raises(TypeError, match=r"\(has_aux=True\): f must return \(output, aux\), got a Tensor"):
            split_vjp(lambda p, x: p * x, torch.ones(2), torch.ones(2), has_aux=True, engine=engine)


RUN = {"pp": 1, "ep": 1, "num_layers": 2, "seq_length": 16, "global_batch_size": 8, "steps": 1,
       "progress": False, "device": "cpu", "lr_warmup_iters": 0, "markov_sequences": 256,
       "keep_host_memory": False}


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (a disk that is always full)")
@pytest.mark.parametrize("flag, path", [("metrics", "/dev/full"), ("tensorboard_dir", "/dev/full/tb")])
def test_an_output_that_cannot_be_written_is_named(capsys, flag: str, path: str) -> None:
    from fmoe.train.config import TrainConfig
    from fmoe.train.launch import launch

    assert launch(TrainConfig(**RUN, **{flag: path})) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    named = f"fmoe train: error: --{flag.replace('_', '-')} {path}: cannot write ("
    assert len(err) == 1 and err[0].startswith(named), err


def test_tensorboard_missing_in_the_ranks_is_named(monkeypatch) -> None:
    import sys

    from fmoe.train.config import TrainConfig
    from fmoe.train.log_backends import LogBackends
    from fmoe.train.run_errors import RunError

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # importable at launch, not here
    with pytest.raises(RunError, match="--tensorboard-dir: rank 0 cannot import torch.utils.tensorboard .* "
                                       "the ranks run another Python environment"):
        LogBackends.open(TrainConfig(tensorboard_dir="tb"), 0)


def test_a_checkpoint_without_the_runs_moe_state_loads_fresh_or_is_named(tmp_path: Path, capsys) -> None:
    """Trained without the aux-loss-free bias or dynamic capacity: a --load starts that state fresh (it
    failed with DCP's "Missing key"), a --resume is refused naming the flag, another window's history is
    named (a "Size mismatch" before)."""
    from fmoe.train.config import TrainConfig
    from fmoe.train.launch import launch

    plain, windowed = tmp_path / "plain", tmp_path / "windowed"
    assert launch(TrainConfig(**RUN, save=str(plain))) == 0
    assert launch(TrainConfig(**RUN, save=str(windowed), moe_dynamic_capacity_window=2)) == 0
    capsys.readouterr()
    later = {**RUN, "steps": 2, "override_opt_param_scheduler": True}
    assert launch(TrainConfig(**later, load=str(plain), moe_router_bias_update_rate=1e-3)) == 0
    assert launch(TrainConfig(**later, load=str(plain), moe_dynamic_capacity_window=2)) == 0
    capsys.readouterr()
    assert launch(TrainConfig(**later, save=str(plain), resume=True, moe_router_bias_update_rate=1e-3)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "has no moe_state/" in err[0] and "expert_bias_E" in err[0], err
    assert "--moe-router-bias-update-rate" in err[0] and "give --load" in err[0], err
    assert launch(TrainConfig(**later, load=str(windowed), moe_dynamic_capacity_window=3)) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "load_history_W of size (2,), this run's is (3,)" in err[0], err
    assert "--moe-dynamic-capacity-window it was trained with" in err[0], err


# ---- a user's router, experts or attention returning what the layer cannot read -------------------------

def _route_then(change):
    from fmoe.router import route

    def router(p, x, cfg, state=None, seq_len=None):
        return change(route(p, x, cfg, state, seq_len))
    return router


def _experts_then(change):
    from fmoe.experts import routed_experts

    return lambda p, x, c, probs, backend: change(routed_experts(p, x, c, probs, backend))


def _attention_then(change):
    from fmoe.ops import attention

    def core(q, k, v, *, rope_theta, causal):
        return change(attention(q, k, v, rope_theta=rope_theta, causal=causal))
    return core


def _seamed_loss(**seams) -> None:
    import torch

    import fmoe
    from fmoe.config import GPTConfig, MoEConfig
    from fmoe.model import gpt_loss

    moe = MoEConfig(d_model=16, d_ff=16, num_experts=4, top_k=2, router=seams.get("router"),
                    experts=seams.get("experts"))
    cfg = GPTConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, d_ff_dense=32, num_dense_layers=0,
                    moe=moe, attention=seams.get("attention"))
    ids = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(0))
    gpt_loss(fmoe.init_gpt(cfg, torch.Generator().manual_seed(0)), ids, ids, cfg)


def _counts_zero(r):
    import dataclasses

    import torch

    return dataclasses.replace(r, counts_E=torch.zeros_like(r.counts_E))


def _probs_nan(r):
    import dataclasses

    return dataclasses.replace(r, probs_TK=r.probs_TK * float("nan"))


@pytest.mark.parametrize("seam, change, error, needle", [
    ("router", _counts_zero, ValueError, "returned counts_E that disagree with its ids_TK"),
    ("router", _probs_nan, ValueError, r"returned gate weights \(probs_TK\) that are not finite"),
    ("router", lambda r: None, TypeError, "returned a NoneType; it must return a fmoe.router.Routing"),
    ("experts", lambda y: (y,), TypeError, r"returned a tuple; it must return y_MD, a tensor of shape"),
    ("experts", lambda y: None, TypeError, "returned a NoneType; it must return y_MD"),
    ("experts", lambda y: y[:-1], ValueError, r"returned y_MD of shape \[31, 16\]; it must be \[32, 16\]"),
    ("experts", lambda y: y[:, :8], ValueError, r"returned y_MD of shape \[32, 8\]"),
    ("experts", lambda y: y.double(), ValueError, "returned y_MD of dtype torch.float64; it must keep its"),
    ("attention", lambda o: (o, None), TypeError, r"returned a tuple; it must return o_BSHd"),
    ("attention", lambda o: o[:, :-1], ValueError, r"returned o_BSHd of shape \[2, 7, 2, 8\]; it must be "),
    ("attention", lambda o: o.double(), ValueError, "returned o_BSHd of dtype torch.float64"),
])
def test_a_seam_returning_what_the_layer_cannot_read_is_named(seam: str, change, error: type,
                                                              needle: str) -> None:
    wrap = {"router": _route_then, "experts": _experts_then, "attention": _attention_then}[seam]
    with pytest.raises(error, match=f"{seam} '.*' {needle}"):
        _seamed_loss(**{seam: wrap(change)})
