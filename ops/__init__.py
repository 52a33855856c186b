"""Operating mqinfer: metrics, cost reports, compaction, bulk-job orchestration."""

if __name__ == "ops":  # imported under its bare name from a checkout: see mqinfer._checkout
    from mqinfer._checkout import defer_to_installed

    defer_to_installed(__name__)
