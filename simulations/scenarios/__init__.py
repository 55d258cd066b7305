"""Scenarios for the virtual-time simulator; each returns a JSON-able report."""
