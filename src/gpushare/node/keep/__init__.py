"""What the node keeps: the config file's format, the session records and lease journal
a restarted node recovers from, totals that outlive sessions, the event log, and the
checked directory all of them are written through. Imports only the host."""
