"""schedule: pipeline schedules as data - generate, print, compare, verify and simulate them.

Generic: never imports fmoe. See docs/schedules.md.
"""

from schedule.comms import with_comms as with_comms
from schedule.comms import without_comms as without_comms
from schedule.costs import Costs as Costs
from schedule.gen_1f1b import gpipe as gpipe
from schedule.gen_1f1b import interleaved_1f1b as interleaved_1f1b
from schedule.gen_1f1b import one_f_one_b as one_f_one_b
from schedule.gen_dualpipe import dualpipe as dualpipe
from schedule.gen_dualpipe import dualpipev as dualpipev
from schedule.gen_zb import zb_h1 as zb_h1
from schedule.gen_zb import zbv as zbv
from schedule.imbalance import LayerPlacement as LayerPlacement
from schedule.imbalance import imbalance_pct as imbalance_pct
from schedule.imbalance import place_layers as place_layers
from schedule.imbalance import rank_costs as rank_costs
from schedule.ir import Action as Action
from schedule.ir import Op as Op
from schedule.ir import Overlap as Overlap
from schedule.ir import Placement as Placement
from schedule.ir import Recv as Recv
from schedule.ir import Schedule as Schedule
from schedule.ir import ScheduleError as ScheduleError
from schedule.ir import Send as Send
from schedule.ir import diff as diff
from schedule.registry import build as build
from schedule.simulate import Report as Report
from schedule.simulate import format_report as format_report
from schedule.simulate import simulate as simulate
from schedule.timeline import write_png as write_png
from schedule.timeline import write_trace as write_trace
from schedule.verify import verify as verify
