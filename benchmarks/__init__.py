"""airspeed velocity (asv) benchmarks of cuflash; see ``asv.conf.json``."""
