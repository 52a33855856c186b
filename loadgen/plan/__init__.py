"""``mqinfer plan``: how many workers, and of what shape, a workload needs to meet its targets.

``command`` is the command (``mqinfer plan``: calibration, simulation, the report), with its options
in ``options``; ``model`` is the step cost model a calibration fits, ``calibrate`` measures it on
the real engine and ``pipeline`` through the real worker loop; ``workload`` and ``target`` describe
what is asked, ``sim`` simulates workers serving it, ``report`` prints the plan, and ``check``
(``python -m mqinfer.loadgen.plan.check``; ``python -m mqinfer.loadgen.plan_check`` still works)
runs the real pipeline beside the plan's figures. docs/plan.md explains the method.
"""
