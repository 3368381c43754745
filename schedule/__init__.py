"""schedule: pipeline schedules as data - generate, print, compare, verify and simulate them.

Generic: never imports fmoe. See docs/schedules.md.
"""

from schedule.comms import with_comms, without_comms
from schedule.gen_1f1b import gpipe, interleaved_1f1b, one_f_one_b
from schedule.gen_dualpipe import dualpipe, dualpipev
from schedule.gen_zb import zb_h1, zbv
from schedule.ir import Action, Op, Overlap, Placement, Recv, Schedule, ScheduleError, Send, diff
from schedule.verify import verify
