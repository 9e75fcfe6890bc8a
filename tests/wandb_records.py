"""Read an offline W&B run's .wandb file (a LevelDB-style log of protobuf records) for assertions."""

from __future__ import annotations

import json
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

_BLOCK = 32 * 1024
_HEADER = 7  # ":W&B", 2 magic bytes, 1 version byte


def records(path: Path) -> list[pb.Record]:
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, pending, out = _HEADER, b"", []
    while pos + 7 <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < 7:  # block trailer padding
            pos += left
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        payload = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 1:  # full
            out.append(payload)
        elif kind == 2:  # first
            pending = payload
        elif kind == 3:  # middle
            pending += payload
        elif kind == 4:  # last
            out.append(pending + payload)
    return [pb.Record.FromString(b) for b in out]


def run_contents(path: Path) -> dict:
    """The run's name, group, config, summary, logged history rows (decoded from JSON values) and exit code (None: not
    finished)."""
    out = {"config": {}, "summary": {}, "history": [], "name": None, "group": None, "exit_code": None}
    for rec in records(path):
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            out["name"], out["group"] = rec.run.display_name, rec.run.run_group
            for item in rec.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "summary":
            for item in rec.summary.update:
                key = item.key or "/".join(item.nested_key)
                out["summary"][key] = json.loads(item.value_json)
        elif kind == "exit":
            out["exit_code"] = rec.exit.exit_code
        elif kind == "history":
            out["history"].append(
                {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in rec.history.item}
            )
    return out
