"""Where the JSONSchemaBench sample is: real JSON schemas and MaskBench
instances for the tests, benchmarks and the soak that need schemas users
actually send.

The folder is not part of the repository. It comes from the public
repository github.com/guidance-ai/jsonschemabench and is laid out as
`schemas/<dataset>/<file>.json` (that repository's `data/<dataset>/<file>.json`)
and `maskbench/<dataset>---<file>.json` (its `maskbench/data/`). It is found at
`VLLM_PATCH_JSONSCHEMABENCH` when that is set, else at
`../shared/data/jsonschemabench-dev` next to the repository. Tests that need it
skip with `MISSING` when it is absent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ENV = "VLLM_PATCH_JSONSCHEMABENCH"
DEFAULT = Path(__file__).resolve().parents[3] / "shared" / "data" / "jsonschemabench-dev"

ROOT = Path(os.environ.get(ENV) or DEFAULT).expanduser()
SCHEMAS = ROOT / "schemas"
MASKBENCH = ROOT / "maskbench"

MISSING = (f"JSONSchemaBench sample not found at {ROOT} (set {ENV} to its folder; "
           "README, Tests: where to get it)")


def maskbench_entries(backend: Any, folder: Path | None = None
                      ) -> Iterator[tuple[str, Any, list[Any]]]:
    """Each MaskBench entry (file order) that has a valid instance and whose
    schema `backend` (a vLLM structured-output backend) compiles: (the
    schema as JSON text, the compiled vLLM grammar, the valid instances)."""
    from vllm_patch.testing.vocabularies import json_grammar

    for path in sorted((folder or MASKBENCH).glob("*.json")):
        entry = json.loads(path.read_text())
        valid = [t["data"] for t in entry.get("tests", []) if t.get("valid")]
        if not valid:
            continue
        spec = entry["schema"] if isinstance(entry["schema"], str) \
            else json.dumps(entry["schema"])
        try:
            grammar = json_grammar(backend, spec)
        except Exception:  # noqa: BLE001 - a schema the backend refuses
            continue
        yield spec, grammar, valid
