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

import os
from pathlib import Path

ENV = "VLLM_PATCH_JSONSCHEMABENCH"
DEFAULT = Path(__file__).resolve().parents[3] / "shared" / "data" / "jsonschemabench-dev"

ROOT = Path(os.environ.get(ENV) or DEFAULT).expanduser()
SCHEMAS = ROOT / "schemas"
MASKBENCH = ROOT / "maskbench"

MISSING = (f"JSONSchemaBench sample not found at {ROOT} (set {ENV} to its folder; "
           "README, Tests: where to get it)")
