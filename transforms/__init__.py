"""Function transforms that know nothing of MoE: split dx/dw backward, recompute, the weight-grad tape.

Installed and imported as `fmoe.transforms` (the folder is transforms/ at the top of the repository).
`check_vjp` and `assert_close` load `fmoe.transforms.testing` (and hypothesis) on first use;
`deferral_report` (what split_vjp's two passes compute, in FLOPs) loads `fmoe.transforms.report`.
"""

from fmoe._lazy import lazy_exports
from fmoe.transforms.remat import POLICIES as POLICIES
from fmoe.transforms.remat import RecomputeError as RecomputeError
from fmoe.transforms.remat import checkpoint_dots as checkpoint_dots
from fmoe.transforms.remat import checkpoint_name as checkpoint_name
from fmoe.transforms.remat import dots_saveable as dots_saveable
from fmoe.transforms.remat import everything_saveable as everything_saveable
from fmoe.transforms.remat import nothing_saveable as nothing_saveable
from fmoe.transforms.remat import remat as remat
from fmoe.transforms.remat import save_only_these_names as save_only_these_names
from fmoe.transforms.remat import saved_residuals as saved_residuals
from fmoe.transforms.split_vjp import DwFn as DwFn
from fmoe.transforms.split_vjp import DxFn as DxFn
from fmoe.transforms.split_vjp import split_vjp as split_vjp
from fmoe.transforms.tape import CaptureModifiedError as CaptureModifiedError
from fmoe.transforms.tape import WeightGradTape as WeightGradTape
from fmoe.transforms.tape import active_tape as active_tape
from fmoe.transforms.tape import defer_weight_grad as defer_weight_grad
from fmoe.transforms.tape import weight_grad_or_defer as weight_grad_or_defer

__getattr__, __dir__ = lazy_exports(__name__, {"assert_close": ".testing", "check_vjp": ".testing",
                                                  "grads_by": ".testing", "tracked_peak_bytes": ".testing",
                                                  "deferral_report": ".report", "DeferralReport": ".report",
                                                  "LeafDeferral": ".report"})
