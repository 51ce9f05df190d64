"""Device models measured on the devices at hand: ``partitioner.calibrate``."""
