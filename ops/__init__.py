"""Operating mqinfer: metrics, cost reports, compaction, bulk-job orchestration."""

from mqinfer._checkout import defer_if_bare  # README.md, "Where the code lives"

defer_if_bare(__name__)
