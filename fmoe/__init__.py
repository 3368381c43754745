"""fmoe: functional Mixture-of-Experts training on torch.func (pure functions over parameter pytrees).

`fmoe.moe` is the MoE layer function (defined in `fmoe/layer.py`). The block's stage functions live in
`fmoe.block`.
"""

from fmoe.config import GPTConfig as GPTConfig
from fmoe.config import MoEConfig as MoEConfig
from fmoe.dispatch.base import Dispatcher as Dispatcher
from fmoe.dispatch.local import LocalDispatcher as LocalDispatcher
from fmoe.layer import MoEAux as MoEAux
from fmoe.layer import MoERoute as MoERoute
from fmoe.layer import init_moe as init_moe
from fmoe.layer import init_moe_state as init_moe_state
from fmoe.layer import moe as moe
from fmoe.model import GPTAux as GPTAux
from fmoe.model import gpt_loss as gpt_loss
from fmoe.model import init_gpt as init_gpt
from fmoe.model import init_gpt_state as init_gpt_state
from fmoe.router import Routing as Routing
from fmoe.router import route as route
