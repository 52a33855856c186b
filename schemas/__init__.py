"""msgspec structs for every wire and storage type, their Arrow schemas, codecs, the OpenAI Batch mapping."""
