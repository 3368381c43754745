"""Function transforms that know nothing of MoE: split dx/dw backward, recompute, the weight-grad tape."""

from transforms.remat import checkpoint_name as checkpoint_name
from transforms.remat import everything_saveable as everything_saveable
from transforms.remat import nothing_saveable as nothing_saveable
from transforms.remat import remat as remat
from transforms.remat import save_only_these_names as save_only_these_names
from transforms.remat import saved_residuals as saved_residuals
from transforms.split_vjp import split_vjp as split_vjp
from transforms.tape import WeightGradTape as WeightGradTape
from transforms.tape import active_tape as active_tape
from transforms.tape import current_tape as current_tape
from transforms.tape import defer_weight_grad as defer_weight_grad
from transforms.testing import assert_close as assert_close
from transforms.testing import check_vjp as check_vjp
