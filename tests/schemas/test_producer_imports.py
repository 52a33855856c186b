"""Producer-side modules (schemas, sinks, compaction, reports) must work without torch."""

from __future__ import annotations

import subprocess
import sys


def test_storage_and_schema_modules_do_not_import_torch():
    code = (
        "import sys\n"
        "import mqinfer.schemas.errors, mqinfer.schemas.request, mqinfer.schemas.openai_batch\n"
        "import mqinfer.schemas.stream, mqinfer.schemas.files, mqinfer.schemas.rows\n"
        "import mqinfer.workers.queue.sink, mqinfer.ops.compact, mqinfer.ops.report\n"
        "heavy = sorted(m for m in ('torch', 'triton', 'transformers', 'tokenizers') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == ""
