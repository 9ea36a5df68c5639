"""The torch-free core: requests, blocks, scheduling. Nothing here imports torch."""
