"""Entry point of a tensor-parallel rank other than 0 (``python -m mqinfer.workers.tp_rank``),
started by its worker (:class:`mqinfer.workers.ranks.Leader`)."""

import sys

from mqinfer.workers.ranks import follower_main

if __name__ == "__main__":
    sys.exit(follower_main())
