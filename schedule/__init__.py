"""schedule: pipeline schedules as data - generate, print, compare, verify and simulate them.

Generic: imports nothing of the model (only fmoe.transforms, for the executor). See docs/schedules.md.
"""

from fmoe._lazy import lazy_exports
from fmoe.schedule.comms import with_comms as with_comms
from fmoe.schedule.comms import without_comms as without_comms
from fmoe.schedule.costs import Costs as Costs
from fmoe.schedule.files import load_schedule as load_schedule
from fmoe.schedule.files import load_schedule_text as load_schedule_text
from fmoe.schedule.fuse import adjacent_iw as adjacent_iw
from fmoe.schedule.fuse import fuse_adjacent_iw as fuse_adjacent_iw
from fmoe.schedule.gen_1f1b import combined_1f1b as combined_1f1b
from fmoe.schedule.gen_1f1b import gpipe as gpipe
from fmoe.schedule.gen_1f1b import interleaved_1f1b as interleaved_1f1b
from fmoe.schedule.gen_1f1b import one_f_one_b as one_f_one_b
from fmoe.schedule.gen_dualpipe import dualpipe as dualpipe
from fmoe.schedule.gen_dualpipe import dualpipev as dualpipev
from fmoe.schedule.gen_zb import zb_h1 as zb_h1
from fmoe.schedule.gen_zb import zbv as zbv
from fmoe.schedule.imbalance import LayerPlacement as LayerPlacement
from fmoe.schedule.imbalance import balance_layers as balance_layers
from fmoe.schedule.imbalance import balance_layers_or_empty as balance_layers_or_empty
from fmoe.schedule.imbalance import cost_rank_costs as cost_rank_costs
from fmoe.schedule.imbalance import cost_stage_costs as cost_stage_costs
from fmoe.schedule.imbalance import even_layers as even_layers
from fmoe.schedule.imbalance import imbalance_pct as imbalance_pct
from fmoe.schedule.imbalance import least_stage_cost as least_stage_cost
from fmoe.schedule.imbalance import place_layers as place_layers
from fmoe.schedule.imbalance import rank_costs as rank_costs
from fmoe.schedule.imbalance import stage_costs as stage_costs
from fmoe.schedule.ir import Action as Action
from fmoe.schedule.ir import Op as Op
from fmoe.schedule.ir import Overlap as Overlap
from fmoe.schedule.ir import Placement as Placement
from fmoe.schedule.ir import Recv as Recv
from fmoe.schedule.ir import Schedule as Schedule
from fmoe.schedule.ir import ScheduleError as ScheduleError
from fmoe.schedule.ir import Send as Send
from fmoe.schedule.ir import diff as diff
from fmoe.schedule.parse import parse_action as parse_action
from fmoe.schedule.parse import parse_schedule as parse_schedule
from fmoe.schedule.registry import build as build
from fmoe.schedule.simulate import Report as Report
from fmoe.schedule.simulate import format_report as format_report
from fmoe.schedule.simulate import simulate as simulate
from fmoe.schedule.timeline import write_png as write_png
from fmoe.schedule.timeline import write_trace as write_trace
from fmoe.schedule.verify import verify as verify

# The executor and stage programs need torch; load them on first use so that generating, verifying and
# simulating schedules stays torch-free.
_LAZY = {"execute": ".execute", "ExecOptions": ".options", "StepResult": ".execute",
         "check_programs": ".execute", "stage_turns_of": ".execute", "Phase": "fmoe.transforms.program",
         "Layer": "fmoe.transforms.program",
         "StageProgram": "fmoe.transforms.program", "Ready": "fmoe.transforms.program",
         "TraceEvent": ".timeline", "report_events": ".timeline"}
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
