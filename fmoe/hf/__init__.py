"""Import and export of Hugging Face MoE checkpoints (Qwen3-MoE, Mixtral) as fmoe GPT params.

    cfg, params = load_hf("hf_dir")                         # config.json + safetensors -> fmoe
    logits_BSV = fmoe.gpt_logits(params, ids_BS, cfg)       # what transformers' model computes
    save_hf("out_dir", cfg, params, "qwen3_moe")            # fmoe -> what from_pretrained loads

Modules: config_map (config.json <-> GPTConfig, and the mapping table), weight_map (state dict <->
params), files (directories, safetensors), checkpoint (fmoe train's checkpoint format). transformers is
never imported; safetensors (the `hf` extra) only when a file is read or written. Names load on first
use (PEP 562), so `fmoe.cli` importing config_map loads no model code.
"""

from fmoe._lazy import lazy_exports

_EXPORTS = {
    "ARCHS": ".config_map",
    "check_exportable": ".config_map",
    "config_from_hf": ".config_map",
    "config_to_hf": ".config_map",
    "load_hf": ".files",
    "read_config": ".files",
    "read_state_dict": ".files",
    "save_hf": ".files",
    "params_from_hf": ".weight_map",
    "params_to_hf": ".weight_map",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
