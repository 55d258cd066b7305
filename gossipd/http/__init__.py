"""The OpenAI-compatible HTTP door (docs/PROTOCOL.md "HTTP")."""
