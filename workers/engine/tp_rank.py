"""Entry point of a tensor-parallel rank other than 0 (``python -m mqinfer.workers.engine.tp_rank``),
started by its worker (:class:`mqinfer.workers.engine.ranks.Leader`)."""

import sys

from mqinfer.workers.engine.ranks import follower_main

if __name__ == "__main__":
    sys.exit(follower_main())
