"""The keys a cost report groups by: the cost rows' own label columns, a request's metadata
labels (``metadata.KEY``) and its length bands.

:func:`checked_by` validates a ``--by`` list; :func:`with_group_columns` gives a cost table one
column per key that is not already a column (``metadata.KEY``, ``prompt_band``, ``output_band``),
so that grouping, allocation and budgets treat every key alike.

Bands sort requests by length to find the expensive cases: a band is a half-open range of tokens
written ``LO-HI`` (``HI`` included) or ``LO+`` for the last. Rows of no request (startup, idle,
lost) have no band.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc

# Keys that are columns of the cost rows.
COLUMN_KEYS = ("tenant", "model", "request_type", "job_id", "worker", "model_variant")
METADATA_PREFIX = "metadata."
# Lower bounds of the length bands, in tokens (the first band starts at 0).
PROMPT_BAND_BOUNDS = (128, 512, 2048, 8192)
OUTPUT_BAND_BOUNDS = (32, 128, 512, 2048)
BAND_KEYS = {"prompt_band": ("prompt_tokens", PROMPT_BAND_BOUNDS),
             "output_band": ("output_tokens", OUTPUT_BAND_BOUNDS)}
GROUP_KEYS = (*COLUMN_KEYS, *BAND_KEYS)
# The kinds of rows that belong to a request, and so have metadata labels and bands.
_REQUEST_KINDS = pa.array(["request", "duplicate"])


def band_labels(bounds: Sequence[int]) -> list[str]:
    """The labels of the bands cut at ``bounds``: ``0-127``, ``128-511``, ..., ``8192+``."""
    lows = [0, *bounds]
    return [f"{lo}-{hi - 1}" for lo, hi in zip(lows, bounds)] + [f"{lows[-1]}+"]


def describe_bands() -> str:
    """The bands in words, for ``--help`` and errors."""
    return (f"prompt_band: {', '.join(band_labels(PROMPT_BAND_BOUNDS))} prompt tokens; "
            f"output_band: {', '.join(band_labels(OUTPUT_BAND_BOUNDS))} output tokens")


def metadata_key(key: str) -> str | None:
    """The metadata label a ``metadata.KEY`` group key names, or None for another key."""
    return key[len(METADATA_PREFIX):] if key.startswith(METADATA_PREFIX) else None


def checked_by(by: Sequence[str] | str) -> list[str]:
    """The ``by`` keys as a list (a single name taken as one key); ValueError unless they are one
    or more distinct keys of :data:`GROUP_KEYS` or ``metadata.KEY`` with a non-empty KEY."""
    if isinstance(by, str):
        by = [by]
    by = list(by)
    bad = [key for key in by if key not in GROUP_KEYS and not metadata_key(key)]
    if bad or not by or len(set(by)) != len(by):
        raise ValueError(f"cannot group costs by {by!r}: use one or more distinct keys of "
                         f"{', '.join(GROUP_KEYS)} or metadata.KEY (a request's metadata label KEY)")
    return by


def _bands(tokens: pa.ChunkedArray | pa.Array, bounds: Sequence[int]) -> pa.ChunkedArray | pa.Array:
    labels = band_labels(bounds)
    result = pa.scalar(labels[-1])
    # From the top band down: each comparison keeps what a higher band already decided.
    for bound, label in zip(reversed(bounds), reversed(labels[:-1])):
        result = pc.if_else(pc.less(tokens, bound), label, result)
    return result


def with_group_columns(table: pa.Table, by: Sequence[str]) -> pa.Table:
    """``table`` (cost rows) with a column for every key of ``by`` that is not one of its columns:
    a ``metadata.KEY`` column holds the request's label KEY (null where it has none), a band
    column the band of its tokens (null for rows of no request)."""
    is_request = pc.is_in(table["kind"], value_set=_REQUEST_KINDS)
    for key in by:
        if key in table.schema.names:
            continue
        label = metadata_key(key)
        if label is not None:
            if table.num_rows:
                values = pc.map_lookup(table["metadata"], pa.scalar(label, pa.string()), "first")
            else:
                values = pa.array([], pa.string())
        elif key in BAND_KEYS:
            column, bounds = BAND_KEYS[key]
            if table.num_rows:
                values = pc.if_else(is_request, _bands(table[column], bounds), pa.scalar(None, pa.string()))
            else:
                values = pa.array([], pa.string())
        else:
            raise ValueError(f"cost rows have no column {key!r}")
        table = table.append_column(pa.field(key, pa.string()), values)
    return table


__all__ = ["BAND_KEYS", "COLUMN_KEYS", "GROUP_KEYS", "METADATA_PREFIX", "OUTPUT_BAND_BOUNDS", "PROMPT_BAND_BOUNDS",
           "band_labels", "checked_by", "describe_bands", "metadata_key", "with_group_columns"]
