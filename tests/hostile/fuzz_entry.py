"""Coverage-guided fuzzing (atheris, libFuzzer) of the stream entry decoder and the JSONL reader.

Optional: needs ``pip install atheris``. Any exception other than a RequestError, and any accepted
request that breaks the guarantees of ``check_request``, is a crash that libFuzzer reports with
the input that caused it. Run from the repository root::

    python tests/hostile/fuzz_entry.py -runs=200000            # a bounded run
    python tests/hostile/fuzz_entry.py -max_total_time=3600 corpus/   # an hour, keeping a corpus
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports(include=["mqinfer", "msgspec"]):
    from mqinfer.schemas.errors import RequestError
    from mqinfer.schemas.files import iter_input
    from mqinfer.schemas.stream import decode_entry

from tests.hostile.hostile_values import check_error, check_request  # noqa: E402

_JSONL = os.path.join(tempfile.mkdtemp(prefix="mqinfer-fuzz-"), "in.jsonl")


def test_one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    mode = fdp.ConsumeIntInRange(0, 4)
    payload = fdp.ConsumeBytes(fdp.remaining_bytes())
    if mode == 4:  # the file reader
        with open(_JSONL, "wb") as f:
            f.write(payload)
        for item in iter_input(_JSONL):
            if item.error is not None:
                check_error(item.error)
            else:
                check_request(item.request)
        return
    half = len(payload) // 2
    fields = [
        {"r": payload, "v": b"1"},
        {"json": payload, "v": b"1"},
        {"json": payload.decode("utf-8", "surrogateescape")},
        {"r": payload[:half], "v": payload[half:]},
    ][mode]
    try:
        request = decode_entry(fields)
    except RequestError as exc:
        check_error(exc)
        return
    check_request(request)


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
