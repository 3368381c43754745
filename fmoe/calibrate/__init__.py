"""Calibration: this machine measured as the planner's ClusterSpec, written as a cluster spec file that
`fmoe plan --cluster local` hands to the planner (machine.py), the live `fmoe train` jobs it times
(jobs.py), and `fmoe train`'s presets as the planner's ModelSpecs (models.py). It joins the trainer and
the planner; neither imports it.
"""
