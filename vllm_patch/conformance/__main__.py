"""`python -m vllm_patch.conformance`: see vllm_patch.conformance.run."""

import sys

from vllm_patch.conformance.run import main

sys.exit(main())
