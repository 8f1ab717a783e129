"""scripts/bench: how fast qmpprof samples a guest, side by side with the other ways to do it.

Nothing in qmpprof imports this package; it imports the transports and, when present, the sampler.
"""
