"""gossipd: a peer-to-peer agent daemon for GPU clusters."""

__version__ = "0.1.0"
