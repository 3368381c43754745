"""fmoe: functional Mixture-of-Experts training on torch.func (pure functions over parameter pytrees).

`fmoe.moe` is the MoE layer function (fmoe/model.py runs the layer's phases, fmoe/phases.py, in order;
its pieces are in fmoe/layer.py); the block's phase functions live in `fmoe.block`. Subpackages:
`fmoe.transforms` (split_vjp, remat, the weight-grad tape, stage programs), `fmoe.ops` (primitives),
`fmoe.parallel` (expert parallelism), `fmoe.schedule` (pipeline schedules as data), `fmoe.cli`. Names
load on first use (PEP 562), so `import fmoe.schedule` loads no model code.
"""

from fmoe._lazy import lazy_exports

_EXPORTS = {
    "GPTConfig": ".config",
    "MoEConfig": ".config",
    "Dispatcher": ".dispatch.base",
    "LocalDispatcher": ".dispatch.local",
    "MoEAux": ".layer",
    "MoERoute": ".layer",
    "init_moe": ".layer",
    "init_moe_state": ".layer",
    "moe": ".model",
    "update_moe_state": ".layer",
    "GPTAux": ".model",
    "gpt_logits": ".model",
    "gpt_loss": ".model",
    "init_gpt": ".gpt_init",
    "init_gpt_state": ".model",
    "Routing": ".router",
    "route": ".router",
}
__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
