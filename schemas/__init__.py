"""msgspec structs for every wire and storage type, their Arrow schemas, codecs, the OpenAI Batch mapping."""

if __name__ == "schemas":  # imported under its bare name from a checkout: see mqinfer._checkout
    from mqinfer._checkout import defer_to_installed

    defer_to_installed(__name__)
