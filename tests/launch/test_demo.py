"""The README's main job, `vllm-patch demo`, as a user runs it (a subset of
the workload to keep CI short): it must finish, print the table, show the
stock failure and a clean patched row, exit 0, and keep every file it says
it kept (and leave no Ray token in the home folder)."""

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
    for k in ("RAY_ADDRESS", "RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(k, None)
    token = Path.home() / ".ray" / "auth_token"  # Ray's default token file
    token_before = token.read_bytes() if token.exists() else None
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
    # what it says it kept is there after it ended
    for kept in re.findall(r"logs kept: (.*)$", r.stderr, re.M):
        for path in kept.split(", "):
            assert os.path.exists(path), f"the demo said it kept {path}"
    token_after = token.read_bytes() if token.exists() else None
    assert token_after == token_before, f"the demo wrote {token}"


@pytest.mark.unit
def test_demo_markdown_table_and_log_dir(tmp_path):
    from vllm_patch.launch import demo

    row = dict(n=4, valid=4, post=0, stop=4, length=0, accepted=6, drafted=6,
               held={"prefill": 0, "decode": 0}, startup=50.2, wall=7.6)
    rows = [{**row, "mode": "stock", "post": 9}, {**row, "mode": "patched"}]
    md = demo.table(rows, markdown=True).splitlines()
    assert md[:2] == ["|  | stock | patched |", "| --- | --- | --- |"]
    assert "| tokens after the grammar's end | 9 | 0 |" in md
    assert "| start-up s / workload s | 50 / 8 | 50 / 8 |" in md
    # the text table has the same rows
    assert [r.split("  ")[0] for r in demo.table(rows).splitlines()[2:]] == \
        [r.split(" | ")[0][2:] for r in md[2:]]
    # logs: in DIR/<mode> when asked (kept), never inside the demo's work dir
    cfg = demo.launch_config("stock", "/m", str(tmp_path / "work"), 3, str(tmp_path / "logs"))
    assert cfg.log_dir == str(tmp_path / "logs" / "stock")
    assert demo.launch_config("patched", "/m", str(tmp_path / "work"), 3).log_dir is None


@pytest.mark.unit
def test_demo_ray_token_stays_in_its_work_dir(tmp_path, monkeypatch):
    from vllm_patch.launch import demo

    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    demo.keep_ray_token_in(str(tmp_path))
    token = tmp_path / "ray-auth-token"
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == str(token)
    assert len(token.read_text()) == 64 and token.stat().st_mode & 0o077 == 0
    # a token the user configured is left alone
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", "/theirs")
    demo.keep_ray_token_in(str(tmp_path / "other"))
    assert os.environ["RAY_AUTH_TOKEN_PATH"] == "/theirs"
