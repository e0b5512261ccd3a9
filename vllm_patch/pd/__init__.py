"""Prefill/decode (P/D) disaggregation helpers for G4.

`proxy`: the smallest OpenAI-compatible P/D router (prefill with
max_tokens=1, then decode with the original request + kv_transfer_params).
`launch`: start/stop a P/D pair of vLLM OpenAI servers (+ the proxy) for
tests and benchmarks, and read their Prometheus metrics.
"""
