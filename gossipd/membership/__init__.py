"""Membership: the SWIM core's asyncio shell over ZeroMQ and the GPU state it gossips."""
