"""Simulations: many protocol cores in virtual time (netsim), and real daemons on loopback."""
