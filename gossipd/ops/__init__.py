"""Operations: Prometheus metrics, structured logs, systemd notification."""
