"""Conformance scenarios: executable checks of guarantees G1-G4.

Shipped inside the package so a user can run them in CI against their own
vLLM build: `vllm-patch verify` runs every scenario twice, in a stock child
process (`VLLM_PATCH_DISABLE=1`) and in a patched one, and fails if a
scenario is violated with the patches on.

A scenario module (listed in `SCENARIO_MODULES`) exposes
`SCENARIOS: list[Scenario]`. `Scenario.run()` returns the violations of its
guarantee it observed, `[]` when the guarantee holds. It must build what it
needs itself (scheduler, grammar, ...) after `vllm_patch.register()` has run,
which the child entry point (`python -m vllm_patch.conformance`) does first.
A scenario that stock vLLM fails names the exact violations stock reports
(`stock_violations`): the failure the patch removes, so a stock run that
fails for another reason is noticed.

This module stays import-light (no vLLM import) so scenario modules and the
CLI can import it cheaply.
"""

from __future__ import annotations

import importlib
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

GUARANTEE_IDS: tuple[str, ...] = ("G1", "G2", "G3", "G4")

# Modules whose SCENARIOS the runner loads by default. Keep this accurate: a
# listed module that cannot be imported is an error of the run (reported,
# and `vllm-patch verify` exits non-zero), never silently ignored.
SCENARIO_MODULES: tuple[str, ...] = (
    "vllm_patch.conformance.g1",
    "vllm_patch.conformance.g2",
    "vllm_patch.conformance.g3",
    "vllm_patch.conformance.g4",
)


@dataclass(frozen=True)
class Scenario:
    name: str
    guarantee: str                 # "G1".."G4"
    description: str
    run: Callable[[], list[str]]   # violations of the guarantee; [] = holds
    stock_fails: bool = True       # False for controls stock already gets right
    series: tuple[str, ...] = ("0.32", "0.33")
    # What `run()` returns on stock vLLM (VLLM_PATCH_DISABLE=1), in order:
    # the same for every series, or {series: violations} where they differ.
    # Empty for a control (stock_fails=False).
    stock_violations: Sequence[str] | Mapping[str, Sequence[str]] = ()

    def __post_init__(self) -> None:
        if self.guarantee not in GUARANTEE_IDS:
            raise ValueError(
                f"scenario {self.name}: guarantee must be one of {GUARANTEE_IDS}"
            )
        if self.stock_violations and not self.stock_fails:
            raise ValueError(f"scenario {self.name}: a control (stock_fails="
                             "False) cannot list stock violations")

    def expected_stock(self, series: str) -> list[str]:
        """The violations stock vLLM of `series` reports ([] if none is
        declared)."""
        expected = self.stock_violations
        if isinstance(expected, Mapping):
            expected = expected.get(series, ())
        return list(expected)


class LoadError(Exception):
    """A scenario module could not be imported or is malformed."""


def load_scenarios(
    modules: Iterable[str] | None = None,
) -> tuple[list[Scenario], list[dict[str, str]]]:
    """Import each module's SCENARIOS.

    Returns (scenarios, errors); an error is {"module", "error"} for a module
    that failed to import, lacks SCENARIOS, or repeats a scenario name.
    """
    scenarios: list[Scenario] = []
    errors: list[dict[str, str]] = []
    seen: dict[str, str] = {}
    for module_name in SCENARIO_MODULES if modules is None else modules:
        try:
            module = importlib.import_module(module_name)
            found = getattr(module, "SCENARIOS", None)
            if found is None:
                raise LoadError("module has no SCENARIOS")
            for scenario in found:
                if not isinstance(scenario, Scenario):
                    raise LoadError(f"SCENARIOS holds a {type(scenario).__name__}, "
                                    "not a Scenario")
                if scenario.name in seen:
                    raise LoadError(f"scenario {scenario.name!r} also defined in "
                                    f"{seen[scenario.name]}")
                seen[scenario.name] = module_name
                scenarios.append(scenario)
        except Exception as exc:  # noqa: BLE001 - reported, never swallowed
            errors.append({"module": module_name,
                           "error": f"{type(exc).__name__}: {exc}"})
    return scenarios, errors


def select(
    scenarios: Iterable[Scenario],
    guarantees: Iterable[str] = (),
    names: Iterable[str] = (),
    keywords: Iterable[str] = (),
) -> list[Scenario]:
    """Filter: guarantee ids (any of), exact names (any of), substrings (any of)."""
    guarantees, names, keywords = set(guarantees), set(names), list(keywords)
    return [
        s for s in scenarios
        if (not guarantees or s.guarantee in guarantees)
        and (not names or s.name in names)
        and (not keywords or any(k in s.name for k in keywords))
    ]


def run_scenario(scenario: Scenario, series: str) -> dict[str, Any]:
    """Run one scenario; an exception is a violation ("raised T: msg")."""
    row: dict[str, Any] = {
        "name": scenario.name,
        "guarantee": scenario.guarantee,
        "description": scenario.description,
        "stock_fails": scenario.stock_fails,
        "series": list(scenario.series),
        "applicable": series in scenario.series,
        "holds": None,
        "violations": [],
        "seconds": 0.0,
    }
    if not row["applicable"]:
        return row
    start = time.monotonic()
    try:
        result = scenario.run()
        if not isinstance(result, list) or not all(isinstance(v, str) for v in result):
            violations = [f"scenario returned {result!r}, not a list of violations"]
        else:
            violations = result
    except Exception as exc:  # noqa: BLE001 - the point: report, keep going
        violations = [f"raised {type(exc).__name__}: {exc}"]
        row["traceback"] = traceback.format_exc()
    row["seconds"] = round(time.monotonic() - start, 3)
    row["violations"] = violations
    row["holds"] = not violations
    return row
