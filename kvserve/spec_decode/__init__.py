"""Speculative decoding: proposers (n-gram prompt lookup, draft model) and the k controller.

A proposer suggests up to ``k`` next tokens for a request; the target model verifies them all in one
forward (``sample/rejection_sampler.py`` keeps the output distribution exactly the target's). The
controller (torch-free, used by the scheduler) picks ``k`` per request and step from the measured
acceptance rate and step times, and turns speculation off when the batch is compute-bound.
"""
