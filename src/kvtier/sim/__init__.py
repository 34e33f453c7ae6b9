"""Replay request sequences through the same directory the runtime uses, on a virtual clock."""
