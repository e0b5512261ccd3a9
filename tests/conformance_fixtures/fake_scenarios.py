"""Test-only scenario module for `vllm-patch verify` tests (tests/test_cli.py).

Loaded by a child process with PYTHONPATH=tests/conformance_fixtures and
`--module fake_scenarios`; select one behaviour with `-k`. A scenario decides
"patched" from the real registry state, as a real scenario observes the real
patched code.
"""

from __future__ import annotations

import os
import time

from vllm_patch import envs
from vllm_patch.conformance import Scenario


def _patched() -> bool:
    return not envs.settings().disable


def _holds() -> list[str]:
    return []


def _violated_when_patched() -> list[str]:
    return ["fake violation seen with patches on"] if _patched() else []


def _violated_when_stock() -> list[str]:
    return [] if _patched() else ["fake violation seen on stock"]


def _raises() -> list[str]:
    raise ValueError("fake scenario blew up")


def _kills_process() -> list[str]:
    os._exit(7)


def _hangs() -> list[str]:
    time.sleep(600)
    return []


def _wrong_type() -> list[str]:
    return "not a list"  # type: ignore[return-value]


SCENARIOS = [
    Scenario("fake_holds", "G1", "holds in both modes", _holds),
    Scenario("fake_fixed_by_patch", "G2", "violated on stock only",
             _violated_when_stock),
    Scenario("fake_control", "G2", "control: holds on stock", _holds,
             stock_fails=False),
    Scenario("fake_violated_patched", "G3", "violated with patches on",
             _violated_when_patched),
    Scenario("fake_raises", "G3", "raises ValueError", _raises),
    Scenario("fake_wrong_type", "G3", "returns a str", _wrong_type),
    Scenario("fake_kills_process", "G4", "os._exit(7)", _kills_process),
    Scenario("fake_hangs", "G4", "sleeps 600 s", _hangs),
    Scenario("fake_future_only", "G1", "series 0.99 only", _holds,
             series=("0.99",)),
]
