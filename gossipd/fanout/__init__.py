"""Fan-out: the forwarder's driver, the owner's endpoint, placement and the peer links."""
