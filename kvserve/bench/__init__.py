"""``kvserve bench``: SLO-aware serving benchmark (``serve``) and offline engine benchmarks (``throughput``,
``latency``). See docs/benchmarking.md.

| module | job |
|---|---|
| ``datasets.py`` | ShareGPT (truncated-file recovery), random token prompts, shared-prefix, multi-turn sessions |
| ``client.py`` | one streamed OpenAI request -> TTFT, ITL samples, E2E, usage token counts |
| ``metrics.py`` | percentiles, throughput, goodput, SLO violation rate; the best sweep point |
| ``serve.py`` | arrivals (Poisson or closed loop), runs and sweeps, JSON |
| ``report.py`` | rich tables and the matplotlib sweep plot |
| ``offline.py`` | ``bench throughput`` (mixed workload) and ``bench latency`` (one request) on ``LLM`` |
| ``cli.py`` | the ``kvserve bench`` argument parser |
"""
