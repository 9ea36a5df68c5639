"""Token sampling: penalties, logprobs, greedy and random (temperature / min-p / top-k / top-p) sampling."""
