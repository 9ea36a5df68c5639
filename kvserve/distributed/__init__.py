"""Beyond one engine: data-parallel replicas (on Ray, or anywhere behind ``kvserve router``) and the
prefix-cache-aware router in front of them (docs/distributed.md)."""
