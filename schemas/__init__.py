"""msgspec structs for every wire and storage type, their Arrow schemas, codecs, the OpenAI Batch mapping."""

from mqinfer._checkout import defer_if_bare  # README.md, "Where the code lives"

defer_if_bare(__name__)
