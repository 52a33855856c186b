"""Operating mqinfer: metrics, cost reports, compaction, bulk-job orchestration."""
