"""The README's main job, `vllm-patch demo`, as a user runs it (a subset of
the workload to keep CI short): it must finish, print the table, show the
stock failure and a clean patched row, and exit 0."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.timeout(900)
def test_demo_command(patched):
    if not patched:
        pytest.skip("the demo runs a stock and a patched deployment itself")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_PATCH_")}
    env.pop("RAY_ADDRESS", None)
    exe = Path(sys.executable).with_name("vllm-patch")
    r = subprocess.run([str(exe), "demo", "--requests", "16"], capture_output=True,
                       text=True, timeout=840, env=env)
    print(r.stdout)
    assert r.returncode == 0, r.stdout + r.stderr[-3000:]
    rows = {m.group(1).strip(): m.group(2).split("  ")
            for m in re.finditer(r"^(valid structured outputs|tokens after the grammar's "
                                 r"end|KV blocks held at idle \(P, D\))\s+(.*)$",
                                 r.stdout, re.M)}
    cells = {k: [c.strip() for c in v if c.strip()] for k, v in rows.items()}
    # columns: stock, patched
    assert cells["valid structured outputs"][1] == "16 / 16"
    assert cells["tokens after the grammar's end"][1] == "0"
    assert int(cells["tokens after the grammar's end"][0]) > 0  # stock's failure
    assert cells["KV blocks held at idle (P, D)"] == ["0, 0", "0, 0"]
    assert "waiting for" in r.stderr or "healthy" in r.stderr  # progress shown
