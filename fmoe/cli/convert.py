"""Convert Hugging Face MoE checkpoints (Qwen3-MoE, Mixtral) to fmoe train checkpoints and back.

Examples:
  fmoe convert hf-to-fmoe --hf Qwen3-30B-A3B --save ckpt     # ckpt/step_00000000 + ckpt/model.toml
  fmoe train --config ckpt/model.toml --load ckpt --save run ...    # train from it
  fmoe convert fmoe-to-hf --load run --out hf_out             # from_pretrained("hf_out") loads it
  fmoe convert fmoe-to-hf --load ckpt2 --out hf_out --arch qwen3_moe  # a model not imported from HF
"""

from __future__ import annotations

import argparse
from typing import Any

from fmoe.hf.config_map import ARCHS

DTYPES = ("float32", "bfloat16", "float64")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers `fmoe convert hf-to-fmoe` and `fmoe convert fmoe-to-hf` on `parser`."""
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = __doc__
    sub = parser.add_subparsers(dest="direction", required=True)
    to_fmoe = sub.add_parser("hf-to-fmoe", help="an HF checkpoint directory -> an fmoe --save directory")
    to_fmoe.add_argument("--hf", required=True, help="HF checkpoint directory (config.json, *.safetensors)")
    to_fmoe.add_argument("--save", required=True, help="fmoe checkpoint directory to write (train --load)")
    to_fmoe.add_argument("--dtype", choices=DTYPES, default="float32",
                         help="weights' dtype (fmoe train --dtype; float32 also for --bf16 mixed precision)")
    to_fmoe.add_argument("--overwrite-save", action="store_true",
                         help="replace the checkpoints already in --save (refused without it)")
    to_hf = sub.add_parser("fmoe-to-hf", help="an fmoe checkpoint -> an HF checkpoint directory")
    to_hf.add_argument("--load", required=True, help="fmoe checkpoint (or --save directory: its latest)")
    to_hf.add_argument("--out", required=True, help="HF checkpoint directory to write")
    to_hf.add_argument("--arch", choices=ARCHS, help="HF architecture (default: the imported one's)")
    to_hf.add_argument("--max-shard-bytes", type=int, default=5 * 2**30, help="safetensors shard size")
    to_hf.add_argument("--overwrite", action="store_true", help="replace a checkpoint already in --out")


def _train_flags(fields: dict[str, Any]) -> str:
    """The `fmoe train` flags of TrainConfig model fields, e.g. "--num-layers 4 --no-mtp"."""
    out = []
    for k, v in fields.items():
        flag = "--" + k.replace("_", "-")
        out.append((flag if v else f"--no-{flag[2:]}") if isinstance(v, bool) else f"{flag} {v}")
    return " ".join(out)


def _toml(fields: dict[str, Any]) -> str:
    def value(v: Any) -> str:
        return str(v).lower() if isinstance(v, bool) else f'"{v}"' if isinstance(v, str) else str(v)
    return "# written by fmoe convert: the model of this checkpoint\n" + "".join(
        f"{k} = {value(v)}\n" for k, v in fields.items())


def _hf_to_fmoe(args: argparse.Namespace) -> int:
    import torch

    from fmoe.hf.checkpoint import gpt_config_dict, save_fmoe, train_fields
    from fmoe.hf.files import load_hf, read_config
    from fmoe.train import save_dir
    from fmoe.train.checkpoint import architecture_diff

    dtype = getattr(torch, args.dtype)
    cfg, params = load_hf(args.hf, dtype=dtype)
    handle = save_dir.claim(args.save, resume=False, overwrite=args.overwrite_save, load=None)
    try:
        path = save_fmoe(args.save, cfg, params, hf_config=read_config(args.hf))
    finally:
        handle.close()
    fields = train_fields(cfg, dtype)
    (path.parent / "model.toml").write_text(_toml(fields))
    print(f"fmoe convert: wrote {path}")
    missing = architecture_diff(gpt_config_dict(cfg), fields)
    if missing:
        print(f"note: fmoe train's flags cannot build this model ({'; '.join(missing)}), so `fmoe train "
              "--load` refuses this checkpoint; fmoe.hf.load_hf and fmoe.gpt_logits run it, `fmoe convert "
              "fmoe-to-hf` exports it")
    else:
        print(f"train from it: {train_command(str(path.parent / 'model.toml'), args.save)} "
              f"(or the model's flags {_train_flags(fields)})")
    return 0


# layouts the printed command may add, tried in order: the tiny preset's own (pp 2 x ep 2, DualPipeV:
# layers in a multiple of 4), one pipeline rank with expert parallelism, one process
LAYOUTS = ({}, {"pp": 1}, {"pp": 1, "ep": 1})


def train_command(toml: str, save: str) -> str:
    """The `fmoe train` command that starts from the converted checkpoint in `save` (its model in `toml`)
    with the first of LAYOUTS its model passes the checks before launch with."""
    from fmoe.train.config import TrainConfig

    for layout in LAYOUTS:
        if TrainConfig.from_sources("tiny", toml, {**layout, "load": save}).problem() is None:
            break
    flags = "".join(f" --{k} {v}" for k, v in layout.items())
    return f"fmoe train --config {toml} --load {save}{flags}"


def _fmoe_to_hf(args: argparse.Namespace) -> int:
    from fmoe.hf.checkpoint import load_fmoe
    from fmoe.hf.files import save_hf

    if args.max_shard_bytes < 1:  # before the checkpoint is read: 0 or -1 wrote one file per tensor
        print(f"fmoe convert: error: --max-shard-bytes must be a positive number of bytes, got "
              f"{args.max_shard_bytes}")
        return 2
    cfg, params, meta = load_fmoe(args.load, seams=False)  # imports no router / attention it names
    base = meta.get("hf_config") or {}
    arch = args.arch or base.get("model_type")
    if arch is None:
        print("fmoe convert: error: --arch is needed (the checkpoint was not imported from HF)")
        return 2
    out = save_hf(args.out, cfg, params, arch, base_config=base, max_shard_bytes=args.max_shard_bytes,
                  overwrite=args.overwrite)
    print(f"fmoe convert: wrote {out} ({arch})")
    return 0


def run(args: argparse.Namespace) -> int:
    """Runs the chosen conversion; returns 0, or 2 with one `fmoe convert: error: ...` line when the
    model, a file or a directory is refused."""
    from fmoe.train.checkpoint import CheckpointError

    try:
        return _hf_to_fmoe(args) if args.direction == "hf-to-fmoe" else _fmoe_to_hf(args)
    except (ValueError, OSError, ImportError, CheckpointError) as exc:
        print(f"fmoe convert: error: {' '.join(str(exc).split())}")
        return 2
