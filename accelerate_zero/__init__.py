"""Accelerate adapter for the ZeRO core (the plugin lands with its own issue)."""
