"""Tools around the daemon (not part of it): CLI, producer client, submit, demo, launcher, benchmarks, model maker."""
