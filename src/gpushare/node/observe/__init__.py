"""What the node shows: the status snapshot, utilization sampled from NVML, the
Prometheus exposition and its exporter process. Imports what decides, the guard, what is
kept and the host below it; never the servers or the daemon."""
