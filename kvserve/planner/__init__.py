"""``kvserve plan``: the back-of-envelope capacity questions of cost-model.md for a real model (docs/planner.md).

| module | job |
|---|---|
| ``model_info.py`` | architecture and weight sizes from a GGUF header or safetensors headers, no weights loaded |
| ``bandwidth.py`` | a quick memory-bandwidth measurement of this machine (numpy copy) |
| ``measured.py`` | measured spec-decode acceptance and KV transfer bandwidth: a server's ``/metrics``, a bench JSON |
| ``plan.py`` | every section of the plan as plain data, computed with ``kvserve.cost_model`` |
| ``render.py`` | the plan as rich tables |
| ``cli.py`` | the ``kvserve plan`` argument parser |
"""
