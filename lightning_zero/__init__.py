"""Lightning adapter for the ZeRO core (the strategy lands with its own issue)."""
