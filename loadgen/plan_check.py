"""``python -m mqinfer.loadgen.plan_check``: the plan's check against the real pipeline, whose code
is ``mqinfer.loadgen.plan.check`` (run it as ``python -m mqinfer.loadgen.plan.check``). This module
only forwards, so that the command lines written before the plan became a subpackage still work."""

import sys

from mqinfer.loadgen.plan.check import main

if __name__ == "__main__":
    sys.exit(main())
