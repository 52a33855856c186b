"""Where `mqinfer run` keeps its state and reads its rows: a local folder, or object storage.

With a local ``--out`` the run's state (its lock, embedded server, job manifests and machine
records, ``OUT/.mqinfer/``) sits beside the rows, as always. With ``--out`` in object storage
(``s3://bucket/prefix``, any pyarrow filesystem URI) the rows go there and the state stays on
this machine, in a folder of the user's cache named after the URI
(``$XDG_CACHE_HOME/mqinfer/runs/<hash>/``, else ``~/.cache/...``). What is done is read from the
store, so a run resumes from the rows there, on this machine or another; the lock and the model
check of the job manifest hold on this machine only.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from mqinfer.config import ConfigError
from mqinfer.schemas.dataset_uri import job_table

STATE_DIR = ".mqinfer"


def state_home(out: Path | str) -> Path:
    """The local folder whose ``.mqinfer/`` holds the run's state: ``out`` itself, or for object
    storage a cache folder of its own (created)."""
    if isinstance(out, Path):
        return out
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    where = out.split("?", 1)[0].rstrip("/")
    home = cache / "mqinfer" / "runs" / hashlib.sha256(where.encode()).hexdigest()[:16]
    home.mkdir(parents=True, exist_ok=True)
    return home


def job_rows(out: Path | str, name: str, job_id: str, columns: list[str], kind: str | None = None) -> list[dict]:
    """The rows of ``job_id`` (of cost ``kind``) in the dataset ``name``; none if it is empty."""
    table = job_table(out, name, job_id, columns, kind)
    return [] if table is None else table.to_pylist()


def ids_with_rows(out: Path | str, job_id: str) -> set[str]:
    return {r["id"] for r in job_rows(out, "results", job_id, ["id"])}


def _manifest_path(home: Path, job_id: str) -> Path:
    return home / STATE_DIR / "jobs" / f"{job_id}.json"


def check_manifest(home: Path, out: Path | str, job_id: str, model: str, fresh: bool) -> None:
    """Refuse to resume a job with another model: its finished rows would be mixed with new ones.
    (A job with no rows yet may change its model freely.)"""
    path = _manifest_path(home, job_id)
    if fresh or not path.is_file() or not ids_with_rows(out, job_id):
        return
    try:
        before = json.loads(path.read_text()).get("model")
    except (OSError, ValueError):
        return
    if before and before != model:
        raise ConfigError(f"{out} already holds job {job_id} computed with --model {before}; pass --fresh to "
                          f"compute it again with {model}, or use another --out")


def write_manifest(home: Path, job_id: str, input_path: Path, model: str, total: int) -> None:
    path = _manifest_path(home, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"job_id": job_id, "input": str(input_path.resolve()), "model": model, "requests": total}
    temp = path.with_suffix(".tmp")
    temp.write_text(json.dumps(doc))
    os.replace(temp, path)


__all__ = ["STATE_DIR", "check_manifest", "ids_with_rows", "job_rows", "state_home", "write_manifest"]
