"""Ingress: producers' tasks in, admission, workers on the engine, answers out."""
