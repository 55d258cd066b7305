"""Operations: Prometheus metrics, structured logs, systemd notification.

A leaf: the daemon's parts import it, and it imports none of them (ingress, fan-out,
membership, leader, engines, the daemon, admin), so that any part can log and count without
an import cycle (tests/test_ops_leaf.py)."""
