"""The discrete-event fleet simulator: the Conductor against modelled engines, its CLI,
sweeps and bounds."""
