"""Inference engines behind one async, streaming interface (``base.Engine``)."""
