"""gossipd: a peer-to-peer agent daemon for GPU clusters."""

__version__ = "0.3.6"

# In a daemon's child process (vLLM's engine core, started with spawn, imports gossipd first):
# log as the daemon does from the start (gossipd/ops/logs.py, follow_parent_logging).
if __import__("os").environ.get("GOSSIPD_CHILD_LOGGING"):
    from gossipd.ops.logs import follow_parent_logging

    follow_parent_logging()
