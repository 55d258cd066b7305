"""The sans-IO protocol core: plain state machines, no sockets, no clock, no global random."""
