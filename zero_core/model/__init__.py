"""The model outside a pass: full parameters on demand, state_dict hooks, changes after sharding,
buffers and meta-device initialisation. Takes units and the runtime's PassControl, never the engine."""
